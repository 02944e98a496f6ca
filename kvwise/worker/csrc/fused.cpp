// The small steps between the quantized matmuls of a decoder layer, each fused into one op.
//
// In the quantized step (models/llama.py) a layer runs four int4 matmuls; around them, torch
// would run ~30 small ops a layer (norm, casts, slices, q/k norm, rotary, SiLU), each costing
// more in dispatch than in arithmetic at one token. These ops do the same arithmetic in one
// pass each, in float32, and hand the next matmul bfloat16 (the int4 kernel's fast input):
//
//   rms_norm_bf16(x, w, eps)                 -> bf16 RMSNorm(x) * w
//   add_rms_norm_bf16(residual!, y, w, eps)  -> residual += y; bf16 RMSNorm(residual) * w
//   qkv_rope(qkv, bias?, qk_norm?, cos, sin, H, KVH, eps) -> q, k, v float32, rotary applied
//   silu_mul_bf16(gate_up)                   -> bf16 silu(gate) * up
//
// and, for layers whose four weights are all int4, the same steps with the matmuls called
// from here (one op where Python made three to five calls):
//
//   rms_norm_int4mm(x, w, eps, W)            -> int4mm(rms_norm_bf16(x, w), W)
//   f32_int4mm(x, W)                         -> int4mm(bf16(x), W)
//   mlp_int4(residual!, o, w, eps, W_gu, W_down) -> residual += o; x = rms_norm_bf16;
//                                               residual += int4mm(silu_mul(int4mm(x, W_gu)), W_down)
//
// where W is a (packed, group size, scales and zeros) triple of torch's CPU int4 kernel.
// Registered as torch.ops.kvwise.*; kvwise/worker/kernels.py builds them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "vec.h"

