// The small steps between the quantized matmuls of a decoder layer, each fused into one op.
//
// In the quantized step (models/decoder.py, models/layer_ops.py) a layer runs four quantized matmuls; around them, torch
// would run ~30 small ops a layer (norm, casts, slices, q/k norm, rotary, SiLU), each costing
// more in dispatch than in arithmetic at one token. These ops do the same arithmetic in one
// pass each, in float32, and hand an int8 weight's matmul bfloat16 (torch's int8 kernel's fast
// input):
//
//   rms_norm_bf16(x, w, eps)                 -> bf16 RMSNorm(x) * w
//   add_rms_norm_bf16(residual!, y, w, eps)  -> residual += y; bf16 RMSNorm(residual) * w
//   qkv_rope(qkv, bias?, qk_norm?, cos, sin, H, KVH, eps) -> q, k, v float32, rotary applied
//   silu_mul_bf16(gate_up)                   -> bf16 silu(gate) * up
//
// and float32 forms of these for weights of other block formats (a GGUF file's own types),
// with Gemma's choices too (an RMSNorm weight's `offset`: 1 for its 1 + w; post-norms; GeGLU):
//
//   rms_norm_f32(x, w, eps, offset=0)        -> RMSNorm(x) * (w + offset)
//   add_rms_normed_f32(residual!, y, w, eps, offset=0) -> residual += RMSNorm(y) * (w + offset)
//   silu_mul_f32(gate_up), gelu_tanh_mul_f32(gate_up) -> silu / tanh-GELU(gate) * up
//
// and, for layers whose four weights are all int4, int4 x int8 matmuls (below) with the steps
// around them, all in float32:
//
//   q4mm(x, W)                               -> x @ W.T, x quantized to int8 per block of 32
//   rms_norm_q4mm(x, w, eps, W)              -> q4mm(RMSNorm(x) * w, W)
//   mlp_q4(residual!, o, w, eps, W_gu, W_down) -> residual += o; x = RMSNorm(residual) * w;
//                                               residual += q4mm(silu_mul(q4mm(x, W_gu)), W_down)
//
// where W is an int4 weight packed as Int4Weight (models/quant.py) packs it; and for int8
// weights in blocks of 32 (the embedding / LM head, GGUF's Q8_0):
//
//   q8mm(x, W)                               -> x @ W.T, x quantized as for q4mm
//   q8_rows_dot(h, W, ids)                   -> h[n] . W[ids[n][i]] in float32
// Registered as torch.ops.kvwise.*; kvwise/worker/kernels.py builds them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "qact.h"
#include "vec.h"
#include "amx.h"
#include "avx512.h"
#include "parallel.h"

namespace {

using c10::BFloat16;

// rows of at least this many elements each get their own task
constexpr int64_t kGrain = 1 << 15;

inline int64_t grain_rows(int64_t row_elems) {
  return std::max<int64_t>(1, kGrain / std::max<int64_t>(1, row_elems));
}

inline float inv_rms(const float* x, float eps, int64_t n) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  return 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
}

// a norm's weight i: w[i] + offset where the offset is not 0 (Gemma's 1 + w, added in float32
// as its reference does), else w[i] as it is, whatever its sign of zero
inline float norm_weight(const float* w, int64_t i, float offset) {
  return offset != 0.f ? w[i] + offset : w[i];
}

// out = RMSNorm(x) * (w + offset)
template <typename Out>
inline void norm_row(const float* x, const float* w, float eps, int64_t n, Out* out,
                     float offset = 0.f) {
  const float inv = inv_rms(x, eps, n);
  for (int64_t i = 0; i < n; ++i) out[i] = Out(x[i] * inv * norm_weight(w, i, offset));
}

void check_rows(const at::Tensor& x, const at::Tensor& w, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), name,
              ": x must be a contiguous float32 (T, N) tensor");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == at::kFloat &&
                  w.is_contiguous(),
              name, ": weight must be float32 (N,)");
}

at::Tensor rms_norm_bf16(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w, "rms_norm_bf16");
  const int64_t T = x.size(0), N = x.size(1);
  at::Tensor out = at::empty({T, N}, x.options().dtype(at::kBFloat16));
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  BFloat16* op = out.data_ptr<BFloat16>();
  kvwise::parallel_for(0, T, grain_rows(N), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) norm_row(xp + t * N, wp, eps, N, op + t * N);
  });
  return out;
}

at::Tensor add_rms_norm_bf16(at::Tensor& residual, const at::Tensor& y, const at::Tensor& w,
                             double eps) {
  check_rows(residual, w, "add_rms_norm_bf16");
  TORCH_CHECK(y.sizes() == residual.sizes() && y.scalar_type() == at::kBFloat16 &&
                  y.is_contiguous(),
              "add_rms_norm_bf16: y must be contiguous bfloat16 shaped like residual");
  const int64_t T = residual.size(0), N = residual.size(1);
  at::Tensor out = at::empty({T, N}, residual.options().dtype(at::kBFloat16));
  float* rp = residual.data_ptr<float>();
  const BFloat16* yp = y.data_ptr<BFloat16>();
  const float* wp = w.data_ptr<float>();
  BFloat16* op = out.data_ptr<BFloat16>();
  kvwise::parallel_for(0, T, grain_rows(N), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* r = rp + t * N;
      const BFloat16* yr = yp + t * N;
      for (int64_t i = 0; i < N; ++i) r[i] += static_cast<float>(yr[i]);
      norm_row(r, wp, eps, N, op + t * N);
    }
  });
  return out;
}

