// A parallel loop for the engine's CPU kernels in which no thread waits for one that is not
// running.
//
// at::parallel_for (OpenMP) gives each thread one share of a range and ends at a barrier. On
// 2 vCPUs shared with the serving processes (the worker's event loop, the gateway, Envoy), a
// thread the OS preempts holds the whole step up until it runs again, while its partner spins
// at the barrier: two torch threads served only 8-12% more tokens than one. Here the calling
// thread starts on the items at once, helper threads claim items one at a time as they wake,
// and the caller waits only for items already claimed (yielding its core to them meanwhile).
// A helper that is not running costs nothing; a spare core is used when there is one.
//
// Which thread computes an item never changes its bits: each item's work is its own.
// Helpers: at::get_num_threads() - 1 (the engine's thread setting), started on first use.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace tandem_par {

class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool();  // never destroyed: its helpers wait for work until exit
    return *pool;
  }

  // f(i) for i in [0, n), on this thread and any helper that joins.
  template <typename F>
  void run(int64_t n, const F& f) {
    const int64_t helpers = std::min<int64_t>(at::get_num_threads() - 1, n - 1);
    if (helpers <= 0 || inside_) {
      for (int64_t i = 0; i < n; ++i) f(i);
      return;
    }
    std::lock_guard<std::mutex> one_job(job_);
    start_helpers(helpers);
    call_.store(&call<F>, std::memory_order_relaxed);
    context_.store(&f, std::memory_order_relaxed);
    size_.store(n, std::memory_order_relaxed);
    active_.store(helpers, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    const uint64_t generation = (state_.load(std::memory_order_relaxed) >> 32) + 1;
    state_.store(generation << 32, std::memory_order_release);  // posted: item 0 is next
    if (sleeping_.load(std::memory_order_acquire)) state_.notify_all();
    const int64_t mine = work(generation, &call<F>, &f, n);
    done_.fetch_add(mine, std::memory_order_acq_rel);
    while (done_.load(std::memory_order_acquire) < n) std::this_thread::yield();
  }

 private:
  static constexpr int kSpins = 4096;  // pauses a helper waits for the next job before sleeping

  template <typename F>
  static void call(const void* f, int64_t i) {
    (*static_cast<const F*>(f))(i);
  }
  using Call = void (*)(const void*, int64_t);

  // The next item of job `generation`, or -1 once it has none left (or a later job is posted).
  int64_t claim(uint64_t generation, int64_t n) {
    uint64_t state = state_.load(std::memory_order_acquire);
    while ((state >> 32) == generation && static_cast<int64_t>(state & 0xffffffffu) < n)
      if (state_.compare_exchange_weak(state, state + 1, std::memory_order_acq_rel)) return state & 0xffffffffu;
    return -1;
  }

  int64_t work(uint64_t generation, Call fn, const void* f, int64_t n) {
    inside_ = true;  // a loop inside an item runs on its own thread
    int64_t count = 0;
    for (int64_t i; (i = claim(generation, n)) >= 0; ++count) fn(f, i);
    inside_ = false;
    return count;
  }

  void start_helpers(int64_t helpers) {
    while (static_cast<int64_t>(num_helpers_) < helpers) {
      std::thread(&Pool::helper, this, num_helpers_++).detach();
    }
  }

  void helper(int64_t index) {
    uint64_t seen = state_.load(std::memory_order_acquire) >> 32;
    while (true) {
      uint64_t state = state_.load(std::memory_order_acquire);
      for (int spins = 0; (state >> 32) == seen; state = state_.load(std::memory_order_acquire)) {
        if (++spins < kSpins) {
#if defined(__x86_64__)
          _mm_pause();
#endif
          continue;
        }
        sleeping_.fetch_add(1, std::memory_order_acq_rel);
        state_.wait(state, std::memory_order_acquire);  // until the state changes: a post or a claim
        sleeping_.fetch_sub(1, std::memory_order_acq_rel);
        spins = 0;
      }
      seen = state >> 32;
      // Read after seeing the post; a claim succeeds only while this job is the posted one, so
      // what is called is always this job's.
      const Call fn = call_.load(std::memory_order_relaxed);
      const void* f = context_.load(std::memory_order_relaxed);
      const int64_t n = size_.load(std::memory_order_relaxed);
      if (index >= active_.load(std::memory_order_relaxed)) continue;
      const int64_t mine = work(seen, fn, f, n);
      if (mine) done_.fetch_add(mine, std::memory_order_acq_rel);
    }
  }

  std::mutex job_;
  // high 32 bits: the job's generation; low 32: its next unclaimed item
  std::atomic<uint64_t> state_{0};
  std::atomic<Call> call_{nullptr};
  std::atomic<const void*> context_{nullptr};
  std::atomic<int64_t> size_{0}, active_{0}, done_{0};
  std::atomic<int> sleeping_{0};
  int64_t num_helpers_ = 0;
  static inline thread_local bool inside_ = false;
};

// at::parallel_for's shape: f(begin, end) over [begin, end) in chunks of `grain` (the last one
// shorter), each chunk one item.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (end <= begin) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t chunks = (end - begin + grain - 1) / grain;
  Pool::get().run(chunks, [&](int64_t c) {
    const int64_t lo = begin + c * grain;
    f(lo, std::min(end, lo + grain));
  });
}

}  // namespace tandem_par
