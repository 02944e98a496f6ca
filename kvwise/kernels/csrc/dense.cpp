// A float32 matmul whose every output is computed in one fixed order, whatever the batch:
//
//   f32mm(x, w) -> x @ w, x (M, K) and w (K, N) float32 (w as the model stores it, [in, out])
//
//   out[m][n] = acc after acc = fma(x[m][k], w[k][n], acc) for k = 0, 1, ..., K - 1 (from 0)
//
// BLAS libraries pick their blocking, their kernels and their thread split from the shape, so
// a row of x @ w can come out with other bits when it is multiplied alone than inside 4 or 17
// rows (MKL does: its remainder rows take another kernel). Here every output element is one
// chain of fused multiply-adds down k, and the tiles (rows x columns held in registers) and the
// threads' shares of the columns decide only which chains run together, never how one is
// computed: a row's bits do not depend on the other rows, the thread count or the ISA (the
// AVX2 lanes, the tail columns and the scalar build run the same IEEE fma in the same order).
//
// Registered as torch.ops.kvwise.f32mm; kvwise/worker/kernels.py builds it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "vec.h"
#include "parallel.h"

namespace {

// columns [n0, n0 + count) (count <= 64) of `rows` rows, one fma chain an element. k outside,
// columns inside: a vectorizer can only run the columns side by side, never reorder a chain.
inline void scalar_cols(const float* x, int64_t K, const float* w, int64_t N, int64_t n0,
                        int64_t count, int64_t rows, float* out, int64_t ldo) {
  float acc[64];
  for (int64_t r = 0; r < rows; ++r) {
    std::fill(acc, acc + count, 0.f);
    for (int64_t k = 0; k < K; ++k) {
      const float xk = x[r * K + k];
      const float* wk = w + k * N + n0;
      for (int64_t c = 0; c < count; ++c) acc[c] = std::fma(xk, wk[c], acc[c]);
    }
    std::copy(acc, acc + count, out + r * ldo + n0);
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// R rows x 8 * NV columns from n0: R * NV accumulators in registers
template <int R, int NV>
inline void tile(const float* x, int64_t K, const float* w, int64_t N, int64_t n0, float* out,
                 int64_t ldo) {
  __m256 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_setzero_ps();
  const float* wk = w + n0;
  for (int64_t k = 0; k < K; ++k, wk += N) {
    __m256 wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = _mm256_loadu_ps(wk + 8 * v);
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * K + k);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_fmadd_ps(xb, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(out + r * ldo + n0 + 8 * v, acc[r][v]);
}

// rows [0, rows) (rows <= R) x 8 * NV columns from n0
template <int R, int NV>
inline void tile_rows(const float* x, int64_t K, const float* w, int64_t N, int64_t n0,
                      int64_t rows, float* out, int64_t ldo) {
  if constexpr (R > 0) {
    if (rows == R) return tile<R, NV>(x, K, w, N, n0, out, ldo);
    tile_rows<R - 1, NV>(x, K, w, N, n0, rows, out, ldo);
  }
}
#endif

// columns [n0, n1) of `rows` rows, k outside: w is read in memory order, 8 of its rows at a
// time (a contiguous run each), and each vector of them serves every row of x; the chains wait
// in `out` between passes (a float's trip through memory is exact)
inline void stream_rows(const float* x, int64_t K, const float* w, int64_t N, int64_t n0,
                        int64_t n1, int64_t rows, float* out) {
  constexpr int64_t kStep = 8;  // rows of w a pass: a chain's next 8 links, then one store
  for (int64_t r = 0; r < rows; ++r) std::fill(out + r * N + n0, out + r * N + n1, 0.f);
  for (int64_t k0 = 0; k0 < K; k0 += kStep) {
    const int64_t steps = std::min(kStep, K - k0);
    const float* wk = w + k0 * N;
    int64_t n = n0;
#if defined(__AVX2__) && defined(__FMA__)
    if (steps == kStep) {
      for (; n + 8 <= n1; n += 8) {
        __m256 wv[kStep];
        for (int j = 0; j < kStep; ++j) wv[j] = _mm256_loadu_ps(wk + j * N + n);
        for (int64_t r = 0; r < rows; ++r) {
          const float* xk = x + r * K + k0;
          float* o = out + r * N + n;
          __m256 acc = _mm256_loadu_ps(o);
          for (int j = 0; j < kStep; ++j)
            acc = _mm256_fmadd_ps(_mm256_broadcast_ss(xk + j), wv[j], acc);
          _mm256_storeu_ps(o, acc);
        }
      }
    }
#endif
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = n; c < n1; ++c) {
        float acc = out[r * N + c];
        for (int64_t j = 0; j < steps; ++j) acc = std::fma(x[r * K + k0 + j], wk[j * N + c], acc);
        out[r * N + c] = acc;
      }
  }
}

// columns [n0, n1) of rows [0, rows) (rows <= 6); w[k * N + n], out[r * ldo + n]
inline void panel(const float* x, int64_t K, const float* w, int64_t N, int64_t n0, int64_t n1,
                  int64_t rows, float* out, int64_t ldo) {
  int64_t n = n0;
#if defined(__AVX2__) && defined(__FMA__)
  if (rows == 1) {  // one row: wide tiles, so each k reads whole cache lines of w
    for (; n + 64 <= n1; n += 64) tile<1, 8>(x, K, w, N, n, out, ldo);
  }
  for (; n + 16 <= n1; n += 16) tile_rows<6, 2>(x, K, w, N, n, rows, out, ldo);
  for (; n + 8 <= n1; n += 8) tile_rows<6, 1>(x, K, w, N, n, rows, out, ldo);
#endif
  scalar_cols(x, K, w, N, n, n1 - n, rows, out, ldo);
}

at::Tensor f32mm(const at::Tensor& x_in, const at::Tensor& w) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat,
              "f32mm: x must be a float32 (M, K) tensor");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous() &&
                  w.size(0) == x_in.size(1),
              "f32mm: w must be a contiguous float32 (K, N) tensor, K = ", x_in.size(1));
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(1);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // Threads share the columns in blocks. A few rows (decodes: 1-3, or up to 31 of a weight too
  // large for the caches, an LM head): k outside (stream_rows: w read in memory order), a
  // thread's share of the columns a block, narrower with more rows so that their outputs stay
  // in cache (~256 KiB). Otherwise 64 columns a block, 6 rows at a time in registers; from 32
  // rows (prefill) the block's weights are first copied into panels of 16 contiguous columns
  // (each k then reads one cache line, the panel streams from L1/L2), in runs of 96 rows so
  // that x's run stays in cache too.
  constexpr int64_t kRows = 96, kPackFrom = 32;
  const bool stream = M <= 3 || (M < kPackFrom && K * N * 4 >= (int64_t{32} << 20));
  const int64_t threads = at::get_num_threads();
  const int64_t share = (N + 64 * threads - 1) / (64 * threads) * 64;
  const int64_t kCols =
      stream ? std::max<int64_t>(512, std::min(share, (65536 / M + 63) / 64 * 64)) : 64;
  const int64_t blocks = (N + kCols - 1) / kCols;
  kvwise::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> packed;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kCols, n1 = std::min(N, n0 + kCols);
      if (M >= kPackFrom && n1 - n0 == kCols) {
        packed.resize(K * kCols);
        for (int64_t p = 0; p < 4; ++p)
          for (int64_t k = 0; k < K; ++k)
            std::copy_n(wp + k * N + n0 + 16 * p, 16, packed.data() + (p * K + k) * 16);
        for (int64_t m0 = 0; m0 < M; m0 += kRows) {
          const int64_t m1 = std::min(M, m0 + kRows);
          for (int64_t p = 0; p < 4; ++p)
            for (int64_t m = m0; m < m1; m += 6)
              panel(xp + m * K, K, packed.data() + p * K * 16, 16, 0, 16,
                    std::min<int64_t>(6, m1 - m), op + m * N + n0 + 16 * p, N);
        }
        continue;
      }
      if (stream) {
        stream_rows(xp, K, wp, N, n0, n1, M, op);
        continue;
      }
      for (int64_t m = 0; m < M; m += 6)
        panel(xp + m * K, K, wp, N, n0, n1, std::min<int64_t>(6, M - m), op + m * N, N);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvwise, m) { m.def("f32mm(Tensor x, Tensor w) -> Tensor"); }

TORCH_LIBRARY_IMPL(kvwise, CPU, m) { m.impl("f32mm", &f32mm); }
