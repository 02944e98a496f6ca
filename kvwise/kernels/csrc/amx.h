// The int4 / Q8_0 block matmuls on AMX tiles (amx.cpp), for fused.cpp's block_mm.
#pragma once

#include <cstdint>

namespace kvwise_amx {

// Rows a tile computes at once: block_mm pads its quantized activations (and their scales) to a
// multiple of this with zeros.
constexpr int64_t kTileRows = 16;

// True once this process may use AMX tiles: the build has the AMX code (KVWISE_AMX) and the
// kernel granted the tile state (asked once, on the first call).
bool ready();

// out[m][16 p .. 16 p + 15] for m < M and the column pairs p in [p0, p1) (groups 2p and 2p + 1
// of `wp`, nb blocks each), the same bits vnni_rows computes: rows of xq (M rounded up to
// kTileRows, K = 32 nb), their block scales dx and, for int4, sx (the same rounding up).
void block_pairs(bool q4, const uint8_t* wp, int64_t nb, int64_t p0, int64_t p1, int64_t M,
                 const int8_t* xq, const float* dx, const float* sx, float* out, int64_t ldo);

}  // namespace kvwise_amx
