// remat_alloc_bench: the cost remat's counting allocator adds to every CPU
// allocation in the process (it wraps c10's CPU allocator). ns per alloc+free of
// torch::empty({64}) (256 B), 1 and 2 threads, in four phases of one
// process:
//   1. LibTorch's allocator alone (remat not installed yet);
//   2. after a Probe has come and gone (what a profile leaves behind:
//      remat's allocator installed, counting off);
//   3. a Probe alive (counting, probes updated);
//   4. enable_tracking() (counting for good, no probe).
// Each phase runs --rounds rounds (7), 1 and 2 threads in turn within a round,
// --iters allocations per thread (200000). Prints a run-metadata record and
// every round's ns per op as one JSON object on stdout (bench/py/alloc.py
// writes it to bench/results/alloc.json), medians on stderr. Uses only the
// public memory API, so the same file builds against an older
// src/core/memory.cpp for a before/after.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/CPUAllocator.h>

#include <remat/memory.h>

#include "bench.h"

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

struct Phases {
  int rounds, iters;
  std::string json;

  /** One phase: `rounds` rounds of 1 and 2 threads in turn; a JSON object appended, medians on stderr. */
  void run(const char* name) {
    std::vector<double> one, two;
    for (int r = 0; r < rounds; ++r) {
      one.push_back(ns_per_op(1, iters));
      two.push_back(ns_per_op(2, iters));
    }
    std::fprintf(stderr, "%-44s %8.1f ns  %8.1f ns\n", name, bench::median(one), bench::median(two));
    json += std::string(json.empty() ? "" : ",\n") + "  {\"name\": " + bench::quoted(name) +
            ", \"ns_1_thread\": " + bench::json_list(one, 1) + ", \"ns_2_threads\": " + bench::json_list(two, 1) + "}";
  }
};

}  // namespace

int main(int argc, char** argv) {
  at::set_num_threads(1);
  Phases p{static_cast<int>(bench::int_arg(argc, argv, "--rounds", "7")),
           static_cast<int>(bench::int_arg(argc, argv, "--iters", "200000")), ""};
  std::fprintf(stderr, "%-44s %11s %11s\n", "alloc+free of 256 B, median", "1 thread", "2 threads");
  p.run("1. LibTorch allocator only");
  { remat::memory::Probe probe; }
  p.run("2. after a Probe (e.g. a profile) has ended");
  {
    remat::memory::Probe probe;
    p.run("3. a Probe alive");
  }
  remat::memory::enable_tracking();
  p.run("4. enable_tracking()");
  std::printf("{\"meta\": %s,\n \"rounds\": %d, \"iters\": %d, \"bytes\": 256,\n \"phases\": [\n%s\n ]}\n",
              bench::metadata(argc, argv).c_str(), p.rounds, p.iters, p.json.c_str());
  return 0;
}