// qkv: (T, (H + 2 KVH) D) bfloat16 or float32, the fused projection's output; cos, sin:
// (T, 1, D) float32 views (any row stride), sin signed as in layers.rope_table. Returns q
// (T, H, D), k and v (T, KVH, D), float32: bias added, q/k normed per head (Qwen3; scaled by
// the weight + norm_offset where that is not 0: Gemma 3's 1 + w), rotary applied to q and k
// ("rotate half": element i pairs with element (i + D/2) mod D).
std::tuple<at::Tensor, at::Tensor, at::Tensor> qkv_rope(
    const at::Tensor& qkv_in, const c10::optional<at::Tensor>& bias,
    const c10::optional<at::Tensor>& qk_norm, const at::Tensor& cos, const at::Tensor& sin,
    int64_t H, int64_t KVH, double eps_in, double norm_offset) {
  TORCH_CHECK(qkv_in.dim() == 2, "qkv_rope: qkv must be (T, (H + 2 KVH) D)");
  const at::Tensor qkv = qkv_in.scalar_type() == at::kFloat ? qkv_in.contiguous()
                                                            : qkv_in.to(at::kFloat).contiguous();
  const int64_t T = qkv.size(0), W = qkv.size(1);
  TORCH_CHECK(W % (H + 2 * KVH) == 0, "qkv_rope: width is not (H + 2 KVH) D");
  const int64_t D = W / (H + 2 * KVH), half = D / 2;
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.size(0) == T && cos.size(-1) == D && cos.stride(-1) == 1 &&
                  sin.stride(-1) == 1 && sin.stride(0) == cos.stride(0),
              "qkv_rope: cos and sin must be float32 (T, 1, D) rows");
  const float* bp = nullptr;
  if (bias) {
    TORCH_CHECK(bias->numel() == W && bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "qkv_rope: bias must be float32 (W,)");
    bp = bias->data_ptr<float>();
  }
  const float* np = nullptr;
  if (qk_norm) {
    TORCH_CHECK(qk_norm->numel() == (H + KVH) * D && qk_norm->scalar_type() == at::kFloat &&
                    qk_norm->is_contiguous(),
                "qkv_rope: qk_norm must be float32 (H + KVH, D)");
    np = qk_norm->data_ptr<float>();
  }
  at::Tensor q = at::empty({T, H, D}, qkv.options().dtype(at::kFloat));
  at::Tensor k = at::empty({T, KVH, D}, q.options());
  at::Tensor v = at::empty({T, KVH, D}, q.options());
  const float* xp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t rope_stride = cos.stride(0);
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  const float eps = static_cast<float>(eps_in), off = static_cast<float>(norm_offset);
  kvwise::parallel_for(0, T, grain_rows(W), [&](int64_t begin, int64_t end) {
    float buf[1024];
    TORCH_CHECK(D <= 1024, "qkv_rope: head_dim above 1024");
    for (int64_t t = begin; t < end; ++t) {
      const float* x = xp + t * W;
      const float* c = cp + t * rope_stride;
      const float* s = sp + t * rope_stride;
      for (int64_t head = 0; head < H + KVH; ++head) {
        const float* hx = x + head * D;
        for (int64_t i = 0; i < D; ++i) buf[i] = hx[i] + (bp ? bp[head * D + i] : 0.f);
        if (np) {
          const float inv = inv_rms(buf, eps, D);
          const float* nw = np + head * D;
          for (int64_t i = 0; i < D; ++i) buf[i] = norm_weight(nw, i, off) * (buf[i] * inv);
        }
        float* o = head < H ? qp + (t * H + head) * D : kp + (t * KVH + head - H) * D;
        for (int64_t i = 0; i < D; ++i) {
          const float other = i < half ? buf[i + half] : buf[i - half];
          o[i] = buf[i] * c[i] + other * s[i];
        }
      }
      const float* xv = x + (H + KVH) * D;
      float* ov = vp + t * KVH * D;
      for (int64_t i = 0; i < KVH * D; ++i) ov[i] = xv[i] + (bp ? bp[(H + KVH) * D + i] : 0.f);
    }
  });
  return {q, k, v};
}

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const BFloat16* p) { return load_bf16(p); }
inline void store8(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
inline void store8(BFloat16* p, __m256 x) { store_bf16(p, x); }
#endif

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 silu8(__m256 g) {
  return _mm256_div_ps(
      g, _mm256_add_ps(_mm256_set1_ps(1.f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

// torch's tanh GELU, 0.5 g (1 + tanh(z)) with z = sqrt(2 / pi) (g + 0.044715 g^3), as
// g * sigmoid(2 z) (the same function): no cancellation where tanh(z) nears -1, so a large
// negative gate gives ~0, not the last bits of 1 + tanh
inline __m256 gelu_tanh8(__m256 g) {
  const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
  const __m256 minus_2z = _mm256_mul_ps(_mm256_set1_ps(-1.5957691216057308f),
                                        _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), g3, g));
  return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), exp256(minus_2z)));
}
#endif

