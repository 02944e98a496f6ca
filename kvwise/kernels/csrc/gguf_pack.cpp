// A GGUF tensor's raw blocks -> the packed layout its kernel reads, in one pass.
//
//   gguf_pack(raw, gguf_type, rows, cols) -> packed uint8
//
// raw: the tensor's bytes as (rows, row bytes) uint8, rows in output order (any row stride, the
// bytes of a row contiguous: a view of the memory-mapped file is fine; it is only read). The
// result is, bit for bit, the `packed` tensor the Python path builds (models/quant.py,
// models/gguf_load.py, models/gguf_blocks.py), rows padded with zero columns to a multiple of 8:
//
//   Q4_0, Q4_1  -> Int4Weight.packed  (rows / 8, cols / 32, 160): fused.cpp's q4mm layout
//   Q8_0        -> Q8Weight.packed    (rows / 8, cols / 32, 272): fused.cpp's q8mm layout
//   Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, Q3_K, Q2_K
//               -> BlockWeight.packed (rows / 8, super-blocks, bytes): kquant.cpp's layout
//
// A Q4_0 block (`w = d (q - 8)`) becomes an int4 block with `m = -8 d`: float16(-8 * float(d)),
// as the Python path computes it (exact, or -inf past float16's range). Every other float16
// (d, m, D, Dmin) is copied as it is in the file. The work is split over groups of 8 rows
// (at::parallel_for); each group reads its 8 rows once and writes its output once.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "weights.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "gguf_pack reads GGUF's little-endian words");

namespace {

constexpr int64_t kBlock = 32;  // weights a block (and a kernel block)

inline uint16_t load16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline uint32_t load32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Q4_0's minimum -8 d as a float16: float16(-8 * float(d)) as the Python path rounds it. For a
// normal d whose -8 d stays normal that is d with its sign flipped and 3 added to its exponent;
// zeros, subnormals, overflows, infinities and NaNs take the float route.
inline uint16_t minus_8d(const uint8_t* d) {
  const uint16_t bits = load16(d);
  const int exponent = (bits >> 10) & 31;
  if (exponent >= 1 && exponent <= 27) return static_cast<uint16_t>((bits ^ 0x8000) + (3 << 10));
  const at::Half h = c10::Half(bits, c10::Half::from_bits());
  return at::Half(-8.f * static_cast<float>(h)).x;
}

// ---- Q4_0 / Q4_1 / Q8_0: one GGUF block -> one kernel block per column ---------------------
//
// A Q4 block's byte i holds weight i (low nibble) and weight 16 + i (high nibble); the kernel's
// chunk j, byte 4 c + t wants weight 4 j + t low and 16 + 4 j + t high: the same byte, so a
// column's 16 code bytes move as four 4-byte pieces. Q8_0's 32 codes move the same way.

template <int SrcBytes, int QsAt, int CodeBytes, int MinKind>
struct Simple {
  static constexpr int64_t src_bytes = SrcBytes;  // a GGUF block
  static constexpr int64_t qs_at = QsAt;          // where its codes start
  static constexpr int64_t code_bytes = CodeBytes;  // codes a column: 16 (int4) or 32 (int8)
  static constexpr int64_t at_d = 8 * CodeBytes;  // the 8 columns' d (then m) after the codes
  static constexpr int64_t out_bytes = at_d + (MinKind ? 32 : 16);  // a kernel block
  static constexpr int min_kind = MinKind;  // 0: none (Q8_0), 1: m = -8 d (Q4_0), 2: m (Q4_1)
};

using Q4_0 = Simple<18, 2, 16, 1>;
using Q4_1 = Simple<20, 4, 16, 2>;
using Q8_0 = Simple<34, 2, 32, 0>;

// column c's GGUF block `blk` into the group's kernel block `dst`
template <class S>
inline void put_simple(const uint8_t* blk, int64_t c, uint8_t* dst) {
  for (int64_t j = 0; j < S::code_bytes / 4; ++j)
    std::memcpy(dst + 32 * j + 4 * c, blk + S::qs_at + 4 * j, 4);
  std::memcpy(dst + S::at_d + 2 * c, blk, 2);
  if constexpr (S::min_kind == 1) {
    const uint16_t m = minus_8d(blk);
    std::memcpy(dst + S::at_d + 16 + 2 * c, &m, 2);
  } else if constexpr (S::min_kind == 2) {
    std::memcpy(dst + S::at_d + 16 + 2 * c, blk + 2, 2);
  }
}

template <class S>
void pack_simple_group(const uint8_t* raw, int64_t pitch, int64_t rows, int64_t nb, int64_t g,
                       uint8_t* out) {
  const int64_t columns = std::min<int64_t>(8, rows - 8 * g);
  uint8_t* dst = out + g * nb * S::out_bytes;
  const uint8_t* src = raw + 8 * g * pitch;
  if (columns == 8) {  // the output in order, the 8 rows' blocks side by side
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t c = 0; c < 8; ++c)
        put_simple<S>(src + c * pitch + b * S::src_bytes, c, dst + b * S::out_bytes);
    return;
  }
  std::memset(dst, 0, nb * S::out_bytes);  // the last group: zero columns past the rows
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t c = 0; c < columns; ++c)
      put_simple<S>(src + c * pitch + b * S::src_bytes, c, dst + b * S::out_bytes);
}

