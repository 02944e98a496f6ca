// Decode attention straight over the paged KV cache (CPU, float32).
//
// One query token per sequence attends to the first ctx_lens[b] slots of its block table,
// reading K/V rows where they lie in the pool: no gather copy, no padding mask. Work is split
// into tasks of (sequence, kv head, span of keys) so that two cores share even one sequence
// (split-K, "flash decoding"); each task keeps the softmax of its span in float32 (running max,
// sum, weighted V), and the spans are combined with their log-sum-exp weights. The query
// heads of one kv head (GQA) are handled together, so each K/V row is read once.
//
// Registered as torch.ops.kvwise.paged_decode_attention; kvwise/worker/kernels.py builds it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "vec.h"

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

#if defined(__AVX2__) && defined(__FMA__)
// ---- the query heads of one GQA group together: each K/V row is loaded (and, for int8,
// converted) once for all of them instead of once per head.

template <bool Q8>
inline __m256 load_row(const void* row, int64_t d) {
  if constexpr (Q8) {
    return load_i8(static_cast<const int8_t*>(row) + d);
  } else {
    return _mm256_loadu_ps(static_cast<const float*>(row) + d);
  }
}

// s[g * n + i] = scale * (rs[i]) * dot(q_g, row_i) for GC heads (q_g = q + g * D), n rows.
// R rows at a time: R * GC accumulators.
template <bool Q8, int GC, int R>
inline void group_scores(float* s, int64_t n, const float* q, const void* const* rows,
                         const float* rs, int64_t D, float scale) {
  int64_t i = 0;
  for (; i + R <= n; i += R) {
    __m256 acc[R][GC];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < GC; ++g) acc[r][g] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      for (int r = 0; r < R; ++r) {
        const __m256 k = load_row<Q8>(rows[i + r], d);
        for (int g = 0; g < GC; ++g)
          acc[r][g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + d), k, acc[r][g]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const float f = Q8 ? scale * rs[i + r] : scale;
      for (int g = 0; g < GC; ++g) s[g * n + i + r] = hsum(acc[r][g]) * f;
    }
  }
  for (; i < n; ++i) {
    __m256 acc[GC];
    for (int g = 0; g < GC; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 k = load_row<Q8>(rows[i], d);
      for (int g = 0; g < GC; ++g)
        acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + d), k, acc[g]);
    }
    const float f = Q8 ? scale * rs[i] : scale;
    for (int g = 0; g < GC; ++g) s[g * n + i] = hsum(acc[g]) * f;
  }
}

// out[g * stride + d] = sum_i w[g * n + i] * (rs[i]) * row_i[d] for GC heads, 32 channels at a
// time (4 GC accumulators); D a multiple of 32.
template <bool Q8, int GC>
inline void group_values(float* out, int64_t stride, const void* const* rows, const float* rs,
                         const float* w, int64_t n, int64_t D) {
  for (int64_t d0 = 0; d0 < D; d0 += 32) {
    __m256 acc[GC][4];
    for (int g = 0; g < GC; ++g)
      for (int j = 0; j < 4; ++j) acc[g][j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      __m256 wg[GC];
      for (int g = 0; g < GC; ++g) wg[g] = _mm256_set1_ps(Q8 ? w[g * n + i] * rs[i] : w[g * n + i]);
      for (int j = 0; j < 4; ++j) {
        const __m256 v = load_row<Q8>(rows[i], d0 + 8 * j);
        for (int g = 0; g < GC; ++g) acc[g][j] = _mm256_fmadd_ps(wg[g], v, acc[g][j]);
      }
    }
    for (int g = 0; g < GC; ++g)
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + g * stride + d0 + 8 * j, acc[g][j]);
  }
}

// scores and weighted values of all G heads of a group, GC of them at a time
template <bool Q8, int GC>
inline void group_chunk_scores(float* s, int64_t n, const float* q, const void* const* rows,
                               const float* rs, int64_t D, float scale) {
  if constexpr (GC >= 4) {
    group_scores<Q8, GC, 2>(s, n, q, rows, rs, D, scale);
  } else {
    group_scores<Q8, GC, 4>(s, n, q, rows, rs, D, scale);
  }
}