inline float silu1(float g) { return g / (1.f + std::exp(-g)); }

inline float gelu_tanh1(float g) {
  return g / (1.f + std::exp(-1.5957691216057308f * (g + 0.044715f * g * g * g)));
}

// gate_up (T, 2 I) -> act(gate) * up (T, I), computed in float32, in and out as T; Gelu: the
// tanh GELU (GeGLU), else SiLU.
template <typename T, bool Gelu = false>
at::Tensor glu_mul(const at::Tensor& gate_up, const char* name) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 &&
                  gate_up.scalar_type() == c10::CppTypeToScalarType<T>::value &&
                  gate_up.is_contiguous(),
              name, ": gate_up must be contiguous (T, 2 I) of its dtype");
  const int64_t T_ = gate_up.size(0), I = gate_up.size(1) / 2;
  at::Tensor out = at::empty({T_, I}, gate_up.options());
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  kvwise::parallel_for(0, T_, grain_rows(2 * I), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* g = gp + t * 2 * I;
      const T* u = g + I;
      T* o = op + t * I;
      int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
      for (; i + 8 <= I; i += 8) {
        const __m256 gi = load8(g + i);
        store8(o + i, _mm256_mul_ps(Gelu ? gelu_tanh8(gi) : silu8(gi), load8(u + i)));
      }
#endif
      for (; i < I; ++i) {
        const float gi = static_cast<float>(g[i]);
        o[i] = T((Gelu ? gelu_tanh1(gi) : silu1(gi)) * static_cast<float>(u[i]));
      }
    }
  });
  return out;
}

at::Tensor silu_mul_bf16(const at::Tensor& gate_up) {
  return glu_mul<BFloat16>(gate_up, "silu_mul_bf16");
}

// ---- int4 weights x int8 activations ---------------------------------------------------------
//
// The dot product llama.cpp runs for Q4_1 weights: each row of activations is quantized to int8
// in blocks of 32 (`x ~ dx * qx`, dx = max|x| / 127, qx rounded to nearest; `sx = dx * sum qx`),
// and a weight block of 32 is `w = d * q + m` with q in 0..15. Then
//
//   out[n] = sum over blocks b, in order, of   acc = fma(d[n,b] * dx[b], isum[n,b], acc)
//                                              acc = fma(m[n,b], sx[b], acc)
//
// with isum = sum_k q * qx an exact integer (|isum| <= 32 * 15 * 127). Integer SIMD makes the
// block sums: `maddubs` multiplies 32 unsigned codes by 32 signed activations and adds pairs,
// four times the multiplies per instruction of a float32 FMA. Every row runs the same operations
// in the same order whatever the number of rows, so a token's output does not depend on the
// batch it was computed in (a prompt prefilled cold, a cached prefix plus its tail, or a decode
// step give the same bits).
//
// Weight layout (Int4Weight in models/quant.py): (N / 8, K / 32, 160) bytes, a group of 8 output
// columns by one block of 32 k: four 32-byte chunks of codes, then d and m as 8 float16 each.
// In chunk j, byte 4 c + t holds column c's code for k = 4 j + t in its low nibble and for
// k = 16 + 4 j + t in its high one, so one byte vector times four broadcast activations gives
// 8 columns' partial sums (2 per 16-bit lane; at most 8 x 3,810 a block: no overflow).
constexpr int64_t kQ4GroupBytes = 160;

// R rows x one group of 8 columns over all K: out[r][0..7] (float32)
template <int R>
inline void q4_rows(const uint8_t* w, int64_t nb, const int8_t* xq, const float* dx,
                    const float* sx, float* out, int64_t ldo) {
  const int64_t K = nb * kQ4Block;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w += kQ4GroupBytes) {
    __m256i sum16[R];
    for (int r = 0; r < R; ++r) sum16[r] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * j));
      const __m256i lo = _mm256_and_si256(c, mask);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), mask);
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = xq + r * K + b * kQ4Block;
        int32_t xl, xh;
        std::memcpy(&xl, xr + 4 * j, 4);
        std::memcpy(&xh, xr + 16 + 4 * j, 4);
        sum16[r] = _mm256_add_epi16(sum16[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xl)));
        sum16[r] = _mm256_add_epi16(sum16[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xh)));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 128)));
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 144)));
    for (int r = 0; r < R; ++r) {
      const __m256 isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum16[r], ones));
      const int64_t i = r * nb + b;
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(dx[i])), isum, acc[r]);
      acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[i]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo, acc[r]);
#else
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < 8; ++c) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* g = w + b * kQ4GroupBytes;
        const int8_t* xr = xq + r * K + b * kQ4Block;
        int32_t isum = 0;
        for (int j = 0; j < 4; ++j)
          for (int t = 0; t < 4; ++t) {
            const uint8_t byte = g[32 * j + 4 * c + t];
            isum += (byte & 15) * xr[4 * j + t] + (byte >> 4) * xr[16 + 4 * j + t];
          }
        const float d = static_cast<float>(reinterpret_cast<const at::Half*>(g + 128)[c]);
        const float m = static_cast<float>(reinterpret_cast<const at::Half*>(g + 144)[c]);
        acc = std::fma(d * dx[r * nb + b], static_cast<float>(isum), acc);
        acc = std::fma(m, sx[r * nb + b], acc);
      }
      out[r * ldo + c] = acc;
    }
  }
