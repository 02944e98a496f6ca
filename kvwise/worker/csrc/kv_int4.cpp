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
// The scale and minimum are folded into the query and the weights instead of dequantizing
// every element: q . k = sum_d (q_d * scale_d) * code_d + sum_d q_d * min_d, and
// sum_t p_t v_t = sum_t (p_t * scale_t) * code_t + sum_t p_t * min_t per group. Same maths as
// the torch path (gather, dequantize, SDPA), another rounding order.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "vec.h"

namespace {

inline float half_at(const uint8_t* p, int64_t i) {
  return static_cast<float>(reinterpret_cast<const at::Half*>(p)[i]);
}

#if defined(__AVX2__) && defined(__FMA__)
// A sealed block's scores for G query heads, 8 tokens at a time, the G accumulators in
// registers: s[g][t] = (qm[g] + sum_d qs[g][d] * codes[d][t]) * scale.
template <int G>
void block_scores(float* s, int64_t stride, const float* codes, const float* qs,
                  const float* qm, int64_t D, int64_t bs, float scale) {
  for (int64_t t8 = 0; t8 < bs; t8 += 8) {
    __m256 a[G];
    for (int g = 0; g < G; ++g) a[g] = _mm256_set1_ps(qm[g]);
    for (int64_t d = 0; d < D; ++d) {
      const __m256 c = _mm256_loadu_ps(codes + d * bs + t8);
      for (int g = 0; g < G; ++g) a[g] = _mm256_fmadd_ps(_mm256_set1_ps(qs[g * D + d]), c, a[g]);
    }
    for (int g = 0; g < G; ++g)
      _mm256_storeu_ps(s + g * stride + t8, _mm256_mul_ps(a[g], _mm256_set1_ps(scale)));
  }
}

// One block's weighted values for one query head and one group of 8 * NV channels, the
// accumulators in registers: a[d] += sum_t (p[t] * scale[t]) * codes[t][d].
template <int NV>
void block_values(float* a, float* am, const float* p, const float* codes, int64_t D,
                  const float* vsm, int64_t groups, int64_t gr, int64_t rows) {
  __m256 acc[NV];
  for (int v = 0; v < NV; ++v) acc[v] = _mm256_loadu_ps(a + 8 * v);
  float m = *am;
  for (int64_t t = 0; t < rows; ++t) {
    const float ps = p[t] * vsm[(t * groups + gr) * 2];
    m += p[t] * vsm[(t * groups + gr) * 2 + 1];
    const __m256 w = _mm256_set1_ps(ps);
    const float* c = codes + t * D + gr * 8 * NV;
    for (int v = 0; v < NV; ++v) acc[v] = _mm256_fmadd_ps(w, _mm256_loadu_ps(c + 8 * v), acc[v]);
  }
  for (int v = 0; v < NV; ++v) _mm256_storeu_ps(a + 8 * v, acc[v]);
  *am = m;
}
#endif

at::Tensor paged_decode_attention_int4(const at::Tensor& q_in, const at::Tensor& k_raw,
                                       const at::Tensor& v_raw, const at::Tensor& staged,
                                       const at::Tensor& block_tables, const at::Tensor& ctx_lens,
                                       const at::Tensor& open_slots, double scale_in,
                                       int64_t block_size, int64_t group) {
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
  const float scale = static_cast<float>(scale_in);
  const int64_t groups = D / group;
  at::Tensor out = at::empty({B, H, D}, q.options());
  float* op = out.data_ptr<float>();

  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, codes(D * bs), qs(G * D), qm(G), acc(G * D), accm(G * groups);
    std::vector<float> ksm(2 * D), vsm(2 * bs * groups);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, h = task % KVH, n = lens[b];
      const int64_t nblk = (n + bs - 1) / bs, own = (n - 1) / bs;
      const float* qh = qp + (b * H + h * G) * D;  // the G query heads of this KV head
      scores.assign(G * n, 0.f);
      for (int64_t j = 0; j < nblk; ++j) {
        const int64_t rows = std::min(bs, n - j * bs);
        const int64_t blk = tables[b * max_blocks + j];
        TORCH_CHECK(blk >= 0 && blk < num_blocks, "paged_decode_attention_int4: block id");
        if (j == own) {  // full precision, from staging
          const float* krows = st + slots[b] * bs * KVH * D;
          for (int64_t t = 0; t < rows; ++t) {
            const float* k = krows + (t * KVH + h) * D;
            for (int64_t g = 0; g < G; ++g) {
              float s = 0.f;
              for (int64_t d = 0; d < D; ++d) s += qh[g * D + d] * k[d];
              scores[g * n + j * bs + t] = s * scale;
            }
          }
          continue;
        }
        const uint8_t* kc = kb + blk * half + h * D * (bs / 2);  // (D, bs / 2)
        const uint8_t* ks = kb + blk * half + codes_bytes + h * D * 4;  // (D, 2) float16
        for (int64_t d = 0; d < D; ++d) {
          for (int64_t i = 0; i < bs / 2; ++i) {
            const uint8_t c = kc[d * (bs / 2) + i];
            codes[d * bs + 2 * i] = static_cast<float>(c & 15);
            codes[d * bs + 2 * i + 1] = static_cast<float>(c >> 4);
          }
        }
        for (int64_t i = 0; i < 2 * D; ++i) ksm[i] = half_at(ks, i);
        for (int64_t g = 0; g < G; ++g) {
          float m = 0.f;
          for (int64_t d = 0; d < D; ++d) {
            qs[g * D + d] = qh[g * D + d] * ksm[2 * d];
            m += qh[g * D + d] * ksm[2 * d + 1];
          }
          qm[g] = m;
        }
#if defined(__AVX2__) && defined(__FMA__)
        if (bs % 8 == 0 && G <= 4) {  // a sealed block is always full
          float* s = scores.data() + j * bs;
          if (G == 1) block_scores<1>(s, n, codes.data(), qs.data(), qm.data(), D, bs, scale);
          if (G == 2) block_scores<2>(s, n, codes.data(), qs.data(), qm.data(), D, bs, scale);
          if (G == 3) block_scores<3>(s, n, codes.data(), qs.data(), qm.data(), D, bs, scale);
          if (G == 4) block_scores<4>(s, n, codes.data(), qs.data(), qm.data(), D, bs, scale);
          continue;
        }
#endif
        for (int64_t g = 0; g < G; ++g) {
          float* s = scores.data() + g * n + j * bs;
          float blockwise[256];
          const int64_t w = std::min<int64_t>(bs, 256);
          for (int64_t t0 = 0; t0 < rows; t0 += w) {
            const int64_t len = std::min(w, rows - t0);
            std::fill(blockwise, blockwise + len, qm[g]);
            for (int64_t d = 0; d < D; ++d) {
              const float a = qs[g * D + d];
              const float* c = codes.data() + d * bs + t0;
              for (int64_t t = 0; t < len; ++t) blockwise[t] += a * c[t];
            }
            for (int64_t t = 0; t < len; ++t) s[t0 + t] = blockwise[t] * scale;
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {  // softmax over the context
        float* s = scores.data() + g * n;
        const float mx = *std::max_element(s, s + n);
        float sum = 0.f;
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
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(accm.begin(), accm.end(), 0.f);
      for (int64_t j = 0; j < nblk; ++j) {
        const int64_t rows = std::min(bs, n - j * bs);
        const int64_t blk = tables[b * max_blocks + j];
        const uint8_t* vc = vb + blk * half;
        const uint8_t* vs = vb + blk * half + codes_bytes;
        for (int64_t t = 0; t < rows; ++t) {  // unpack the block's codes and scales once
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
          for (int64_t g = 0; g < G; ++g) {
            const float* pg = scores.data() + g * n + j * bs;
            for (int64_t gr = 0; gr < groups; ++gr) {
              float* a = acc.data() + g * D + gr * group;
              float* am = accm.data() + g * groups + gr;
              if (group == 16) block_values<2>(a, am, pg, codes.data(), D, vsm.data(), groups, gr, rows);
              if (group == 32) block_values<4>(a, am, pg, codes.data(), D, vsm.data(), groups, gr, rows);
              if (group == 64) block_values<8>(a, am, pg, codes.data(), D, vsm.data(), groups, gr, rows);
            }
          }
          continue;
        }
#endif
        for (int64_t g = 0; g < G; ++g) {
          float* a = acc.data() + g * D;
          for (int64_t t = 0; t < rows; ++t) {
            const float p = scores[g * n + j * bs + t];
            const float* row = codes.data() + t * D;
            for (int64_t gr = 0; gr < groups; ++gr) {
              const float ps = p * vsm[(t * groups + gr) * 2];
              accm[g * groups + gr] += p * vsm[(t * groups + gr) * 2 + 1];
              const float* cc = row + gr * group;
              float* aa = a + gr * group;
              for (int64_t d = 0; d < group; ++d) aa[d] += ps * cc[d];
            }
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* o = op + (b * H + h * G + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = acc[g * D + d] + accm[g * groups + d / group];
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
      "int group) -> Tensor");
  m.def(
      "kv_write_int4(Tensor(a!) v_raw, Tensor(b!) staged, Tensor k, Tensor v, Tensor slots, "
      "Tensor stage_rows, int block_size, int group) -> ()");
}

TORCH_LIBRARY_IMPL(kvwise, CPU, m) {
  m.impl("paged_decode_attention_int4", &paged_decode_attention_int4);
  m.impl("kv_write_int4", &kv_write_int4);
}
