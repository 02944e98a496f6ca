// AVX-512 loads shared by the block matmuls (VNNI in fused.cpp and kquant.cpp, AMX in amx.cpp):
// two column groups' 32 bytes, or their 8 float16 scales, side by side in one vector.
#pragma once

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>

inline __m512i load_pair(const uint8_t* a, const uint8_t* b) {
  return _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}

inline __m512 load_ph_pair(const uint8_t* a, const uint8_t* b) {
  return _mm512_cvtph_ps(_mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1));
}
#endif
