// GGUF's other block types run at the file's own precision: Q5_0, Q5_1, the K-quants Q2_K,
// Q3_K, Q4_K, Q5_K, Q6_K and MXFP4 weights x int8 activations.
//
//   qkmm(x, W, kind)   -> x @ W.T, x quantized to int8 per block of 32 (qact.h), as q4mm does
//   qkmm_experts(x, offsets, W, kind) -> each row of x against its expert's weight (W stacks
//                         the experts: (E, N / 8, ...)); x's rows grouped by expert
//
// Every one of these types is, per block of 32 weights of an output column, unsigned codes q of
// 2..6 bits with one or two scales (sub-blocks of 32 or 16), an optional minimum and an
// optional integer offset:  w = scale * (q - offset) - minimum.  The K-quants hold each scale
// as a small integer times a float16 per super-block of 256 (`scale = D * sc`, `minimum = Dmin *
// mn`); Q5_0 / Q5_1 hold float16 `d` (and `m`) per block. Packed as models/gguf_blocks.py
// packs it, the kernel keeps exactly those numbers: the integer parts stay integers and the
// float16 parts float16, so the block sums are exact integers and each block adds, per row,
//
//   K-quants:   per block b of a super-block, from v = m = 0:
//                 v = fma(dx_b, sum_h sc_h (isum_h - offset xsum_h), v)
//                 m = fma(dx_b, sum_h mn_h xsum_h, m)                   (types with minimums)
//               then, once a super-block: acc = fma(D, v, acc); acc = fma(-Dmin, m, acc)
//   Q5_0/Q5_1:  acc = fma(d dx, isum - offset xsum, acc)
//               acc = fma(m, dx xsum, acc)                              (Q5_1)
//
// MXFP4 (gpt-oss's experts) is a block of 32 four-bit floats (e2m1: sign, 2 exponent bits, 1
// mantissa bit) sharing a power-of-two scale byte e (E8M0): w = v(q) 2^(e - 128), with v(q) in
// {0, +-1, +-2, +-3, +-4, +-6, +-8, +-12} the e2m1 values doubled. The kernel reads each code
// through a table as q' = v(q) + 12 (0..24, unsigned: the integer path of an offset of 12), so
//   MXFP4:      acc = fma(2^(e - 128) dx, isum - 12 xsum, acc)
// (2^(e - 128) formed from e's bits exactly, as ggml's GGML_E8M0_TO_FP32_HALF does);
//
// with isum_h = sum q qx over a sub-block h and xsum_h = sum qx (exact integers: at most
// ~5 10^7). The float steps are the same operations in the same order on every path (AVX-512
// VNNI, AVX2, scalar), so they give the same bits, and every row's result is independent of
// the other rows of the batch.
//
// Layout: (N / 8, super-blocks, bytes) uint8, a group of 8 output columns by one super-block
// (8 blocks of 32 for the K-quants, 1 for Q5_x): a header (K-quants: D, then Dmin, as 8
// float16 each), then per block
//   128 bytes of low nibbles: in chunk j, byte 4 c + t holds column c's code bits 0..3 for
//       k = 4 j + t in its low nibble and for k = 16 + 4 j + t in its high one (as q4mm);
//   5-bit codes: 32 bytes, byte 4 c + t holding bit 4 of k = 4 j + t in bit j and of
//       k = 16 + 4 j + t in bit 4 + j;
//   6-bit codes: 64 bytes, bytes 4 c + t (k < 16) and 32 + 4 c + t (k >= 16) holding bits 4..5
//       of chunk j's code in bits 2 j .. 2 j + 1;
//   then the scales: K-quants int8 sc (8, or 16 for sub-blocks of 16: the first half's 8
//   then the second's), then mn likewise; Q5_x float16 d (8), then m (8); MXFP4 its 8 e bytes
//   (the codes the file's own 4 bits, 4.25 bits a weight in all).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "qact.h"
#include "weights.h"
#include "avx512.h"
#include "parallel.h"

