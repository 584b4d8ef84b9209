// A decode step's threads held in one parallel region for the whole step: the calling thread runs the step
// and hands each kernel's parallel part to the others as a job; between jobs they read ahead into their caches
// the weights the next projection will read.
//
// At a few rows a decode step is ~100 memory-bound projections with serial work between them (norms, the
// convolution, gates, the cache's bookkeeping). One parallel region per kernel left the other threads
// spinning in the OpenMP runtime through that work, and the memory idle. Which weights follow which is
// learned from the calls (a decode step's projections come in the same order every step); a member warms
// the start of its own share of them, where its part of the next job begins. Which thread computes a unit
// never changes what it computes: results are bit for bit those without a team
// (docs/performance.md#measurements-behind-choices-in-the-code).
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <initializer_list>
#include <unordered_map>
#include <vector>

namespace nanovllm {

// Memory a job reads: one plane of a projection's weights.
struct Stream {
  const char* data = nullptr;
  int64_t bytes = 0;
};

// Each projection's planes (by its first plane's address) that came after it: kept by the team's owner from
// step to step, and only for the weights it owns.
using StreamOrder = std::unordered_map<const void*, std::vector<Stream>>;

class DecodeTeam {
 public:
  // The team the calling thread leads, or nullptr.
  static DecodeTeam*& current() {
    static thread_local DecodeTeam* team = nullptr;
    return team;
  }

