// Decode attention straight over int4 KV blocks (KVSpec's int4 layout), one query row per
// sequence:
//
//   K half of a block: codes (KVH, D, block_size / 2) uint8, token 2i in the low nibble and
//     2i+1 in the high one (each head and channel over the block's tokens), then (KVH, D, 2)
//     float16 (scale, min): k = code * scale + min.
//   V half: codes (block_size, KVH, D / 2) uint8, channel 2i low, 2i+1 high, then
//     (block_size, KVH, D / group, 2) float16 (scale, min) per token, head and group.
//
// A sequence's own (last) block is not sealed yet: its keys come from the staging slot
// `open_slots[b]` of `staged` (slots, block_size, KVH, D) float32, as attention.py reads them.
// Rows that share a block table (a prefill chunk's rows, each a query over its position + 1
// keys) are grouped so that each block is unpacked once for all of them; a row's operations,
// and so its bits, are the same alone or in a group, decoded or prefilled.
// The scale and minimum are folded into the query and the weights instead of dequantizing
// every element: q . k = sum_d (q_d * scale_d) * code_d + sum_d q_d * min_d, and
// sum_t p_t v_t = sum_t (p_t * scale_t) * code_t + sum_t p_t * min_t per group. Same maths as
// the torch path (gather, dequantize, SDPA), another rounding order.
// Per call, a layer's kind (window, softcap), as attention_kind.h defines it for both kernels.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "attention_kind.h"
#include "vec.h"
#include "parallel.h"

namespace {

inline float half_at(const uint8_t* p, int64_t i) {
  return static_cast<float>(reinterpret_cast<const at::Half*>(p)[i]);
}

// sum_d q[d] * mins[d] (a query with a block's per-channel minimums), in one fixed order:
// 8 lanes of fused multiply-adds, then the lanes summed
inline float dot_mins(const float* q, const float* mins, int64_t D) {
  int64_t d = 0;
  float m = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; d + 8 <= D; d += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(mins + d), acc);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (int i = 0; i < 8; ++i) m += lanes[i];
#endif
  for (; d < D; ++d) m = std::fma(q[d], mins[d], m);
  return m;
}

// the largest of n floats (exact in any order)
inline float max_of(const float* s, int64_t n) {
  float mx = s[0];
  int64_t i = 1;
#if defined(__AVX2__) && defined(__FMA__)
  if (n >= 8) {
    __m256 v = _mm256_loadu_ps(s);
    for (i = 8; i + 8 <= n; i += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(s + i));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v);
    for (float x : lanes) mx = std::max(mx, x);
  }
#endif
  for (; i < n; ++i) mx = std::max(mx, s[i]);
  return mx;
}

#if defined(__AVX2__) && defined(__FMA__)
// A sealed block's scores for Q query vectors (a row's query heads, of one row or several), 8
// tokens at a time, the Q accumulators in registers, each codes load shared by all of them:
// s[q][t] = (qm[q] + sum_d qs[d][q] * codes[d][t]) * scale (qs transposed: qs[d * Q + q]). A
// score is the same chain of operations for any Q: a row's bits do not depend on the rows it
// is computed with.
template <int Q>
void block_scores(float* const* s, const float* codes, const float* qs, const float* qm,
                  int64_t D, int64_t bs, float scale) {
  for (int64_t t8 = 0; t8 < bs; t8 += 8) {
    __m256 a[Q];
    for (int q = 0; q < Q; ++q) a[q] = _mm256_set1_ps(qm[q]);
    for (int64_t d = 0; d < D; ++d) {
      const __m256 c = _mm256_loadu_ps(codes + d * bs + t8);
      const float* qd = qs + d * Q;
      for (int q = 0; q < Q; ++q) a[q] = _mm256_fmadd_ps(_mm256_set1_ps(qd[q]), c, a[q]);
    }
    for (int q = 0; q < Q; ++q) _mm256_storeu_ps(s[q] + t8, _mm256_mul_ps(a[q], _mm256_set1_ps(scale)));
  }
}

// block_scores for n (1 .. Q) query vectors
template <int Q>
void block_scores_n(int64_t n, float* const* s, const float* codes, const float* qs,
                    const float* qm, int64_t D, int64_t bs, float scale) {
  if constexpr (Q > 0) {
    if (n == Q) return block_scores<Q>(s, codes, qs, qm, D, bs, scale);
    block_scores_n<Q - 1>(n, s, codes, qs, qm, D, bs, scale);
  }
}