namespace {

using c10::BFloat16;

// rows of at least this many elements each get their own task
constexpr int64_t kGrain = 1 << 15;

inline int64_t grain_rows(int64_t row_elems) {
  return std::max<int64_t>(1, kGrain / std::max<int64_t>(1, row_elems));
}

inline void norm_row(const float* x, const float* w, float eps, int64_t n, BFloat16* out) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = BFloat16(x[i] * inv * w[i]);
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
  at::parallel_for(0, T, grain_rows(N), [&](int64_t begin, int64_t end) {
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
  at::parallel_for(0, T, grain_rows(N), [&](int64_t begin, int64_t end) {
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
// (T, H, D), k and v (T, KVH, D), float32: bias added, q/k normed per head (Qwen3), rotary
// applied to q and k ("rotate half": element i pairs with element (i + D/2) mod D).
std::tuple<at::Tensor, at::Tensor, at::Tensor> qkv_rope(
    const at::Tensor& qkv_in, const c10::optional<at::Tensor>& bias,
    const c10::optional<at::Tensor>& qk_norm, const at::Tensor& cos, const at::Tensor& sin,
    int64_t H, int64_t KVH, double eps_in) {
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
  const float eps = static_cast<float>(eps_in);
  at::parallel_for(0, T, grain_rows(W), [&](int64_t begin, int64_t end) {
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
          float ss = 0.f;
          for (int64_t i = 0; i < D; ++i) ss += buf[i] * buf[i];
          const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
          for (int64_t i = 0; i < D; ++i) buf[i] = np[head * D + i] * (buf[i] * inv);
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

at::Tensor silu_mul_bf16(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 &&
                  gate_up.scalar_type() == at::kBFloat16 && gate_up.is_contiguous(),
              "silu_mul_bf16: gate_up must be contiguous bfloat16 (T, 2 I)");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  at::Tensor out = at::empty({T, I}, gate_up.options());
  const BFloat16* gp = gate_up.data_ptr<BFloat16>();
  BFloat16* op = out.data_ptr<BFloat16>();
  at::parallel_for(0, T, grain_rows(2 * I), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const BFloat16* g = gp + t * 2 * I;
      const BFloat16* u = g + I;
      BFloat16* o = op + t * I;
      int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
      for (; i + 8 <= I; i += 8) {
        const __m256 gi = load_bf16(g + i);
        const __m256 silu = _mm256_div_ps(
            gi, _mm256_add_ps(_mm256_set1_ps(1.f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), gi))));
        store_bf16(o + i, _mm256_mul_ps(silu, load_bf16(u + i)));
      }
#endif
      for (; i < I; ++i) {
        const float gi = static_cast<float>(g[i]);
        o[i] = BFloat16(gi / (1.f + std::exp(-gi)) * static_cast<float>(u[i]));
      }
    }
  });
  return out;
}

// ---- int4 matmul for several rows, bit for bit torch's CPU int4 kernel ----------------------
//
// torch's kernel (aten/src/ATen/native/cpu/int4mm_kernel.cpp, AVX2) computes each output as
// one float32 FMA chain over k = 0 .. K-1: w = fma(q, scale, fma(scale, -8, zero)) with q the
// 4-bit code as a float, then acc = fma(x[k], w, acc), rounded to bfloat16 at the end. Those
// are the only roundings, so any kernel doing the same operations in the same k order gives
// the same bits, however it tiles rows and columns: this one dequantizes a block of 32 output
// columns once into a float32 tile (2 x K x 16, in L2) and runs every row through it with a
// register-blocked 6-rows x 16-columns micro-kernel (torch's kernel re-dequantizes per row
// block and runs ~50 GFLOP/s here on prefill; this one ~2x that). One row (decode) keeps
// torch's kernel: it streams the weights once either way.
#if defined(__AVX2__) && defined(__FMA__)

// the float32 weights of output block `nb` as two (K, 16) halves: columns 0..15, then 16..31
// (torch's packed layout: (N / 32, K, 16) bytes, byte j holding column j in its low nibble and
// 16 + j in its high one)
void dequant_block(const uint8_t* packed, const BFloat16* sz, int64_t N, int64_t K,
                   int64_t group, int64_t nb, float* tile) {
  const uint8_t* q = packed + nb * K * 16;
  const __m256i nib = _mm256_set1_epi32(15);
  const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const __m256 minus8 = _mm256_set1_ps(-8.f);
  __m256 scale[4], zero[4];
  for (int64_t k = 0; k < K; ++k) {
    if (k % group == 0) {
      // (scale, zero) bf16 pairs of columns 32 nb + 8 j .. + 7 as 32-bit words
      const BFloat16* p = sz + ((k / group) * N + nb * 32) * 2;
      for (int j = 0; j < 4; ++j) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * j));
        scale[j] = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
        zero[j] = _mm256_fmadd_ps(scale[j], minus8, _mm256_castsi256_ps(_mm256_and_si256(w, hi_mask)));
      }
    }
    const uint8_t* b = q + k * 16;
    const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
    const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 8)));
    const __m256 c[4] = {_mm256_cvtepi32_ps(_mm256_and_si256(lo, nib)),   // columns 0..7
                         _mm256_cvtepi32_ps(_mm256_and_si256(hi, nib)),   // 8..15
                         _mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4)),    // 16..23
                         _mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4))};   // 24..31
    // two (K, 16) halves, each contiguous for the micro-kernel's pass over it
    for (int j = 0; j < 4; ++j)
      _mm256_storeu_ps(tile + (j / 2) * K * 16 + k * 16 + 8 * (j % 2), _mm256_fmadd_ps(c[j], scale[j], zero[j]));
  }
}

