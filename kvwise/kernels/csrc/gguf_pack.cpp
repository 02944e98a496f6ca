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

// Q4_0's minimum -8 d as a float16, rounded as torch rounds float32 -> float16
inline uint16_t minus_8d(const uint8_t* d) {
  const at::Half h = c10::Half(load16(d), c10::Half::from_bits());
  return at::Half(-8.f * static_cast<float>(h)).x;
}

// ---- Q4_0 / Q4_1 / Q8_0: one GGUF block -> one kernel block per column ---------------------
//
// A Q4 block's byte i holds weight i (low nibble) and weight 16 + i (high nibble); the kernel's
// chunk j, byte 4 c + t wants weight 4 j + t low and 16 + 4 j + t high: the same byte, so a
// column's 16 code bytes move as four 4-byte pieces. Q8_0's 32 codes move the same way.

struct SimpleType {
  int64_t src_bytes;  // a GGUF block
  int64_t qs_at;      // where its codes start
  int64_t code_bytes; // codes a column: 16 (int4) or 32 (int8)
  int64_t out_bytes;  // a kernel block of 8 columns
  int min_kind;       // 0: no minimum (Q8_0), 1: m = -8 d (Q4_0), 2: m in the file (Q4_1)
};

constexpr SimpleType kQ4_0{18, 2, 16, 160, 1};
constexpr SimpleType kQ4_1{20, 4, 16, 160, 2};
constexpr SimpleType kQ8_0{34, 2, 32, 272, 0};

void pack_simple_group(const SimpleType& s, const uint8_t* raw, int64_t pitch, int64_t rows,
                       int64_t nb, int64_t g, uint8_t* out) {
  const int64_t columns = std::min<int64_t>(8, rows - 8 * g);
  uint8_t* dst = out + g * nb * s.out_bytes;
  if (columns < 8) std::memset(dst, 0, nb * s.out_bytes);
  const int64_t at_d = 8 * s.code_bytes;  // 128 or 256
  for (int64_t c = 0; c < columns; ++c) {
    const uint8_t* src = raw + (8 * g + c) * pitch;
    for (int64_t b = 0; b < nb; ++b, src += s.src_bytes) {
      uint8_t* p = dst + b * s.out_bytes;
      for (int64_t j = 0; j < s.code_bytes / 4; ++j) std::memcpy(p + 32 * j + 4 * c, src + s.qs_at + 4 * j, 4);
      std::memcpy(p + at_d + 2 * c, src, 2);
      if (s.min_kind == 1) {
        const uint16_t m = minus_8d(src);
        std::memcpy(p + at_d + 16 + 2 * c, &m, 2);
      } else if (s.min_kind == 2) {
        std::memcpy(p + at_d + 16 + 2 * c, src + 2, 2);
      }
    }
  }
}

// ---- Q5_x and the K-quants: kquant.cpp's layout --------------------------------------------
//
// Per (super-)block of a column: the codes q[0 .. 32 blocks) (one byte each, 2..6 bits used),
// the integer sub-block scales and minimums of the K-quants, and the float16 fields' bytes;
// then written into the group's kernel block at column c. The decoding follows ggml's block
// structs (as models/gguf_blocks.py's `_decode_blocks` does).

struct Column {
  uint8_t q[256];
  int8_t sc[16], mn[16];  // per block of 32 (8) or per sub-block of 16 (16: 2 b + half)
  const uint8_t* f16[2];  // d / D, then m / Dmin where the type has them
};

struct BlockType {
  int64_t src_bytes;   // a GGUF (super-)block
  int64_t blocks;      // blocks of 32 a (super-)block: 8 for the K-quants, 1 for Q5_x
  int bits;            // bits a code as stored in the kernel layout: 4, 5 or 6
  bool kscales, halves, mins;
  void (*decode)(const uint8_t* src, Column& col);

  int64_t plane_bytes() const { return 32 * (bits - 4); }
  int64_t sc_bytes() const { return kscales ? 8 * (halves ? 2 : 1) : 16; }
  int64_t block_bytes() const { return 128 + plane_bytes() + sc_bytes() * (mins ? 2 : 1); }
  int64_t header_bytes() const { return kscales ? 16 * (mins ? 2 : 1) : 0; }
  int64_t super_bytes() const { return header_bytes() + blocks * block_bytes(); }
};