namespace {

template <int Bits, bool KScales, bool Halves, bool Mins, int Offset, bool Fp4 = false>
struct Layout {
  static constexpr int bits = Bits;
  static constexpr bool kscales = KScales, halves = Halves, mins = Mins, fp4 = Fp4;
  static constexpr int offset = Offset;
  static constexpr int64_t plane_bytes = 32 * (Bits - 4);
  static constexpr int64_t sc_bytes = KScales ? 8 * (Halves ? 2 : 1) : Fp4 ? 8 : 16;  // a kind
  static constexpr int64_t block_bytes = 128 + plane_bytes + sc_bytes * (Mins ? 2 : 1);
  static constexpr int64_t blocks = KScales ? 8 : 1;  // blocks of 32 a super-block
  static constexpr int64_t header_bytes = KScales ? 16 * (Mins ? 2 : 1) : 0;
  static constexpr int64_t super_bytes = header_bytes + blocks * block_bytes;
};

// the kinds, in models/gguf_blocks.py's order
using Q5_0 = Layout<5, false, false, false, 16>;
using Q5_1 = Layout<5, false, false, true, 0>;
using Q4_K = Layout<4, true, false, true, 0>;
using Q5_K = Layout<5, true, false, true, 0>;
using Q6_K = Layout<6, true, true, false, 32>;
using Q3_K = Layout<4, true, true, false, 4>;
using Q2_K = Layout<4, true, true, true, 0>;
using MXFP4 = Layout<4, false, false, false, 12, true>;

// MXFP4's code -> its e2m1 value doubled, plus 12 (see the header)
constexpr uint8_t kFp4[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

// 2^(e - 128) of an E8M0 byte, exactly (e < 2: a subnormal)
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : (static_cast<uint32_t>(e) - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Weights stream from memory once a step: each block asks for the bytes kPrefetch ahead of it
// (into L1), continuing into the next group (pair) of the same stream. Measured, one row out of
// cache: 28 -> 44 GB/s for K = 8,192 against prefetching each next group whole (which
// overflows L1 when a group is large), and no slower for K = 2,048.
constexpr int64_t kPrefetch = 4096;

// where block b of a column group starts, and its super-block's header
template <class L>
inline const uint8_t* block_at(const uint8_t* group, int64_t b) {
  return group + (b / L::blocks) * L::super_bytes + L::header_bytes + (b % L::blocks) * L::block_bytes;
}
template <class L>
inline const uint8_t* header_at(const uint8_t* group, int64_t b) {
  return group + (b / L::blocks) * L::super_bytes;
}

// column c's code for k of a block (scalar; the reference the vector paths match)
template <class L>
inline int32_t code_at(const uint8_t* p, int c, int k) {
  const int hi = k >= 16, j = (k % 16) / 4, t = k % 4;
  int32_t q = hi ? p[32 * j + 4 * c + t] >> 4 : p[32 * j + 4 * c + t] & 15;
  if constexpr (L::bits == 5) q |= ((p[128 + 4 * c + t] >> (4 * hi + j)) & 1) << 4;
  if constexpr (L::bits == 6) q |= ((p[128 + 32 * hi + 4 * c + t] >> (2 * j)) & 3) << 4;
  if constexpr (L::fp4) q = kFp4[q];
  return q;
}

inline float half_at(const uint8_t* p, int c) {
  return static_cast<float>(reinterpret_cast<const at::Half*>(p)[c]);
}

// a Q5_x / MXFP4 block's scale for column c (its float16 d, or 2^(e - 128))
template <class L>
inline float block_scale(const uint8_t* sc, int c) {
  if constexpr (L::fp4) return e8m0_half(sc[c]);
  return half_at(sc, c);
}

// a block's integer sums for column c: iv = sum_h sc_h (isum_h - offset xsum_h) and im =
// sum_h mn_h xsum_h (K-quants), or isum - offset xsum in iv (Q5_x)
template <class L>
inline void block_ints(const uint8_t* p, int c, const int8_t* xr, int64_t i, const int32_t* xs,
                       const int32_t* xh, int32_t& iv, int32_t& im) {
  int32_t s[2] = {0, 0};
  for (int k = 0; k < 32; ++k) s[k >= 16] += code_at<L>(p, c, k) * xr[k];
  const auto* v = reinterpret_cast<const int8_t*>(p + 128 + L::plane_bytes);
  im = 0;
  if constexpr (L::kscales && L::halves) {
    iv = v[c] * (s[0] - L::offset * xh[2 * i]) + v[8 + c] * (s[1] - L::offset * xh[2 * i + 1]);
    if constexpr (L::mins) im = v[16 + c] * xh[2 * i] + v[24 + c] * xh[2 * i + 1];
  } else if constexpr (L::kscales) {
    iv = v[c] * (s[0] + s[1] - L::offset * xs[i]);
    if constexpr (L::mins) im = v[8 + c] * xs[i];
  } else {
    iv = s[0] + s[1] - L::offset * xs[i];
  }
}

template <class L>
void scalar_group(const uint8_t* w, int64_t nb, int64_t r, const int8_t* xq, const float* dx,
                  const float* sx, const int32_t* xs, const int32_t* xh, float* out) {
  const int64_t K = nb * kQ4Block;
  for (int c = 0; c < 8; ++c) {
    float acc = 0.f;
    for (int64_t s0 = 0; s0 < nb; s0 += L::blocks) {
      float v = 0.f, m = 0.f;
      for (int64_t b = s0; b < s0 + L::blocks; ++b) {
        const int64_t i = r * nb + b;
        const uint8_t* p = block_at<L>(w, b);
        int32_t iv, im;
        block_ints<L>(p, c, xq + r * K + b * kQ4Block, i, xs, xh, iv, im);
        if constexpr (L::kscales) {
          v = std::fma(dx[i], static_cast<float>(iv), v);
          if constexpr (L::mins) m = std::fma(dx[i], static_cast<float>(im), m);
        } else {
          const uint8_t* sc = p + 128 + L::plane_bytes;
          acc = std::fma(block_scale<L>(sc, c) * dx[i], static_cast<float>(iv), acc);
          if constexpr (L::mins) acc = std::fma(half_at(sc + 16, c), sx[i], acc);
        }
      }
      if constexpr (L::kscales) {
        const uint8_t* head = header_at<L>(w, s0);
        acc = std::fma(half_at(head, c), v, acc);
        if constexpr (L::mins) acc = std::fma(-half_at(head + 16, c), m, acc);
      }
    }
    out[c] = acc;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// AVX2: block b's code x activation sums for R rows and one group of 8 columns, s[r][0] over
// k < 16 and s[r][1] over k >= 16 (exact integers)
template <class L, int R>
inline void avx2_sums(const uint8_t* p, const int8_t* xq, int64_t K, int64_t b,
                      __m256i (&s)[R][2]) {
  // codes of at most 5 bits: a half's four int16 pair sums add up exactly in int16 (at most
  // 4 * 2 * 31 * 127 = 31,496), widened once a block, not once a chunk (6 bits: 63,000 would
  // wrap, so each chunk widens)
  constexpr bool kInt16 = L::bits <= 5;
  const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i top = _mm256_set1_epi8(L::bits == 5 ? 0x10 : 0x30);
  __m256i planes[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int h = 0; h < L::bits - 4; ++h)
    planes[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * h));
  for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * j));
    __m256i lo = _mm256_and_si256(c, mask);
    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), mask);
    if constexpr (L::bits == 5) {  // bit j -> 4 (lo), bit 4 + j -> 4 (hi)
      lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_sll_epi16(planes[0], _mm_cvtsi32_si128(4 - j)), top));
      hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srl_epi16(planes[0], _mm_cvtsi32_si128(j)), top));
    }
    if constexpr (L::bits == 6) {  // bits 2j..2j+1 -> 4..5
      const __m128i n = _mm_cvtsi32_si128(j < 2 ? 4 - 2 * j : 2 * j - 4);
      const __m256i a = j < 2 ? _mm256_sll_epi16(planes[0], n) : _mm256_srl_epi16(planes[0], n);
      const __m256i e = j < 2 ? _mm256_sll_epi16(planes[1], n) : _mm256_srl_epi16(planes[1], n);
      lo = _mm256_or_si256(lo, _mm256_and_si256(a, top));
      hi = _mm256_or_si256(hi, _mm256_and_si256(e, top));
    }
    if constexpr (L::fp4) {
      const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kFp4)));
      lo = _mm256_shuffle_epi8(lut, lo);
      hi = _mm256_shuffle_epi8(lut, hi);
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = xq + r * K + b * kQ4Block;
      int32_t xl, xhh;
      std::memcpy(&xl, xr + 4 * j, 4);
      std::memcpy(&xhh, xr + 16 + 4 * j, 4);
      const __m256i pl = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xl));
      const __m256i ph = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xhh));
      if constexpr (kInt16) {
        s[r][0] = _mm256_add_epi16(s[r][0], pl);
        s[r][1] = _mm256_add_epi16(s[r][1], ph);
      } else {
        s[r][0] = _mm256_add_epi32(s[r][0], _mm256_madd_epi16(pl, ones));
        s[r][1] = _mm256_add_epi32(s[r][1], _mm256_madd_epi16(ph, ones));
      }
    }
  }
  if constexpr (kInt16) {
    for (int r = 0; r < R; ++r) {
      s[r][0] = _mm256_madd_epi16(s[r][0], ones);
      s[r][1] = _mm256_madd_epi16(s[r][1], ones);
    }
  }
}