template <bool Q8>
void all_group_scores(float* s, int64_t n, const float* q, const void* const* rows,
                      const float* rs, int64_t G, int64_t D, float scale) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    float* sg = s + g0 * n;
    const float* qg = q + g0 * D;
    switch (std::min<int64_t>(4, G - g0)) {
      case 1: group_chunk_scores<Q8, 1>(sg, n, qg, rows, rs, D, scale); break;
      case 2: group_chunk_scores<Q8, 2>(sg, n, qg, rows, rs, D, scale); break;
      case 3: group_chunk_scores<Q8, 3>(sg, n, qg, rows, rs, D, scale); break;
      default: group_chunk_scores<Q8, 4>(sg, n, qg, rows, rs, D, scale); break;
    }
  }
}

template <bool Q8>
void all_group_values(float* out, int64_t stride, const void* const* rows, const float* rs,
                      const float* w, int64_t n, int64_t G, int64_t D) {
  for (int64_t g0 = 0; g0 < G; g0 += 3) {
    float* og = out + g0 * stride;
    const float* wg = w + g0 * n;
    switch (std::min<int64_t>(3, G - g0)) {
      case 1: group_values<Q8, 1>(og, stride, rows, rs, wg, n, D); break;
      case 2: group_values<Q8, 2>(og, stride, rows, rs, wg, n, D); break;
      default: group_values<Q8, 3>(og, stride, rows, rs, wg, n, D); break;
    }
  }
}
#endif