#endif
}


// ---- int8 weights in blocks of 32 x int8 activations (llama.cpp's Q8_0 x Q8_0 dot) ----------
//
// A weight block of 32 is `w = d * q`, q in -127..127, d float16 (GGUF's Q8_0); the activations
// are quantized as for q4mm, and out[n] = sum over blocks b of acc = fma(d[n,b] * dx[b],
// isum[n,b], acc), isum exact. maddubs wants one unsigned operand: |w| times x carrying w's
// sign. Layout: (N / 8, K / 32, 272) bytes: eight 32-byte chunks, byte 4 c + t of chunk j
// holding column c's code for k = 4 j + t, then d as 8 float16.
constexpr int64_t kQ8GroupBytes = 272;

template <int R>
inline void q8_rows(const uint8_t* w, int64_t nb, const int8_t* xq, const float* dx, float* out,
                    int64_t ldo) {
  const int64_t K = nb * kQ4Block;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w += kQ8GroupBytes) {
    __m256i sum[R];
    for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * j));
      const __m256i a = _mm256_abs_epi8(c);
      for (int r = 0; r < R; ++r) {
        int32_t x4;
        std::memcpy(&x4, xq + r * K + b * kQ4Block + 4 * j, 4);
        const __m256i p = _mm256_maddubs_epi16(a, _mm256_sign_epi8(_mm256_set1_epi32(x4), c));
        sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(p, ones));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 256)));
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(dx[r * nb + b])),
                               _mm256_cvtepi32_ps(sum[r]), acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo, acc[r]);
#else
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < 8; ++c) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* g = w + b * kQ8GroupBytes;
        int32_t isum = 0;
        for (int j = 0; j < 8; ++j)
          for (int t = 0; t < 4; ++t)
            isum += static_cast<int8_t>(g[32 * j + 4 * c + t]) * xq[r * K + b * kQ4Block + 4 * j + t];
        const float d = static_cast<float>(reinterpret_cast<const at::Half*>(g + 256)[c]);
        acc = std::fma(d * dx[r * nb + b], static_cast<float>(isum), acc);
      }
      out[r * ldo + c] = acc;
    }
  }
#endif
}


// ---- the same two matmuls with AVX-512 VNNI ---------------------------------------------------
//
// Where the CPU runs AVX-512 VNNI (kernels.py probes it by running a test program, then builds
// with KVWISE_AVX512VNNI), `vpdpbusd` does a maddubs, its 16-bit add and the widening to 32 bits
// in one instruction, on 512-bit vectors: two column groups side by side (16 columns), each row
// a broadcast of 4 activations. The integer block sums are the same exact integers and the float
// operations after them the same, in the same order, so the results are bit-identical to the
// AVX2 path (tested). For Q8_0 weights, vpdpbusd too wants unsigned weights: it sums
// (w + 128) * x, and 128 * sum(x) comes off again (both exact).
#if defined(KVWISE_AVX512VNNI)
bool g_vnni = true;

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// R rows x two groups of 8 columns (w0, w1) over all K: out[r][0..15]
template <bool Q4, int R>
inline void vnni_rows(const uint8_t* w0, const uint8_t* w1, int64_t nb, const int8_t* xq,
                      const float* dx, const float* sx, const int32_t* xs, float* out,
                      int64_t ldo) {
  constexpr int64_t gb = Q4 ? kQ4GroupBytes : kQ8GroupBytes;
  const int64_t K = nb * kQ4Block;
  const __m512i mask = _mm512_set1_epi8(0x0F);
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w0 += gb, w1 += gb) {
    __m512i s0[R], s1[R];
    for (int r = 0; r < R; ++r) s0[r] = s1[r] = _mm512_setzero_si512();
    if constexpr (Q4) {
      for (int j = 0; j < 4; ++j) {
        const __m512i c = load_pair(w0 + 32 * j, w1 + 32 * j);
        const __m512i lo = _mm512_and_si512(c, mask);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(c, 4), mask);
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = xq + r * K + b * kQ4Block;
          s0[r] = _mm512_dpbusd_epi32(s0[r], lo, bcast4(xr + 4 * j));
          s1[r] = _mm512_dpbusd_epi32(s1[r], hi, bcast4(xr + 16 + 4 * j));
        }
      }
      const __m512 d = load_ph_pair(w0 + 128, w1 + 128);
      const __m512 m = load_ph_pair(w0 + 144, w1 + 144);
      for (int r = 0; r < R; ++r) {
        const __m512 isum = _mm512_cvtepi32_ps(_mm512_add_epi32(s0[r], s1[r]));
        const int64_t i = r * nb + b;
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(dx[i])), isum, acc[r]);
        acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[i]), acc[r]);
      }
    } else {
      for (int j = 0; j < 8; j += 2) {
        const __m512i u0 = _mm512_xor_si512(load_pair(w0 + 32 * j, w1 + 32 * j), bias);
        const __m512i u1 = _mm512_xor_si512(load_pair(w0 + 32 * j + 32, w1 + 32 * j + 32), bias);
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = xq + r * K + b * kQ4Block;
          s0[r] = _mm512_dpbusd_epi32(s0[r], u0, bcast4(xr + 4 * j));
          s1[r] = _mm512_dpbusd_epi32(s1[r], u1, bcast4(xr + 4 * j + 4));
        }
      }
      const __m512 d = load_ph_pair(w0 + 256, w1 + 256);
      for (int r = 0; r < R; ++r) {
        const int64_t i = r * nb + b;
        const __m512i isum = _mm512_sub_epi32(_mm512_add_epi32(s0[r], s1[r]),
                                              _mm512_set1_epi32(128 * xs[i]));
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(dx[i])),
                                 _mm512_cvtepi32_ps(isum), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, acc[r]);
}

