// Paged attention straight over the KV pool (CPU): one query row per call row, each with its own
// block table and context length, reading K/V rows where they lie in the pool (float32,
// bfloat16, float16, or int8 codes and their scales): no gather copy, no padding mask.
// Decode rows and prefill rows go through it alike (a prefill row at position p is a query
// over p + 1 keys), so a token's attention is the same whether it was decoded or prefilled,
// in whichever batch, chunk or step.
//
// Split-K ("flash decoding") over a FIXED partition: a row's keys are cut into spans of
// kSpan keys from position 0, whatever the batch, the other rows' lengths or the thread
// count. Each span's softmax is kept in float32 (its max, its sum, its weighted V), and the
// spans are folded into the row's result in span order, always by the same function
// (`fold_span`). How spans are shared out between threads (a whole row to one task, or a long
// row's spans to several tasks, their partials folded in a second pass) changes only who
// computes a span, never what is computed: each row's output bits depend on the row alone
// (tests/unit/test_kernels.py, tests/model/test_batch_invariance.py). The query heads of one
// kv head (GQA) are handled together, so each K/V row is read once.
//
// Per call, a layer's kind (`window`, `softcap`), as attention_kind.h defines it for both
// kernels: the spans before a row's window are skipped.
//
// Registered as torch.ops.kvwise.paged_decode_attention (float pools) and
// paged_decode_attention_int8; kvwise/worker/kernels.py builds them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention_kind.h"
#include "vec.h"
#include "parallel.h"

namespace {


#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float r = hsum(acc);
  for (; i < n; ++i) r += a[i] * b[i];
  return r;
}

// out[i] = scale * dot(q, rows[i]) for n rows, four at a time: four independent FMA chains
// instead of one, reduced together.
inline void dots(float* out, const float* q, const float* const* rows, int64_t n, int64_t D,
                 float scale) {
  int64_t i = 0;
  if (D % 8 == 0) {
    for (; i + 4 <= n; i += 4) {
      const float *r0 = rows[i], *r1 = rows[i + 1], *r2 = rows[i + 2], *r3 = rows[i + 3];
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r0 + d), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r1 + d), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r2 + d), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r3 + d), a3);
      }
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
      const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
      _mm_storeu_ps(out + i, _mm_mul_ps(sum, _mm_set1_ps(scale)));
    }
  }
  for (; i < n; ++i) out[i] = dot(q, rows[i], D) * scale;
}

// the largest of s[0 .. n) (n >= 1; a max is exact, so any order gives the same value)
inline float row_max(const float* s, int64_t n) {
  int64_t i = 0;
  float m = s[0];
  if (n >= 8) {
    __m256 mv = _mm256_loadu_ps(s);
    for (i = 8; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + i));
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    m = _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
  }
  for (; i < n; ++i) m = std::max(m, s[i]);
  return m;
}

// s[i] = exp(s[i] - m); returns the sum
inline float exp_sum(float* s, int64_t n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float l = hsum(acc);
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    l += s[i];
  }
  return l;
}
#else
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc = 0.f;
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

inline void dots(float* out, const float* q, const float* const* rows, int64_t n, int64_t D,
                 float scale) {
  for (int64_t i = 0; i < n; ++i) out[i] = dot(q, rows[i], D) * scale;
}

inline float exp_sum(float* s, int64_t n, float m) {
  float l = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    l += s[i];
  }
  return l;
}
#endif

inline void axpy(float* __restrict y, float a, const float* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// out (D floats) = sum over rows i of w[i] * rows[i]
#if defined(__AVX2__) && defined(__FMA__)
template <int NV>  // D = 8 * NV: the accumulators stay in registers
inline void weighted_rows(float* out, const float* const* rows, const float* w, int64_t n) {
  __m256 acc[NV];
  for (int j = 0; j < NV; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const float* v = rows[i];
    const __m256 wi = _mm256_set1_ps(w[i]);
    for (int j = 0; j < NV; ++j) acc[j] = _mm256_fmadd_ps(wi, _mm256_loadu_ps(v + 8 * j), acc[j]);
  }
  for (int j = 0; j < NV; ++j) _mm256_storeu_ps(out + 8 * j, acc[j]);
}
#endif

inline void weighted_rows_any(float* out, const float* const* rows, const float* w, int64_t n,
                              int64_t D) {
#if defined(__AVX2__) && defined(__FMA__)
  if (D == 64) return weighted_rows<8>(out, rows, w, n);
  if (D == 128) return weighted_rows<16>(out, rows, w, n);
#endif
  std::fill(out, out + D, 0.f);
  for (int64_t i = 0; i < n; ++i) axpy(out, w[i], rows[i], D);
}

// ---- int8 KV: codes (block_size, KVH, D) int8 then scales (block_size, KVH) float32 per block
// half (KVSpec); x = code * scale.

// out[i] = scale * row_scale[i] * dot(q, codes[i])
inline void dots_q8(float* out, const float* q, const int8_t* const* rows, const float* rs,
                    int64_t n, int64_t D, float scale) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0) {
    for (; i + 4 <= n; i += 4) {
      const int8_t *r0 = rows[i], *r1 = rows[i + 1], *r2 = rows[i + 2], *r3 = rows[i + 3];
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qv, load_i8(r0 + d), a0);
        a1 = _mm256_fmadd_ps(qv, load_i8(r1 + d), a1);
        a2 = _mm256_fmadd_ps(qv, load_i8(r2 + d), a2);
        a3 = _mm256_fmadd_ps(qv, load_i8(r3 + d), a3);
      }
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
      const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
      const __m128 s4 = _mm_mul_ps(_mm_loadu_ps(rs + i), _mm_set1_ps(scale));
      _mm_storeu_ps(out + i, _mm_mul_ps(sum, s4));
    }
  }
#endif
  for (; i < n; ++i) {
    float acc = 0.f;
    for (int64_t d = 0; d < D; ++d) acc += q[d] * static_cast<float>(rows[i][d]);
    out[i] = acc * rs[i] * scale;
  }
}

// out (D floats) = sum over rows i of w[i] * row_scale[i] * codes[i]
#if defined(__AVX2__) && defined(__FMA__)
template <int NV>
inline void weighted_rows_q8(float* out, const int8_t* const* rows, const float* rs,
                             const float* w, int64_t n) {
  __m256 acc[NV];
  for (int j = 0; j < NV; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const int8_t* v = rows[i];
    const __m256 wi = _mm256_set1_ps(w[i] * rs[i]);
    for (int j = 0; j < NV; ++j) acc[j] = _mm256_fmadd_ps(wi, load_i8(v + 8 * j), acc[j]);
  }
  for (int j = 0; j < NV; ++j) _mm256_storeu_ps(out + 8 * j, acc[j]);
}
#endif

inline void weighted_rows_q8_any(float* out, const int8_t* const* rows, const float* rs,
                                 const float* w, int64_t n, int64_t D) {
#if defined(__AVX2__) && defined(__FMA__)
  if (D == 64) return weighted_rows_q8<8>(out, rows, rs, w, n);
  if (D == 128) return weighted_rows_q8<16>(out, rows, rs, w, n);
#endif
  std::fill(out, out + D, 0.f);
  for (int64_t i = 0; i < n; ++i) {
    const float wi = w[i] * rs[i];
    for (int64_t d = 0; d < D; ++d) out[d] += wi * static_cast<float>(rows[i][d]);
  }
}

