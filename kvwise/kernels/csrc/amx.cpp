// The int4 and Q8_0 block matmuls on AMX tiles: the same exact integer block sums as the VNNI
// and AVX2 code, then the same float operations in the same order, so the same bits.
//
// An AMX tile multiply (TDPBSUD / TDPBSSD) sums, for each of 16 rows and 16 columns, the
// products of 4 signed activation bytes with 4 weight bytes over the K of its tiles, into
// int32. With tiles one block (32 k) wide it gives exactly the block sums the VNNI code builds
// from vpdpbusd (isum[r][c] = sum over the block's 32 k of q[c][k] * xq[r][k], integers, no
// overflow), 16 x 16 of them in one instruction. What follows per block is vnni_rows's own
// sequence on the stored sums: acc = fma(d * dx, float(isum), acc), then for int4 acc =
// fma(m, sx, acc). int4 codes are unsigned (0..15): the signed-by-unsigned multiply takes them
// as they are; Q8_0 codes are signed: signed by signed, with none of VNNI's +128 shift.
//
// Tiles: tmm0 the activations of 16 rows by one block (32 bytes a row, the rows K bytes
// apart); tmm1 the weights of one block for 16 columns in VNNI's layout (8 rows of k quads, 64
// bytes: 16 columns x 4 k), unpacked once a column pair from the packed groups (int4: low and
// high nibbles to bytes); tmm2 the sums. Tile state is per thread and other code (oneDNN's
// bf16 matmuls) loads its own configuration: each call loads ours and releases it at the end.

#include "amx.h"
#include "avx512.h"

#if defined(KVWISE_AMX)

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <vector>

namespace kvwise_amx {
namespace {

constexpr int64_t kBlock = 32, kQ4Group = 160, kQ8Group = 272, kTileBytes = 512;
constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

TileConfig make_config() {
  TileConfig c;
  for (int t : {0, 3}) c.rows[t] = kTileRows, c.colsb[t] = kBlock;  // activations
  for (int t : {1, 4}) c.rows[t] = kBlock / 4, c.colsb[t] = 64;     // weights
  for (int t : {2, 5}) c.rows[t] = kTileRows, c.colsb[t] = 64;      // sums (int32)
  return c;
}

const TileConfig kConfig = make_config();

// one column pair's weights, every block, as tile rows: tiles[b] = 8 rows x 64 bytes
template <bool Q4>
void unpack_pair(const uint8_t* w0, const uint8_t* w1, int64_t nb, uint8_t* tiles) {
  constexpr int64_t gb = Q4 ? kQ4Group : kQ8Group;
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b, w0 += gb, w1 += gb, tiles += kTileBytes) {
    __m512i* row = reinterpret_cast<__m512i*>(tiles);
    if constexpr (Q4) {
      for (int j = 0; j < 4; ++j) {  // k = 4 j + t in the low nibbles, 16 + 4 j + t high
        const __m512i c = load_pair(w0 + 32 * j, w1 + 32 * j);
        _mm512_store_si512(row + j, _mm512_and_si512(c, mask));
        _mm512_store_si512(row + 4 + j, _mm512_and_si512(_mm512_srli_epi16(c, 4), mask));
      }
    } else {
      for (int j = 0; j < 8; ++j) _mm512_store_si512(row + j, load_pair(w0 + 32 * j, w1 + 32 * j));
    }
  }
}

// 16 rows x one column pair over all K. Blocks go in pairs on two sets of tiles (0-2 and
// 3-5), so the second block's tile multiply runs while the first's sums are scaled.
template <bool Q4>
void tile_rows(const uint8_t* w0, const uint8_t* w1, const uint8_t* tiles, int64_t nb,
               int64_t rows, const int8_t* xq, const float* dx, const float* sx, float* out,
               int64_t ldo) {
  constexpr int64_t gb = Q4 ? kQ4Group : kQ8Group;
  const int64_t K = nb * kBlock;
  alignas(64) int32_t sums[2][kTileRows * 16];
  __m512 acc[kTileRows];
  for (int r = 0; r < kTileRows; ++r) acc[r] = _mm512_setzero_ps();
  // block b's scaled sums into acc, in vnni_rows's order
  auto scale = [&](int64_t b, const int32_t* sum) {
    const uint8_t *g0 = w0 + b * gb, *g1 = w1 + b * gb;
    const __m512 d = load_ph_pair(g0 + (Q4 ? 128 : 256), g1 + (Q4 ? 128 : 256));
    if constexpr (Q4) {
      const __m512 m = load_ph_pair(g0 + 144, g1 + 144);
      for (int r = 0; r < kTileRows; ++r) {
        const __m512 isum = _mm512_cvtepi32_ps(_mm512_load_si512(sum + 16 * r));
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(dx[r * nb + b])), isum, acc[r]);
        acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * nb + b]), acc[r]);
      }
    } else {
      for (int r = 0; r < kTileRows; ++r) {
        const __m512 isum = _mm512_cvtepi32_ps(_mm512_load_si512(sum + 16 * r));
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(dx[r * nb + b])), isum, acc[r]);
      }
    }
  };
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    _tile_loadd(0, xq + b * kBlock, K);
    _tile_loadd(1, tiles + b * kTileBytes, 64);
    _tile_zero(2);
    _tile_loadd(3, xq + (b + 1) * kBlock, K);
    _tile_loadd(4, tiles + (b + 1) * kTileBytes, 64);
    _tile_zero(5);
    if constexpr (Q4) {
      _tile_dpbsud(2, 0, 1);
      _tile_dpbsud(5, 3, 4);
    } else {
      _tile_dpbssd(2, 0, 1);
      _tile_dpbssd(5, 3, 4);
    }
    _tile_stored(2, sums[0], 64);
    scale(b, sums[0]);
    _tile_stored(5, sums[1], 64);
    scale(b + 1, sums[1]);
  }
  if (b < nb) {
    _tile_loadd(0, xq + b * kBlock, K);
    _tile_loadd(1, tiles + b * kTileBytes, 64);
    _tile_zero(2);
    if constexpr (Q4) {
      _tile_dpbsud(2, 0, 1);
    } else {
      _tile_dpbssd(2, 0, 1);
    }
    _tile_stored(2, sums[0], 64);
    scale(b, sums[0]);
  }
  for (int64_t r = 0; r < rows; ++r) _mm512_storeu_ps(out + r * ldo, acc[r]);
}

