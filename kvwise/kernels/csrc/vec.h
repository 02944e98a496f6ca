// AVX2 helpers shared by the kernels (compiled in only where the CPU has AVX2 and FMA).
#pragma once

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
