// remat_overhead: per-call cost of remat::checkpoint on a tiny layer
// (Linear(16, 16) on a (4, 16) input that requires grad), Google Benchmark.
// Overhead = checkpoint forward+backward minus plain forward+backward; the
// Python twin is bench/py/overhead.py (timeit). One intra-op thread.
// Leaves out: large layers (there the recompute, not the call, dominates).
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include <remat/remat.h>

namespace {

struct Tiny {
  torch::nn::Linear lin{16, 16};
  torch::Tensor x = torch::randn({4, 16}).set_requires_grad(true);
};

Tiny& tiny() {
  static Tiny* t = [] {
    torch::set_num_threads(1);
    torch::manual_seed(0);
    return new Tiny();
  }();
  return *t;
}

void BM_plain(benchmark::State& state) {
  auto& t = tiny();
  for (auto _ : state) {
    t.lin->forward(t.x).sum().backward();
  }
}

void BM_checkpoint(benchmark::State& state) {
  auto& t = tiny();
  for (auto _ : state) {
    remat::checkpoint(t.lin, t.x).sum().backward();
  }
}

void BM_checkpoint_no_rng(benchmark::State& state) {
  auto& t = tiny();
  auto opts = remat::CheckpointOptions().preserve_rng_state(false);
  for (auto _ : state) {
    remat::checkpoint(opts, t.lin, t.x).sum().backward();
  }
}

}  // namespace

BENCHMARK(BM_plain);
BENCHMARK(BM_checkpoint);
BENCHMARK(BM_checkpoint_no_rng);
BENCHMARK_MAIN();