void decode_q5_0(const uint8_t* s, Column& col) {
  const uint32_t qh = load32(s + 2);
  const uint8_t* qs = s + 6;
  for (int k = 0; k < 16; ++k) {
    col.q[k] = (qs[k] & 15) | (((qh >> k) & 1) << 4);
    col.q[16 + k] = (qs[k] >> 4) | (((qh >> (16 + k)) & 1) << 4);
  }
  col.f16[0] = s;
}

void decode_q5_1(const uint8_t* s, Column& col) {
  const uint32_t qh = load32(s + 4);
  const uint8_t* qs = s + 8;
  for (int k = 0; k < 16; ++k) {
    col.q[k] = (qs[k] & 15) | (((qh >> k) & 1) << 4);
    col.q[16 + k] = (qs[k] >> 4) | (((qh >> (16 + k)) & 1) << 4);
  }
  col.f16[0] = s;
  col.f16[1] = s + 2;
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

void decode_q4_k(const uint8_t* s, Column& col) {
  k_scales(s + 4, col);
  const uint8_t* qs = s + 16;  // 32 bytes hold blocks 2 i (low nibbles) and 2 i + 1 (high)
  for (int i = 0; i < 4; ++i)
    for (int k = 0; k < 32; ++k) {
      col.q[64 * i + k] = qs[32 * i + k] & 15;
      col.q[64 * i + 32 + k] = qs[32 * i + k] >> 4;
    }
  col.f16[0] = s;
  col.f16[1] = s + 2;
}

void decode_q5_k(const uint8_t* s, Column& col) {
  k_scales(s + 4, col);
  const uint8_t *qh = s + 16, *qs = s + 48;  // bit b of qh[k]: bit 4 of block b's code k
  for (int i = 0; i < 4; ++i)
    for (int k = 0; k < 32; ++k) {
      col.q[64 * i + k] = (qs[32 * i + k] & 15) | (((qh[k] >> (2 * i)) & 1) << 4);
      col.q[64 * i + 32 + k] = (qs[32 * i + k] >> 4) | (((qh[k] >> (2 * i + 1)) & 1) << 4);
    }
  col.f16[0] = s;
  col.f16[1] = s + 2;
}

void decode_q6_k(const uint8_t* s, Column& col) {
  const uint8_t *ql = s, *qh = s + 128;
  for (int h = 0; h < 2; ++h)  // halves of 128: blocks 4 h + p, p = 2 n + l
    for (int p = 0; p < 4; ++p)
      for (int k = 0; k < 32; ++k) {
        const uint8_t low = (ql[64 * h + 32 * (p % 2) + k] >> (4 * (p / 2))) & 15;
        col.q[32 * (4 * h + p) + k] = low | (((qh[32 * h + k] >> (2 * p)) & 3) << 4);
      }
  std::memcpy(col.sc, s + 192, 16);
  col.f16[0] = s + 208;
}

void decode_q3_k(const uint8_t* s, Column& col) {
  const uint8_t *hmask = s, *qs = s + 32, *sc = s + 96;
  for (int h = 0; h < 2; ++h)
    for (int p = 0; p < 4; ++p) {
      const int b = 4 * h + p;
      for (int k = 0; k < 32; ++k)
        col.q[32 * b + k] = ((qs[32 * h + k] >> (2 * p)) & 3) | (((hmask[k] >> b) & 1) << 2);
    }
  for (int i = 0; i < 16; ++i) {
    const int low = i < 8 ? sc[i] & 15 : sc[i - 8] >> 4;
    const int high = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
    col.sc[i] = static_cast<int8_t>((low | (high << 4)) - 32);
  }
  col.f16[0] = s + 108;
}

void decode_q2_k(const uint8_t* s, Column& col) {
  const uint8_t* qs = s + 16;
  for (int h = 0; h < 2; ++h)
    for (int p = 0; p < 4; ++p)
      for (int k = 0; k < 32; ++k) col.q[32 * (4 * h + p) + k] = (qs[32 * h + k] >> (2 * p)) & 3;
  for (int i = 0; i < 16; ++i) {
    col.sc[i] = s[i] & 15;
    col.mn[i] = s[i] >> 4;
  }
  col.f16[0] = s + 80;
  col.f16[1] = s + 82;
}

// in the order of models/gguf_blocks.py's SPECS (bits: 2- and 3-bit codes ride in nibbles)
constexpr BlockType kQ5_0{22, 1, 5, false, false, false, decode_q5_0};
constexpr BlockType kQ5_1{24, 1, 5, false, false, true, decode_q5_1};
constexpr BlockType kQ4_K{144, 8, 4, true, false, true, decode_q4_k};
constexpr BlockType kQ5_K{176, 8, 5, true, false, true, decode_q5_k};
constexpr BlockType kQ6_K{210, 8, 6, true, true, false, decode_q6_k};
constexpr BlockType kQ3_K{110, 8, 4, true, true, false, decode_q3_k};
constexpr BlockType kQ2_K{84, 8, 4, true, true, true, decode_q2_k};

// column c's 32 codes `q` into a kernel block `p` (nibbles, then the bit planes of 5 / 6 bits)
template <int Bits>
inline void put_codes(const uint8_t* q, int64_t c, uint8_t* p) {
  for (int t = 0; t < 4; ++t) {
    uint8_t plane_lo = 0, plane_hi = 0;
    for (int j = 0; j < 4; ++j) {
      const uint8_t lo = q[4 * j + t], hi = q[16 + 4 * j + t];
      p[32 * j + 4 * c + t] = (lo & 15) | ((hi & 15) << 4);
      if constexpr (Bits == 5) plane_lo |= (((lo >> 4) & 1) << j) | (((hi >> 4) & 1) << (4 + j));
      if constexpr (Bits == 6) {
        plane_lo |= ((lo >> 4) & 3) << (2 * j);
        plane_hi |= ((hi >> 4) & 3) << (2 * j);
      }
    }
    if constexpr (Bits >= 5) p[128 + 4 * c + t] = plane_lo;
    if constexpr (Bits == 6) p[160 + 4 * c + t] = plane_hi;
  }
}

template <int Bits>
void pack_block_group(const BlockType& s, const uint8_t* raw, int64_t pitch, int64_t rows,
                      int64_t nsb, int64_t g, uint8_t* out) {
  const int64_t columns = std::min<int64_t>(8, rows - 8 * g);
  const int64_t super = s.super_bytes(), block = s.block_bytes(), head = s.header_bytes();
  const int64_t at_sc = 128 + s.plane_bytes(), n_sc = s.sc_bytes();
  uint8_t* dst = out + g * nsb * super;
  if (columns < 8) std::memset(dst, 0, nsb * super);
  Column col;
  for (int64_t c = 0; c < columns; ++c) {
    const uint8_t* src = raw + (8 * g + c) * pitch;
    for (int64_t sb = 0; sb < nsb; ++sb, src += s.src_bytes) {
      s.decode(src, col);
      uint8_t* base = dst + sb * super;
      if (s.kscales) {  // header: D of the 8 columns, then Dmin
        std::memcpy(base + 2 * c, col.f16[0], 2);
        if (s.mins) std::memcpy(base + 16 + 2 * c, col.f16[1], 2);
      }
      for (int64_t b = 0; b < s.blocks; ++b) {
        uint8_t* p = base + head + b * block;
        put_codes<Bits>(col.q + kBlock * b, c, p);
        uint8_t* t = p + at_sc;
        if (!s.kscales) {  // d, then m, as 8 float16
          std::memcpy(t + 2 * c, col.f16[0], 2);
          if (s.mins) std::memcpy(t + 16 + 2 * c, col.f16[1], 2);
        } else if (s.halves) {  // the first halves' 8 scales, the second halves', then mins
          t[c] = col.sc[2 * b];
          t[8 + c] = col.sc[2 * b + 1];
          if (s.mins) {
            t[16 + c] = col.mn[2 * b];
            t[24 + c] = col.mn[2 * b + 1];
          }
        } else {
          t[c] = col.sc[b];
          if (s.mins) t[n_sc + c] = col.mn[b];
        }
      }
    }
  }
}

// groups of 8 rows per task: about 64 KiB of input each
inline int64_t grain(int64_t row_bytes) {
  return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, 8 * row_bytes));
}