template <bool Q4, int R>
void vnni_tile(const uint8_t* w0, const uint8_t* w1, int64_t nb, int64_t rows, const int8_t* xq,
               const float* dx, const float* sx, const int32_t* xs, float* out, int64_t ldo) {
  if constexpr (R > 0) {
    if (rows == R) return vnni_rows<Q4, R>(w0, w1, nb, xq, dx, sx, xs, out, ldo);
    vnni_tile<Q4, R - 1>(w0, w1, nb, rows, xq, dx, sx, xs, out, ldo);
  }
}
#else
bool g_vnni = false;
#endif
bool g_amx = kvwise_amx::ready();  // AMX tiles where the build has them and the OS grants them
constexpr int64_t kAmxRows = 16;

template <bool Q4, int R>
inline void block_rows(const uint8_t* w, int64_t nb, const int8_t* xq, const float* dx,
                       const float* sx, float* out, int64_t ldo) {
  if constexpr (Q4) {
    q4_rows<R>(w, nb, xq, dx, sx, out, ldo);
  } else {
    q8_rows<R>(w, nb, xq, dx, out, ldo);
  }
}

// (M, K) float32 x an int4 (Q4) or int8-block weight -> (M, N) float32: the rows quantized
// per block of 32, then column groups split between threads; each group's weights (K / 32
// blocks) stay in cache while every row runs through them, 4 rows at a time
template <bool Q4>
at::Tensor block_mm(const at::Tensor& x, const at::Tensor& packed, const char* name) {
  constexpr int64_t group_bytes = Q4 ? kQ4GroupBytes : kQ8GroupBytes;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), name,
              ": x must be a contiguous float32 (T, K) tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == group_bytes && packed.size(1) * kQ4Block == x.size(1),
              name, ": packed must be uint8 (N / 8, K / 32, ", group_bytes, ") for K = ", x.size(1));
  const int64_t M = x.size(0), K = x.size(1), G = packed.size(0), nb = packed.size(1);
  const int64_t N = G * 8;
  // AMX tiles from kAmxRows rows on (their rows' quantized activations padded with zeros to
  // a whole tile); fewer rows run the VNNI tiles, where a 16-row tile would be mostly padding
  const bool amx = g_amx && M >= kAmxRows;
  const int64_t rows = amx ? (M + kvwise_amx::kTileRows - 1) / kvwise_amx::kTileRows *
                                 kvwise_amx::kTileRows
                           : M;
  std::vector<int8_t> xq(rows * K);
  std::vector<float> dx(rows * nb), sx(rows * nb);
  std::vector<int32_t> xs(rows * nb);
  const float* xp = x.data_ptr<float>();
  kvwise::parallel_for(0, M, grain_rows(4 * K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      quantize_row_q8(xp + m * K, K, xq.data() + m * K, dx.data() + m * nb, sx.data() + m * nb,
                      xs.data() + m * nb);
  });
  at::Tensor out = at::empty({M, N}, x.options());
  float* op = out.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  // the groups one AVX2 tile runs: those the VNNI pairs leave (an odd last one), or all
  auto avx2_groups = [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* w = wp + g * nb * group_bytes;
      if (g + 1 < g1)  // the next group's weights on their way while this one runs
        for (int64_t byte = 0; byte < nb * group_bytes; byte += 64)
          __builtin_prefetch(w + nb * group_bytes + byte, 0, 3);
      int64_t m = 0;
      for (; m + 4 <= M; m += 4)
        block_rows<Q4, 4>(w, nb, xq.data() + m * K, dx.data() + m * nb, sx.data() + m * nb,
                          op + m * N + g * 8, N);
      for (; m < M; ++m)
        block_rows<Q4, 1>(w, nb, xq.data() + m * K, dx.data() + m * nb, sx.data() + m * nb,
                          op + m * N + g * 8, N);
    }
  };
