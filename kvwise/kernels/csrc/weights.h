// Buffers for packed weights, aligned for transparent huge pages.
//
// A decode step streams every weight once from DRAM. On 4 KiB pages a 1B model's ~620 MB cross
// 150,000 page boundaries a token, each a TLB miss and a stop for the hardware prefetchers; on
// 2 MiB pages, 300. A weight of 4 MiB or more is therefore packed into a buffer whose data
// starts on a 2 MiB boundary (allocated 2 MiB larger, the aligned part returned as a view; the
// unused lead and tail are never touched, so they take no resident memory): where the host's
// THP setting is "always", Linux backs it with huge pages at first touch, whole.
//
// Not advised where the setting is "madvise", as on the machine these were measured on: huge
// pages made the 1B Q4_K_M decode ~10% faster there, but every way of getting them cost the
// load more than issue 27's budget allows (MADV_HUGEPAGE before the pack: +0.6 s of fault-time
// compaction; MADV_COLLAPSE after each pack or after the load: +1.5 s; collapsing from a
// thread: a core taken from the first token for ~0.5 s). See docs/BENCHMARKS.md, issue 27.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

constexpr int64_t kHugePage = int64_t{2} << 20;

inline at::Tensor empty_weights(at::IntArrayRef sizes, const at::TensorOptions& options) {
  int64_t bytes = options.dtype().itemsize();
  for (const int64_t s : sizes) bytes *= s;
  if (bytes < 2 * kHugePage) return at::empty(sizes, options);
  at::Tensor raw = at::empty({bytes + kHugePage}, options.dtype(at::kByte));
  const auto base = reinterpret_cast<uintptr_t>(raw.data_ptr());
  const uintptr_t start = (base + kHugePage - 1) & ~static_cast<uintptr_t>(kHugePage - 1);
  return raw.narrow(0, static_cast<int64_t>(start - base), bytes)
      .view(options.dtype().toScalarType())
      .view(sizes);
}