at::Tensor check_raw(const at::Tensor& raw, const std::string& type, int64_t rows, int64_t cols,
                     int64_t per, int64_t bytes) {
  TORCH_CHECK(rows > 0 && cols > 0 && cols % per == 0, "gguf_pack: a ", type, " row of ", cols,
              " weights is not whole blocks of ", per);
  const int64_t row_bytes = cols / per * bytes;
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.size(0) == rows &&
                  raw.size(1) == row_bytes && raw.stride(1) == 1 && raw.stride(0) >= row_bytes &&
                  raw.device().is_cpu(),
              "gguf_pack: raw must be CPU uint8 (", rows, ", ", row_bytes, ") with contiguous ",
              "rows for a ", type, " tensor of (", rows, ", ", cols, "), got ", raw.sizes(),
              " strides ", raw.strides());
  return raw;
}

at::Tensor pack_simple(const SimpleType& s, const at::Tensor& raw, const std::string& type,
                       int64_t rows, int64_t cols) {
  check_raw(raw, type, rows, cols, kBlock, s.src_bytes);
  const int64_t nb = cols / kBlock, G = (rows + 7) / 8, pitch = raw.stride(0);
  at::Tensor out = at::empty({G, nb, s.out_bytes}, raw.options().memory_format(at::MemoryFormat::Contiguous));
  const uint8_t* rp = raw.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, G, grain(raw.size(1)), [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) pack_simple_group(s, rp, pitch, rows, nb, g, op);
  });
  return out;
}