#if defined(KVWISE_AVX512VNNI)
  if (amx) {
    // in runs of rows whose quantized activations stay in L2 while every column pair runs
    // through them (a prompt's thousands of rows would stream from memory once a pair)
    constexpr int64_t kRunRows = 256;
    for (int64_t m0 = 0; m0 < M; m0 += kRunRows) {
      const int64_t run = std::min(kRunRows, M - m0);
      kvwise::parallel_for(0, G / 2, 1, [&](int64_t p0, int64_t p1) {
        kvwise_amx::block_pairs(Q4, wp, nb, p0, p1, run, xq.data() + m0 * K,
                                dx.data() + m0 * nb, sx.data() + m0 * nb, op + m0 * N, N);
      });
    }
    if (G % 2) avx2_groups(G - 1, G);
    return out;
  }
  if (g_vnni) {
    constexpr int64_t kRows = 8;
    kvwise::parallel_for(0, G / 2, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const uint8_t* w0 = wp + 2 * p * nb * group_bytes;
        const uint8_t* w1 = w0 + nb * group_bytes;
        if (p + 1 < p1)  // the next pair's weights on their way while this one runs
          for (int64_t byte = 0; byte < 2 * nb * group_bytes; byte += 64)
            __builtin_prefetch(w1 + nb * group_bytes + byte, 0, 3);
        for (int64_t m = 0; m < M; m += kRows)
          vnni_tile<Q4, kRows>(w0, w1, nb, std::min(kRows, M - m), xq.data() + m * K,
                               dx.data() + m * nb, sx.data() + m * nb, xs.data() + m * nb,
                               op + m * N + p * 16, N);
      }
    });
    if (G % 2) avx2_groups(G - 1, G);
    return out;
  }
#endif
  kvwise::parallel_for(0, G, 1, avx2_groups);
  return out;
}

// which instructions q4mm / q8mm run: "amx" where built and the CPU and OS grant the tiles
// (AMX from kAmxRows rows, VNNI below), else "avx512vnni" where built and the CPU runs it, else
// "avx2"; `isa` non-empty switches (the results are the same bits either way)
std::string block_isa(c10::string_view isa) {
  if (isa == "avx2") {
    g_vnni = g_amx = false;
  } else if (isa == "avx512vnni") {
#if defined(KVWISE_AVX512VNNI)
    g_vnni = true, g_amx = false;
#else
    TORCH_CHECK(false, "block_isa: this build has no AVX-512 VNNI kernels");
#endif
  } else if (isa == "amx") {
    TORCH_CHECK(kvwise_amx::ready(), "block_isa: this build or CPU has no AMX kernels");
    g_vnni = g_amx = true;
  } else {
    TORCH_CHECK(isa.empty(), "block_isa: expected 'avx2', 'avx512vnni' or 'amx', got '",
                std::string(isa), "'");
  }
  return g_amx ? "amx" : g_vnni ? "avx512vnni" : "avx2";
}

at::Tensor q4mm(const at::Tensor& x, const at::Tensor& packed) {
  return block_mm<true>(x, packed, "q4mm");
}

at::Tensor q8mm(const at::Tensor& x, const at::Tensor& packed) {
  return block_mm<false>(x, packed, "q8mm");
}

// out[n][i] = dot(hidden[n], row ids[n][i] of an int8-block weight), in float32 (the exact
// logits of a few candidates per row after q8mm's approximate ones)
at::Tensor q8_rows_dot(const at::Tensor& hidden, const at::Tensor& packed, const at::Tensor& ids) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && hidden.is_contiguous(),
              "q8_rows_dot: hidden must be a contiguous float32 (N, K) tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == kQ8GroupBytes && packed.size(1) * kQ4Block == hidden.size(1),
              "q8_rows_dot: packed must be uint8 (V / 8, K / 32, 272)");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == hidden.size(0) && ids.scalar_type() == at::kLong &&
                  ids.is_contiguous(),
              "q8_rows_dot: ids must be int64 (N, k)");
  const int64_t N = ids.size(0), k = ids.size(1), K = hidden.size(1), nb = packed.size(1);
  const int64_t rows = packed.size(0) * 8;
  at::Tensor out = at::empty({N, k}, hidden.options());
  const float* hp = hidden.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const int64_t* ip = ids.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < N * k; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < rows, "q8_rows_dot: id ", ip[i], " out of range");
  kvwise::parallel_for(0, N * k, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t id = ip[i], c = id % 8;
      const uint8_t* g = wp + (id / 8) * nb * kQ8GroupBytes;
      const float* h = hp + (i / k) * K;
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b, g += kQ8GroupBytes, h += kQ4Block) {
        float part = 0.f;
        for (int j = 0; j < 8; ++j)
          for (int t = 0; t < 4; ++t)
            part += static_cast<float>(static_cast<int8_t>(g[32 * j + 4 * c + t])) * h[4 * j + t];
        acc += static_cast<float>(reinterpret_cast<const at::Half*>(g + 256)[c]) * part;
      }
      op[i] = acc;
    }
  });
  return out;
}


// ---- the rows of logits: top-k candidates, greedy picks ---------------------------------------

// ids (N, k) int64 of the k largest values of each row of x (N, V) float32, in no set order
// (ties at the k-th value: the earlier ids). One pass a row: a min-heap of k, and 8 values at a
// time skipped while none beats the heap's least (after the first few hundred, nearly all).
at::Tensor top_k_ids(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "top_k_ids: x must be a contiguous float32 (N, V) tensor");
  const int64_t N = x.size(0), V = x.size(1);
  TORCH_CHECK(k >= 1 && k <= V, "top_k_ids: k must be in 1..", V, ", got ", k);
  at::Tensor ids = at::empty({N, k}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  kvwise::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    std::vector<std::pair<float, int64_t>> heap;  // min-heap by value, then by later id
    const auto after = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    };
    for (int64_t n = begin; n < end; ++n) {
      const float* row = xp + n * V;
      heap.clear();
      auto offer = [&](int64_t i) {
        if (static_cast<int64_t>(heap.size()) < k) {
          heap.emplace_back(row[i], i);
          std::push_heap(heap.begin(), heap.end(), after);
        } else if (row[i] > heap.front().first) {
          std::pop_heap(heap.begin(), heap.end(), after);
          heap.back() = {row[i], i};
          std::push_heap(heap.begin(), heap.end(), after);
        }
      };
      int64_t i = 0;
      for (; i < V && static_cast<int64_t>(heap.size()) < k; ++i) offer(i);
#if defined(__AVX2__) && defined(__FMA__)
      for (; i + 8 <= V; i += 8) {
        const __m256 least = _mm256_set1_ps(heap.front().first);
        int bits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), least, _CMP_GT_OQ));
        while (bits) {
          offer(i + __builtin_ctz(bits));
          bits &= bits - 1;
        }
      }