// One block's weighted values for R query vectors (heads of one row or several) and one group
// of 8 * NV channels, the accumulators in registers and each codes load shared:
// a[r][d] += sum_t (p[r][t] * scale[t]) * codes[t][d], am[r] += sum_t p[r][t] * min[t]; the
// same chain for any R.
template <int NV, int R>
void block_values(float* const* a, float* const* am, const float* const* p, const float* codes,
                  int64_t D, const float* vsm, int64_t groups, int64_t gr, int64_t rows) {
  __m256 acc[R][NV];
  float m[R];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_loadu_ps(a[r] + 8 * v);
    m[r] = *am[r];
  }
  for (int64_t t = 0; t < rows; ++t) {
    const float vscale = vsm[(t * groups + gr) * 2], vmin = vsm[(t * groups + gr) * 2 + 1];
    const float* c = codes + t * D + gr * 8 * NV;
    __m256 cv[NV];
    for (int v = 0; v < NV; ++v) cv[v] = _mm256_loadu_ps(c + 8 * v);
    for (int r = 0; r < R; ++r) {
      const float ps = p[r][t] * vscale;
      m[r] = std::fma(p[r][t], vmin, m[r]);
      const __m256 w = _mm256_set1_ps(ps);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_fmadd_ps(w, cv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(a[r] + 8 * v, acc[r][v]);
    *am[r] = m[r];
  }
}

template <int NV, int R>
void block_values_rows(int64_t n, float* const* a, float* const* am, const float* const* p,
                       const float* codes, int64_t D, const float* vsm, int64_t groups,
                       int64_t gr, int64_t rows) {
  if constexpr (R > 0) {
    if (n == R) return block_values<NV, R>(a, am, p, codes, D, vsm, groups, gr, rows);
    block_values_rows<NV, R - 1>(n, a, am, p, codes, D, vsm, groups, gr, rows);
  }
}
#endif

at::Tensor paged_decode_attention_int4(const at::Tensor& q_in, const at::Tensor& k_raw,
                                       const at::Tensor& v_raw, const at::Tensor& staged,
                                       const at::Tensor& block_tables, const at::Tensor& ctx_lens,
                                       const at::Tensor& open_slots, double scale_in,
                                       int64_t block_size, int64_t group, int64_t window,
                                       double softcap_in, const c10::optional<at::Tensor>& sinks_in) {
  check_attention_kind("paged_decode_attention_int4", window, softcap_in);
  const float* sinks = sinks_of("paged_decode_attention_int4", sinks_in, q_in.size(1));
  TORCH_CHECK(q_in.dim() == 3 && q_in.scalar_type() == at::kFloat,
              "paged_decode_attention_int4: q must be float32 (B, H, D)");
  TORCH_CHECK(staged.dim() == 4 && staged.scalar_type() == at::kFloat && staged.is_contiguous(),
              "paged_decode_attention_int4: staged must be contiguous float32 (S, bs, KVH, D)");
  TORCH_CHECK(k_raw.scalar_type() == at::kByte && v_raw.scalar_type() == at::kByte &&
                  k_raw.dim() == 2 && k_raw.is_contiguous() && v_raw.is_contiguous(),
              "paged_decode_attention_int4: block halves must be contiguous uint8 rows");
  const at::Tensor q = q_in.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = block_size, KVH = staged.size(2), G = H / KVH;
  TORCH_CHECK(staged.size(1) == bs && staged.size(3) == D && H % KVH == 0 && bs % 2 == 0 &&
                  group > 0 && D % group == 0 && D % 2 == 0,
              "paged_decode_attention_int4: shape mismatch");
  const int64_t half = k_raw.size(1), codes_bytes = bs * KVH * D / 2;
  TORCH_CHECK(half >= codes_bytes + std::max(KVH * D * 4, bs * KVH * (D / group) * 4),
              "paged_decode_attention_int4: block half size");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B && ctx_lens.numel() == B &&
                  open_slots.numel() == B,
              "paged_decode_attention_int4: one table row, length and slot per sequence");
  const at::Tensor tables_c = block_tables.contiguous(), lens_c = ctx_lens.contiguous(),
                   slots_c = open_slots.contiguous();
  const int64_t* tables = tables_c.data_ptr<int64_t>();
  const int64_t* lens = lens_c.data_ptr<int64_t>();
  const int64_t* slots = slots_c.data_ptr<int64_t>();
  const int64_t max_blocks = block_tables.size(1), num_blocks = k_raw.size(0);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_blocks * bs,
                "paged_decode_attention_int4: context length outside the block table");
    TORCH_CHECK(slots[b] >= 0 && slots[b] < staged.size(0),
                "paged_decode_attention_int4: staging slot out of range");
  }
  const uint8_t* kb = k_raw.data_ptr<uint8_t>();
  const uint8_t* vb = v_raw.data_ptr<uint8_t>();
  const float* st = staged.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  const float scale = static_cast<float>(scale_in), softcap = static_cast<float>(softcap_in);
  const int64_t groups = D / group;
  // a sliding window (window > 0): row b attends to keys [first_key(b), lens[b]) only. Its
  // scores are kept from the start of that key's block (`from(b)`, `span(b)` of them), the
  // blocks before it never read (they may be gone from the table), the keys of the first
  // block before first_key(b) weighted 0.
  auto first_key = [&](int64_t b) { return window_first_key(lens[b], window); };
  auto from = [&](int64_t b) { return first_key(b) / bs * bs; };
  auto span = [&](int64_t b) { return lens[b] - from(b); };
  at::Tensor out = at::empty({B, H, D}, q.options());
  float* op = out.data_ptr<float>();

  // Rows that share a block table (a prefill chunk's) go in groups: each sealed block's codes
  // and scales are unpacked once for the group, then every row of it runs the very operations a
  // row alone runs (a row's bits never depend on its group). Tasks: (group, kv head), the groups
  // taken alternately from both ends, so that contiguous shares of them weigh alike.
  constexpr int64_t kGroupRows = 8;
  std::vector<int64_t> group_start{0};
  for (int64_t b = 1; b < B; ++b) {
    const bool same = std::equal(tables + b * max_blocks, tables + (b + 1) * max_blocks,
                                 tables + (b - 1) * max_blocks);
    if (!same || b - group_start.back() == kGroupRows) group_start.push_back(b);
  }
  group_start.push_back(B);
  const int64_t num_groups = static_cast<int64_t>(group_start.size()) - 1;
  std::vector<int64_t> order(num_groups);
  for (int64_t i = 0; i < num_groups; ++i) order[i] = i % 2 ? num_groups - 1 - i / 2 : i / 2;

  kvwise::parallel_for(0, num_groups * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc, accm, codes(D * bs), qs(12 * D), qm(12);
    std::vector<float> ksm(2 * D), vsm(2 * bs * groups);
    std::vector<int64_t> score_at, tile_rows;
    float* tile_scores[12];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t gi = order[task / KVH], h = task % KVH;
      const int64_t b0 = group_start[gi], b1 = group_start[gi + 1];
      const int64_t* table = tables + b0 * max_blocks;
      int64_t n_max = 0, total = 0, j_min = max_blocks;
      score_at.resize(b1 - b0);
      for (int64_t b = b0; b < b1; ++b) {
        score_at[b - b0] = total;
        total += G * span(b);
        n_max = std::max(n_max, lens[b]);
        j_min = std::min(j_min, from(b) / bs);
      }
      scores.assign(total, 0.f);
      const int64_t nblk_max = (n_max + bs - 1) / bs;
      // row b's score of query head g and key pos (from(b) <= pos < lens[b])
      auto score_of = [&](int64_t b, int64_t g, int64_t pos) {
        return scores.data() + score_at[b - b0] + g * span(b) + (pos - from(b));
      };
      auto covers = [&](int64_t b, int64_t j) { return j * bs < lens[b] && j * bs >= from(b); };
      for (int64_t j = j_min; j < nblk_max; ++j) {
        const int64_t blk = table[j];
        tile_rows.clear();
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t n = lens[b], own = (n - 1) / bs;
          if (!covers(b, j)) continue;  // past this row's context, or before its window
          const int64_t rows = std::min(bs, n - j * bs);
          const float* qh = qp + (b * H + h * G) * D;  // the G query heads of this KV head
          if (j == own) {  // full precision, from staging
            const float* krows = st + slots[b] * bs * KVH * D;
            for (int64_t t = 0; t < rows; ++t) {
              const float* k = krows + (t * KVH + h) * D;
              for (int64_t g = 0; g < G; ++g) {
                float s = 0.f;
                for (int64_t d = 0; d < D; ++d) s += qh[g * D + d] * k[d];
                *score_of(b, g, j * bs + t) = s * scale;
              }
            }
            continue;
          }
          tile_rows.push_back(b);  // sealed: scored below, with the group's other rows
        }
        if (tile_rows.empty()) continue;
        TORCH_CHECK(blk >= 0 && blk < num_blocks, "paged_decode_attention_int4: block id");
        {  // the block's codes and scales, once for the group
          const uint8_t* kc = kb + blk * half + h * D * (bs / 2);  // (D, bs / 2)
          const uint8_t* ks = kb + blk * half + codes_bytes + h * D * 4;  // (D, 2) float16
          for (int64_t d = 0; d < D; ++d) {
            for (int64_t i = 0; i < bs / 2; ++i) {
              const uint8_t c = kc[d * (bs / 2) + i];
              codes[d * bs + 2 * i] = static_cast<float>(c & 15);
              codes[d * bs + 2 * i + 1] = static_cast<float>(c >> 4);
            }
          }
          for (int64_t d = 0; d < D; ++d) {  // per channel: scale, then minimum
            ksm[d] = half_at(ks, 2 * d);
            ksm[D + d] = half_at(ks, 2 * d + 1);
          }
        }
        // the rows' query heads, 12 at a time (each folded with the block's scales)
        constexpr int64_t kTile = 12;
        const int64_t num_q = static_cast<int64_t>(tile_rows.size()) * G;
        for (int64_t q0 = 0; q0 < num_q; q0 += kTile) {
          const int64_t count = std::min(kTile, num_q - q0);
          for (int64_t i = 0; i < count; ++i) {
            const int64_t b = tile_rows[(q0 + i) / G], g = (q0 + i) % G;
            const float* qg = qp + (b * H + h * G + g) * D;
            for (int64_t d = 0; d < D; ++d) qs[d * count + i] = qg[d] * ksm[d];
            qm[i] = dot_mins(qg, ksm.data() + D, D);
            tile_scores[i] = score_of(b, g, j * bs);
          }
#if defined(__AVX2__) && defined(__FMA__)
          if (bs % 8 == 0) {  // a sealed block is always full
            block_scores_n<kTile>(count, tile_scores, codes.data(), qs.data(), qm.data(), D, bs,
                                  scale);
            continue;
          }
#endif
          for (int64_t i = 0; i < count; ++i) {
            for (int64_t t = 0; t < bs; ++t) {
              float a = qm[i];
              for (int64_t d = 0; d < D; ++d) a = std::fma(qs[d * count + i], codes[d * bs + t], a);
              tile_scores[i][t] = a * scale;
            }
          }
        }
      }
      for (int64_t b = b0; b < b1; ++b) {  // softmax over each row's keys (its window's)
        const int64_t n = lens[b] - first_key(b), skip = first_key(b) - from(b);
        for (int64_t g = 0; g < G; ++g) {
          float* s = score_of(b, g, first_key(b));
          std::fill(s - skip, s, 0.f);  // before the window: weight 0
          if (softcap > 0.f) cap_scores(s, n, softcap);
          // a sink: one more logit in the max and the sum, with no value
          const float* sink = sinks ? sinks + h * G + g : nullptr;
          const float mx = sink ? std::max(max_of(s, n), *sink) : max_of(s, n);
          float sum = sink ? std::exp(*sink - mx) : 0.f;
          int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
          __m256 vsum = _mm256_setzero_ps();
          for (; t + 8 <= n; t += 8) {
            const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(mx)));
            _mm256_storeu_ps(s + t, e);
            vsum = _mm256_add_ps(vsum, e);
          }
          float lanes[8];
          _mm256_storeu_ps(lanes, vsum);
          for (float x : lanes) sum += x;