inline __m256i avx2_i8(const uint8_t* q) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
}
inline __m256 avx2_ph(const uint8_t* q) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
}
// 8 columns' block scales: float16 d, or MXFP4's 2^(e - 128) (e8m0_half, 8 at a time)
template <class L>
inline __m256 avx2_scale(const uint8_t* q) {
  if constexpr (L::fp4) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
    const __m256i big = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i small = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    const __m256i tiny = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(big, small, tiny));
  }
  return avx2_ph(q);
}

// AVX2: R rows x one group of 8 columns; the same integers, the same float steps as scalar
template <class L, int R>
inline void avx2_rows(const uint8_t* w, int64_t nb, const int8_t* xq, const float* dx,
                      const float* sx, const int32_t* xs, const int32_t* xh, float* out,
                      int64_t ldo) {
  const int64_t K = nb * kQ4Block;
  __m256 acc[R], v[R], m[R];
  __m256i s[R][2];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t s0 = 0; s0 < nb; s0 += L::blocks) {
    for (int r = 0; r < R; ++r) v[r] = m[r] = _mm256_setzero_ps();
    for (int64_t b = s0; b < s0 + L::blocks; ++b) {
      const uint8_t* p = block_at<L>(w, b);
      for (int64_t o = 0; o < L::block_bytes; o += 64) __builtin_prefetch(p + kPrefetch + o, 0, 3);
      avx2_sums<L, R>(p, xq, K, b, s);
      const uint8_t* sc = p + 128 + L::plane_bytes;
      for (int r = 0; r < R; ++r) {
        const int64_t i = r * nb + b;
        const __m256 dxv = _mm256_set1_ps(dx[i]);
        if constexpr (L::kscales && L::halves) {
          const __m256i a = _mm256_sub_epi32(s[r][0], _mm256_set1_epi32(L::offset * xh[2 * i]));
          const __m256i e = _mm256_sub_epi32(s[r][1], _mm256_set1_epi32(L::offset * xh[2 * i + 1]));
          const __m256i iv = _mm256_add_epi32(_mm256_mullo_epi32(avx2_i8(sc), a),
                                              _mm256_mullo_epi32(avx2_i8(sc + 8), e));
          v[r] = _mm256_fmadd_ps(dxv, _mm256_cvtepi32_ps(iv), v[r]);
          if constexpr (L::mins) {
            const __m256i im = _mm256_add_epi32(
                _mm256_mullo_epi32(avx2_i8(sc + 16), _mm256_set1_epi32(xh[2 * i])),
                _mm256_mullo_epi32(avx2_i8(sc + 24), _mm256_set1_epi32(xh[2 * i + 1])));
            m[r] = _mm256_fmadd_ps(dxv, _mm256_cvtepi32_ps(im), m[r]);
          }
        } else if constexpr (L::kscales) {
          const __m256i t = _mm256_sub_epi32(_mm256_add_epi32(s[r][0], s[r][1]),
                                             _mm256_set1_epi32(L::offset * xs[i]));
          v[r] = _mm256_fmadd_ps(dxv, _mm256_cvtepi32_ps(_mm256_mullo_epi32(avx2_i8(sc), t)), v[r]);
          if constexpr (L::mins)
            m[r] = _mm256_fmadd_ps(dxv, _mm256_cvtepi32_ps(_mm256_mullo_epi32(
                                            avx2_i8(sc + 8), _mm256_set1_epi32(xs[i]))), m[r]);
        } else {
          const __m256i t = _mm256_sub_epi32(_mm256_add_epi32(s[r][0], s[r][1]),
                                             _mm256_set1_epi32(L::offset * xs[i]));
          acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(avx2_scale<L>(sc), dxv), _mm256_cvtepi32_ps(t), acc[r]);
          if constexpr (L::mins)
            acc[r] = _mm256_fmadd_ps(avx2_ph(sc + 16), _mm256_set1_ps(sx[i]), acc[r]);
        }
      }
    }
    if constexpr (L::kscales) {
      const uint8_t* head = header_at<L>(w, s0);
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm256_fmadd_ps(avx2_ph(head), v[r], acc[r]);
        if constexpr (L::mins) acc[r] = _mm256_fnmadd_ps(avx2_ph(head + 16), m[r], acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo, acc[r]);
}
#endif