#endif
      for (; i < V; ++i) offer(i);
      for (int64_t j = 0; j < k; ++j) ip[n * k + j] = heap[j].second;
    }
  });
  return ids;
}

// Grammars' token masks on logits (N, V) float32, in place: row n keeps token t where bit t % 32
// of words[n][t / 32] is set (a grammar allows it) and becomes -inf elsewhere, tokens past the
// words' end too. words (N, W) int32: llguidance's bitmask layout.
void mask_logits(at::Tensor& logits, const at::Tensor& words) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "mask_logits: logits must be a contiguous float32 (N, V) tensor");
  TORCH_CHECK(words.dim() == 2 && words.scalar_type() == at::kInt && words.is_contiguous() &&
                  words.size(0) == logits.size(0),
              "mask_logits: words must be contiguous int32 (N, W), a row per logits row");
  const int64_t N = logits.size(0), V = logits.size(1), W = words.size(1);
  float* xp = logits.data_ptr<float>();
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(words.data_ptr<int32_t>());
  const float inf = -std::numeric_limits<float>::infinity();
  kvwise::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      float* row = xp + n * V;
      const uint32_t* w = wp + n * W;
      for (int64_t t0 = 0; t0 < V; t0 += 32) {
        const uint32_t bits = t0 / 32 < W ? w[t0 / 32] : 0u;
        if (bits == 0xffffffffu) continue;  // (the common words: all allowed, or none)
        const int64_t stop = std::min<int64_t>(32, V - t0);
        if (bits == 0u) {
          std::fill(row + t0, row + t0 + stop, inf);
          continue;
        }
        for (int64_t i = 0; i < stop; ++i)
          if (!((bits >> i) & 1u)) row[t0 + i] = inf;
      }
    }
  });
}

// greedy picks of logits (N, V) float32: the id of each row's largest value (the first, on a
// tie) and its log-probability, -log(sum exp(x - max)), in one pass and a half a row
std::tuple<at::Tensor, at::Tensor> greedy_pick(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() &&
                  logits.size(1) > 0,
              "greedy_pick: logits must be a contiguous float32 (N, V) tensor");
  const int64_t N = logits.size(0), V = logits.size(1);
  at::Tensor ids = at::empty({N}, logits.options().dtype(at::kLong));
  at::Tensor logprobs = at::empty({N}, logits.options());
  const float* xp = logits.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* lp = logprobs.data_ptr<float>();
  kvwise::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* row = xp + n * V;
      // the largest value (NaN counts as largest, as in torch.argmax), then its first id
      float m = row[0];
      bool nan = std::isnan(m);
      int64_t i = 1;
#if defined(__AVX2__) && defined(__FMA__)
      if (V >= 8) {
        __m256 mx = _mm256_loadu_ps(row), un = _mm256_cmp_ps(mx, mx, _CMP_UNORD_Q);
        for (i = 8; i + 8 <= V; i += 8) {
          const __m256 v = _mm256_loadu_ps(row + i);
          mx = _mm256_max_ps(mx, v);
          un = _mm256_or_ps(un, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, mx);
        for (float v : lanes) m = std::max(m, v);
        nan = nan || _mm256_movemask_ps(un) != 0;
      }
#endif
      for (; i < V; ++i) {
        nan = nan || std::isnan(row[i]);
        m = std::max(m, row[i]);
      }
      int64_t best = 0;
      while (best < V && !(nan ? std::isnan(row[best]) : row[best] == m)) ++best;
      m = row[best];
      double total = 0.0;
      i = 0;
#if defined(__AVX2__) && defined(__FMA__)
      __m256 acc = _mm256_setzero_ps();
      const __m256 mv = _mm256_set1_ps(m);
      for (; i + 8 <= V; i += 8)
        acc = _mm256_add_ps(acc, exp256(_mm256_sub_ps(_mm256_loadu_ps(row + i), mv)));
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, acc);
      for (float v : lanes) total += v;
#endif
      for (; i < V; ++i) total += std::exp(row[i] - m);
      ip[n] = best;
      lp[n] = static_cast<float>(-std::log(total));
    }
  });
  return {ids, logprobs};
}

at::Tensor rms_norm_f32(const at::Tensor& x, const at::Tensor& w, double eps, double offset) {
  check_rows(x, w, "rms_norm_f32");
  const int64_t T = x.size(0), N = x.size(1);
  at::Tensor out = at::empty({T, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float off = static_cast<float>(offset);
  kvwise::parallel_for(0, T, grain_rows(N), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) norm_row(xp + t * N, wp, eps, N, op + t * N, off);
  });
  return out;
}

