// remat_block_cg: one reference GPT block's forward + backward (.sum()), plain
// or per-block checkpointed, for instruction counts under callgrind
// (bench/callgrind/run.sh; the Python twin is block_cg.py). Instrumentation
// is on only around the measured iterations (run valgrind with
// --instr-atstart=no), after warm-up. Arguments: plain|ckpt, T, batch,
// iterations, track (1: remat::memory's counting allocator, as remat_compare).
// Mode `time`: a stack of `blocks` blocks (argument 6, default 8), plain and
// per-block checkpointed steps alternated `iterations` times after one
// warm-up pair; prints each step's thread CPU milliseconds (immune to the
// waits of a shared machine, unlike remat_compare's wall clock) and the
// median and range of the paired ratios.
#include <valgrind/callgrind.h>

#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <remat/models/gpt.h>
#include <remat/remat.h>

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "plain";
  const int64_t T = argc > 2 ? std::atoll(argv[2]) : 512;
  const int64_t B = argc > 3 ? std::atoll(argv[3]) : 4;
  const int iters = argc > 4 ? std::atoi(argv[4]) : 1;
  const bool track = argc > 5 && std::atoi(argv[5]) == 1;
  torch::set_num_threads(1);
  if (track) remat::memory::enable_tracking();
  torch::manual_seed(0);
  if (mode == "time") {
    const int blocks = argc > 6 ? std::atoi(argv[6]) : 8;
    std::vector<remat::models::GptBlock> stack;
    for (int i = 0; i < blocks; ++i) stack.emplace_back(512, 8, 0.0);
    auto x = torch::randn({B, T, 512}).set_requires_grad(true);  // (B, T, C)
    auto cpu_ms = [] {
      timespec ts{};
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
      return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
    };
    auto step = [&](bool ckpt) {
      for (auto& b : stack) {
        for (auto& p : b->parameters()) {
          if (p.grad().defined()) p.mutable_grad().zero_();
        }
      }
      x.mutable_grad() = torch::Tensor();
      const double t0 = cpu_ms();
      torch::Tensor h = x;
      for (auto& b : stack) h = ckpt ? remat::checkpoint(b, h) : b->forward(h);
      h.sum().backward();
      return cpu_ms() - t0;
    };
    step(false);
    step(true);
    std::vector<double> ratios;
    for (int i = 0; i < iters; ++i) {
      const double p = step(false), c = step(true);
      ratios.push_back(c / p);
      std::printf("cpp pair %d: plain %.1f ms, ckpt %.1f ms, ratio %.4f\n", i, p, c, c / p);
    }
    std::sort(ratios.begin(), ratios.end());
    std::printf("cpp median ratio %.4f range %.4f-%.4f (%d pairs, thread CPU time)\n", ratios[ratios.size() / 2],
                ratios.front(), ratios.back(), iters);
    return 0;
  }
  remat::models::GptBlock block(512, 8, 0.0);
  block->train();
  auto x = torch::randn({B, T, 512}).set_requires_grad(true);  // (B, T, C)
  auto run = [&] {
    for (auto& p : block->parameters()) {
      if (p.grad().defined()) p.mutable_grad().zero_();
    }
    x.mutable_grad() = torch::Tensor();
    if (mode == "plain") {
      block->forward(x).sum().backward();
    } else {
      remat::checkpoint(block, x).sum().backward();
    }
  };
  for (int i = 0; i < 2; ++i) run();
  CALLGRIND_START_INSTRUMENTATION;
  for (int i = 0; i < iters; ++i) run();
  CALLGRIND_STOP_INSTRUMENTATION;
  std::printf("%s T=%lld B=%lld iters=%d stats: regions %lld recomputations %lld early stops %lld\n", mode.c_str(),
              (long long)T, (long long)B, iters, (long long)remat::checkpoint_stats().regions,
              (long long)remat::checkpoint_stats().recomputations, (long long)remat::checkpoint_stats().early_stops);
  return 0;
}
