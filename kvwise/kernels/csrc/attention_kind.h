// A layer's kind of attention, as both paged attention kernels (paged_attention.cpp for the
// float and int8 pools, kv_int4.cpp for the int4 pool) take it, written once:
//
// - `window` = W > 0: a row over `len` keys sees its last W of them, keys
//   [window_first_key(len, W), len); the blocks (or spans) before them are never read, so they
//   may be gone from the table. 0: every key.
// - `softcap` = c > 0: every score (after the scale) becomes c * tanh(score / c) before the
//   softmax (Gemma 2), by `cap_scores` (vec.h), a function of the score alone. 0: none, and
//   the bits are those of a kernel without it.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

// The first key a row over `len` keys attends to under `window` (0: none).
inline int64_t window_first_key(int64_t len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, len - window) : int64_t{0};
}

// - `sinks` (H,) float32: query head h's learned logit joins its softmax's denominator with no
//   value (gpt-oss's attention sinks). None: none, and the bits are those without it.

// The sinks an op was given (checked: contiguous float32, one a query head), or null.
inline const float* sinks_of(const char* op, const c10::optional<at::Tensor>& sinks, int64_t H) {
  if (!sinks) return nullptr;
  TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->dim() == 1 &&
                  sinks->numel() == H,
              op, ": sinks must be a contiguous float32 (H,) tensor, one a query head");
  return sinks->data_ptr<float>();
}

// The kind's arguments as an op takes them: both >= 0 (0: none).
inline void check_attention_kind(const char* op, int64_t window, double softcap) {
  TORCH_CHECK(window >= 0, op, ": window must be >= 0 (0: none)");
  TORCH_CHECK(softcap >= 0, op, ": softcap must be >= 0 (0: none)");
}