// Quantize rows x (T, KVH, D) float32 into int8 block halves (num_blocks, half_bytes) at slots:
// per token and head scale = amax * (1/127), code = round(x * (127 / amax)) clamped to +-127;
// the same operations as kv_quant.quantize_int8, so either writes the same bytes.
void write_q8(at::Tensor& raw, const at::Tensor& x_in, const int64_t* slots, int64_t T,
              int64_t block_size) {
  const at::Tensor x = x_in.contiguous();
  const int64_t KVH = x.size(1), D = x.size(2), num_blocks = raw.size(0);
  const int64_t half = raw.size(1), codes_bytes = block_size * KVH * D;
  TORCH_CHECK(half == codes_bytes + block_size * KVH * 4, "int8 KV: block half size mismatch");
  uint8_t* base = raw.data_ptr<uint8_t>();
  const float* xp = x.data_ptr<float>();
  const float inv127 = static_cast<float>(1.0 / 127.0);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t b = slots[t] / block_size, off = slots[t] % block_size;
    TORCH_CHECK(slots[t] >= 0 && b < num_blocks, "int8 KV: slot out of range");
    int8_t* codes = reinterpret_cast<int8_t*>(base + b * half) + off * KVH * D;
    float* scales = reinterpret_cast<float*>(base + b * half + codes_bytes) + off * KVH;
    for (int64_t h = 0; h < KVH; ++h) {
      const float* r = xp + (t * KVH + h) * D;
      float amax = 0.f;
      for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(r[d]));
      scales[h] = amax * inv127;
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      for (int64_t d = 0; d < D; ++d) {
        const float c = std::nearbyint(r[d] * inv);
        codes[h * D + d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, c)));
      }
    }
  }
}

void kv_write_int8(at::Tensor& k_raw, at::Tensor& v_raw, const at::Tensor& k,
                   const at::Tensor& v, const at::Tensor& slots_in, int64_t block_size) {
  TORCH_CHECK(k_raw.scalar_type() == at::kByte && v_raw.scalar_type() == at::kByte &&
                  k_raw.dim() == 2 && k_raw.stride(1) == 1 && v_raw.stride(1) == 1,
              "kv_write_int8: block halves must be uint8 (num_blocks, half_bytes) rows");
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && k.dim() == 3,
              "kv_write_int8: k and v must be float32 (T, KVH, D)");
  const at::Tensor slots = slots_in.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == k.size(0), "kv_write_int8: one slot per row");
  write_q8(k_raw, k, slots.data_ptr<int64_t>(), slots.numel(), block_size);
  write_q8(v_raw, v, slots.data_ptr<int64_t>(), slots.numel(), block_size);
}

// keys a span: the split-K partition of every row (a constant: see the top of the file)
constexpr int64_t kSpan = 32;

template <typename E>
constexpr bool kIsQ8 = std::is_same_v<E, int8_t>;

template <typename E>
inline float to_float(E x) {
  return static_cast<float>(x);
}

// a prefetch into L2 that the optimizer keeps: GCC deletes a loop of __builtin_prefetch with
// nothing else in it as dead code
inline void prefetch_l2(const char* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht1 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// One layer's K/V as attention reads them: float pools (E float / BFloat16 / Half) are
// (num_blocks, block_size, KVH, D) elements; int8 ones (num_blocks, half_bytes) bytes a block
// half, the codes (block_size, KVH, D) then the scales (block_size, KVH) float32.
struct Pool {
  const char* k;
  const char* v;
  int64_t block_size, KVH, D, G;
  int64_t block_bytes;  // from one block to the next
  int64_t codes_bytes;  // int8: where a block half's scales start
  float scale;
  float softcap;  // > 0: every score s becomes softcap * tanh(s / softcap); 0: none
  const float* sinks = nullptr;  // (H,): query head h's logit in its softmax; null: none
};

// K/V rows asked for a few cache lines at a time while a span computes (the next span's rows of
// one kv head, spread over the arithmetic instead of asked for at once): keys [p, stop) of the
// block table, each row's lines in turn, one K line and one V line a step
struct Ahead {
  const Pool* pool = nullptr;
  const int64_t* table = nullptr;
  int64_t row_bytes = 0, h = 0, p = 0, stop = 0;
  int64_t byte = 0, row = 0;  // row: key p's row, from the pool's start
  inline void some(int pairs) {
    for (; pairs > 0 && p < stop; --pairs) {
      if (byte == 0)
        row = table[p / pool->block_size] * pool->block_bytes +
              ((p % pool->block_size) * pool->KVH + h) * row_bytes;
      prefetch_l2(pool->k + row + byte);
      prefetch_l2(pool->v + row + byte);
      byte += 64;
      if (byte >= row_bytes) {
        byte = 0;
        ++p;
      }
    }
  }
  void finish() {
    while (p < stop) some(64);
  }
};

#if defined(__AVX2__) && defined(__FMA__)
// ---- several query vectors together (the heads of one GQA group, of one row or of rows
// attending to the same keys): each K/V row is loaded (and converted) once for all of them.
// Every (vector, key) score and every (vector, channel) weighted sum is the same chain of
// operations however the vectors are grouped.

template <typename E>
inline __m256 load_row(const void* row, int64_t d) {
  const E* p = static_cast<const E*>(row) + d;
  if constexpr (kIsQ8<E>) {
    return load_i8(p);
  } else if constexpr (std::is_same_v<E, at::BFloat16>) {
    return load_bf16(p);
  } else if constexpr (std::is_same_v<E, at::Half>) {
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    alignas(32) float f[8];
    for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(p[i]);
    return _mm256_load_ps(f);
#endif
  } else {
    return _mm256_loadu_ps(p);
  }
}

// s[g * n + i] = scale * (rs[i]) * dot(qv[g], row_i) for GC query vectors, n rows, R rows at a
// time: R * GC accumulators.
template <typename E, int GC, int R>
inline void group_scores(float* s, int64_t n, const float* const* qv, const void* const* rows,
                         const float* rs, int64_t D, float scale, Ahead* ahead) {
  int64_t i = 0;
  for (; i + R <= n; i += R) {
    if (ahead) ahead->some(R);
    __m256 acc[R][GC];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < GC; ++g) acc[r][g] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      for (int r = 0; r < R; ++r) {
        const __m256 k = load_row<E>(rows[i + r], d);
        for (int g = 0; g < GC; ++g)
          acc[r][g] = _mm256_fmadd_ps(_mm256_loadu_ps(qv[g] + d), k, acc[r][g]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const float f = kIsQ8<E> ? scale * rs[i + r] : scale;
      for (int g = 0; g < GC; ++g) s[g * n + i + r] = hsum(acc[r][g]) * f;
    }
  }
  for (; i < n; ++i) {
    __m256 acc[GC];
    for (int g = 0; g < GC; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 k = load_row<E>(rows[i], d);
      for (int g = 0; g < GC; ++g)
        acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qv[g] + d), k, acc[g]);
    }
    const float f = kIsQ8<E> ? scale * rs[i] : scale;
    for (int g = 0; g < GC; ++g) s[g * n + i] = hsum(acc[g]) * f;
  }
}

// out[g][d] = sum_i w[g * n + i] * (rs[i]) * row_i[d] for GC query vectors, 32 channels at a
// time (4 GC accumulators); D a multiple of 32.
template <typename E, int GC>
inline void group_values(float* const* out, const void* const* rows, const float* rs,
                         const float* w, int64_t n, int64_t D, Ahead* ahead) {
  for (int64_t d0 = 0; d0 < D; d0 += 32) {
    __m256 acc[GC][4];
    for (int g = 0; g < GC; ++g)
      for (int j = 0; j < 4; ++j) acc[g][j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      if (ahead) ahead->some(1);
      __m256 wg[GC];
      for (int g = 0; g < GC; ++g)
        wg[g] = _mm256_set1_ps(kIsQ8<E> ? w[g * n + i] * rs[i] : w[g * n + i]);
      for (int j = 0; j < 4; ++j) {
        const __m256 v = load_row<E>(rows[i], d0 + 8 * j);
        for (int g = 0; g < GC; ++g) acc[g][j] = _mm256_fmadd_ps(wg[g], v, acc[g][j]);
      }
    }
    for (int g = 0; g < GC; ++g)
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out[g] + d0 + 8 * j, acc[g][j]);
  }
}