template <bool Q4>
void pairs(const uint8_t* wp, int64_t nb, int64_t p0, int64_t p1, int64_t M, const int8_t* xq,
           const float* dx, const float* sx, float* out, int64_t ldo) {
  constexpr int64_t gb = Q4 ? kQ4Group : kQ8Group;
  const int64_t K = nb * kBlock;
  std::vector<uint8_t> buffer(nb * kTileBytes + 64);
  uint8_t* tiles = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
  _tile_loadconfig(&kConfig);
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* w0 = wp + 2 * p * nb * gb;
    const uint8_t* w1 = w0 + nb * gb;
    unpack_pair<Q4>(w0, w1, nb, tiles);
    for (int64_t m = 0; m < M; m += kTileRows)
      tile_rows<Q4>(w0, w1, tiles, nb, std::min(kTileRows, M - m), xq + m * K, dx + m * nb,
                    Q4 ? sx + m * nb : nullptr, out + m * ldo + 16 * p, ldo);
  }
  _tile_release();
}

}  // namespace

bool ready() {
  static const bool granted =
      syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

void block_pairs(bool q4, const uint8_t* wp, int64_t nb, int64_t p0, int64_t p1, int64_t M,
                 const int8_t* xq, const float* dx, const float* sx, float* out, int64_t ldo) {
  if (q4) {
    pairs<true>(wp, nb, p0, p1, M, xq, dx, sx, out, ldo);
  } else {
    pairs<false>(wp, nb, p0, p1, M, xq, dx, sx, out, ldo);
  }
}

}  // namespace kvwise_amx

#else  // no AMX code in this build

namespace kvwise_amx {
bool ready() { return false; }
void block_pairs(bool, const uint8_t*, int64_t, int64_t, int64_t, int64_t, const int8_t*,
                 const float*, const float*, float*, int64_t) {}
}  // namespace kvwise_amx

#endif