#if defined(KVWISE_AVX512VNNI)
inline __m512i i8_pair(const uint8_t* a, const uint8_t* b) {
  return _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)),
                                                 _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b))));
}
// two groups' block scales side by side: float16 d, or MXFP4's 2^(e - 128) (as avx2_scale)
template <class L>
inline __m512 scale_pair(const uint8_t* a, const uint8_t* b) {
  if constexpr (L::fp4) {
    const __m512i e = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b))));
    const __m512i big = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i small = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    const __mmask16 tiny = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(tiny, big, small));
  }
  return load_ph_pair(a, b);
}
inline __m512i x4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// AVX-512 VNNI: block b's code x activation sums for R rows and two groups of 8 columns (w0's
// in the low 256 bits, w1's in the high), s[r][0] over k < 16 and s[r][1] over k >= 16; types
// without halves sum all 32 into s[r][0] (the same integers)
template <class L, int R>
inline void vnni_sums(const uint8_t* p0, const uint8_t* p1, const int8_t* xq, int64_t K,
                      int64_t b, __m512i (&s)[R][2]) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  const __m512i top = _mm512_set1_epi8(L::bits == 5 ? 0x10 : 0x30);
  constexpr int hs = L::halves ? 1 : 0;
  __m512i planes[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
  for (int h = 0; h < L::bits - 4; ++h) planes[h] = load_pair(p0 + 128 + 32 * h, p1 + 128 + 32 * h);
  for (int r = 0; r < R; ++r) s[r][0] = s[r][hs] = _mm512_setzero_si512();
  for (int j = 0; j < 4; ++j) {
    const __m512i c = load_pair(p0 + 32 * j, p1 + 32 * j);
    __m512i lo = _mm512_and_si512(c, mask);
    __m512i hi = _mm512_and_si512(_mm512_srli_epi16(c, 4), mask);
    if constexpr (L::bits == 5) {
      lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_sll_epi16(planes[0], _mm_cvtsi32_si128(4 - j)), top));
      hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_srl_epi16(planes[0], _mm_cvtsi32_si128(j)), top));
    }
    if constexpr (L::bits == 6) {
      const __m128i n = _mm_cvtsi32_si128(j < 2 ? 4 - 2 * j : 2 * j - 4);
      const __m512i a = j < 2 ? _mm512_sll_epi16(planes[0], n) : _mm512_srl_epi16(planes[0], n);
      const __m512i e = j < 2 ? _mm512_sll_epi16(planes[1], n) : _mm512_srl_epi16(planes[1], n);
      lo = _mm512_or_si512(lo, _mm512_and_si512(a, top));
      hi = _mm512_or_si512(hi, _mm512_and_si512(e, top));
    }
    if constexpr (L::fp4) {
      const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kFp4)));
      lo = _mm512_shuffle_epi8(lut, lo);
      hi = _mm512_shuffle_epi8(lut, hi);
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = xq + r * K + b * kQ4Block;
      s[r][0] = _mm512_dpbusd_epi32(s[r][0], lo, x4(xr + 4 * j));
      s[r][hs] = _mm512_dpbusd_epi32(s[r][hs], hi, x4(xr + 16 + 4 * j));
    }
  }
}

