// Google Benchmark of the planner's DPs: optimal() for heterogeneous chains of
// L stages at 500 memory slots, budgets between the smallest feasible peak and
// the store-all peak, under each OptimalScope (0 auto, 1 all, 2 persistent);
// reports the planned time of the chain and the bound on its gap to the exact
// optimum (gap_pct, Plan::relative_gap()) too. Leaves out the heuristics
// (microseconds).
#include <benchmark/benchmark.h>

#include <random>
#include <string>

#include "remat/plan/plan.h"

namespace rp = remat::plan;

static rp::Chain bench_chain(int L) {
  std::mt19937 rng(42);
  std::uniform_int_distribution<int64_t> mib(1, 64);
  std::uniform_real_distribution<double> ms(0.1, 5.0);
  rp::Chain c;
  c.input_bytes = mib(rng) << 20;
  for (int i = 0; i < L; ++i) {
    const int64_t out = mib(rng) << 20;
    c.stages.push_back({"layer" + std::to_string(i), ms(rng), 2 * ms(rng), out, out + (mib(rng) << 20),
                        (mib(rng) << 20) / 4, (mib(rng) << 20) / 4});
  }
  return c;
}

static void BM_Optimal(benchmark::State& state) {
  const int L = static_cast<int>(state.range(0));
  const int slots = static_cast<int>(state.range(1));
  const rp::Chain c = bench_chain(L);
  const int64_t lo = rp::min_feasible_peak_bytes(c), hi = rp::store_all(c).prediction.peak_bytes;
  const int64_t budget = lo + (hi - lo) * state.range(2) / 100;
  const auto scope = static_cast<rp::OptimalScope>(state.range(3));
  double planned_ms = 0, gap = 0;
  for (auto _ : state) {
    rp::Plan p = rp::optimal(c, budget, slots, scope);
    benchmark::DoNotOptimize(p.schedule.ops.data());
    planned_ms = p.prediction.time_ms;
    gap = p.relative_gap();
  }
  state.counters["stages"] = L;
  state.counters["slots"] = slots;
  state.counters["budget_pct"] = static_cast<double>(state.range(2));
  state.counters["scope"] = static_cast<double>(state.range(3));
  // The bound on the plan's gap to the exact optimum (Plan::relative_gap()), %.
  state.counters["gap_pct"] = 100 * gap;
  state.SetLabel("planned " + std::to_string(planned_ms) + " ms");
}
// Budget: min feasible peak + pct% of the way to the store-all peak.
BENCHMARK(BM_Optimal)
    ->Args({32, 500, 50, 0})
    ->Args({64, 500, 50, 0})
    ->Args({83, 500, 10, 0})
    ->Args({128, 500, 50, 0})
    ->Args({128, 500, 10, 0})
    ->Args({128, 500, 2, 0})
    ->Args({128, 1000, 10, 0})
    ->Args({256, 500, 10, 0})
    ->Args({32, 500, 10, 1})
    ->Args({64, 500, 10, 1})
    ->Args({96, 500, 10, 1})
    ->Args({128, 500, 10, 1})
    ->Args({32, 500, 10, 2})
    ->Args({64, 500, 10, 2})
    ->Args({128, 500, 10, 2})
    ->Unit(benchmark::kMillisecond);

static void BM_Simulate(benchmark::State& state) {
  const rp::Chain c = bench_chain(128);
  const rp::Plan p = rp::revolve(c, 8);
  for (auto _ : state) benchmark::DoNotOptimize(rp::simulate(c, p.schedule));
}
BENCHMARK(BM_Simulate)->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
