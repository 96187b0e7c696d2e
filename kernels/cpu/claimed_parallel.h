// Work items [0, n) spread over torch's intra-op threads by claiming, not by a split fixed
// up front: each thread starts on its own contiguous share (one sequential stream, as a
// static split gives), takes it `grain` items at a time, and once its share is done takes
// from the others' shares what they have not started.
//
// Why: on a CPU shared with other processes (a serving box runs the front ends, the
// scheduler and the other worker beside a step's threads), one thread of the team is often
// preempted mid-product. With `at::parallel_for`'s fixed split the other thread then
// finishes its half and waits at the join for the rest of the preempted thread's half;
// here it does that half itself, and the join waits at most for the `grain` items the
// preempted thread was in. The items a thread runs are the same items, in a different
// thread: results are identical to the static split.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace tandem_cpu {

struct alignas(64) ClaimCursor {
  std::atomic<int64_t> next{0};
  int64_t end = 0;
};

// Calls fn(begin, end) over disjoint ranges covering [0, n), each at most `grain` long.
template <class F>
void claimed_parallel_for(int64_t n, int64_t grain, const F& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  const int64_t pieces = (n + grain - 1) / grain;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), pieces);
  if (threads <= 1 || at::in_parallel_region()) {
    fn(0, n);
    return;
  }
  std::unique_ptr<ClaimCursor[]> shares(new ClaimCursor[threads]);
  for (int64_t t = 0; t < threads; ++t) {
    // Shares in whole grains, so that claims never straddle two shares.
    shares[t].next.store(pieces * t / threads * grain, std::memory_order_relaxed);
    shares[t].end = std::min(n, pieces * (t + 1) / threads * grain);
  }
  // One index per thread: at::parallel_for gives each of `threads` threads one.
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t self = first; self < last; ++self) {
      for (int64_t visit = 0; visit < threads; ++visit) {
        ClaimCursor& share = shares[(self + visit) % threads];
        for (;;) {
          const int64_t begin = share.next.fetch_add(grain, std::memory_order_relaxed);
          if (begin >= share.end) break;
          fn(begin, std::min(begin + grain, share.end));
        }
      }
    }
  });
}

}  // namespace tandem_cpu