template <typename E, int GC>
inline void group_chunk_scores(float* s, int64_t n, const float* const* qv,
                               const void* const* rows, const float* rs, int64_t D,
                               float scale, Ahead* ahead) {
  if constexpr (GC >= 4) {
    group_scores<E, GC, 2>(s, n, qv, rows, rs, D, scale, ahead);
  } else {
    group_scores<E, GC, 4>(s, n, qv, rows, rs, D, scale, ahead);
  }
}

#if defined(__AVX512F__)
// ---- the same chains 16 lanes wide (the AVX-512 build): every lane runs the operations of
// its AVX2 lane in the same order, so the bits are the AVX2 build's
// (tests/unit/test_kernels.py). Scores pair two query vectors in one register, each half the
// AVX2 accumulator of one (vector, key) dot product, reduced by the same additions as `hsum`
// (eight vectors' at once by `hsum_2x4`); weighted sums take 16 channels a register, up to
// eight vectors a pass, a channel's chain over the keys unchanged.

// 16 channels d .. d + 15 of a row as float32 (an exact conversion from any storage dtype)
template <typename E>
inline __m512 load_row16(const void* row, int64_t d) {
  const E* p = static_cast<const E*>(row) + d;
  if constexpr (kIsQ8<E>) {
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  } else if constexpr (std::is_same_v<E, at::BFloat16>) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else if constexpr (std::is_same_v<E, at::Half>) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else {
    return _mm512_loadu_ps(p);
  }
}

// channels d .. d + 7 of a row in both halves
template <typename E>
inline __m512 load_row8x2(const void* row, int64_t d) {
  if constexpr (std::is_same_v<E, float>) {  // one broadcast load
    const double* p = reinterpret_cast<const double*>(static_cast<const float*>(row) + d);
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(p)));
  } else {
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(load_row<E>(row, d))));
  }
}

inline __m256 high_half(__m512 x) {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
}

constexpr int64_t kMaxHeadDim512 = 256;

// false: the AVX2 chains in this build too (attention_isa("avx2"): the same bits, for tests)
bool g_attn512 = true;

// The hsum of each 8-lane half of 8 accumulators (two keys x four pairs of vectors: a[p],
// b[p] the pairs' sums over key 0 and key 1), all at once: each sum is the chain of additions
// `hsum` makes, ((x0 + x4) + (x2 + x6)) + ((x1 + x5) + (x3 + x7)), lane for lane, so the bits
// are hsum's. Lane 4 * (2 * key + half) + pair holds the sum of vector 2 * pair + half.
__attribute__((always_inline)) inline __m512 hsum_2x4(const __m512* a, const __m512* b) {
  __m512 lo[4];  // (x0 + x4, x1 + x5, x2 + x6, x3 + x7) per 128-bit lane: key 0's halves, key 1's
  for (int p = 0; p < 4; ++p)
    lo[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[p], b[p], 0x88),
                          _mm512_shuffle_f32x4(a[p], b[p], 0xDD));
  // ((x0 + x4) + (x2 + x6), (x1 + x5) + (x3 + x7)) of pairs 0 and 1, of pairs 2 and 3
  const __m512 c01 = _mm512_add_ps(_mm512_shuffle_ps(lo[0], lo[1], 0x44),
                                   _mm512_shuffle_ps(lo[0], lo[1], 0xEE));
  const __m512 c23 = _mm512_add_ps(_mm512_shuffle_ps(lo[2], lo[3], 0x44),
                                   _mm512_shuffle_ps(lo[2], lo[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(c01, c23, 0x88), _mm512_shuffle_ps(c01, c23, 0xDD));
}

// group_scores for GC query vectors in (GC + 1) / 2 pairs, R keys at a time
template <typename E, int GC, int R>
inline void group_scores512(float* s, int64_t n, const float* const* qv, const void* const* rows,
                            const float* rs, int64_t D, float scale, Ahead* ahead) {
  constexpr int P = (GC + 1) / 2;
  // each pair's vectors 8 channels at a time side by side: [q_2p[d..d+7], q_2p+1[d..d+7]]
  alignas(64) float qp[P][2 * kMaxHeadDim512];
  for (int p = 0; p < P; ++p)
    for (int64_t d = 0; d < D; d += 8) {
      _mm256_store_ps(qp[p] + 2 * d, _mm256_loadu_ps(qv[2 * p] + d));
      _mm256_store_ps(qp[p] + 2 * d + 8,
                      2 * p + 1 < GC ? _mm256_loadu_ps(qv[2 * p + 1] + d) : _mm256_setzero_ps());
    }
  int64_t i = 0;
  for (; i + R <= n; i += R) {
    if (ahead) ahead->some(R);
    __m512 acc[R][P];
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      for (int r = 0; r < R; ++r) {
        const __m512 k = load_row8x2<E>(rows[i + r], d);
        for (int p = 0; p < P; ++p)
          acc[r][p] = _mm512_fmadd_ps(_mm512_load_ps(qp[p] + 2 * d), k, acc[r][p]);
      }
    }
    if constexpr (P == 4 && R % 2 == 0) {  // 16 sums at once, by hsum's own additions
      for (int r = 0; r < R; r += 2) {
        alignas(64) float sum[16];
        _mm512_store_ps(sum, hsum_2x4(acc[r], acc[r + 1]));
        const float f0 = kIsQ8<E> ? scale * rs[i + r] : scale;
        const float f1 = kIsQ8<E> ? scale * rs[i + r + 1] : scale;
        for (int g = 0; g < GC; ++g) {  // lane 4 * (2 * key + g % 2) + g / 2
          s[g * n + i + r] = sum[4 * (g % 2) + g / 2] * f0;
          s[g * n + i + r + 1] = sum[4 * (2 + g % 2) + g / 2] * f1;
        }
      }
      continue;
    }
    for (int r = 0; r < R; ++r) {
      const float f = kIsQ8<E> ? scale * rs[i + r] : scale;
      for (int p = 0; p < P; ++p) {
        s[2 * p * n + i + r] = hsum(_mm512_castps512_ps256(acc[r][p])) * f;
        if (2 * p + 1 < GC) s[(2 * p + 1) * n + i + r] = hsum(high_half(acc[r][p])) * f;
      }
    }
  }
  for (; i < n; ++i) {
    __m512 acc[P];
    for (int p = 0; p < P; ++p) acc[p] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m512 k = load_row8x2<E>(rows[i], d);
      for (int p = 0; p < P; ++p)
        acc[p] = _mm512_fmadd_ps(_mm512_load_ps(qp[p] + 2 * d), k, acc[p]);
    }
    const float f = kIsQ8<E> ? scale * rs[i] : scale;
    for (int p = 0; p < P; ++p) {
      s[2 * p * n + i] = hsum(_mm512_castps512_ps256(acc[p])) * f;
      if (2 * p + 1 < GC) s[(2 * p + 1) * n + i] = hsum(high_half(acc[p])) * f;
    }
  }
}

// group_values, 32 channels in two registers
template <typename E, int GC>
inline void group_values512(float* const* out, const void* const* rows, const float* rs,
                            const float* w, int64_t n, int64_t D, Ahead* ahead) {
  for (int64_t d0 = 0; d0 < D; d0 += 32) {
    __m512 acc[GC][2];
    for (int g = 0; g < GC; ++g) acc[g][0] = acc[g][1] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      if (ahead) ahead->some(1);
      __m512 wg[GC];
      for (int g = 0; g < GC; ++g)
        wg[g] = _mm512_set1_ps(kIsQ8<E> ? w[g * n + i] * rs[i] : w[g * n + i]);
      for (int j = 0; j < 2; ++j) {
        const __m512 v = load_row16<E>(rows[i], d0 + 16 * j);
        for (int g = 0; g < GC; ++g) acc[g][j] = _mm512_fmadd_ps(wg[g], v, acc[g][j]);
      }
    }
    for (int g = 0; g < GC; ++g)
      for (int j = 0; j < 2; ++j) _mm512_storeu_ps(out[g] + d0 + 16 * j, acc[g][j]);
  }
}
#endif

