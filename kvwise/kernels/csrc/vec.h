// AVX2 helpers shared by the kernels (compiled in only where the CPU has AVX2 and FMA).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// exp(x) for x in [-87, 88] (clamped outside), relative error ~2e-7: 2^(x log2 e) = 2^k * 2^f
// with k an integer and f in [-0.5, 0.5], 2^f by a degree-6 polynomial.
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 k = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, k);
  __m256 p = _mm256_set1_ps(1.5353362e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3398874e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6180499e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5503406e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022652e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(k), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}

// 8 bfloat16 -> 8 float32
inline __m256 load_bf16(const void* p) {
  const __m128i h = _mm_loadu_si128(static_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 8 int8 -> 8 float32
inline __m256 load_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// 8 float32 -> 8 bfloat16, rounded to nearest even (finite inputs)
inline void store_bf16(void* p, __m256 x) {
  __m256i i = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(i, 16), _mm256_set1_epi32(1));
  i = _mm256_add_epi32(i, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  i = _mm256_srli_epi32(i, 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
  _mm_storeu_si128(static_cast<__m128i*>(p), packed);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// tanh(x) within 4.4 ulp (2.6e-7; measured against float64 over [-12, 12]), never past +-1:
// Eigen's rational approximation, an odd degree-13 numerator over an even degree-6
// denominator, x clamped to +-7.9053 (where tanh is 1 - 2.7e-7); x itself below 4e-4 (where
// tanh(x) rounds to x).
inline __m256 tanh256(__m256 x) {
  const __m256 abs = _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
  const __m256 tiny = _mm256_cmp_ps(abs, _mm256_set1_ps(4e-4f), _CMP_LT_OQ);
  const __m256 bound = _mm256_set1_ps(7.90531110763549805f);
  const __m256 c = _mm256_min_ps(_mm256_max_ps(x, _mm256_sub_ps(_mm256_setzero_ps(), bound)),
                                 bound);
  const __m256 x2 = _mm256_mul_ps(c, c);
  __m256 p = _mm256_set1_ps(-2.76076847742355e-16f);
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(2.00018790482477e-13f));
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-8.60467152213735e-11f));
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(5.12229709037114e-08f));
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(1.48572235717979e-05f));
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(6.37261928875436e-04f));
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(4.89352455891786e-03f));
  p = _mm256_mul_ps(p, c);
  __m256 q = _mm256_set1_ps(1.19825839466702e-06f);
  q = _mm256_fmadd_ps(q, x2, _mm256_set1_ps(1.18534705686654e-04f));
  q = _mm256_fmadd_ps(q, x2, _mm256_set1_ps(2.26843463243900e-03f));
  q = _mm256_fmadd_ps(q, x2, _mm256_set1_ps(4.89352518554385e-03f));
  return _mm256_blendv_ps(_mm256_div_ps(p, q), x, tiny);
}
#endif

// s[i] = cap * tanh(s[i] / cap) for n scores (Gemma 2's attention-logit soft cap, after the
// scale, before the softmax). Eight at a time, the tail padded to eight: each score's bits are
// a function of its value alone, wherever it lies in the array (noinline: one body for all).
inline __attribute__((noinline)) void cap_scores(float* s, int64_t n, float cap) {
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 c = _mm256_set1_ps(cap);
  auto capped = [&](__m256 x) { return _mm256_mul_ps(tanh256(_mm256_div_ps(x, c)), c); };
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(s + i, capped(_mm256_loadu_ps(s + i)));
  if (i < n) {
    alignas(32) float tail[8] = {};
    std::copy(s + i, s + n, tail);
    _mm256_store_ps(tail, capped(_mm256_load_ps(tail)));
    std::copy(tail, tail + (n - i), s + i);
  }
#else
  for (int64_t i = 0; i < n; ++i) s[i] = cap * std::tanh(s[i] / cap);
#endif
}
