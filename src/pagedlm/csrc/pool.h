// The kernels' parallel loops: chunks claimed one at a time, inside one OpenMP region per kernel call.
//
// An OpenMP region or worksharing loop ends at a barrier that each of its threads must reach. On a small machine
// shared with the server's other threads (HTTP, detokenization, the client of a benchmark), one of the two
// compute threads is often descheduled for a few milliseconds, and every barrier it belongs to waits for it:
// measured on 2 Zen 4 cores, a busy loop taking 1 ms in every 5 cut a batch-16 decode from 575 to 371 tok/s, and
// the fused decoder stack passed ~200 barriers per step. Here a call that runs many loops (the fused stack) opens
// one region, `with_team`: its first thread runs the call and publishes each loop as a job, the others serve the
// jobs until the call is done. A job's chunks are claimed one at a time (each thread first from the front of its
// own contiguous share, then from the back of the others'), and the job is over once every chunk has run: a
// descheduled thread holds up at most the one chunk it claimed, and one that has not arrived holds up nothing. The
// only barrier is the region's end, once per call.
//
// The region is OpenMP's, so the threads are torch's (one libgomp per process): no second pool competes with
// torch's threads for the cores.
#pragma once

#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

thread_local bool in_chunk = false;  // this thread is running a chunk: a loop it starts runs serially

class Team {
 public:
  static constexpr int MAX_THREADS = 64;
  using Body = void (*)(void* ctx, int64_t begin, int64_t end);

  explicit Team(int threads) : threads_(std::min(threads, MAX_THREADS)) {}

  // On the team's first thread: runs fn(ctx, begin, end) over [0, n) in `chunks` chunks of `grain` items on up to
  // `threads` threads; returns when every chunk has run.
  void run(int64_t n, int64_t grain, int64_t chunks, int threads, Body fn, void* ctx) {
    threads = std::min(threads, threads_);
    fn_ = fn, ctx_ = ctx, n_ = n, grain_ = grain;
    remaining_.store(chunks, std::memory_order_relaxed);
    // The previous job's cursors are all spent (each of its chunks ran), so no thread can claim from one while
    // they are rewritten.
    for (int u = 0; u < threads_; ++u) {
      const int64_t lo = u < threads ? chunks * u / threads : 0, hi = u < threads ? chunks * (u + 1) / threads : 0;
      cursors_[u].v.store(uint64_t(lo) << 32 | uint64_t(hi), std::memory_order_release);
    }
    generation_.fetch_add(1, std::memory_order_release);
    run_chunks(0);
    for (int spins = 0; remaining_.load(std::memory_order_acquire) > 0; ++spins) {
      if (spins < (1 << 14)) cpu_relax();
      else sched_yield();  // the thread of the last chunk was descheduled: offer it this core
    }
  }

  // On the team's other threads: runs the jobs' chunks until finish().
  void serve(int self) {
    uint64_t seen = 0;
    for (;;) {
      const uint64_t g = generation_.load(std::memory_order_acquire);
      if (g != seen) {
        seen = g;
        run_chunks(self);
      } else if (done_.load(std::memory_order_acquire)) {
        return;
      } else {
        cpu_relax();
      }
    }
  }

  void finish() { done_.store(true, std::memory_order_release); }

 private:
  struct alignas(64) Cursor {
    std::atomic<uint64_t> v{0};  // next chunk (32 bits) | end of the share (32)
  };

  // Takes a chunk from cursor u: from the front (its owner) or the back (a thief).
  bool claim(int u, bool front, int64_t* chunk) {
    uint64_t v = cursors_[u].v.load(std::memory_order_acquire);
    for (;;) {
      const int64_t lo = int64_t(v >> 32), hi = int64_t(v & 0xffffffffu);
      if (lo >= hi) return false;
      const uint64_t next = front ? v + (uint64_t(1) << 32) : v - 1;
      if (cursors_[u].v.compare_exchange_weak(v, next, std::memory_order_acq_rel, std::memory_order_acquire)) {
        *chunk = front ? lo : hi - 1;
        return true;
      }
    }
  }

  // Runs chunks until none is left to claim: this thread's share, then the others'. The job's fields are read
  // after a claim succeeds, when the job cannot be over.
  void run_chunks(int self) {
    for (int k = 0; k < threads_; ++k) {
      const int u = (self + k) % threads_;
      int64_t c;
      while (claim(u, k == 0, &c)) {
        const int64_t b = c * grain_;
        in_chunk = true;
        fn_(ctx_, b, std::min(n_, b + grain_));
        in_chunk = false;
        remaining_.fetch_sub(1, std::memory_order_release);
      }
    }
  }

  const int threads_;
  Cursor cursors_[MAX_THREADS];
  Body fn_ = nullptr;
  void* ctx_ = nullptr;
  int64_t n_ = 0, grain_ = 1;
  alignas(64) std::atomic<int64_t> remaining_{0};
  alignas(64) std::atomic<uint64_t> generation_{0};
  std::atomic<bool> done_{false};
};

thread_local Team* current_team = nullptr;  // on the first thread of the team whose call is running

// The threads a kernel uses when its caller passes nthreads < 1.
inline int default_threads() { return omp_get_max_threads(); }

// Runs f() on this thread with a team of nthreads threads serving its parallel_for loops (one OpenMP region).
// Inside another team or region, f() runs as it is (its loops join that team, or run serially).
template <class F>
void with_team(int nthreads, F&& f) {
  if (current_team != nullptr || nthreads <= 1 || omp_in_parallel()) {
    f();
    return;
  }
  Team team(nthreads);
#pragma omp parallel num_threads(nthreads)
  {
    if (omp_get_thread_num() == 0) {
      current_team = &team;
      f();
      current_team = nullptr;
      team.finish();
    } else {
      team.serve(omp_get_thread_num());
    }
  }
}

// body(begin, end) over [0, n), in chunks of at least `grain` items, on up to nthreads threads: the running
// call's team, or a team for this loop alone. Serial inside a loop body or another OpenMP region.
template <class F>
void parallel_for(int64_t n, int nthreads, int64_t grain, F&& body) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t chunks = (n + grain - 1) / grain;
  const int threads = int(std::min<int64_t>(nthreads, chunks));
  if (threads <= 1 || in_chunk || (current_team == nullptr && omp_in_parallel())) {
    body(int64_t(0), n);
    return;
  }
  using Fn = std::remove_reference_t<F>;
  const Team::Body call = [](void* ctx, int64_t b, int64_t e) { (*static_cast<Fn*>(ctx))(b, e); };
  void* const ctx = const_cast<void*>(static_cast<const void*>(&body));
  auto run = [&] { current_team->run(n, grain, chunks, threads, call, ctx); };
  if (current_team != nullptr) run();
  else with_team(threads, run);
}

}  // namespace