// ---- Q5_x and the K-quants: kquant.cpp's layout --------------------------------------------
//
// Per (super-)block of a column: its codes q[32 b + k] (a byte each, 2..6 bits used), the
// integer sub-block scales and minimums of the K-quants, and where its float16 fields are; then
// written into the group's kernel blocks at column c. The decoding follows ggml's block structs
// (as models/gguf_blocks.py's `_decode_blocks` does), 8 codes at a time in a uint64 (x86 is
// little-endian: byte i of the word is byte i of memory; every shift-and-mask below keeps the
// bits inside their byte).

constexpr uint64_t kLow4 = 0x0F0F0F0F0F0F0F0FULL, kLow2 = 0x0303030303030303ULL;
constexpr uint64_t kBit0 = 0x0101010101010101ULL;

inline uint64_t load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
inline void store64(uint8_t* p, uint64_t v) { std::memcpy(p, &v, 8); }
inline void store32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }

struct Column {
  alignas(8) uint8_t q[256];
  int8_t sc[16], mn[16];  // per block of 32 (8) or per sub-block of 16 (16: 2 b + half)
  const uint8_t* f16[2];  // d / D, then m / Dmin where the type has them
};

// kSpread[v]: the 8 bits of v as 8 bytes of 0 / 1 (bit i -> byte i)
struct SpreadTable {
  uint64_t v[256];
  constexpr SpreadTable() : v() {
    for (int x = 0; x < 256; ++x)
      for (int i = 0; i < 8; ++i) v[x] |= static_cast<uint64_t>((x >> i) & 1) << (8 * i);
  }
};
constexpr SpreadTable kSpread;

inline uint64_t spread8(uint32_t bits) { return kSpread.v[bits & 255]; }

// Q5_0 / Q5_1: qh bit k is bit 4 of code k; qs byte i holds codes i (low) and 16 + i (high)
inline void q5_codes(const uint8_t* qh_at, const uint8_t* qs, Column& col) {
  const uint32_t qh = load32(qh_at);
  for (int h = 0; h < 2; ++h) {
    const uint64_t v = load64(qs + 8 * h);
    store64(col.q + 8 * h, (v & kLow4) | (spread8(qh >> (8 * h)) << 4));
    store64(col.q + 16 + 8 * h, ((v >> 4) & kLow4) | (spread8(qh >> (16 + 8 * h)) << 4));
  }
}

// Q4_K / Q5_K's 12 bytes: 8 six-bit scales and 8 six-bit minimums
inline void k_scales(const uint8_t* s, Column& col) {
  for (int i = 0; i < 4; ++i) {
    col.sc[i] = s[i] & 63;
    col.mn[i] = s[4 + i] & 63;
    col.sc[4 + i] = (s[8 + i] & 15) | ((s[i] >> 2) & 48);
    col.mn[4 + i] = (s[8 + i] >> 4) | ((s[4 + i] >> 2) & 48);
  }
}