// AVX-512 VNNI: R rows x two groups of 8 columns (w0, w1) side by side; the K-quants' running
// result waits in `out` between super-blocks (registers hold each super-block's v and m)
template <class L, int R>
inline void vnni_rows(const uint8_t* w0, const uint8_t* w1, int64_t nb, const int8_t* xq,
                      const float* dx, const float* sx, const int32_t* xs, const int32_t* xh,
                      float* out, int64_t ldo) {
  const int64_t K = nb * kQ4Block;
  __m512 acc[R], v[R], m[R];
  __m512i s[R][2];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t s0 = 0; s0 < nb; s0 += L::blocks) {
    for (int r = 0; r < R; ++r) v[r] = m[r] = _mm512_setzero_ps();
    for (int64_t b = s0; b < s0 + L::blocks; ++b) {
      const uint8_t *p0 = block_at<L>(w0, b), *p1 = block_at<L>(w1, b);
      const int64_t gb = w1 - w0, at = (p0 - w0) + kPrefetch;
      const int64_t skip = at < gb ? 0 : gb;  // past the group: the next pair's same group
      for (int64_t o = 0; o < L::block_bytes; o += 64) {
        __builtin_prefetch(w0 + skip + at + o, 0, 3);
        __builtin_prefetch(w1 + skip + at + o, 0, 3);
      }
      vnni_sums<L, R>(p0, p1, xq, K, b, s);
      const uint8_t *c0 = p0 + 128 + L::plane_bytes, *c1 = p1 + 128 + L::plane_bytes;
      for (int r = 0; r < R; ++r) {
        const int64_t i = r * nb + b;
        const __m512 dxv = _mm512_set1_ps(dx[i]);
        if constexpr (L::kscales && L::halves) {
          const __m512i a = _mm512_sub_epi32(s[r][0], _mm512_set1_epi32(L::offset * xh[2 * i]));
          const __m512i e = _mm512_sub_epi32(s[r][1], _mm512_set1_epi32(L::offset * xh[2 * i + 1]));
          const __m512i iv = _mm512_add_epi32(_mm512_mullo_epi32(i8_pair(c0, c1), a),
                                              _mm512_mullo_epi32(i8_pair(c0 + 8, c1 + 8), e));
          v[r] = _mm512_fmadd_ps(dxv, _mm512_cvtepi32_ps(iv), v[r]);
          if constexpr (L::mins) {
            const __m512i im = _mm512_add_epi32(
                _mm512_mullo_epi32(i8_pair(c0 + 16, c1 + 16), _mm512_set1_epi32(xh[2 * i])),
                _mm512_mullo_epi32(i8_pair(c0 + 24, c1 + 24), _mm512_set1_epi32(xh[2 * i + 1])));
            m[r] = _mm512_fmadd_ps(dxv, _mm512_cvtepi32_ps(im), m[r]);
          }
        } else if constexpr (L::kscales) {
          const __m512i t = _mm512_sub_epi32(s[r][0], _mm512_set1_epi32(L::offset * xs[i]));
          v[r] = _mm512_fmadd_ps(dxv, _mm512_cvtepi32_ps(_mm512_mullo_epi32(i8_pair(c0, c1), t)), v[r]);
          if constexpr (L::mins)
            m[r] = _mm512_fmadd_ps(dxv, _mm512_cvtepi32_ps(_mm512_mullo_epi32(
                                            i8_pair(c0 + 8, c1 + 8), _mm512_set1_epi32(xs[i]))), m[r]);
        } else {
          const __m512i t = _mm512_sub_epi32(s[r][0], _mm512_set1_epi32(L::offset * xs[i]));
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(scale_pair<L>(c0, c1), dxv), _mm512_cvtepi32_ps(t), acc[r]);
          if constexpr (L::mins)
            acc[r] = _mm512_fmadd_ps(load_ph_pair(c0 + 16, c1 + 16), _mm512_set1_ps(sx[i]), acc[r]);
        }
      }
    }
    if constexpr (L::kscales) {
      const uint8_t *h0 = header_at<L>(w0, s0), *h1 = header_at<L>(w1, s0);
      const __m512 d = load_ph_pair(h0, h1);
      for (int r = 0; r < R; ++r) {
        __m512 a = s0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(out + r * ldo);
        a = _mm512_fmadd_ps(d, v[r], a);
        if constexpr (L::mins) a = _mm512_fnmadd_ps(load_ph_pair(h0 + 16, h1 + 16), m[r], a);
        _mm512_storeu_ps(out + r * ldo, a);
      }
    }
  }
  if constexpr (!L::kscales)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, acc[r]);
}

template <class L, int R>
void vnni_tile(const uint8_t* w0, const uint8_t* w1, int64_t nb, int64_t rows, const int8_t* xq,
               const float* dx, const float* sx, const int32_t* xs, const int32_t* xh,
               float* out, int64_t ldo) {
  if constexpr (R > 0) {
    if (rows == R) return vnni_rows<L, R>(w0, w1, nb, xq, dx, sx, xs, xh, out, ldo);
    vnni_tile<L, R - 1>(w0, w1, nb, rows, xq, dx, sx, xs, xh, out, ldo);
  }
}
#endif

// which path qkmm runs: 2 AVX-512 VNNI, 1 AVX2, 0 scalar (the same bits on each)
int g_path = -1;

int best_path() {
#if defined(KVWISE_AVX512VNNI)
  return 2;
#elif defined(__AVX2__) && defined(__FMA__)
  return 1;
#else
  return 0;
#endif
}

// rows of x quantized as qkmm reads them (qact.h), with each block's halves' sums
struct QRows {
  int64_t K, nb;
  std::vector<int8_t> xq;
  std::vector<float> dx, sx;
  std::vector<int32_t> xs, xh;
};

QRows quantize_rows(const float* xp, int64_t M, int64_t K) {
  const int64_t nb = K / kQ4Block;
  QRows q{K, nb, std::vector<int8_t>(M * K), std::vector<float>(M * nb), std::vector<float>(M * nb),
          std::vector<int32_t>(M * nb), std::vector<int32_t>(2 * M * nb)};
  kvwise::parallel_for(0, M, std::max<int64_t>(1, (1 << 15) / (4 * K)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      quantize_row_q8(xp + m * K, K, q.xq.data() + m * K, q.dx.data() + m * nb,
                      q.sx.data() + m * nb, q.xs.data() + m * nb);
      for (int64_t b = 0; b < nb; ++b) {  // the halves' sums (sub-blocks of 16)
        int32_t lo = 0;
        for (int k = 0; k < 16; ++k) lo += q.xq[m * K + b * kQ4Block + k];
        q.xh[2 * (m * nb + b)] = lo;
        q.xh[2 * (m * nb + b) + 1] = q.xs[m * nb + b] - lo;
      }
    }
  });
  return q;
}

