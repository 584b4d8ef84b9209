// A memory-bound pass over a weight's rows on all the threads, balanced without breaking each thread's stream.
//
// With at::parallel_for's static ranges one thread of two finished its half of a one-row projection well
// before the other, nearly every call (a tenth of a Qwen3.5-0.8B int8 decode step spent waiting); ranges
// handed out on demand in small blocks balanced the threads but read slower, each thread jumping between
// blocks the hardware prefetcher had not seen coming. Here each thread owns one contiguous range and reads it
// front to back (one ascending stream); a thread that finishes its own takes the rest of another's from the
// far end, a share at a time, so the threads finish together and only the tail changes hands
// (docs/performance.md#measurements-behind-choices-in-the-code). Which thread computes a unit never changes
// what it computes.
#pragma once

#include <ATen/Parallel.h>

#include "decode_team.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace {

// The least weight bytes a claim reads (a claim is also `grain` units at least): the tail's granularity, a
// few microseconds of one thread's reading.
constexpr int64_t kClaimBytes = 64 * 1024;

// Units [front, back) of one thread's range that no thread has claimed yet, in one word so that the owner
// (from the front) and the others (from the back) each claim with one compare-and-swap; a cache line each,
// so that the owners' claims do not contend.
class alignas(64) UnclaimedRange {
 public:
  void reset(int64_t front, int64_t back) { bits_.store(pack(front, back), std::memory_order_relaxed); }

  // The next `share` of the unclaimed units (at least `grain` of them) from the front or the back; false when
  // none are left.
  bool claim(bool from_front, int64_t grain, int64_t share, int64_t& begin, int64_t& end) {
    uint64_t bits = bits_.load(std::memory_order_relaxed);
    while (true) {
      const int64_t front = static_cast<int64_t>(bits >> 32), back = static_cast<int64_t>(bits & 0xFFFFFFFFu);
      if (front >= back) return false;
      const int64_t take = std::min(back - front, std::max(grain, (back - front) / share));
      begin = from_front ? front : back - take;
      end = begin + take;
      const uint64_t next = from_front ? pack(end, back) : pack(front, begin);
      if (bits_.compare_exchange_weak(bits, next, std::memory_order_acq_rel, std::memory_order_relaxed)) return true;
    }
  }

 private:
  static uint64_t pack(int64_t front, int64_t back) {
    return (static_cast<uint64_t>(front) << 32) | static_cast<uint64_t>(back);
  }
  std::atomic<uint64_t> bits_{0};
};

// fn(begin, end) over units [0, n) on up to at::get_num_threads() threads, each taking `grain` units at
// least (fewer threads when n is small, the calling thread alone when it is inside a parallel region, as
// at::parallel_for does). Claims are a quarter of a range's unclaimed units per thread, `grain` at least:
// few compare-and-swaps a call, and a tail of about `grain` units.
template <typename F>
void parallel_rows(int64_t n, int64_t grain, const F& fn) {
  TORCH_CHECK(n < (int64_t{1} << 32), "parallel_rows: ", n, " units do not fit a claim's 32 bits");
  nanovllm::DecodeTeam* team = nanovllm::DecodeTeam::current();
  const int64_t threads = std::min<int64_t>(nanovllm::num_threads(), (n + grain - 1) / grain);
  if (threads <= 1 || (team == nullptr && at::in_parallel_region())) {
    if (n > 0) fn(0, n);
    return;
  }
  const std::unique_ptr<UnclaimedRange[]> ranges(new UnclaimedRange[threads]);
  for (int64_t t = 0; t < threads; ++t) ranges[t].reset(n * t / threads, n * (t + 1) / threads);
  const int64_t share = 2 * threads;
  nanovllm::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    int64_t begin = 0, end = 0;
    for (int64_t t = first; t < last; ++t)
      while (ranges[t].claim(/*from_front=*/true, grain, share, begin, end)) fn(begin, end);
    for (int64_t k = 1; k < threads; ++k) {
      UnclaimedRange& other = ranges[(first + k) % threads];
      while (other.claim(/*from_front=*/false, grain, share, begin, end)) fn(begin, end);
    }
  });
}

}  // namespace