// The attention itself, over float32 K/V (Q8 false: `k_base`/`v_base` are the float caches)
// or int8 block halves (Q8 true: `k_base`/`v_base` are the uint8 (num_blocks, half_bytes)
// rows, codes then scales).
template <bool Q8>
at::Tensor attend(const at::Tensor& q, const void* k_base, const void* v_base,
                  const at::Tensor& block_tables, const at::Tensor& ctx_lens, int64_t block_size,
                  int64_t KVH, int64_t half_bytes, double scale_in) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t G = H / KVH, max_blocks = block_tables.size(1);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_blocks * block_size,
                "paged_decode_attention: context length outside the block table");
    max_len = std::max(max_len, lens[b]);
  }
  // Spans: enough tasks to keep every thread busy, but no span shorter than 32 keys. A task is
  // one span of one sequence for all its KV heads, one head after the other: a token's K (and
  // V) row holds every head side by side, so the span's rows come from memory once, and the
  // later heads find them in cache (one task per head read each row from memory KVH times).
  const int64_t threads = at::get_num_threads();
  const int64_t want = std::max<int64_t>(1, (4 * threads + B - 1) / B);
  const int64_t span = std::max<int64_t>(32, (max_len + want - 1) / want);
  const int64_t num_spans = (max_len + span - 1) / span;
  const int64_t num_tasks = B * KVH * num_spans;  // partial results: one per (b, h, span)

  at::Tensor out = at::empty({B, H, D}, q.options());
  // per task and query head: max, sum, then D weighted values
  at::Tensor partial = at::empty({num_tasks, G, D + 2}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = static_cast<const float*>(k_base);
  const float* vp = static_cast<const float*>(v_base);
  const uint8_t* kb = static_cast<const uint8_t*>(k_base);
  const uint8_t* vb = static_cast<const uint8_t*>(v_base);
  const int64_t codes_bytes = block_size * KVH * D;
  float* part = partial.data_ptr<float>();
  const float scale = static_cast<float>(scale_in);
  const int64_t row_stride = KVH * D, block_stride = block_size * KVH * D;

  // a handful of keys runs on the calling thread alone; from ~8 keys on, sharing the work
  // wins even at a 10 us thread wake-up (measured in the decode step)
  const bool small = B * max_len * H * D < (1 << 12);
  auto work = [&](int64_t begin, int64_t end) {
    std::vector<float> scores, row_scales;
    std::vector<const float*> rows;
    std::vector<const int8_t*> rows8;
    for (int64_t bs = begin; bs < end; ++bs)
    for (int64_t h = 0; h < KVH; ++h) {
      const int64_t s = bs % num_spans, b = bs / num_spans;
      const int64_t task = (b * KVH + h) * num_spans + s;
      const int64_t start = s * span, stop = std::min(lens[b], start + span);
      float* res = part + task * G * (D + 2);
      if (start >= stop) {  // this sequence is shorter than the longest: an empty span
        for (int64_t g = 0; g < G; ++g) {
          res[g * (D + 2)] = -std::numeric_limits<float>::infinity();
          res[g * (D + 2) + 1] = 0.f;
        }
        continue;
      }
      const int64_t n = stop - start;
      scores.resize(G * n);
      const int64_t* table = tables + b * max_blocks;
      // the span's K/V rows, every head, asked for at once (the heads then find them in L2):
      // the rows arrive at the memory's streaming rate, ~1.8x the rate the head-by-head reads
      // alone got (measured, 16 sequences of 165 tokens, each layer's K/V out of cache)
      if (h == 0) {
        const int64_t elem = Q8 ? 1 : 4;  // bytes a value
        for (int64_t p = start; p < stop;) {
          const int64_t off = p % block_size, n_rows = std::min(block_size - off, stop - p);
          const int64_t at = table[p / block_size] * (Q8 ? half_bytes : block_stride * 4) +
                             off * row_stride * elem;
          const char* kr = static_cast<const char*>(k_base) + at;
          const char* vr = static_cast<const char*>(v_base) + at;
          for (int64_t byte = 0; byte < n_rows * row_stride * elem; byte += 64) {
            __builtin_prefetch(kr + byte, 0, 2);
            __builtin_prefetch(vr + byte, 0, 2);
          }
          p += n_rows;
        }
      }
      // walk the span block by block (no division per key)
      if constexpr (Q8) {
        rows8.resize(2 * n);
        row_scales.resize(2 * n);
        for (int64_t p = start, i = 0; p < stop;) {
          const int64_t blk = table[p / block_size] * half_bytes;
          const int8_t* kc = reinterpret_cast<const int8_t*>(kb + blk);
          const int8_t* vc = reinterpret_cast<const int8_t*>(vb + blk);
          const float* ks = reinterpret_cast<const float*>(kb + blk + codes_bytes);
          const float* vs = reinterpret_cast<const float*>(vb + blk + codes_bytes);
          for (int64_t off = p % block_size; off < block_size && p < stop; ++off, ++p, ++i) {
            const int64_t r = off * KVH + h;
            rows8[i] = kc + r * D;
            rows8[n + i] = vc + r * D;
            row_scales[i] = ks[r];
            row_scales[n + i] = vs[r];
          }
        }
      } else {
        rows.resize(2 * n);
        for (int64_t p = start, i = 0; p < stop;) {
          const int64_t blk = table[p / block_size] * block_stride + h * D;
          for (int64_t off = p % block_size; off < block_size && p < stop; ++off, ++p, ++i) {
            rows[i] = kp + blk + off * row_stride;
            rows[n + i] = vp + blk + off * row_stride;
          }
        }
      }
      const float* qh = qp + (b * H + h * G) * D;
#if defined(__AVX2__) && defined(__FMA__)
      if (D % 32 == 0) {  // the group kernels: each row read once for the G heads
        const void* const* krows = Q8 ? reinterpret_cast<const void* const*>(rows8.data())
                                      : reinterpret_cast<const void* const*>(rows.data());
        const float* krs = Q8 ? row_scales.data() : nullptr;
        all_group_scores<Q8>(scores.data(), n, qh, krows, krs, G, D, scale);
        for (int64_t g = 0; g < G; ++g) {
          float* sg = scores.data() + g * n;
          float m = sg[0];
          for (int64_t i = 1; i < n; ++i) m = std::max(m, sg[i]);
          res[g * (D + 2)] = m;
          res[g * (D + 2) + 1] = exp_sum(sg, n, m);
        }
        all_group_values<Q8>(res + 2, D + 2, krows + n, Q8 ? krs + n : nullptr, scores.data(),
                             n, G, D);
        continue;
      }
#endif
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * n;
        const float* qg = qh + g * D;
        if constexpr (Q8) {
          dots_q8(sg, qg, rows8.data(), row_scales.data(), n, D, scale);
        } else {
          dots(sg, qg, rows.data(), n, D, scale);
        }
        float m = sg[0];
        for (int64_t i = 1; i < n; ++i) m = std::max(m, sg[i]);
        float* r = res + g * (D + 2);
        r[0] = m;
        r[1] = exp_sum(sg, n, m);
        if constexpr (Q8) {
          weighted_rows_q8_any(r + 2, rows8.data() + n, row_scales.data() + n, sg, n, D);
        } else {
          weighted_rows_any(r + 2, rows.data() + n, sg, n, D);
        }
      }
    }
  };
  // one task (or a handful of keys) runs here: waking the other threads costs more than it
  const int64_t num_work = B * num_spans;
  if (small || num_work == 1) {
    work(0, num_work);
  } else {
    at::parallel_for(0, num_work, 1, work);
  }

  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * H, std::max<int64_t>(1, 4096 / (num_spans * D)), [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, head = bh % H, h = head / G, g = head % G;
      const float* first = part + ((b * KVH + h) * num_spans) * G * (D + 2) + g * (D + 2);
      const int64_t task_stride = G * (D + 2);
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < num_spans; ++s) m = std::max(m, first[s * task_stride]);
      float* o = op + bh * D;
      std::fill(o, o + D, 0.f);
      float l = 0.f;
      for (int64_t s = 0; s < num_spans; ++s) {
        const float* r = first + s * task_stride;
        if (r[1] == 0.f) continue;  // empty span
        const float w = std::exp(r[0] - m);
        l += r[1] * w;
        axpy(o, w, r + 2, D);
      }
      const float inv = 1.f / l;
      for (int64_t i = 0; i < D; ++i) o[i] *= inv;
    }
  });
  return out;
}