// scores and weighted values of nv query vectors, a few of them at a time
template <typename E>
void all_group_scores(float* s, int64_t n, const float* const* qv, int64_t nv,
                      const void* const* rows, const float* rs, int64_t D, float scale,
                      Ahead* ahead) {
#if defined(__AVX512F__)
  if (g_attn512 && D <= kMaxHeadDim512 && nv >= 4) {
    for (int64_t g0 = 0; g0 < nv; g0 += 8) {
      float* sg = s + g0 * n;
      const float* const* qg = qv + g0;
      switch (std::min<int64_t>(8, nv - g0)) {
        case 1: group_scores512<E, 1, 4>(sg, n, qg, rows, rs, D, scale, ahead); break;
        case 2: group_scores512<E, 2, 4>(sg, n, qg, rows, rs, D, scale, ahead); break;
        case 3: group_scores512<E, 3, 4>(sg, n, qg, rows, rs, D, scale, ahead); break;
        case 4: group_scores512<E, 4, 4>(sg, n, qg, rows, rs, D, scale, ahead); break;
        case 5: group_scores512<E, 5, 2>(sg, n, qg, rows, rs, D, scale, ahead); break;
        case 6: group_scores512<E, 6, 2>(sg, n, qg, rows, rs, D, scale, ahead); break;
        case 7: group_scores512<E, 7, 2>(sg, n, qg, rows, rs, D, scale, ahead); break;
        default: group_scores512<E, 8, 2>(sg, n, qg, rows, rs, D, scale, ahead); break;
      }
    }
    return;
  }
#endif
  for (int64_t g0 = 0; g0 < nv; g0 += 4) {
    float* sg = s + g0 * n;
    const float* const* qg = qv + g0;
    switch (std::min<int64_t>(4, nv - g0)) {
      case 1: group_chunk_scores<E, 1>(sg, n, qg, rows, rs, D, scale, ahead); break;
      case 2: group_chunk_scores<E, 2>(sg, n, qg, rows, rs, D, scale, ahead); break;
      case 3: group_chunk_scores<E, 3>(sg, n, qg, rows, rs, D, scale, ahead); break;
      default: group_chunk_scores<E, 4>(sg, n, qg, rows, rs, D, scale, ahead); break;
    }
  }
}

template <typename E>
void all_group_values(float* const* out, const void* const* rows, const float* rs,
                      const float* w, int64_t n, int64_t nv, int64_t D, Ahead* ahead) {
#if defined(__AVX512F__)
  if (g_attn512) {  // up to 8 vectors a pass (16 accumulators): each V row converted once
    for (int64_t g0 = 0; g0 < nv; g0 += 8) {
      float* const* og = out + g0;
      const float* wg = w + g0 * n;
      switch (std::min<int64_t>(8, nv - g0)) {
        case 1: group_values512<E, 1>(og, rows, rs, wg, n, D, ahead); break;
        case 2: group_values512<E, 2>(og, rows, rs, wg, n, D, ahead); break;
        case 3: group_values512<E, 3>(og, rows, rs, wg, n, D, ahead); break;
        case 4: group_values512<E, 4>(og, rows, rs, wg, n, D, ahead); break;
        case 5: group_values512<E, 5>(og, rows, rs, wg, n, D, ahead); break;
        case 6: group_values512<E, 6>(og, rows, rs, wg, n, D, ahead); break;
        case 7: group_values512<E, 7>(og, rows, rs, wg, n, D, ahead); break;
        default: group_values512<E, 8>(og, rows, rs, wg, n, D, ahead); break;
      }
    }
    return;
  }
#endif
  for (int64_t g0 = 0; g0 < nv; g0 += 3) {
    float* const* og = out + g0;
    const float* wg = w + g0 * n;
    switch (std::min<int64_t>(3, nv - g0)) {
      case 1: group_values<E, 1>(og, rows, rs, wg, n, D, ahead); break;
      case 2: group_values<E, 2>(og, rows, rs, wg, n, D, ahead); break;
      default: group_values<E, 3>(og, rows, rs, wg, n, D, ahead); break;
    }
  }
}
#endif

// per thread: the span's scores, row pointers, row scales, rows converted to float32
struct Scratch {
  std::vector<float> scores, row_scales, converted;
  std::vector<const void*> rows;
  std::vector<const float*> float_rows;
  Ahead ahead;
};

// the span's K/V rows, every head, asked for at once (the heads then find them in L2): the
// rows arrive at the memory's streaming rate, ~1.8x the rate the head-by-head reads alone got
// (measured, 16 sequences of 165 tokens, each layer's K/V out of cache)
template <typename E>
inline void prefetch_span(const Pool& P, const int64_t* table, int64_t start, int64_t stop) {
  const int64_t row_bytes = P.KVH * P.D * static_cast<int64_t>(sizeof(E));
  for (int64_t p = start; p < stop;) {
    const int64_t off = p % P.block_size, n_rows = std::min(P.block_size - off, stop - p);
    const int64_t at = table[p / P.block_size] * P.block_bytes + off * row_bytes;
    for (int64_t byte = 0; byte < n_rows * row_bytes; byte += 64) {
      prefetch_l2(P.k + at + byte);
      prefetch_l2(P.v + at + byte);
    }
    p += n_rows;
  }
}

// kv head h's K/V rows of keys [start, stop), to be asked for a few lines at a time while the
// current span computes (what is left of the previous ones asked for first)
template <typename E>
inline void ask_ahead(const Pool& P, const int64_t* table, int64_t start, int64_t stop, int64_t h,
                      Ahead& ahead) {
  ahead.finish();
  ahead = Ahead{&P, table, P.D * static_cast<int64_t>(sizeof(E)), h, start, stop};
}


// The softmax partial of keys [start, stop) for nv query vectors qv of KV head h (its query
// heads, of one row or of several rows that all see these keys), each score soft-capped where
// the pool says so: res[v][0] = the largest score, [1] = the sum of exp(score - largest),
// [2 .. D + 1] = the values weighted by those exps. One compiled body (noinline) for every
// caller, and each vector's result the same whatever the others: a span's bits never depend
// on where or with whom it was computed.
template <typename E>
__attribute__((noinline)) void span_partial(const Pool& P, const float* const* qv, int64_t nv,
                                            const int64_t* table, int64_t start, int64_t stop,
                                            int64_t h, float* const* res, Scratch& S) {
  const int64_t n = stop - start, D = P.D;
  S.scores.resize(nv * n);
  S.rows.resize(2 * n);
  if constexpr (kIsQ8<E>) S.row_scales.resize(2 * n);
  // walk the span block by block (no division per key; the pool's fields in locals, which the
  // stores into rows cannot alias)
  const char *kp = P.k, *vp = P.v;
  const int64_t bsz = P.block_size, bbytes = P.block_bytes, KVH = P.KVH;
  const void** rows = S.rows.data();
  for (int64_t p = start, i = 0; p < stop;) {
    const int64_t blk = table[p / bsz] * bbytes;
    for (int64_t off = p % bsz; off < bsz && p < stop; ++off, ++p, ++i) {
      const int64_t r = off * KVH + h;
      rows[i] = kp + blk + r * D * static_cast<int64_t>(sizeof(E));
      rows[n + i] = vp + blk + r * D * static_cast<int64_t>(sizeof(E));
      if constexpr (kIsQ8<E>) {
        S.row_scales[i] = reinterpret_cast<const float*>(P.k + blk + P.codes_bytes)[r];
        S.row_scales[n + i] = reinterpret_cast<const float*>(P.v + blk + P.codes_bytes)[r];
      }
    }
  }
  const float* rs = kIsQ8<E> ? S.row_scales.data() : nullptr;
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 32 == 0) {  // the group kernels: each row read once for all the vectors
    all_group_scores<E>(S.scores.data(), n, qv, nv, S.rows.data(), rs, D, P.scale, &S.ahead);
    if (P.softcap > 0.f) cap_scores(S.scores.data(), nv * n, P.softcap);
    float* outs[64];
    for (int64_t v0 = 0; v0 < nv; v0 += 64) {
      const int64_t count = std::min<int64_t>(64, nv - v0);
      for (int64_t v = 0; v < count; ++v) {
        float* sg = S.scores.data() + (v0 + v) * n;
        const float m = row_max(sg, n);
        res[v0 + v][0] = m;
        res[v0 + v][1] = exp_sum(sg, n, m);
        outs[v] = res[v0 + v] + 2;
      }
      all_group_values<E>(outs, S.rows.data() + n, kIsQ8<E> ? rs + n : nullptr,
                          S.scores.data() + v0 * n, n, count, D, &S.ahead);
    }
    return;
  }
