// Activations quantized to int8 per block of 32, as the block matmuls read them (fused.cpp's
// q4mm / q8mm and kquant.cpp's qkmm): one definition, so every kernel rounds a row alike.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

constexpr int64_t kQ4Block = 32;

// a row's activations -> int8 codes, dx, sx and the codes' integer sum per block of 32
inline void quantize_row_q8(const float* x, int64_t K, int8_t* q, float* dx, float* sx, int32_t* xs) {
  for (int64_t b = 0; b < K / kQ4Block; ++b) {
    const float* src = x + b * kQ4Block;
    float amax = 0.f;
    int32_t total = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 v[4];
    __m256 am = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(src + 8 * i);
      am = _mm256_max_ps(am, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 a = _mm_max_ps(_mm256_castps256_ps128(am), _mm256_extractf128_ps(am, 1));
    a = _mm_max_ps(a, _mm_movehl_ps(a, a));
    amax = _mm_cvtss_f32(_mm_max_ss(a, _mm_movehdup_ps(a)));
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    __m256i qi[4];
    for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // nearest
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_hadd_epi32(s4, s4);
    total = _mm_cvtsi128_si32(_mm_hadd_epi32(s4, s4));
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                              _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kQ4Block),
                        _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
    for (int i = 0; i < kQ4Block; ++i) amax = std::max(amax, std::fabs(src[i]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    for (int i = 0; i < kQ4Block; ++i) {
      const int32_t c = static_cast<int32_t>(std::nearbyint(src[i] * inv));
      q[b * kQ4Block + i] = static_cast<int8_t>(c);
      total += c;
    }
#endif
    dx[b] = amax / 127.f;
    sx[b] = dx[b] * static_cast<float>(total);
    xs[b] = total;
  }
}