// rows m0..m1 of q against one group of 8 columns w (AVX2 or scalar), into out (row stride ldo)
template <class L>
void narrow_group(const uint8_t* w, const QRows& q, int64_t m0, int64_t m1, float* out,
                  int64_t ldo, int path) {
  const int64_t K = q.K, nb = q.nb;
  int64_t m = m0;
#if defined(__AVX2__) && defined(__FMA__)
  if (path >= 1) {
    for (; m + 4 <= m1; m += 4)
      avx2_rows<L, 4>(w, nb, q.xq.data() + m * K, q.dx.data() + m * nb, q.sx.data() + m * nb,
                      q.xs.data() + m * nb, q.xh.data() + 2 * m * nb, out + m * ldo, ldo);
    for (; m < m1; ++m)
      avx2_rows<L, 1>(w, nb, q.xq.data() + m * K, q.dx.data() + m * nb, q.sx.data() + m * nb,
                      q.xs.data() + m * nb, q.xh.data() + 2 * m * nb, out + m * ldo, ldo);
  }
#endif
  for (; m < m1; ++m)
    scalar_group<L>(w, nb, m, q.xq.data(), q.dx.data(), q.sx.data(), q.xs.data(), q.xh.data(),
                    out + m * ldo);
}

// rows m0..m1 of q against "pair" p of a weight's column groups (wp, G groups of gb bytes):
// groups 2p and 2p + 1 side by side on AVX-512 VNNI, else (and a last odd group) one at a time
template <class L>
void pair_rows(const uint8_t* wp, int64_t G, int64_t gb, int64_t p, const QRows& q, int64_t m0,
               int64_t m1, float* out, int64_t ldo, int path) {
#if defined(KVWISE_AVX512VNNI)
  if (path == 2 && 2 * p + 1 < G) {
    constexpr int64_t kRows = 8;
    const int64_t K = q.K, nb = q.nb;
    const uint8_t* w0 = wp + 2 * p * gb;
    for (int64_t m = m0; m < m1; m += kRows)
      vnni_tile<L, kRows>(w0, w0 + gb, nb, std::min(kRows, m1 - m), q.xq.data() + m * K,
                          q.dx.data() + m * nb, q.sx.data() + m * nb, q.xs.data() + m * nb,
                          q.xh.data() + 2 * m * nb, out + m * ldo + p * 16, ldo);
    return;
  }
#endif
  for (int64_t g = 2 * p; g < std::min(2 * p + 2, G); ++g)
    narrow_group<L>(wp + g * gb, q, m0, m1, out + g * 8, ldo, path);
}

template <class L>
void check_packed(const at::Tensor& x, const at::Tensor& packed, int64_t dims, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), op,
              ": x must be a contiguous float32 (T, K) tensor");
  TORCH_CHECK(packed.dim() == dims && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(dims - 1) == L::super_bytes &&
                  packed.size(dims - 2) * L::blocks * kQ4Block == x.size(1),
              op, ": packed must be uint8 (", dims == 4 ? "E, " : "", "N / 8, K / ",
              L::blocks * kQ4Block, ", ", L::super_bytes, ") for K = ", x.size(1));
}

template <class L>
at::Tensor qk_mm(const at::Tensor& x, const at::Tensor& packed) {
  check_packed<L>(x, packed, 3, "qkmm");
  const int64_t M = x.size(0), K = x.size(1), G = packed.size(0);
  const int64_t N = G * 8, gb = packed.size(1) * L::super_bytes;
  const QRows q = quantize_rows(x.data_ptr<float>(), M, K);
  at::Tensor out = at::empty({M, N}, x.options());
  float* op = out.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const int path = g_path < 0 ? best_path() : g_path;
  kvwise::parallel_for(0, (G + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) pair_rows<L>(wp, G, gb, p, q, 0, M, op, N, path);
  });
  return out;
}

// a mixture of experts' matmuls in one pass: x's rows grouped by expert (expert e's rows
// offsets[e] .. offsets[e + 1]) against packed (E, N / 8, K / ..., bytes), each row against its
// expert's weight; the work split over (expert, column pair), every row's arithmetic qkmm's
template <class L>
at::Tensor qk_mm_experts(const at::Tensor& x, const at::Tensor& offsets, const at::Tensor& packed) {
  check_packed<L>(x, packed, 4, "qkmm_experts");
  const int64_t E = packed.size(0), M = x.size(0), K = x.size(1), G = packed.size(1);
  TORCH_CHECK(offsets.dim() == 1 && offsets.size(0) == E + 1 && offsets.scalar_type() == at::kLong &&
                  offsets.is_contiguous(), "qkmm_experts: offsets must be int64 (E + 1,)");
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[E] == M, "qkmm_experts: offsets must run from 0 to x's rows");
  for (int64_t e = 0; e < E; ++e)
    TORCH_CHECK(off[e] <= off[e + 1], "qkmm_experts: offsets must not decrease");
  const int64_t N = G * 8, gb = packed.size(2) * L::super_bytes, pairs = (G + 1) / 2;
  std::vector<int64_t> used;  // experts with rows
  for (int64_t e = 0; e < E; ++e)
    if (off[e + 1] > off[e]) used.push_back(e);
  const QRows q = quantize_rows(x.data_ptr<float>(), M, K);
  at::Tensor out = at::empty({M, N}, x.options());
  float* op = out.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const int path = g_path < 0 ? best_path() : g_path;
  const int64_t items = static_cast<int64_t>(used.size()) * pairs;
  kvwise::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = used[i / pairs];
      pair_rows<L>(wp + e * G * gb, G, gb, i % pairs, q, off[e], off[e + 1], op, N, path);
    }
  });
  return out;
}