// one type: its GGUF (super-)block, its kernel layout and its decoder (in SPECS' order)
template <int SrcBytes, int Blocks, int Bits, bool KScales, bool Halves, bool Mins>
struct Kind {
  static constexpr int64_t src_bytes = SrcBytes, blocks = Blocks;
  static constexpr int bits = Bits;  // as stored: 2- and 3-bit codes ride in the nibbles
  static constexpr bool kscales = KScales, halves = Halves, mins = Mins;
  static constexpr int64_t plane_bytes = 32 * (Bits - 4);
  static constexpr int64_t sc_bytes = KScales ? 8 * (Halves ? 2 : 1) : 16;
  static constexpr int64_t block_bytes = 128 + plane_bytes + sc_bytes * (Mins ? 2 : 1);
  static constexpr int64_t header_bytes = KScales ? 16 * (Mins ? 2 : 1) : 0;
  static constexpr int64_t super_bytes = header_bytes + Blocks * block_bytes;
};

struct Q5_0 : Kind<22, 1, 5, false, false, false> {
  static void decode(const uint8_t* s, Column& col) {
    q5_codes(s + 2, s + 6, col);
    col.f16[0] = s;
  }
};

struct Q5_1 : Kind<24, 1, 5, false, false, true> {
  static void decode(const uint8_t* s, Column& col) {
    q5_codes(s + 4, s + 8, col);
    col.f16[0] = s;
    col.f16[1] = s + 2;
  }
};

struct Q4_K : Kind<144, 8, 4, true, false, true> {
  static void decode(const uint8_t* s, Column& col) {
    k_scales(s + 4, col);
    const uint8_t* qs = s + 16;  // 32 bytes hold blocks 2 i (low nibbles) and 2 i + 1 (high)
    for (int i = 0; i < 4; ++i)
      for (int k = 0; k < 32; k += 8) {
        const uint64_t v = load64(qs + 32 * i + k);
        store64(col.q + 64 * i + k, v & kLow4);
        store64(col.q + 64 * i + 32 + k, (v >> 4) & kLow4);
      }
    col.f16[0] = s;
    col.f16[1] = s + 2;
  }
};

struct Q5_K : Kind<176, 8, 5, true, false, true> {
  static void decode(const uint8_t* s, Column& col) {
    k_scales(s + 4, col);
    const uint8_t *qh = s + 16, *qs = s + 48;  // bit b of qh[k]: bit 4 of block b's code k
    for (int i = 0; i < 4; ++i)
      for (int k = 0; k < 32; k += 8) {
        const uint64_t v = load64(qs + 32 * i + k), h = load64(qh + k);
        store64(col.q + 64 * i + k, (v & kLow4) | (((h >> (2 * i)) & kBit0) << 4));
        store64(col.q + 64 * i + 32 + k, ((v >> 4) & kLow4) | (((h >> (2 * i + 1)) & kBit0) << 4));
      }
    col.f16[0] = s;
    col.f16[1] = s + 2;
  }
};

struct Q6_K : Kind<210, 8, 6, true, true, false> {
  static void decode(const uint8_t* s, Column& col) {
    const uint8_t *ql = s, *qh = s + 128;
    for (int h = 0; h < 2; ++h)  // halves of 128 weights: blocks 4 h + p
      for (int p = 0; p < 4; ++p)
        for (int k = 0; k < 32; k += 8) {
          const uint64_t low = (load64(ql + 64 * h + 32 * (p % 2) + k) >> (4 * (p / 2))) & kLow4;
          const uint64_t high = (load64(qh + 32 * h + k) >> (2 * p)) & kLow2;
          store64(col.q + 32 * (4 * h + p) + k, low | (high << 4));
        }
    std::memcpy(col.sc, s + 192, 16);
    col.f16[0] = s + 208;
  }
};

struct Q3_K : Kind<110, 8, 4, true, true, false> {
  static void decode(const uint8_t* s, Column& col) {
    const uint8_t *hmask = s, *qs = s + 32, *sc = s + 96;
    for (int h = 0; h < 2; ++h)
      for (int p = 0; p < 4; ++p)
        for (int k = 0; k < 32; k += 8) {
          const int b = 4 * h + p;
          const uint64_t low = (load64(qs + 32 * h + k) >> (2 * p)) & kLow2;
          store64(col.q + 32 * b + k, low | (((load64(hmask + k) >> b) & kBit0) << 2));
        }
    for (int i = 0; i < 16; ++i) {  // 4 low bits of 16 scales, then their 2 high bits
      const int low = i < 8 ? sc[i] & 15 : sc[i - 8] >> 4;
      const int high = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
      col.sc[i] = static_cast<int8_t>((low | (high << 4)) - 32);
    }
    col.f16[0] = s + 108;
  }
};