// residual += RMSNorm(y) * (w + offset): a post-norm family's output, normed before its add
void add_rms_normed_f32(at::Tensor& residual, const at::Tensor& y, const at::Tensor& w,
                        double eps, double offset) {
  check_rows(residual, w, "add_rms_normed_f32");
  check_rows(y, w, "add_rms_normed_f32");
  TORCH_CHECK(y.size(0) == residual.size(0), "add_rms_normed_f32: y must be shaped like residual");
  const int64_t T = residual.size(0), N = residual.size(1);
  float* rp = residual.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float off = static_cast<float>(offset);
  kvwise::parallel_for(0, T, grain_rows(N), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* yr = yp + t * N;
      float* r = rp + t * N;
      const float inv = inv_rms(yr, eps, N);
      for (int64_t i = 0; i < N; ++i) r[i] += yr[i] * inv * norm_weight(wp, i, off);
    }
  });
}

at::Tensor silu_mul_f32(const at::Tensor& gate_up) { return glu_mul<float>(gate_up, "silu_mul_f32"); }

at::Tensor gelu_tanh_mul_f32(const at::Tensor& gate_up) {
  return glu_mul<float, true>(gate_up, "gelu_tanh_mul_f32");
}

at::Tensor rms_norm_q4mm(const at::Tensor& x, const at::Tensor& w, double eps,
                         const at::Tensor& packed) {
  return q4mm(rms_norm_f32(x, w, eps, 0.), packed);
}

// residual += o; residual += down(silu(gate) * up) of the normed residual
void mlp_q4(at::Tensor& residual, const at::Tensor& o, const at::Tensor& w, double eps,
            const at::Tensor& gu_packed, const at::Tensor& down_packed) {
  check_rows(residual, w, "mlp_q4");
  TORCH_CHECK(o.sizes() == residual.sizes() && o.scalar_type() == at::kFloat,
              "mlp_q4: o must be float32 shaped like residual");
  residual.add_(o);
  const at::Tensor gate = silu_mul_f32(q4mm(rms_norm_f32(residual, w, eps, 0.), gu_packed));
  residual.add_(q4mm(gate, down_packed));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvwise, m) {
  m.def("rms_norm_bf16(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_bf16(Tensor(a!) residual, Tensor y, Tensor weight, float eps) -> Tensor");
  m.def(
      "qkv_rope(Tensor qkv, Tensor? bias, Tensor? qk_norm, Tensor cos, Tensor sin, int num_heads, "
      "int num_kv_heads, float eps, float norm_offset=0.) -> (Tensor, Tensor, Tensor)");
  m.def("silu_mul_bf16(Tensor gate_up) -> Tensor");
  m.def("block_isa(str isa='') -> str", &block_isa);  // no tensors: a catch-all kernel
  m.def("q4mm(Tensor x, Tensor packed) -> Tensor");
  m.def("q8mm(Tensor x, Tensor packed) -> Tensor");
  m.def("q8_rows_dot(Tensor hidden, Tensor packed, Tensor ids) -> Tensor");
  m.def("top_k_ids(Tensor x, int k) -> Tensor");
  m.def("greedy_pick(Tensor logits) -> (Tensor, Tensor)");
  m.def("mask_logits(Tensor(a!) logits, Tensor words) -> ()");
  m.def("rms_norm_q4mm(Tensor x, Tensor weight, float eps, Tensor packed) -> Tensor");
  m.def("rms_norm_f32(Tensor x, Tensor weight, float eps, float offset=0.) -> Tensor");
  m.def(
      "add_rms_normed_f32(Tensor(a!) residual, Tensor y, Tensor weight, float eps, "
      "float offset=0.) -> ()");
  m.def("silu_mul_f32(Tensor gate_up) -> Tensor");
  m.def("gelu_tanh_mul_f32(Tensor gate_up) -> Tensor");
  m.def(
      "mlp_q4(Tensor(a!) residual, Tensor o, Tensor weight, float eps, Tensor gu_packed, "
      "Tensor down_packed) -> ()");
}

TORCH_LIBRARY_IMPL(kvwise, CPU, m) {
  m.impl("rms_norm_bf16", &rms_norm_bf16);
  m.impl("add_rms_norm_bf16", &add_rms_norm_bf16);
  m.impl("qkv_rope", &qkv_rope);
  m.impl("silu_mul_bf16", &silu_mul_bf16);
  m.impl("q4mm", &q4mm);
  m.impl("q8mm", &q8mm);
  m.impl("q8_rows_dot", &q8_rows_dot);
  m.impl("top_k_ids", &top_k_ids);
  m.impl("greedy_pick", &greedy_pick);
  m.impl("mask_logits", &mask_logits);
  m.impl("rms_norm_q4mm", &rms_norm_q4mm);
  m.impl("rms_norm_f32", &rms_norm_f32);
  m.impl("add_rms_normed_f32", &add_rms_normed_f32);
  m.impl("silu_mul_f32", &silu_mul_f32);
  m.impl("gelu_tanh_mul_f32", &gelu_tanh_mul_f32);
  m.impl("mlp_q4", &mlp_q4);
}