// R rows x 16 columns: out[r][0..15] = bf16(sum_k x[r][k] * tile[k][0..15]), one FMA chain
// per output. Named accumulators: GCC keeps an array of them on the stack, storing every one
// at every k, which halves the speed.
template <int R>
inline void micro(const float* x, int64_t ldx, const float* tile, int64_t K, BFloat16* out,
                  int64_t ldo) {
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
  __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  const float* x0 = x;
  const float* x1 = x + ldx;
  const float* x2 = x + 2 * ldx;
  const float* x3 = x + 3 * ldx;
  const float* x4 = x + 4 * ldx;
  const float* x5 = x + 5 * ldx;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(tile + k * 16), w1 = _mm256_loadu_ps(tile + k * 16 + 8);
    __m256 xv = _mm256_broadcast_ss(x0 + k);
    a00 = _mm256_fmadd_ps(xv, w0, a00);
    a01 = _mm256_fmadd_ps(xv, w1, a01);
    if constexpr (R > 1) {
      xv = _mm256_broadcast_ss(x1 + k);
      a10 = _mm256_fmadd_ps(xv, w0, a10);
      a11 = _mm256_fmadd_ps(xv, w1, a11);
    }
    if constexpr (R > 2) {
      xv = _mm256_broadcast_ss(x2 + k);
      a20 = _mm256_fmadd_ps(xv, w0, a20);
      a21 = _mm256_fmadd_ps(xv, w1, a21);
    }
    if constexpr (R > 3) {
      xv = _mm256_broadcast_ss(x3 + k);
      a30 = _mm256_fmadd_ps(xv, w0, a30);
      a31 = _mm256_fmadd_ps(xv, w1, a31);
    }
    if constexpr (R > 4) {
      xv = _mm256_broadcast_ss(x4 + k);
      a40 = _mm256_fmadd_ps(xv, w0, a40);
      a41 = _mm256_fmadd_ps(xv, w1, a41);
    }
    if constexpr (R > 5) {
      xv = _mm256_broadcast_ss(x5 + k);
      a50 = _mm256_fmadd_ps(xv, w0, a50);
      a51 = _mm256_fmadd_ps(xv, w1, a51);
    }
  }
  const __m256 acc[6][2] = {{a00, a01}, {a10, a11}, {a20, a21},
                            {a30, a31}, {a40, a41}, {a50, a51}};
  for (int r = 0; r < R; ++r) {
    store_bf16(out + r * ldo, acc[r][0]);
    store_bf16(out + r * ldo + 8, acc[r][1]);
  }
}

void rows_through_tile(const float* x, int64_t M, int64_t K, const float* tile, BFloat16* out,
                       int64_t N) {
  for (int half = 0; half < 2; ++half) {
    const float* t = tile + half * K * 16;
    BFloat16* o = out + 16 * half;
    int64_t m = 0;
    for (; m + 6 <= M; m += 6) micro<6>(x + m * K, K, t, K, o + m * N, N);
    switch (M - m) {
      case 5: micro<5>(x + m * K, K, t, K, o + m * N, N); break;
      case 4: micro<4>(x + m * K, K, t, K, o + m * N, N); break;
      case 3: micro<3>(x + m * K, K, t, K, o + m * N, N); break;
      case 2: micro<2>(x + m * K, K, t, K, o + m * N, N); break;
      case 1: micro<1>(x + m * K, K, t, K, o + m * N, N); break;
      default: break;
    }
  }
}
#endif

