// Sharing a kernel's work between threads by pieces taken from a shared counter.
//
// at::parallel_for splits [begin, end) into one fixed range a thread: when the OS gives one of
// the two cores to another thread for a moment (the HTTP server's event loop, a tokenizer, the
// tier writer, a client on the same machine), the whole op waits for the range of the thread
// it took, and the other core idles at the barrier. Here the range is cut into pieces (about
// kPiecesPerThread a thread, none smaller than `grain`) that the threads take one at a time, so
// a preempted thread holds back only the piece it is on. Which thread computes a piece, and
// where the pieces are cut, never changes what an index computes: every caller's body gives
// each index the same bits whatever range it is handed.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace kvwise {

constexpr int64_t kPiecesPerThread = 8;

template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& body) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t threads = at::get_num_threads();
  const int64_t piece = std::max<int64_t>(
      std::max<int64_t>(grain, 1), (n + kPiecesPerThread * threads - 1) / (kPiecesPerThread * threads));
  const int64_t pieces = (n + piece - 1) / piece;
  if (pieces <= 1 || threads <= 1 || at::in_parallel_region()) {
    body(begin, end);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, pieces), 1, [&](int64_t, int64_t) {
    for (int64_t p = next.fetch_add(1, std::memory_order_relaxed); p < pieces;
         p = next.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t lo = begin + p * piece;
      body(lo, std::min(end, lo + piece));
    }
  });
}

}  // namespace kvwise
