// Buffers for packed weights, on transparent huge pages where the OS offers them.
//
// A decode step streams every weight once from DRAM. On 4 KiB pages a 1B model's ~620 MB cross
// 150,000 page boundaries a token, each a TLB miss and a stop for the hardware prefetchers; on
// 2 MiB pages, 300. Linux gives an anonymous range huge pages at first touch when it is advised
// (MADV_HUGEPAGE) and the system's THP setting is "madvise" or "always": so the buffer is
// allocated 2 MiB larger than asked, its 2 MiB-aligned interior advised before anything writes
// it, and the aligned part returned (a view; the unused lead and tail are never touched, so
// they take no resident memory). Measured on the 1B Q4_K_M decode: ~3-4% faster. The advice
// is only advice: where it is refused, or on another OS, the buffer is an ordinary one.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

constexpr int64_t kHugePage = int64_t{2} << 20;

inline at::Tensor empty_weights(at::IntArrayRef sizes, const at::TensorOptions& options) {
  int64_t bytes = options.dtype().itemsize();
  for (const int64_t s : sizes) bytes *= s;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (bytes >= 2 * kHugePage) {
    at::Tensor raw = at::empty({bytes + kHugePage}, options.dtype(at::kByte));
    const auto base = reinterpret_cast<uintptr_t>(raw.data_ptr());
    const uintptr_t start = (base + kHugePage - 1) & ~static_cast<uintptr_t>(kHugePage - 1);
    const uintptr_t end = (start + bytes) & ~static_cast<uintptr_t>(kHugePage - 1);
    madvise(reinterpret_cast<void*>(start), end - start, MADV_HUGEPAGE);  // advice: may fail
    return raw.narrow(0, static_cast<int64_t>(start - base), bytes)
        .view(options.dtype().toScalarType())
        .view(sizes);
  }
#endif
  return at::empty(sizes, options);
}