#endif
  // any head size: float32 rows (16-bit ones converted first), one vector after the other
  const float* const* krows;
  const float* const* vrows;
  if constexpr (std::is_same_v<E, float> || kIsQ8<E>) {
    krows = reinterpret_cast<const float* const*>(S.rows.data());
    vrows = krows + n;
  } else {
    S.converted.resize(2 * n * D);
    S.float_rows.resize(2 * n);
    for (int64_t i = 0; i < 2 * n; ++i) {
      const E* src = static_cast<const E*>(S.rows[i]);
      float* dst = S.converted.data() + i * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = to_float(src[d]);
      S.float_rows[i] = dst;
    }
    krows = S.float_rows.data();
    vrows = krows + n;
  }
  for (int64_t v = 0; v < nv; ++v) {
    float* sg = S.scores.data() + v * n;
    if constexpr (kIsQ8<E>) {
      dots_q8(sg, qv[v], reinterpret_cast<const int8_t* const*>(S.rows.data()), rs, n, D,
              P.scale);
    } else {
      dots(sg, qv[v], krows, n, D, P.scale);
    }
    if (P.softcap > 0.f) cap_scores(sg, n, P.softcap);
    float m = sg[0];
    for (int64_t i = 1; i < n; ++i) m = std::max(m, sg[i]);
    float* r = res[v];
    r[0] = m;
    r[1] = exp_sum(sg, n, m);
    if constexpr (kIsQ8<E>) {
      weighted_rows_q8_any(r + 2, reinterpret_cast<const int8_t* const*>(S.rows.data()) + n,
                           rs + n, sg, n, D);
    } else {
      weighted_rows_any(r + 2, vrows, sg, n, D);
    }
  }
}

// A row's softmax so far, per query head (max, sum, D weighted values; start: -inf, 0, zeros),
// with the next span's partials (the same layout, H heads of D + 2) folded in. Spans are always
// folded in span order by this one function; the rescaling exps run 8 heads at a time.
__attribute__((noinline)) void fold_span(float* state, const float* part, int64_t H, int64_t D) {
  const int64_t stride = D + 2;
  for (int64_t h0 = 0; h0 < H; h0 += 8) {
    const int64_t lanes = std::min<int64_t>(8, H - h0);
    alignas(32) float m[8] = {}, a[8] = {}, w[8] = {};
    for (int64_t i = 0; i < lanes; ++i) {
      m[i] = std::max(state[(h0 + i) * stride], part[(h0 + i) * stride]);
      a[i] = state[(h0 + i) * stride] - m[i];
      w[i] = part[(h0 + i) * stride] - m[i];
    }
#if defined(__AVX2__) && defined(__FMA__)
    _mm256_store_ps(a, exp256(_mm256_load_ps(a)));  // exp(-inf) clamps to ~1e-38: times 0
    _mm256_store_ps(w, exp256(_mm256_load_ps(w)));
#else
    for (int i = 0; i < 8; ++i) {
      a[i] = std::exp(a[i]);
      w[i] = std::exp(w[i]);
    }
#endif
    for (int64_t i = 0; i < lanes; ++i) {
      float* st = state + (h0 + i) * stride;
      const float* pt = part + (h0 + i) * stride;
      st[0] = m[i];
      st[1] = std::fma(st[1], a[i], pt[1] * w[i]);
      int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
      const __m256 av = _mm256_set1_ps(a[i]), wv = _mm256_set1_ps(w[i]);
      for (; d + 8 <= D; d += 8)
        _mm256_storeu_ps(st + 2 + d, _mm256_fmadd_ps(_mm256_loadu_ps(st + 2 + d), av,
                                                     _mm256_mul_ps(_mm256_loadu_ps(pt + 2 + d), wv)));
#endif
      for (; d < D; ++d) st[2 + d] = std::fma(st[2 + d], a[i], pt[2 + d] * w[i]);
    }
  }
}

// a row's softmax before any key: nothing (-inf, 0), or its head's sink (sink, exp(0) = 1),
// a logit in the denominator with no value: every span folded in after it, as with keys
inline void start_state(float* state, int64_t D, const float* sink = nullptr) {
  state[0] = sink ? *sink : -std::numeric_limits<float>::infinity();
  state[1] = sink ? 1.f : 0.f;
  std::fill(state + 2, state + D + 2, 0.f);
}

__attribute__((noinline)) void finish_state(float* out, const float* state, int64_t D) {
  const float inv = 1.f / state[1];
  for (int64_t d = 0; d < D; ++d) out[d] = state[2 + d] * inv;
}

// Spans that rows of different sequences read from the same pool blocks (decode rows over one
// cached prefix: a system prompt, a conversation's history forked by n > 1): each such span is
// computed once for all those rows' query heads together, each K/V row loaded once for all of
// them, instead of once a row. span_partial gives every vector the bits it has alone, and the
// rows' spans are still folded in span order: no bit changes. Only rows alone in their group
// (one query row of a sequence) take part; a row's shared spans are those it sees whole.
struct Sharing {
  std::vector<int64_t> span, first, count;  // shared span i: its index, rows[first, +count)
  std::vector<int64_t> rows;
  std::vector<char> marked;  // marked[b * stride + s]: row b's span s is computed shared
  int64_t stride = 0;
  bool is_marked(int64_t b, int64_t s) const { return !marked.empty() && marked[b * stride + s]; }
};

Sharing find_shared(const int64_t* tables, int64_t max_blocks, const int64_t* lens,
                    const std::vector<int64_t>& group_start, int64_t block_size, int64_t window) {
  struct Entry {
    uint64_t key;
    int64_t s, b;
  };
  Sharing sh;
  std::vector<Entry> entries;
  const int64_t T = group_start.back();
  auto first_block = [&](int64_t s) { return s * kSpan / block_size; };
  auto last_block = [&](int64_t s) { return (s * kSpan + kSpan - 1) / block_size; };
  for (size_t gi = 0; gi + 1 < group_start.size(); ++gi) {
    if (group_start[gi + 1] - group_start[gi] != 1) continue;
    const int64_t b = group_start[gi], len = lens[b];
    const int64_t* table = tables + b * max_blocks;
    const int64_t key0 = window_first_key(len, window);
    for (int64_t s = (key0 + kSpan - 1) / kSpan; (s + 1) * kSpan <= len; ++s) {
      uint64_t key = static_cast<uint64_t>(s) * 0x9E3779B97F4A7C15ull;
      for (int64_t j = first_block(s); j <= last_block(s); ++j)
        key = (key ^ static_cast<uint64_t>(table[j])) * 0x100000001B3ull;
      entries.push_back({key, s, b});
    }
  }
  if (entries.size() < 2) return sh;
  std::sort(entries.begin(), entries.end(), [](const Entry& x, const Entry& y) {  // span order
    return x.s != y.s ? x.s < y.s : x.key != y.key ? x.key < y.key : x.b < y.b;
  });
  auto same = [&](const Entry& x, const Entry& y) {
    if (x.key != y.key || x.s != y.s) return false;
    const int64_t *tx = tables + x.b * max_blocks, *ty = tables + y.b * max_blocks;
    return std::equal(tx + first_block(x.s), tx + last_block(x.s) + 1, ty + first_block(x.s));
  };
  for (size_t i = 0, j; i < entries.size(); i = j) {
    for (j = i + 1; j < entries.size() && same(entries[i], entries[j]);) ++j;
    if (j - i < 2) continue;
    if (sh.marked.empty()) {
      for (int64_t b = 0; b < T; ++b) sh.stride = std::max(sh.stride, (lens[b] + kSpan - 1) / kSpan);
      sh.marked.assign(T * sh.stride, 0);
    }
    sh.span.push_back(entries[i].s);
    sh.first.push_back(static_cast<int64_t>(sh.rows.size()));
    sh.count.push_back(static_cast<int64_t>(j - i));
    for (size_t k = i; k < j; ++k) {
      sh.rows.push_back(entries[k].b);
      sh.marked[entries[k].b * sh.stride + entries[k].s] = 1;
    }
  }
  return sh;
}

