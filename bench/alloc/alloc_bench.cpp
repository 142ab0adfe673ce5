// remat_alloc_bench: the cost remat's counting allocator adds to every CPU
// allocation in the process (it wraps c10's CPU allocator). ns per alloc+free of
// torch::empty({64}) (256 B), 1 and 2 threads, in four phases of one
// process:
//   1. LibTorch's allocator alone (remat not installed yet);
//   2. after a Probe has come and gone (what a profile leaves behind:
//      installed; counting off since this change, on for good before it);
//   3. a Probe alive (counting, probes updated);
//   4. enable_tracking() (counting for good, no probe).
// Prints medians of 7 rounds. Uses only the public memory API, so the same
// file builds against an older src/core/memory.cpp for a before/after.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/CPUAllocator.h>

#include <remat/memory.h>

namespace {

double ns_per_op(int threads, int iters) {
  auto work = [iters] {
    for (int i = 0; i < iters; ++i) {
      auto t = at::empty({64});
      (void)t;
    }
  };
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(work);
  for (auto& th : pool) th.join();
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
  return ns / iters;  // per op of one thread (threads run at once)
}

double median_of(int threads, int iters) {
  std::vector<double> v;
  for (int r = 0; r < 7; ++r) v.push_back(ns_per_op(threads, iters));
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void phase(const char* name) {
  std::printf("%-44s %8.1f ns  %8.1f ns\n", name, median_of(1, 200000), median_of(2, 200000));
}

}  // namespace

int main() {
  at::set_num_threads(1);
  std::printf("%-44s %11s %11s\n", "alloc+free of 256 B", "1 thread", "2 threads");
  phase("1. LibTorch allocator only");
  { remat::memory::Probe p; }
  phase("2. after a Probe (e.g. a profile) has ended");
  {
    remat::memory::Probe p;
    phase("3. a Probe alive");
  }
  remat::memory::enable_tracking();
  phase("4. enable_tracking()");
  return 0;
}