// q: (B, H, D); k_cache, v_cache: (num_blocks, block_size, KVH, D); block_tables: (B, max_blocks)
// int64; ctx_lens: (B,) int64. Returns (B, H, D).
// k_new, v_new (T, KVH, D) and slots (T,), when given, are first written into the caches (the
// step's new K/V rows: a decode-only step writes and attends in this one call).
at::Tensor paged_decode_attention(const at::Tensor& q_in, at::Tensor& k_cache, at::Tensor& v_cache,
                                  const at::Tensor& block_tables_in, const at::Tensor& ctx_lens_in,
                                  double scale_in, const c10::optional<at::Tensor>& k_new,
                                  const c10::optional<at::Tensor>& v_new,
                                  const c10::optional<at::Tensor>& slots) {
  TORCH_CHECK(q_in.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "paged_decode_attention: q (B, H, D), caches (blocks, block_size, KVH, D)");
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat,
              "paged_decode_attention: float32 only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode_attention: caches must be contiguous");
  const at::Tensor q = q_in.contiguous();
  const at::Tensor block_tables = block_tables_in.to(at::kLong).contiguous();
  const at::Tensor ctx_lens = ctx_lens_in.to(at::kLong).contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0, "paged_decode_attention: shape mismatch");
  TORCH_CHECK(block_tables.size(0) == B && ctx_lens.size(0) == B,
              "paged_decode_attention: one table row and one length per sequence");
  if (k_new || v_new || slots) {
    TORCH_CHECK(k_new && v_new && slots, "paged_decode_attention: k_new, v_new, slots go together");
    const at::Tensor slot_ids = slots->to(at::kLong).contiguous();
    const int64_t T = slot_ids.numel(), num_slots = k_cache.size(0) * block_size;
    TORCH_CHECK(k_new->scalar_type() == at::kFloat && v_new->scalar_type() == at::kFloat &&
                    k_new->numel() == T * KVH * D && v_new->numel() == T * KVH * D,
                "paged_decode_attention: k_new and v_new must be float32 (T, KVH, D)");
    const at::Tensor kn = k_new->contiguous(), vn = v_new->contiguous();
    const int64_t* sp = slot_ids.data_ptr<int64_t>();
    float* kc = k_cache.data_ptr<float>();
    float* vc = v_cache.data_ptr<float>();
    const int64_t row = KVH * D;
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "paged_decode_attention: slot out of range");
      std::copy_n(kn.data_ptr<float>() + t * row, row, kc + sp[t] * row);
      std::copy_n(vn.data_ptr<float>() + t * row, row, vc + sp[t] * row);
    }
  }
  return attend<false>(q, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), block_tables,
                       ctx_lens, block_size, KVH, 0, scale_in);
}