// The attention itself: q (T, H, D) float32; tables (T, max_blocks), lens (T,) int64.
//
// Rows that share a block table (a prefill chunk's: the same sequence at other positions) go in
// groups of up to kGroupRows: for each span, the rows that see all of it are computed together
// (each K/V row loaded once for all their query heads), a row whose context ends inside it on
// its own. A group is a unit of work, or, when there are too few rows to busy the threads, its
// spans are shared between tasks and their partials folded in a second pass.
template <typename E>
at::Tensor attend(const at::Tensor& q, const Pool& P, int64_t num_blocks,
                  const at::Tensor& block_tables, const at::Tensor& ctx_lens, int64_t window) {
  constexpr int64_t kGroupRows = 8;
  const int64_t T = q.size(0), H = q.size(1), D = P.D, G = P.G, KVH = P.KVH;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  // a sliding window (window > 0): row b attends to keys [first_key(b), lens[b]), the last
  // `window`; its spans are still the fixed partition from key 0, the first one cut at
  // first_key(b), and the spans before it are skipped (their blocks are never read, so they
  // may be gone from the table)
  auto first_key = [&](int64_t b) { return window_first_key(lens[b], window); };
  auto first_span = [&](int64_t b) { return first_key(b) / kSpan; };
  auto spans_of = [&](int64_t b) { return (lens[b] + kSpan - 1) / kSpan; };
  int64_t total = 0, max_len = 0;
  std::vector<int64_t> group_start{0}, group_spans, group_first;  // most spans, first span
  for (int64_t b = 0; b < T; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_blocks * P.block_size,
                "paged_decode_attention: context length outside the block table");
    const int64_t* table = tables + b * max_blocks;
    for (int64_t j = first_key(b) / P.block_size; j < (lens[b] + P.block_size - 1) / P.block_size; ++j)
      TORCH_CHECK(table[j] >= 0 && table[j] < num_blocks,
                  "paged_decode_attention: block id out of range");
    if (b > 0 && (b - group_start.back() == kGroupRows ||
                  !std::equal(table, table + max_blocks, table - max_blocks)))
      group_start.push_back(b);
    total += spans_of(b) - first_span(b);
    max_len = std::max(max_len, lens[b] - first_key(b));
  }
  group_start.push_back(T);
  const int64_t num_groups = static_cast<int64_t>(group_start.size()) - 1;
  for (int64_t gi = 0; gi < num_groups; ++gi) {
    int64_t most = 0, first = std::numeric_limits<int64_t>::max();
    for (int64_t b = group_start[gi]; b < group_start[gi + 1]; ++b) {
      most = std::max(most, spans_of(b));
      first = std::min(first, first_span(b));
    }
    group_spans.push_back(most);
    group_first.push_back(first);
  }
  // Sharing out (no effect on the bits): about 4 tasks a thread of about `chunk` spans' work
  // each; a group with more spans than that is split, its rows' spans' partials kept for a
  // second pass.
  const int64_t threads = at::get_num_threads();
  const int64_t chunk = std::max<int64_t>(1, (total + 4 * threads - 1) / (4 * threads));
  struct Unit {
    int64_t group, first, last;  // spans [first, last) of the group's rows
  };
  std::vector<Unit> units;
  std::vector<char> is_split(T, 0);
  std::vector<int64_t> split_at(T, 0);  // where a split row's span 0 would lie in `partial`
  std::vector<int64_t> split_rows;
  int64_t split_spans = 0;
  std::vector<int64_t> unit_work;
  const Sharing shared = find_shared(tables, max_blocks, lens, group_start, P.block_size, window);
  for (int64_t gi = 0; gi < num_groups; ++gi) {
    const int64_t b0 = group_start[gi], b1 = group_start[gi + 1];
    bool sharing = false;  // a row with shared spans: its other spans in runs, all kept split
    for (int64_t s = group_first[gi]; s < group_spans[gi] && !sharing; ++s)
      sharing = shared.is_marked(b0, s);
    if (sharing) {
      is_split[b0] = 1;
      split_at[b0] = split_spans - first_span(b0);
      split_spans += spans_of(b0) - first_span(b0);
      split_rows.push_back(b0);
      for (int64_t s = first_span(b0); s < spans_of(b0);) {
        if (shared.is_marked(b0, s)) {
          ++s;
          continue;
        }
        int64_t e = s + 1;
        while (e < spans_of(b0) && e - s < chunk && !shared.is_marked(b0, e)) ++e;
        units.push_back({gi, s, e});
        unit_work.push_back(e - s);
        s = e;
      }
      continue;
    }
    if (group_spans[gi] - group_first[gi] <= chunk) {
      int64_t work = 0;
      for (int64_t b = b0; b < b1; ++b) work += spans_of(b) - first_span(b);
      units.push_back({gi, group_first[gi], group_spans[gi]});
      unit_work.push_back(work);
      continue;
    }
    for (int64_t b = b0; b < b1; ++b) {
      is_split[b] = 1;
      split_at[b] = split_spans - first_span(b);  // its spans [first_span, spans_of) stored
      split_spans += spans_of(b) - first_span(b);
      split_rows.push_back(b);
    }
    for (int64_t s = group_first[gi]; s < group_spans[gi]; s += chunk) {
      units.push_back({gi, s, std::min(group_spans[gi], s + chunk)});
      unit_work.push_back((units.back().last - s) * (b1 - b0));
    }
  }
  // tasks: runs of units holding about `chunk` spans' work each
  std::vector<int64_t> task_start{0};
  for (int64_t u = 0, work = 0; u < static_cast<int64_t>(units.size()); ++u) {
    work += unit_work[u];
    if (work >= chunk) {
      task_start.push_back(u + 1);
      work = 0;
    }
  }
  if (task_start.back() != static_cast<int64_t>(units.size())) task_start.push_back(units.size());
  const int64_t num_tasks = static_cast<int64_t>(task_start.size()) - 1;

  at::Tensor out = at::empty({T, H, D}, q.options());
  const int64_t part_size = G * (D + 2);  // one span, one kv head, one row
  at::Tensor partial = at::empty({std::max<int64_t>(1, split_spans * KVH * part_size)},
                                 q.options());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* pp = partial.data_ptr<float>();

  auto work = [&](int64_t begin, int64_t end) {
    Scratch S;
    std::vector<float> span_part(kGroupRows * KVH * part_size);
    std::vector<float> state(kGroupRows * H * (D + 2));
    std::vector<const float*> qv;
    std::vector<float*> res;
    std::vector<int64_t> seen;  // the group's rows that see all of a span
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t u = task_start[t]; u < task_start[t + 1]; ++u) {
        const Unit& unit = units[u];
        const int64_t b0 = group_start[unit.group], b1 = group_start[unit.group + 1];
        const int64_t* table = tables + b0 * max_blocks;
        const bool whole = !is_split[b0];
        // where row b's partial for span s and kv head h goes
        auto part_of = [&](int64_t b, int64_t s, int64_t h) {
          return whole ? span_part.data() + ((b - b0) * KVH + h) * part_size
                       : pp + ((split_at[b] + s) * KVH + h) * part_size;
        };
        if (whole)
          for (int64_t i = 0; i < (b1 - b0) * H; ++i)
            start_state(state.data() + i * (D + 2), D, P.sinks ? P.sinks + i % H : nullptr);
        int64_t group_len = 0;
        for (int64_t b = b0; b < b1; ++b) group_len = std::max(group_len, lens[b]);
        // the unit's first span asked for at once; each later one spread over the span before
        // it (ask_ahead): measured 10-35% faster than the whole unit asked for at once, when
        // one long row's K/V stream from DRAM
        const int64_t unit_end = std::min(group_len, unit.last * kSpan);
        prefetch_span<E>(P, table, unit.first * kSpan, std::min(unit_end, (unit.first + 1) * kSpan));
        for (int64_t s = unit.first; s < unit.last; ++s) {
          const int64_t start = s * kSpan;
          seen.clear();
          for (int64_t b = b0; b < b1; ++b)
            if (lens[b] >= start + kSpan && first_key(b) <= start) seen.push_back(b);
          for (int64_t h = 0; h < KVH; ++h) {
            ask_ahead<E>(P, table, start + kSpan, std::min(unit_end, start + 2 * kSpan), h, S.ahead);
            if (!seen.empty()) {  // the rows that see the whole span, together
              qv.clear();
              res.clear();
              for (const int64_t b : seen) {
                float* dst = part_of(b, s, h);
                for (int64_t g = 0; g < G; ++g) {
                  qv.push_back(qp + (b * H + h * G + g) * D);
                  res.push_back(dst + g * (D + 2));
                }
              }
              span_partial<E>(P, qv.data(), qv.size(), table, start, start + kSpan, h,
                              res.data(), S);
            }
            for (int64_t b = b0; b < b1; ++b) {  // a row whose keys end or begin inside it
              const int64_t lo = std::max(start, first_key(b));
              const int64_t hi = std::min(lens[b], start + kSpan);
              if (hi <= lo || (lo == start && hi == start + kSpan)) continue;
              float* dst = part_of(b, s, h);
              qv.clear();
              res.clear();
              for (int64_t g = 0; g < G; ++g) {
                qv.push_back(qp + (b * H + h * G + g) * D);
                res.push_back(dst + g * (D + 2));
              }
              span_partial<E>(P, qv.data(), G, table, lo, hi, h, res.data(), S);
            }
          }
          if (whole)  // a row's H heads' partials lie together: (kv head, its heads)
            for (int64_t b = b0; b < b1; ++b)
              if (lens[b] > start && first_key(b) < start + kSpan)
                fold_span(state.data() + (b - b0) * H * (D + 2), part_of(b, s, 0), H, D);
        }
        if (whole)
          for (int64_t b = b0; b < b1; ++b)
            for (int64_t head = 0; head < H; ++head)
              finish_state(op + (b * H + head) * D,
                           state.data() + ((b - b0) * H + head) * (D + 2), D);
      }
    }
  };
  // a handful of keys runs on the calling thread alone; from ~8 keys on, sharing the work
  // wins even at a 10 us thread wake-up (measured in the decode step)
  const bool small = T * max_len * H * D < (1 << 12);
  if (small || num_tasks == 1) {
    work(0, num_tasks);
  } else {
    kvwise::parallel_for(0, num_tasks, 1, work);
  }
  // the shared spans, each for all its rows at once
  kvwise::parallel_for(0, static_cast<int64_t>(shared.span.size()), 1, [&](int64_t u0, int64_t u1) {
    Scratch S;
    std::vector<const float*> qv;
    std::vector<float*> res;
    if (u0 < u1)
      prefetch_span<E>(P, tables + shared.rows[shared.first[u0]] * max_blocks,
                       shared.span[u0] * kSpan, (shared.span[u0] + 1) * kSpan);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t s = shared.span[u], start = s * kSpan;
      const int64_t* rows = shared.rows.data() + shared.first[u];
      for (int64_t h = 0; h < KVH; ++h) {
        if (u + 1 < u1) {  // the next span's rows on their way while this one computes
          const int64_t next = shared.span[u + 1] * kSpan;
          ask_ahead<E>(P, tables + shared.rows[shared.first[u + 1]] * max_blocks, next,
                       next + kSpan, h, S.ahead);
        }
        qv.clear();
        res.clear();
        for (int64_t i = 0; i < shared.count[u]; ++i) {
          const int64_t b = rows[i];
          float* dst = pp + ((split_at[b] + s) * KVH + h) * part_size;
          for (int64_t g = 0; g < G; ++g) {
            qv.push_back(qp + (b * H + h * G + g) * D);
            res.push_back(dst + g * (D + 2));
          }
        }
        span_partial<E>(P, qv.data(), qv.size(), tables + rows[0] * max_blocks, start,
                        start + kSpan, h, res.data(), S);
      }
    }
  });
  // the split rows: their spans' partials folded in span order, as a whole row's are
  if (!split_rows.empty()) {
    const int64_t num_split = static_cast<int64_t>(split_rows.size());
    kvwise::parallel_for(0, num_split, std::max<int64_t>(1, 512 / (chunk * H)),
                     [&](int64_t begin, int64_t end) {
      std::vector<float> state(H * (D + 2));
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = split_rows[i];
        for (int64_t head = 0; head < H; ++head)
          start_state(state.data() + head * (D + 2), D, P.sinks ? P.sinks + head : nullptr);
        for (int64_t s = first_span(b); s < spans_of(b); ++s)
          fold_span(state.data(), pp + (split_at[b] + s) * KVH * part_size, H, D);
        for (int64_t head = 0; head < H; ++head)
          finish_state(op + (b * H + head) * D, state.data() + head * (D + 2), D);
      }
    });
  }
  return out;
}