at::Tensor pack_blocks(const BlockType& s, const at::Tensor& raw, const std::string& type,
                       int64_t rows, int64_t cols) {
  check_raw(raw, type, rows, cols, kBlock * s.blocks, s.src_bytes);
  const int64_t nsb = cols / (kBlock * s.blocks), G = (rows + 7) / 8, pitch = raw.stride(0);
  at::Tensor out = at::empty({G, nsb, s.super_bytes()}, raw.options().memory_format(at::MemoryFormat::Contiguous));
  const uint8_t* rp = raw.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, G, grain(raw.size(1)), [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      if (s.bits == 4) pack_block_group<4>(s, rp, pitch, rows, nsb, g, op);
      else if (s.bits == 5) pack_block_group<5>(s, rp, pitch, rows, nsb, g, op);
      else pack_block_group<6>(s, rp, pitch, rows, nsb, g, op);
    }
  });
  return out;
}

at::Tensor gguf_pack(const at::Tensor& raw, c10::string_view gguf_type, int64_t rows, int64_t cols) {
  const std::string type(gguf_type);
  if (type == "Q4_0") return pack_simple(kQ4_0, raw, type, rows, cols);
  if (type == "Q4_1") return pack_simple(kQ4_1, raw, type, rows, cols);
  if (type == "Q8_0") return pack_simple(kQ8_0, raw, type, rows, cols);
  if (type == "Q5_0") return pack_blocks(kQ5_0, raw, type, rows, cols);
  if (type == "Q5_1") return pack_blocks(kQ5_1, raw, type, rows, cols);
  if (type == "Q4_K") return pack_blocks(kQ4_K, raw, type, rows, cols);
  if (type == "Q5_K") return pack_blocks(kQ5_K, raw, type, rows, cols);
  if (type == "Q6_K") return pack_blocks(kQ6_K, raw, type, rows, cols);
  if (type == "Q3_K") return pack_blocks(kQ3_K, raw, type, rows, cols);
  if (type == "Q2_K") return pack_blocks(kQ2_K, raw, type, rows, cols);
  TORCH_CHECK(false, "gguf_pack: no packed layout for GGUF type '", type, "'");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvwise, m) {
  m.def("gguf_pack(Tensor raw, str gguf_type, int rows, int cols) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvwise, CPU, m) { m.impl("gguf_pack", &gguf_pack); }
