// Work items 0 .. n − 1 on T threads (at::parallel_for): each thread runs its own contiguous range in order, then
// takes what is left of the others' ranges, so a thread that the serving path (event loop, Ray, the gateway)
// preempts on a CPU replica holds nobody up at the barrier. Which thread runs an item never changes its value.
// ``enter`` / ``leave`` run on each worker around its items (AMX: the per-thread tile configuration).
#pragma once

#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>
#include <vector>

namespace dmtd_steal {

template <class Run, class Enter, class Leave>
inline void run(int64_t n, int64_t T, Run&& item, Enter&& enter, Leave&& leave) {
  struct alignas(64) Range { std::atomic<int64_t> next; int64_t end; };
  std::vector<Range> ranges(T);
  for (int64_t t = 0; t < T; ++t) {
    ranges[t].next.store(n * t / T, std::memory_order_relaxed);
    ranges[t].end = n * (t + 1) / T;
  }
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    enter();
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t v = 0; v < T; ++v) {  // own range first, then the others'
        Range& r = ranges[(t + v) % T];
        for (int64_t i; (i = r.next.fetch_add(1, std::memory_order_relaxed)) < r.end;) item(i);
      }
    leave();
  });
}

template <class Run>
inline void run(int64_t n, int64_t T, Run&& item) {
  run(n, T, item, [] {}, [] {});
}

}  // namespace dmtd_steal