at::Tensor int4mm(const at::Tensor& x, const at::Tensor& packed, int64_t group,
                  const at::Tensor& scales_zeros) {
#if defined(__AVX2__) && defined(__FMA__)
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  if (M >= 2 && x.dim() == 2 && N % 32 == 0 && group % 8 == 0 && K % group == 0 &&
      packed.scalar_type() == at::kByte && packed.size(1) * 2 == K &&
      scales_zeros.scalar_type() == at::kBFloat16 && scales_zeros.is_contiguous() &&
      x.scalar_type() == at::kBFloat16) {
    const at::Tensor xf = x.to(at::kFloat).contiguous();  // exact: bf16 -> f32
    const at::Tensor q = packed.contiguous();
    at::Tensor out = at::empty({M, N}, x.options());
    const float* xp = xf.data_ptr<float>();
    const uint8_t* qp = q.data_ptr<uint8_t>();
    const BFloat16* szp = scales_zeros.data_ptr<BFloat16>();
    BFloat16* op = out.data_ptr<BFloat16>();
    at::parallel_for(0, N / 32, 1, [&](int64_t b0, int64_t b1) {
      std::vector<float> tile(K * 32);
      for (int64_t nb = b0; nb < b1; ++nb) {
        dequant_block(qp, szp, N, K, group, nb, tile.data());
        rows_through_tile(xp, M, K, tile.data(), op + nb * 32, N);
      }
    });
    return out;
  }
#endif
  return at::_weight_int4pack_mm_for_cpu(x, packed, group, scales_zeros);
}

at::Tensor int4mm_op(const at::Tensor& x, const at::Tensor& packed, int64_t group,
                     const at::Tensor& scales_zeros) {
  return int4mm(x.to(at::kBFloat16).contiguous(), packed, group, scales_zeros);
}

at::Tensor rms_norm_int4mm(const at::Tensor& x, const at::Tensor& w, double eps,
                           const at::Tensor& packed, int64_t group, const at::Tensor& sz) {
  return int4mm(rms_norm_bf16(x, w, eps), packed, group, sz);
}

at::Tensor f32_int4mm(const at::Tensor& x, const at::Tensor& packed, int64_t group,
                      const at::Tensor& sz) {
  return int4mm(x.to(at::kBFloat16).contiguous(), packed, group, sz);
}

void mlp_int4(at::Tensor& residual, const at::Tensor& o, const at::Tensor& w, double eps,
              const at::Tensor& gu_packed, const at::Tensor& gu_sz, const at::Tensor& down_packed,
              const at::Tensor& down_sz, int64_t group) {
  const at::Tensor x = add_rms_norm_bf16(residual, o, w, eps);
  const at::Tensor gate = silu_mul_bf16(int4mm(x, gu_packed, group, gu_sz));
  residual.add_(int4mm(gate, down_packed, group, down_sz));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvwise, m) {
  m.def("rms_norm_bf16(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_bf16(Tensor(a!) residual, Tensor y, Tensor weight, float eps) -> Tensor");
  m.def(
      "qkv_rope(Tensor qkv, Tensor? bias, Tensor? qk_norm, Tensor cos, Tensor sin, int num_heads, "
      "int num_kv_heads, float eps) -> (Tensor, Tensor, Tensor)");
  m.def("silu_mul_bf16(Tensor gate_up) -> Tensor");
  m.def(
      "rms_norm_int4mm(Tensor x, Tensor weight, float eps, Tensor packed, int group, "
      "Tensor scales_zeros) -> Tensor");
  m.def("f32_int4mm(Tensor x, Tensor packed, int group, Tensor scales_zeros) -> Tensor");
  m.def("int4mm(Tensor x, Tensor packed, int group, Tensor scales_zeros) -> Tensor");
  m.def(
      "mlp_int4(Tensor(a!) residual, Tensor o, Tensor weight, float eps, Tensor gu_packed, "
      "Tensor gu_scales_zeros, Tensor down_packed, Tensor down_scales_zeros, int group) -> ()");
}

TORCH_LIBRARY_IMPL(kvwise, CPU, m) {
  m.impl("rms_norm_bf16", &rms_norm_bf16);
  m.impl("add_rms_norm_bf16", &add_rms_norm_bf16);
  m.impl("qkv_rope", &qkv_rope);
  m.impl("silu_mul_bf16", &silu_mul_bf16);
  m.impl("rms_norm_int4mm", &rms_norm_int4mm);
  m.impl("f32_int4mm", &f32_int4mm);
  m.impl("mlp_int4", &mlp_int4);
  m.impl("int4mm", &int4mm_op);
}