#endif
          for (; t < n; ++t) {
            s[t] = std::exp(s[t] - mx);
            sum += s[t];
          }
          const float inv = 1.f / sum;
          for (int64_t t = 0; t < n; ++t) s[t] *= inv;
        }
      }
      acc.assign((b1 - b0) * G * D, 0.f);
      accm.assign((b1 - b0) * G * groups, 0.f);
      for (int64_t j = j_min; j < nblk_max; ++j) {
        // the rows that cover this block, those with all of its tokens first (in tiles)
        tile_rows.clear();
        for (int64_t b = b0; b < b1; ++b)
          if (covers(b, j) && lens[b] >= (j + 1) * bs) tile_rows.push_back(b);
        const int64_t num_full = static_cast<int64_t>(tile_rows.size());
        for (int64_t b = b0; b < b1; ++b)
          if (covers(b, j) && lens[b] < (j + 1) * bs) tile_rows.push_back(b);
        if (tile_rows.empty()) continue;
        const int64_t blk = table[j];
        const uint8_t* vc = vb + blk * half;
        const uint8_t* vs = vb + blk * half + codes_bytes;
        const int64_t unpack_rows = std::min(bs, n_max - j * bs);
        for (int64_t t = 0; t < unpack_rows; ++t) {  // the block's codes and scales, once
          const uint8_t* c = vc + (t * KVH + h) * (D / 2);
          float* row = codes.data() + t * D;
          for (int64_t i = 0; i < D / 2; ++i) {
            row[2 * i] = static_cast<float>(c[i] & 15);
            row[2 * i + 1] = static_cast<float>(c[i] >> 4);
          }
          const uint8_t* sm = vs + (t * KVH + h) * groups * 4;  // (groups, 2) float16
          for (int64_t i = 0; i < 2 * groups; ++i) vsm[t * 2 * groups + i] = half_at(sm, i);
        }
#if defined(__AVX2__) && defined(__FMA__)
        if (group == 16 || group == 32 || group == 64) {
          // query vectors (row, head): the full rows' together, a partial row's on their own
          const int64_t per_tile = group == 16 ? 6 : group == 32 ? 3 : 1;
          const int64_t num_full_q = num_full * G, num_q = static_cast<int64_t>(tile_rows.size()) * G;
          for (int64_t q0 = 0; q0 < num_q;) {
            const int64_t row_end = q0 < num_full_q ? num_full_q : (q0 / G + 1) * G;
            const int64_t count = std::min(per_tile, row_end - q0);
            const int64_t rows = q0 < num_full_q ? bs : lens[tile_rows[q0 / G]] - j * bs;
            for (int64_t gr = 0; gr < groups; ++gr) {
              float* a[6];
              float* am[6];
              const float* pr[6];
              for (int64_t i = 0; i < count; ++i) {
                const int64_t b = tile_rows[(q0 + i) / G], g = (q0 + i) % G;
                a[i] = acc.data() + ((b - b0) * G + g) * D + gr * group;
                am[i] = accm.data() + ((b - b0) * G + g) * groups + gr;
                pr[i] = score_of(b, g, j * bs);
              }
              if (group == 16) block_values_rows<2, 6>(count, a, am, pr, codes.data(), D, vsm.data(), groups, gr, rows);
              if (group == 32) block_values_rows<4, 3>(count, a, am, pr, codes.data(), D, vsm.data(), groups, gr, rows);
              if (group == 64) block_values_rows<8, 1>(count, a, am, pr, codes.data(), D, vsm.data(), groups, gr, rows);
            }
            q0 += count;
          }
          continue;
        }
#endif
        for (const int64_t b : tile_rows) {
          const int64_t rows = std::min(bs, lens[b] - j * bs);
          float* row_acc = acc.data() + (b - b0) * G * D;
          float* row_accm = accm.data() + (b - b0) * G * groups;
          for (int64_t g = 0; g < G; ++g) {
            float* a = row_acc + g * D;
            for (int64_t t = 0; t < rows; ++t) {
              const float p = score_of(b, g, j * bs + t)[0];
              const float* row = codes.data() + t * D;
              for (int64_t gr = 0; gr < groups; ++gr) {
                const float ps = p * vsm[(t * groups + gr) * 2];
                row_accm[g * groups + gr] = std::fma(p, vsm[(t * groups + gr) * 2 + 1],
                                                     row_accm[g * groups + gr]);
                const float* cc = row + gr * group;
                float* aa = a + gr * group;
                for (int64_t d = 0; d < group; ++d) aa[d] = std::fma(ps, cc[d], aa[d]);
              }
            }
          }
        }
      }
      for (int64_t b = b0; b < b1; ++b) {
        const float* row_acc = acc.data() + (b - b0) * G * D;
        const float* row_accm = accm.data() + (b - b0) * G * groups;
        for (int64_t g = 0; g < G; ++g) {
          float* o = op + (b * H + h * G + g) * D;
          for (int64_t d = 0; d < D; ++d) o[d] = row_acc[g * D + d] + row_accm[g * groups + d / group];
        }
      }
    }
  });
  return out;
}

