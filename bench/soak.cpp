// remat_soak: long soak (leaks and growth over thousands of steps). Trains a small GPT block stack
// (remat::models::GptBlock, d_model 64, 4 heads, T 32, batch 4, 6 blocks,
// dropout 0.1, Adam) for N steps (default 2,000) under each strategy:
// plain, remat::checkpoint per block, checkpoint_sequential (2 segments),
// CheckpointedSequential with a budget a quarter of the way from the
// smallest feasible peak to store-all. At the same point of every step
// (after opt.step(), the step's tensors dropped) it samples tracked bytes
// (remat::memory::current_bytes()) and the resident set (/proc/self/statm),
// and prints, over the steps after a 100-step warm-up, the least-squares
// slope per 1,000 steps of both, their range, and the time per step.
// tests/test_soak.cpp is the short version that asserts.
// Usage: remat_soak [steps]   (1 intra-op thread, as every CPU benchmark)
// Leaves out: CUDA memory (CPU build).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <remat/memory.h>
#include <remat/models/gpt.h>

#include "bench.h"
#include "soak_workload.h"

namespace {

using namespace remat_soak;

constexpr int kWarmup = 100;

void soak(Strategy s, int steps) {
  torch::manual_seed(0);
  torch::nn::Sequential seq;
  for (int i = 0; i < 6; ++i) seq->push_back(remat::models::GptBlock(64, 4, 0.1));
  Workload work(seq, {4, 32, 64}, s);  // (B, T, C)
  std::vector<int64_t> tracked, rss;
  int64_t peak = 0;
  auto t0 = bench::Clock::now();
  for (int step = 0; step < steps; ++step) {
    if (step == kWarmup) {
      t0 = bench::Clock::now();
      remat::memory::reset_peak();
    }
    work.step();
    if (step >= kWarmup) {
      tracked.push_back(remat::memory::current_bytes());
      rss.push_back(rss_bytes());
    }
  }
  peak = remat::memory::peak_bytes();
  const double ms = bench::ms_since(t0) / std::max<size_t>(1, tracked.size());
  const auto [tmin, tmax] = std::minmax_element(tracked.begin(), tracked.end());
  const auto [rmin, rmax] = std::minmax_element(rss.begin(), rss.end());
  std::printf("%-32s %8.1f %12lld %12.1f %10.2f %10.2f %14.1f %9.2f %9.2f\n", name(s), ms,
              static_cast<long long>(*tmax - *tmin), 1000.0 * slope(tracked), (*rmin) / 1048576.0, (*rmax) / 1048576.0,
              1000.0 * slope(rss), peak / 1048576.0, tracked.back() / 1048576.0);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? static_cast<int>(bench::to_int("steps", argv[1])) : 2000;
  if (steps <= kWarmup + 1) {
    std::fprintf(stderr, "remat_soak: steps must be > %d (the warm-up), got %d\n", kWarmup + 1, steps);
    return 2;
  }
  torch::set_num_threads(1);
  remat::memory::enable_tracking();
  std::printf("remat_soak: %d steps per strategy, slopes over steps %d..%d, 1 intra-op thread\n", steps, kWarmup,
              steps - 1);
  std::printf("%-32s %8s %12s %12s %10s %10s %14s %9s %9s\n", "strategy", "ms/step", "tracked rng B", "tracked/1k",
              "RSS min", "RSS max", "RSS B/1k", "peak MiB", "live MiB");
  for (auto s : {Strategy::kPlain, Strategy::kPerBlock, Strategy::kCheckpointSequential, Strategy::kBudget}) {
    soak(s, steps);
  }
  return 0;
}