  // body() on the calling thread, leading a team of at::get_num_threads() threads; alone without a second
  // thread or inside a parallel region already. The ATen ops body() calls run on the calling thread alone
  // (inside a parallel region): right for a decode step's small ones, not for a GEMM. A member may arrive
  // after the first job is posted: it sees that job's generation and runs its share then.
  template <typename Body>
  static void lead(StreamOrder& order, const Body& body) {
    const int64_t threads = at::get_num_threads();
    if (threads <= 1 || at::in_parallel_region() || current() != nullptr) return body();
    DecodeTeam team(order, threads);
    at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
      if (first != 0) return team.serve();
      team.members_ = (threads + (last - first) - 1) / (last - first);  // at::parallel_for's chunks
      if (team.members_ > 1) led().fetch_add(1, std::memory_order_relaxed);
      struct Dismiss {  // also when body() throws: the members leave before the region ends
        DecodeTeam& team;
        ~Dismiss() {
          current() = nullptr;
          team.dismissed_ = true;
          team.generation_.fetch_add(1, std::memory_order_release);
          team.generation_.notify_all();
        }
      } dismiss{team};
      current() = &team;
      body();
    });
  }

  // How many teams of more than one thread have been led in this process.
  static std::atomic<int64_t>& led() {
    static std::atomic<int64_t> count{0};
    return count;
  }

  int64_t members() const { return members_; }

  // fn(begin, end) over [0, n) in at::parallel_for's chunks (at least `grain` each, one a member).
  template <typename F>
  void parallel_for(int64_t n, int64_t grain, const F& fn) {
    const int64_t chunks = std::min(members_, (n + grain - 1) / grain);
    if (chunks <= 1) return fn(0, n);
    const int64_t size = (n + chunks - 1) / chunks;
    run_job([&](int64_t member) {
      if (member * size < n) fn(member * size, std::min(n, (member + 1) * size));
    });
  }

  // fn(member) on every member, the leader's (0) on the calling thread; returns when all are done, with
  // the first exception a member's share threw.
  template <typename F>
  void run_job(const F& fn) {
    if (in_job_) {  // the leader's share parallelising again: all of it here, as at::parallel_for nests
      for (int64_t member = 0; member < members_; ++member) fn(member);
      return;
    }
    job_ = &fn;
    invoke_ = [](const void* job, int64_t member) { (*static_cast<const F*>(job))(member); };
    error_ = nullptr;
    failed_.store(false, std::memory_order_relaxed);
    pending_.store(static_cast<uint32_t>(members_ - 1), std::memory_order_relaxed);
    warm_ = target_;  // each member copies it after its share, before it counts itself done
    generation_.fetch_add(1, std::memory_order_release);
    generation_.notify_all();
    std::exception_ptr own;
    in_job_ = true;
    try {
      fn(0);
    } catch (...) {
      own = std::current_exception();
    }
    in_job_ = false;
    for (uint32_t left; (left = pending_.load(std::memory_order_acquire)) != 0;) wait_while(pending_, left);
    if (own) std::rethrow_exception(own);
    if (failed_.load(std::memory_order_acquire)) std::rethrow_exception(error_);
  }

  // The next job reads these planes (a projection's, its weight first): learned to follow the last ones read,
  // and what the members warm after it is what was learned to follow them.
  void reads(std::initializer_list<Stream> planes) {
    if (planes.size() == 0 || planes.size() > kMaxPlanes) return;
    if (last_ != nullptr) (*order_)[last_].assign(planes.begin(), planes.end());
    last_ = planes.begin()->data;
    target_ = Target();
    const auto next = order_->find(last_);
    if (next == order_->end()) return;
    for (const Stream& plane : next->second) target_.planes[target_.count++] = plane;
  }

 private:
  static constexpr size_t kMaxPlanes = 4;
  static constexpr int64_t kWarmBytes = 512 * 1024;  // of a projection's weight, a member's share's first
  static constexpr int64_t kWarmPass = 4096;          // bytes warmed between looks for the next job
  static constexpr int64_t kSpins = 1 << 15;          // pauses before a waiting thread sleeps (~1 ms)

  struct Target {
    Stream planes[kMaxPlanes];
    size_t count = 0;
  };

  DecodeTeam(StreamOrder& order, int64_t threads) : order_(&order) {
    // More threads than CPUs: a spinning thread would hold the CPU another needs, so wait asleep at once.
    cpu_set_t cpus;
    spins_ = sched_getaffinity(0, sizeof cpus, &cpus) == 0 && CPU_COUNT(&cpus) >= threads ? kSpins : 0;
  }

  // Until `value` is no longer `seen`: spinning a while, then asleep.
  void wait_while(const std::atomic<uint32_t>& value, uint32_t seen) const {
    for (int64_t i = 0; i < spins_; ++i) {
      if (value.load(std::memory_order_acquire) != seen) return;
      _mm_pause();
    }
    value.wait(seen, std::memory_order_acquire);
  }

  // A member's loop: its share of each job, then the start of its share of the planes that follow, a pass at
  // a time, then wait for the next job.
  void serve() {
    const int64_t member = arrivals_.fetch_add(1, std::memory_order_acq_rel) + 1;
    uint32_t seen = 0;
    Target warming;
    size_t plane = 0;
    int64_t warmed = 0, idle = 0;
    uint64_t sink = 0;
    while (true) {
      const uint32_t generation = generation_.load(std::memory_order_acquire);
      if (generation == seen) {
        if (spins_ > 0 && plane < warming.count) {  // (not on a CPU another member needs)
          const Stream& s = warming.planes[plane];
          // the same fraction of each plane as kWarmBytes is of the weight's share
          const int64_t share = s.bytes / members_, start = s.bytes * member / members_;
          const int64_t length = std::min(share, share * kWarmBytes / std::max<int64_t>(1, warming.planes[0].bytes / members_));
          const int64_t end = std::min(length, warmed + kWarmPass);
          for (int64_t at = warmed; at < end; at += 64) sink += *reinterpret_cast<const volatile char*>(s.data + start + at);
          warmed = end;
          if (warmed >= length) ++plane, warmed = 0;
        } else if (++idle < spins_) {
          _mm_pause();
        } else {
          generation_.wait(seen, std::memory_order_acquire);
        }
        continue;
      }
      seen = generation;
      if (dismissed_) break;
      try {
        (*invoke_)(job_, member);
      } catch (...) {
        if (!failed_.exchange(true, std::memory_order_acq_rel)) error_ = std::current_exception();
      }
      if (warm_.count != warming.count || (warm_.count > 0 && warm_.planes[0].data != warming.planes[0].data))
        warming = warm_, plane = 0, warmed = 0;
      idle = 0;
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) pending_.notify_one();
    }
    sink_.fetch_add(sink, std::memory_order_relaxed);
  }

  StreamOrder* order_;
  const void* last_ = nullptr;  // the last planes read (the leader's)
  Target target_;               // what follows them (the leader's)
  Target warm_;                 // what follows the current job (the leader writes it before posting)
  int64_t members_ = 1, spins_ = 0;
  const void* job_ = nullptr;
  void (*invoke_)(const void*, int64_t) = nullptr;
  std::exception_ptr error_;
  bool dismissed_ = false;
  bool in_job_ = false;  // the leader is running its share of a job
  alignas(64) std::atomic<uint32_t> generation_{0};
  alignas(64) std::atomic<uint32_t> pending_{0};
  alignas(64) std::atomic<int64_t> arrivals_{0};
  std::atomic<bool> failed_{false};
  std::atomic<uint64_t> sink_{0};  // the warming loads' sum, so that they are not optimised away
};

// Threads a kernel's parallel part runs on: the members of the team the calling thread leads, if any.
inline int64_t num_threads() {
  if (const DecodeTeam* team = DecodeTeam::current()) return team->members();
  return at::get_num_threads();
}

// at::parallel_for, on the team the calling thread leads, if any.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& fn) {
  if (DecodeTeam* team = DecodeTeam::current())
    return team->parallel_for(end - begin, grain, [&](int64_t b, int64_t e) { fn(begin + b, begin + e); });
  at::parallel_for(begin, end, grain, fn);
}

}  // namespace nanovllm