// Write new rows into int4 blocks: values quantized per token and group into their block half
// (the same operations as kv_quant.quantize_int4, so the same bytes), keys copied into their
// block's staging slot (`stage_rows[t]`, -1: the row's block is sealed from it in torch).
void kv_write_int4(at::Tensor& v_raw, at::Tensor& staged, const at::Tensor& k_in,
                   const at::Tensor& v_in, const at::Tensor& slots_in,
                   const at::Tensor& stage_rows_in, int64_t block_size, int64_t group) {
  TORCH_CHECK(k_in.dim() == 3 && v_in.sizes() == k_in.sizes(), "kv_write_int4: k, v (T, KVH, D)");
  const at::Tensor k = k_in.to(at::kFloat).contiguous(), v = v_in.to(at::kFloat).contiguous();
  const at::Tensor slots = slots_in.contiguous(), stage_rows = stage_rows_in.contiguous();
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2), bs = block_size;
  TORCH_CHECK(slots.numel() == T && stage_rows.numel() == T, "kv_write_int4: one slot per row");
  TORCH_CHECK(staged.dim() == 4 && staged.is_contiguous() && staged.size(1) == bs &&
                  staged.size(2) == KVH && staged.size(3) == D,
              "kv_write_int4: staged must be contiguous float32 (S, bs, KVH, D)");
  TORCH_CHECK(v_raw.dim() == 2 && v_raw.is_contiguous() && group > 0 && D % group == 0,
              "kv_write_int4: value block halves must be contiguous uint8 rows");
  const int64_t half = v_raw.size(1), codes_bytes = bs * KVH * D / 2, groups = D / group;
  const int64_t num_blocks = v_raw.size(0), num_slots = staged.size(0);
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t* sr = stage_rows.data_ptr<int64_t>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  uint8_t* base = v_raw.data_ptr<uint8_t>();
  float* st = staged.data_ptr<float>();
  const float inv15 = static_cast<float>(1.0 / 15.0);  // as torch applies the scalar
  for (int64_t t = 0; t < T; ++t) {
    const int64_t b = sl[t] / bs, off = sl[t] % bs;
    TORCH_CHECK(sl[t] >= 0 && b < num_blocks, "kv_write_int4: slot out of range");
    if (sr[t] >= 0) {
      TORCH_CHECK(sr[t] < num_slots * bs, "kv_write_int4: staging row out of range");
      std::copy(kp + t * KVH * D, kp + (t + 1) * KVH * D, st + sr[t] * KVH * D);
    }
    uint8_t* codes = base + b * half + off * KVH * (D / 2);
    at::Half* sm = reinterpret_cast<at::Half*>(base + b * half + codes_bytes) + off * KVH * groups * 2;
    for (int64_t h = 0; h < KVH; ++h) {
      for (int64_t gr = 0; gr < groups; ++gr) {
        const float* x = vp + (t * KVH + h) * D + gr * group;
        float lo = x[0], hi = x[0];
        for (int64_t d = 1; d < group; ++d) {
          lo = std::min(lo, x[d]);
          hi = std::max(hi, x[d]);
        }
        const at::Half low(std::min(65504.f, std::max(-65504.f, lo)));
        const float lowf = static_cast<float>(low);
        const at::Half sc(std::min(65504.f, (hi - lowf) * inv15));
        const float s32 = static_cast<float>(sc);
        const float inv = s32 > 0.f ? 1.f / s32 : 0.f;
        sm[(h * groups + gr) * 2] = sc;
        sm[(h * groups + gr) * 2 + 1] = low;
        uint8_t* c = codes + h * (D / 2) + gr * group / 2;
        for (int64_t d = 0; d < group; d += 2) {
          const float q0 = std::min(15.f, std::max(0.f, std::nearbyint((x[d] - lowf) * inv)));
          const float q1 = std::min(15.f, std::max(0.f, std::nearbyint((x[d + 1] - lowf) * inv)));
          c[d / 2] = static_cast<uint8_t>(q0) | static_cast<uint8_t>(static_cast<uint8_t>(q1) << 4);
        }
      }
    }
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvwise, m) {
  m.def(
      "paged_decode_attention_int4(Tensor q, Tensor k_raw, Tensor v_raw, Tensor staged, "
      "Tensor block_tables, Tensor ctx_lens, Tensor open_slots, float scale, int block_size, "
      "int group, int window=0, float softcap=0.0, Tensor? sinks=None) -> Tensor");
  m.def(
      "kv_write_int4(Tensor(a!) v_raw, Tensor(b!) staged, Tensor k, Tensor v, Tensor slots, "
      "Tensor stage_rows, int block_size, int group) -> ()");
}

TORCH_LIBRARY_IMPL(kvwise, CPU, m) {
  m.impl("paged_decode_attention_int4", &paged_decode_attention_int4);
  m.impl("kv_write_int4", &kv_write_int4);
}
