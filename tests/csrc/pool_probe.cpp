// Test hooks for src/pagedlm/csrc/pool.h (built by tests/test_pool.py): which thread ran each item of a loop.
#include <chrono>
#include <cstdint>
#include <thread>
#include "../../src/pagedlm/csrc/pagedlm.h"
#include "../../src/pagedlm/csrc/pool.h"

extern "C" {

// `jobs` loops of n items (grain items a chunk) in one team of nthreads, as the fused stack runs its layers. Item
// i of loop j writes owner[j * n + i] = its thread's number and adds 1 to count[j * n + i]; each loop also checks
// that the previous one had finished (every count of loop j - 1 is 1) and adds the items that were not to
// *unfinished. With stall_ms > 0 the first chunk the team's second thread claims sleeps that long (a descheduled
// thread), and every item takes item_us microseconds. nested: each item runs a parallel_for of its own (which
// must run serially, on its thread).
void pool_probe(int64_t n, int64_t grain, int nthreads, int jobs, int stall_ms, int item_us, int nested,
                int32_t* owner, int32_t* count, int64_t* unfinished) {
  std::atomic<int64_t> bad{0};
  std::atomic<int> stalled{0};
  with_team(nthreads, [&] {
    for (int j = 0; j < jobs; ++j) {
      parallel_for(n, nthreads, grain, [&](int64_t b, int64_t e) {
        const int me = omp_get_thread_num();
        if (stall_ms > 0 && me == 1 && stalled.exchange(1) == 0)
          std::this_thread::sleep_for(std::chrono::milliseconds(stall_ms));
        for (int64_t i = b; i < e; ++i) {
          if (item_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(item_us));
          if (j > 0 && __atomic_load_n(&count[(j - 1) * n + i], __ATOMIC_ACQUIRE) != 1) bad.fetch_add(1);
          auto mark = [&](int64_t, int64_t) {
            owner[j * n + i] = omp_get_thread_num();
            __atomic_fetch_add(&count[j * n + i], 1, __ATOMIC_RELEASE);
          };
          if (nested) parallel_for(4, nthreads, 1, [&](int64_t c, int64_t) { if (c == 0) mark(0, 0); });
          else mark(0, 0);
        }
      });
    }
  });
  *unfinished = bad.load();
}

}