template <typename E>
at::Tensor attend_float_pool(const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& tables,
                             const at::Tensor& lens, double scale, int64_t window,
                             double softcap, const float* sinks) {
  const int64_t block_size = k_cache.size(1), KVH = k_cache.size(2), D = q.size(2);
  const Pool P{static_cast<const char*>(k_cache.data_ptr()),
               static_cast<const char*>(v_cache.data_ptr()),
               block_size, KVH, D, q.size(1) / KVH,
               block_size * KVH * D * static_cast<int64_t>(sizeof(E)), 0,
               static_cast<float>(scale), static_cast<float>(softcap), sinks};
  return attend<E>(q, P, k_cache.size(0), tables, lens, window);
}

// q: (T, H, D) float32; k_cache, v_cache: (num_blocks, block_size, KVH, D) float32, bfloat16 or
// float16; block_tables: (T, max_blocks) int64; ctx_lens: (T,) int64: row t attends to the first
// ctx_lens[t] slots of its table. Returns (T, H, D) float32.
// k_new, v_new (N, KVH, D) and slots (N,), when given (float32 pools only), are first written
// into the caches (the step's new K/V rows: a decode-only step writes and attends in this one
// call). window > 0: row t attends to its last `window` keys only; softcap > 0: every score
// soft-capped, softcap * tanh(score / softcap).
at::Tensor paged_decode_attention(const at::Tensor& q_in, at::Tensor& k_cache, at::Tensor& v_cache,
                                  const at::Tensor& block_tables_in, const at::Tensor& ctx_lens_in,
                                  double scale_in, const c10::optional<at::Tensor>& k_new,
                                  const c10::optional<at::Tensor>& v_new,
                                  const c10::optional<at::Tensor>& slots, int64_t window,
                                  double softcap, const c10::optional<at::Tensor>& sinks_in) {
  check_attention_kind("paged_decode_attention", window, softcap);
  const float* sinks = sinks_of("paged_decode_attention", sinks_in, q_in.size(1));
  TORCH_CHECK(q_in.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "paged_decode_attention: q (T, H, D), caches (blocks, block_size, KVH, D)");
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && v_cache.scalar_type() == dtype &&
                  (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf),
              "paged_decode_attention: q float32, caches float32, bfloat16 or float16");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode_attention: caches must be contiguous");
  const at::Tensor q = q_in.contiguous();
  const at::Tensor block_tables = block_tables_in.to(at::kLong).contiguous();
  const at::Tensor ctx_lens = ctx_lens_in.to(at::kLong).contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0 && v_cache.sizes() == k_cache.sizes(),
              "paged_decode_attention: shape mismatch");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == T && ctx_lens.numel() == T,
              "paged_decode_attention: one table row and one length per query row");
  if (k_new || v_new || slots) {
    TORCH_CHECK(k_new && v_new && slots, "paged_decode_attention: k_new, v_new, slots go together");
    TORCH_CHECK(dtype == at::kFloat, "paged_decode_attention: k_new needs a float32 pool");
    const at::Tensor slot_ids = slots->to(at::kLong).contiguous();
    const int64_t N = slot_ids.numel(), num_slots = k_cache.size(0) * block_size;
    TORCH_CHECK(k_new->scalar_type() == at::kFloat && v_new->scalar_type() == at::kFloat &&
                    k_new->numel() == N * KVH * D && v_new->numel() == N * KVH * D,
                "paged_decode_attention: k_new and v_new must be float32 (N, KVH, D)");
    const at::Tensor kn = k_new->contiguous(), vn = v_new->contiguous();
    const int64_t* sp = slot_ids.data_ptr<int64_t>();
    float* kc = k_cache.data_ptr<float>();
    float* vc = v_cache.data_ptr<float>();
    const int64_t row = KVH * D;
    for (int64_t t = 0; t < N; ++t) {
      TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "paged_decode_attention: slot out of range");
      std::copy_n(kn.data_ptr<float>() + t * row, row, kc + sp[t] * row);
      std::copy_n(vn.data_ptr<float>() + t * row, row, vc + sp[t] * row);
    }
  }
  if (dtype == at::kBFloat16)
    return attend_float_pool<at::BFloat16>(q, k_cache, v_cache, block_tables, ctx_lens, scale_in,
                                           window, softcap, sinks);
  if (dtype == at::kHalf)
    return attend_float_pool<at::Half>(q, k_cache, v_cache, block_tables, ctx_lens, scale_in,
                                       window, softcap, sinks);
  return attend_float_pool<float>(q, k_cache, v_cache, block_tables, ctx_lens, scale_in, window,
                                  softcap, sinks);
}