struct Q2_K : Kind<84, 8, 4, true, true, true> {
  static void decode(const uint8_t* s, Column& col) {
    const uint8_t* qs = s + 16;
    for (int h = 0; h < 2; ++h)
      for (int p = 0; p < 4; ++p)
        for (int k = 0; k < 32; k += 8)
          store64(col.q + 32 * (4 * h + p) + k, (load64(qs + 32 * h + k) >> (2 * p)) & kLow2);
    for (int i = 0; i < 16; ++i) {
      col.sc[i] = s[i] & 15;
      col.mn[i] = s[i] >> 4;
    }
    col.f16[0] = s + 80;
    col.f16[1] = s + 82;
  }
};

// column c's 32 codes `q` into a kernel block `p`: in chunk j, byte 4 c + t holds codes
// 4 j + t (low nibble) and 16 + 4 j + t (high); 5 / 6 bits: their top bits in the planes
template <int Bits>
inline void put_codes(const uint8_t* q, int64_t c, uint8_t* p) {
  constexpr uint32_t low4 = 0x0F0F0F0F, bit0 = 0x01010101, low2 = 0x03030303;
  uint32_t plane_lo = 0, plane_hi = 0;
  for (int j = 0; j < 4; ++j) {
    const uint32_t lo = load32(q + 4 * j), hi = load32(q + 16 + 4 * j);
    store32(p + 32 * j + 4 * c, (lo & low4) | ((hi & low4) << 4));
    if constexpr (Bits == 5) plane_lo |= (((lo >> 4) & bit0) << j) | (((hi >> 4) & bit0) << (4 + j));
    if constexpr (Bits == 6) {
      plane_lo |= ((lo >> 4) & low2) << (2 * j);
      plane_hi |= ((hi >> 4) & low2) << (2 * j);
    }
  }
  if constexpr (Bits >= 5) store32(p + 128 + 4 * c, plane_lo);
  if constexpr (Bits == 6) store32(p + 160 + 4 * c, plane_hi);
}

// column c's decoded (super-)block into the group's kernel (super-)block at `base`
template <class K>
inline void put_column(const Column& col, int64_t c, uint8_t* base) {
  if constexpr (K::kscales) {  // the header: D of the 8 columns, then Dmin
    std::memcpy(base + 2 * c, col.f16[0], 2);
    if constexpr (K::mins) std::memcpy(base + 16 + 2 * c, col.f16[1], 2);
  }
  for (int64_t b = 0; b < K::blocks; ++b) {
    uint8_t* p = base + K::header_bytes + b * K::block_bytes;
    put_codes<K::bits>(col.q + kBlock * b, c, p);
    uint8_t* t = p + 128 + K::plane_bytes;
    if constexpr (!K::kscales) {  // d, then m, as 8 float16
      std::memcpy(t + 2 * c, col.f16[0], 2);
      if constexpr (K::mins) std::memcpy(t + 16 + 2 * c, col.f16[1], 2);
    } else if constexpr (K::halves) {  // the first halves' 8 scales, the second's, then mins
      t[c] = col.sc[2 * b];
      t[8 + c] = col.sc[2 * b + 1];
      if constexpr (K::mins) {
        t[16 + c] = col.mn[2 * b];
        t[24 + c] = col.mn[2 * b + 1];
      }
    } else {
      t[c] = col.sc[b];
      if constexpr (K::mins) t[8 + c] = col.mn[b];
    }
  }
}