// paged_decode_attention over int8 KV: k_raw, v_raw (num_blocks, half_bytes) uint8 rows of one
// layer (codes (block_size, KVH, D) int8, then scales (block_size, KVH) float32). k_new, v_new,
// slots: rows to quantize and write first (kv_write_int8), as in the float op.
at::Tensor paged_decode_attention_int8(const at::Tensor& q_in, at::Tensor& k_raw,
                                       at::Tensor& v_raw, const at::Tensor& block_tables_in,
                                       const at::Tensor& ctx_lens_in, double scale_in,
                                       int64_t block_size, const c10::optional<at::Tensor>& k_new,
                                       const c10::optional<at::Tensor>& v_new,
                                       const c10::optional<at::Tensor>& slots) {
  TORCH_CHECK(q_in.dim() == 3 && q_in.scalar_type() == at::kFloat,
              "paged_decode_attention_int8: q must be float32 (B, H, D)");
  TORCH_CHECK(k_raw.scalar_type() == at::kByte && v_raw.scalar_type() == at::kByte &&
                  k_raw.dim() == 2 && k_raw.stride(1) == 1 && v_raw.stride(1) == 1 &&
                  k_raw.stride(0) == k_raw.size(1) && v_raw.stride(0) == v_raw.size(1),
              "paged_decode_attention_int8: block halves must be contiguous uint8 rows");
  const at::Tensor q = q_in.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t half = k_raw.size(1), per_row = D + 4;  // codes and one scale
  TORCH_CHECK(half % (block_size * per_row) == 0, "paged_decode_attention_int8: block size");
  const int64_t KVH = half / (block_size * per_row);
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "paged_decode_attention_int8: shape mismatch");
  const at::Tensor block_tables = block_tables_in.to(at::kLong).contiguous();
  const at::Tensor ctx_lens = ctx_lens_in.to(at::kLong).contiguous();
  TORCH_CHECK(block_tables.size(0) == B && ctx_lens.size(0) == B,
              "paged_decode_attention_int8: one table row and one length per sequence");
  if (k_new || v_new || slots) {
    TORCH_CHECK(k_new && v_new && slots, "paged_decode_attention_int8: k_new, v_new, slots go together");
    kv_write_int8(k_raw, v_raw, *k_new, *v_new, *slots, block_size);
  }
  return attend<true>(q, k_raw.data_ptr<uint8_t>(), v_raw.data_ptr<uint8_t>(), block_tables,
                      ctx_lens, block_size, KVH, half, scale_in);
}

}  // namespace

TORCH_LIBRARY(kvwise, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor block_tables, Tensor ctx_lens, float scale, Tensor? k_new=None, "
      "Tensor? v_new=None, Tensor? slots=None) -> Tensor");
  m.def(
      "paged_decode_attention_int8(Tensor q, Tensor(a!) k_raw, Tensor(b!) v_raw, "
      "Tensor block_tables, Tensor ctx_lens, float scale, int block_size, Tensor? k_new=None, "
      "Tensor? v_new=None, Tensor? slots=None) -> Tensor");
  m.def(
      "kv_write_int8(Tensor(a!) k_raw, Tensor(b!) v_raw, Tensor k, Tensor v, Tensor slots, "
      "int block_size) -> ()");
}

TORCH_LIBRARY_IMPL(kvwise, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_decode_attention_int8", &paged_decode_attention_int8);
  m.impl("kv_write_int8", &kv_write_int8);
}