at::Tensor qkmm(const at::Tensor& x, const at::Tensor& packed, int64_t kind) {
  switch (kind) {
    case 0: return qk_mm<Q5_0>(x, packed);
    case 1: return qk_mm<Q5_1>(x, packed);
    case 2: return qk_mm<Q4_K>(x, packed);
    case 3: return qk_mm<Q5_K>(x, packed);
    case 4: return qk_mm<Q6_K>(x, packed);
    case 5: return qk_mm<Q3_K>(x, packed);
    case 6: return qk_mm<Q2_K>(x, packed);
    case 7: return qk_mm<MXFP4>(x, packed);
    default: TORCH_CHECK(false, "qkmm: kind must be 0..7, got ", kind);
  }
}

at::Tensor qkmm_experts(const at::Tensor& x, const at::Tensor& offsets, const at::Tensor& packed,
                        int64_t kind) {
  switch (kind) {
    case 0: return qk_mm_experts<Q5_0>(x, offsets, packed);
    case 1: return qk_mm_experts<Q5_1>(x, offsets, packed);
    case 2: return qk_mm_experts<Q4_K>(x, offsets, packed);
    case 3: return qk_mm_experts<Q5_K>(x, offsets, packed);
    case 4: return qk_mm_experts<Q6_K>(x, offsets, packed);
    case 5: return qk_mm_experts<Q3_K>(x, offsets, packed);
    case 6: return qk_mm_experts<Q2_K>(x, offsets, packed);
    case 7: return qk_mm_experts<MXFP4>(x, offsets, packed);
    default: TORCH_CHECK(false, "qkmm_experts: kind must be 0..7, got ", kind);
  }
}

// the path qkmm runs: "avx512vnni", "avx2" or "scalar"; `path` non-empty switches (tests)
std::string qk_path(c10::string_view path) {
  const char* names[] = {"scalar", "avx2", "avx512vnni"};
  if (!path.empty()) {
    int want = -1;
    for (int i = 0; i < 3; ++i)
      if (path == names[i]) want = i;
    TORCH_CHECK(want >= 0 && want <= best_path(), "qk_path: this build runs at most '",
                names[best_path()], "', got '", std::string(path), "'");
    g_path = want;
  }
  return names[g_path < 0 ? best_path() : g_path];
}

// codes (rows, K) uint8 -> the layout above: each block's nibbles and bit planes made here, its
// scale bytes `tail` (G, K / 32, T) and each super-block's `heads` (G, super-blocks, H; H may
// be 0) copied in (models/gguf_blocks.py `pack` makes those; rows past the end are zeros)
at::Tensor qk_pack(const at::Tensor& codes, int64_t bits, const at::Tensor& tail,
                   const at::Tensor& heads, int64_t blocks_per_super) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.size(1) % (kQ4Block * blocks_per_super) == 0,
              "qk_pack: codes must be contiguous uint8 (rows, K), K whole super-blocks");
  TORCH_CHECK(bits >= 4 && bits <= 6, "qk_pack: bits must be 4, 5 or 6");
  const int64_t rows = codes.size(0), K = codes.size(1), nb = K / kQ4Block, G = (rows + 7) / 8;
  const int64_t nsb = nb / blocks_per_super;
  TORCH_CHECK(tail.dim() == 3 && tail.size(0) == G && tail.size(1) == nb && tail.is_contiguous() &&
                  tail.scalar_type() == at::kByte, "qk_pack: tail must be uint8 (G, nb, T)");
  TORCH_CHECK(heads.dim() == 3 && heads.size(0) == G && heads.size(1) == nsb &&
                  heads.is_contiguous() && heads.scalar_type() == at::kByte,
              "qk_pack: heads must be uint8 (G, super-blocks, H)");
  const int64_t T = tail.size(2), H = heads.size(2), code_bytes = 128 + 32 * (bits - 4);
  const int64_t block = code_bytes + T, super = H + blocks_per_super * block;
  at::Tensor out = empty_weights({G, nsb, super}, codes.options());
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint8_t* tp = tail.data_ptr<uint8_t>();
  const uint8_t* hp = heads.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  kvwise::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* sb = op + (g * nsb + b / blocks_per_super) * super;
        if (b % blocks_per_super == 0) std::memcpy(sb, hp + (g * nsb + b / blocks_per_super) * H, H);
        uint8_t* p = sb + H + (b % blocks_per_super) * block;
        std::memset(p, 0, code_bytes);
        for (int c = 0; c < 8; ++c) {
          const int64_t row = 8 * g + c;
          if (row >= rows) continue;
          const uint8_t* q = cp + row * K + b * kQ4Block;
          for (int j = 0; j < 4; ++j)
            for (int t = 0; t < 4; ++t) {
              const uint8_t lo = q[4 * j + t], hi = q[16 + 4 * j + t];
              p[32 * j + 4 * c + t] = (lo & 15) | ((hi & 15) << 4);
              if (bits == 5)
                p[128 + 4 * c + t] |= (((lo >> 4) & 1) << j) | (((hi >> 4) & 1) << (4 + j));
              if (bits == 6) {
                p[128 + 4 * c + t] |= ((lo >> 4) & 3) << (2 * j);
                p[160 + 4 * c + t] |= ((hi >> 4) & 3) << (2 * j);
              }
            }
        }
        std::memcpy(p + code_bytes, tp + (g * nb + b) * T, T);
      }
  });
  return out;
}