template <class K>
void pack_block_group(const uint8_t* raw, int64_t pitch, int64_t rows, int64_t nsb, int64_t g,
                      uint8_t* out) {
  const int64_t columns = std::min<int64_t>(8, rows - 8 * g);
  uint8_t* dst = out + g * nsb * K::super_bytes;
  const uint8_t* src = raw + 8 * g * pitch;
  if (columns < 8) std::memset(dst, 0, nsb * K::super_bytes);  // zero columns past the rows
  Column col;
  for (int64_t sb = 0; sb < nsb; ++sb)  // the output in order, the 8 rows' blocks side by side
    for (int64_t c = 0; c < columns; ++c) {
      K::decode(src + c * pitch + sb * K::src_bytes, col);
      put_column<K>(col, c, dst + sb * K::super_bytes);
    }
}

// groups of 8 rows per task: about 1 MiB of input each (a few hundred microseconds), so that a
// small tensor runs on the calling thread rather than wait for a busy core
inline int64_t grain(int64_t row_bytes) {
  return std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(1, 8 * row_bytes));
}

void check_raw(const at::Tensor& raw, const std::string& type, int64_t rows, int64_t cols,
               int64_t per, int64_t bytes) {
  TORCH_CHECK(rows > 0 && cols > 0 && cols % per == 0, "gguf_pack: a ", type, " row of ", cols,
              " weights is not whole blocks of ", per);
  const int64_t row_bytes = cols / per * bytes;
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.size(0) == rows &&
                  raw.size(1) == row_bytes && raw.stride(1) == 1 && (rows == 1 || raw.stride(0) >= row_bytes) &&
                  raw.device().is_cpu(),
              "gguf_pack: raw must be CPU uint8 (", rows, ", ", row_bytes, ") with contiguous ",
              "rows for a ", type, " tensor of (", rows, ", ", cols, "), got ", raw.sizes(),
              " strides ", raw.strides());
}

template <class S>
at::Tensor pack_simple(const at::Tensor& raw, const std::string& type, int64_t rows, int64_t cols) {
  check_raw(raw, type, rows, cols, kBlock, S::src_bytes);
  const int64_t nb = cols / kBlock, G = (rows + 7) / 8, pitch = raw.stride(0);
  at::Tensor out = empty_weights({G, nb, S::out_bytes}, raw.options());
  const uint8_t* rp = raw.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, G, grain(raw.size(1)), [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) pack_simple_group<S>(rp, pitch, rows, nb, g, op);
  });
  return out;
}

template <class K>
at::Tensor pack_blocks(const at::Tensor& raw, const std::string& type, int64_t rows, int64_t cols) {
  check_raw(raw, type, rows, cols, kBlock * K::blocks, K::src_bytes);
  const int64_t nsb = cols / (kBlock * K::blocks), G = (rows + 7) / 8, pitch = raw.stride(0);
  at::Tensor out = empty_weights({G, nsb, K::super_bytes}, raw.options());
  const uint8_t* rp = raw.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, G, grain(raw.size(1)), [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) pack_block_group<K>(rp, pitch, rows, nsb, g, op);
  });
  return out;
}

at::Tensor gguf_pack(const at::Tensor& raw, c10::string_view gguf_type, int64_t rows, int64_t cols) {
  const std::string type(gguf_type);
  if (type == "Q4_0") return pack_simple<Q4_0>(raw, type, rows, cols);
  if (type == "Q4_1") return pack_simple<Q4_1>(raw, type, rows, cols);
  if (type == "Q8_0") return pack_simple<Q8_0>(raw, type, rows, cols);
  if (type == "Q5_0") return pack_blocks<Q5_0>(raw, type, rows, cols);
  if (type == "Q5_1") return pack_blocks<Q5_1>(raw, type, rows, cols);
  if (type == "Q4_K") return pack_blocks<Q4_K>(raw, type, rows, cols);
  if (type == "Q5_K") return pack_blocks<Q5_K>(raw, type, rows, cols);
  if (type == "Q6_K") return pack_blocks<Q6_K>(raw, type, rows, cols);
  if (type == "Q3_K") return pack_blocks<Q3_K>(raw, type, rows, cols);
  if (type == "Q2_K") return pack_blocks<Q2_K>(raw, type, rows, cols);
  TORCH_CHECK(false, "gguf_pack: no packed layout for GGUF type '", type, "'");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvwise, m) {
  m.def("gguf_pack(Tensor raw, str gguf_type, int rows, int cols) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvwise, CPU, m) { m.impl("gguf_pack", &gguf_pack); }