// paged_decode_attention over int8 KV: k_raw, v_raw (num_blocks, half_bytes) uint8 rows of one
// layer (codes (block_size, KVH, D) int8, then scales (block_size, KVH) float32). k_new, v_new,
// slots: rows to quantize and write first (kv_write_int8); window, softcap: as in the float op.
at::Tensor paged_decode_attention_int8(const at::Tensor& q_in, at::Tensor& k_raw,
                                       at::Tensor& v_raw, const at::Tensor& block_tables_in,
                                       const at::Tensor& ctx_lens_in, double scale_in,
                                       int64_t block_size, const c10::optional<at::Tensor>& k_new,
                                       const c10::optional<at::Tensor>& v_new,
                                       const c10::optional<at::Tensor>& slots, int64_t window,
                                       double softcap, const c10::optional<at::Tensor>& sinks_in) {
  check_attention_kind("paged_decode_attention_int8", window, softcap);
  const float* sinks = sinks_of("paged_decode_attention_int8", sinks_in, q_in.size(1));
  TORCH_CHECK(q_in.dim() == 3 && q_in.scalar_type() == at::kFloat,
              "paged_decode_attention_int8: q must be float32 (T, H, D)");
  TORCH_CHECK(k_raw.scalar_type() == at::kByte && v_raw.scalar_type() == at::kByte &&
                  k_raw.dim() == 2 && k_raw.stride(1) == 1 && v_raw.stride(1) == 1 &&
                  k_raw.stride(0) == k_raw.size(1) && v_raw.stride(0) == v_raw.size(1),
              "paged_decode_attention_int8: block halves must be contiguous uint8 rows");
  const at::Tensor q = q_in.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t half = k_raw.size(1), per_row = D + 4;  // codes and one scale
  TORCH_CHECK(half % (block_size * per_row) == 0, "paged_decode_attention_int8: block size");
  const int64_t KVH = half / (block_size * per_row);
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "paged_decode_attention_int8: shape mismatch");
  const at::Tensor block_tables = block_tables_in.to(at::kLong).contiguous();
  const at::Tensor ctx_lens = ctx_lens_in.to(at::kLong).contiguous();
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == T && ctx_lens.numel() == T,
              "paged_decode_attention_int8: one table row and one length per query row");
  if (k_new || v_new || slots) {
    TORCH_CHECK(k_new && v_new && slots, "paged_decode_attention_int8: k_new, v_new, slots go together");
    kv_write_int8(k_raw, v_raw, *k_new, *v_new, *slots, block_size);
  }
  const Pool P{reinterpret_cast<const char*>(k_raw.data_ptr<uint8_t>()),
               reinterpret_cast<const char*>(v_raw.data_ptr<uint8_t>()),
               block_size, KVH, D, H / KVH, half, block_size * KVH * D,
               static_cast<float>(scale_in), static_cast<float>(softcap), sinks};
  return attend<int8_t>(q, P, k_raw.size(0), block_tables, ctx_lens, window);
}

// the width of the paged kernels' dot products and weighted sums: "avx512" where built (16
// lanes, each running its AVX2 lane's chain), else "avx2"; `isa` non-empty switches (the
// results are the same bits either way)
std::string attention_isa(c10::string_view isa) {
  if (isa == "avx2") {
#if defined(__AVX512F__)
    g_attn512 = false;
#endif
  } else if (isa == "avx512") {
#if defined(__AVX512F__)
    g_attn512 = true;
#else
    TORCH_CHECK(false, "attention_isa: this build has no AVX-512 attention");
#endif
  } else {
    TORCH_CHECK(isa.empty(), "attention_isa: expected 'avx2' or 'avx512', got '",
                std::string(isa), "'");
  }
#if defined(__AVX512F__)
  return g_attn512 ? "avx512" : "avx2";
#else
  return "avx2";
#endif
}

}  // namespace

TORCH_LIBRARY(kvwise, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor block_tables, Tensor ctx_lens, float scale, Tensor? k_new=None, "
      "Tensor? v_new=None, Tensor? slots=None, int window=0, float softcap=0.0, "
      "Tensor? sinks=None) -> Tensor");
  m.def(
      "paged_decode_attention_int8(Tensor q, Tensor(a!) k_raw, Tensor(b!) v_raw, "
      "Tensor block_tables, Tensor ctx_lens, float scale, int block_size, Tensor? k_new=None, "
      "Tensor? v_new=None, Tensor? slots=None, int window=0, float softcap=0.0, "
      "Tensor? sinks=None) -> Tensor");
  m.def(
      "kv_write_int8(Tensor(a!) k_raw, Tensor(b!) v_raw, Tensor k, Tensor v, Tensor slots, "
      "int block_size) -> ()");
  m.def("attention_isa(str isa='') -> str", &attention_isa);  // no tensors: a catch-all kernel
}

TORCH_LIBRARY_IMPL(kvwise, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_decode_attention_int8", &paged_decode_attention_int8);
  m.impl("kv_write_int8", &kv_write_int8);
}