// column c's 32 weights of a block as float32 (the formula `unpack` in gguf_blocks.py computes:
// exact products of float16s and small integers, then the minimum; each half's factors formed
// once, every weight one rounding, as before)
template <class L>
inline void block_row(const uint8_t* head, const uint8_t* p, int c, float* w) {
  const uint8_t* sc = p + 128 + L::plane_bytes;
  float a[2], m[2] = {0.f, 0.f};  // w = a q - m, per half of the block
  for (int half = 0; half < 2; ++half) {
    if constexpr (L::kscales) {
      const auto* v = reinterpret_cast<const int8_t*>(sc);
      const int n = L::halves ? 16 : 8, at = L::halves ? 8 * half + c : c;
      a[half] = half_at(head, c) * static_cast<float>(v[at]);
      if constexpr (L::mins) m[half] = half_at(head + 16, c) * static_cast<float>(v[n + at]);
    } else {
      a[half] = block_scale<L>(sc, c);
      if constexpr (L::mins) m[half] = -half_at(sc + 16, c);
    }
  }
  for (int half = 0; half < 2; ++half)
    for (int k = 16 * half; k < 16 * half + 16; ++k)
      w[k] = a[half] * static_cast<float>(code_at<L>(p, c, k) - L::offset) - m[half];
}

// rows ids (n) of a packed weight as float32 (n, K), exact (the embedding); with `h` (N, K) given,
// ids (N, k): the float32 dot products h[r] . row ids[r][j], (N, k) (the LM head's refinement)
template <class L>
at::Tensor qk_rows_impl(const at::Tensor& packed, const at::Tensor& ids, const at::Tensor* h) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == L::super_bytes, "qk_rows: packed has another layout");
  TORCH_CHECK(ids.dim() == (h ? 2 : 1) && ids.scalar_type() == at::kLong && ids.is_contiguous(),
              "qk_rows: ids must be contiguous int64, (n,) or (N, k) with h");
  const int64_t n = ids.numel(), per = h ? ids.size(1) : 1;  // ids a row of h
  const int64_t nb = packed.size(1) * L::blocks, K = nb * kQ4Block;
  const int64_t gb = packed.size(1) * L::super_bytes, rows = packed.size(0) * 8;
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < rows, "qk_rows: id ", ip[i], " out of range");
  at::Tensor out = h ? at::empty({ids.size(0), per}, packed.options().dtype(at::kFloat))
                     : at::empty({n, K}, packed.options().dtype(at::kFloat));
  if (h) TORCH_CHECK(h->dim() == 2 && h->size(0) == ids.size(0) && h->size(1) == K &&
                         h->scalar_type() == at::kFloat && h->is_contiguous(),
                     "qk_rows: h must be contiguous float32 (N, K)");
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const float* hp = h ? h->data_ptr<float>() : nullptr;
  kvwise::parallel_for(0, n, 8, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const uint8_t* g = wp + (ip[i] / 8) * gb;
      const int c = static_cast<int>(ip[i] % 8);
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        float w[32];
        block_row<L>(header_at<L>(g, b), block_at<L>(g, b), c, hp ? w : op + i * K + b * kQ4Block);
        if (hp)
          for (int k = 0; k < 32; ++k) acc = std::fma(w[k], hp[(i / per) * K + b * kQ4Block + k], acc);
      }
      if (hp) op[i] = acc;
    }
  });
  return out;
}

template <class L>
at::Tensor qk_rows_kind(const at::Tensor& packed, const at::Tensor& ids, const at::Tensor* h) {
  return qk_rows_impl<L>(packed, ids, h);
}

at::Tensor qk_rows_any(const at::Tensor& packed, const at::Tensor& ids, int64_t kind,
                       const at::Tensor* h) {
  switch (kind) {
    case 0: return qk_rows_kind<Q5_0>(packed, ids, h);
    case 1: return qk_rows_kind<Q5_1>(packed, ids, h);
    case 2: return qk_rows_kind<Q4_K>(packed, ids, h);
    case 3: return qk_rows_kind<Q5_K>(packed, ids, h);
    case 4: return qk_rows_kind<Q6_K>(packed, ids, h);
    case 5: return qk_rows_kind<Q3_K>(packed, ids, h);
    case 6: return qk_rows_kind<Q2_K>(packed, ids, h);
    case 7: return qk_rows_kind<MXFP4>(packed, ids, h);
    default: TORCH_CHECK(false, "qk_rows: kind must be 0..7, got ", kind);
  }
}

at::Tensor qk_rows(const at::Tensor& packed, const at::Tensor& ids, int64_t kind) {
  return qk_rows_any(packed, ids, kind, nullptr);
}

at::Tensor qk_rows_dot(const at::Tensor& h, const at::Tensor& packed, const at::Tensor& ids,
                       int64_t kind) {
  return qk_rows_any(packed, ids, kind, &h);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvwise, m) {
  m.def("qkmm(Tensor x, Tensor packed, int kind) -> Tensor");
  m.def("qkmm_experts(Tensor x, Tensor offsets, Tensor packed, int kind) -> Tensor");
  m.def("qk_path(str path='') -> str", &qk_path);
  m.def("qk_rows(Tensor packed, Tensor ids, int kind) -> Tensor");
  m.def("qk_rows_dot(Tensor h, Tensor packed, Tensor ids, int kind) -> Tensor");
  m.def("qk_pack(Tensor codes, int bits, Tensor tail, Tensor heads, int blocks_per_super) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvwise, CPU, m) {
  m.impl("qkmm", &qkmm);
  m.impl("qkmm_experts", &qkmm_experts);
  m.impl("qk_pack", &qk_pack);
  m.impl("qk_rows", &qk_rows);
  m.impl("qk_rows_dot", &qk_rows_dot);
}
