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
  const int64_t G = H / KVH, max_blocks = block_tables.size(1);
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
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_blocks * block_size,
                "paged_decode_attention: context length outside the block table");
    max_len = std::max(max_len, lens[b]);
  }
  // Spans: enough tasks to keep every thread busy, but no span shorter than 32 keys.
  const int64_t threads = at::get_num_threads();
  const int64_t want = std::max<int64_t>(1, (4 * threads + B * KVH - 1) / (B * KVH));
  const int64_t span = std::max<int64_t>(32, (max_len + want - 1) / want);
  const int64_t num_spans = (max_len + span - 1) / span;
  const int64_t num_tasks = B * KVH * num_spans;

  at::Tensor out = at::empty({B, H, D}, q.options());
  // per task and query head: max, sum, then D weighted values
  at::Tensor partial = at::empty({num_tasks, G, D + 2}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* part = partial.data_ptr<float>();
  const float scale = static_cast<float>(scale_in);
  const int64_t row_stride = KVH * D, block_stride = block_size * KVH * D;

  // a handful of keys runs on the calling thread alone; from ~8 keys on, sharing the work
  // wins even at a 10 us thread wake-up (measured in the decode step)
  const bool small = B * max_len * H * D < (1 << 12);
  at::parallel_for(0, num_tasks, small ? num_tasks : 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<const float*> rows;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task % num_spans, h = (task / num_spans) % KVH, b = task / (num_spans * KVH);
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
      rows.resize(2 * n);
      const int64_t* table = tables + b * max_blocks;
      for (int64_t p = start; p < stop; ++p) {
        const int64_t at = table[p / block_size] * block_stride + (p % block_size) * row_stride + h * D;
        rows[p - start] = kp + at;
        rows[n + p - start] = vp + at;
      }
      const float* qh = qp + (b * H + h * G) * D;
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * n;
        const float* qg = qh + g * D;
        dots(sg, qg, rows.data(), n, D, scale);
        float m = sg[0];
        for (int64_t i = 1; i < n; ++i) m = std::max(m, sg[i]);
        float* r = res + g * (D + 2);
        r[0] = m;
        r[1] = exp_sum(sg, n, m);
        weighted_rows_any(r + 2, rows.data() + n, sg, n, D);
      }
    }
  });

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

}  // namespace

TORCH_LIBRARY(kvwise, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor block_tables, Tensor ctx_lens, float scale, Tensor? k_new=None, "
      "Tensor? v_new=None, Tensor? slots=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvwise, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
