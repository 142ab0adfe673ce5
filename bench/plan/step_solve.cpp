// remat_step_solve: how long the whole-step solver (remat/plan/step.h) takes
// as the step grows. Synthetic steps shaped like a transformer's: U units
// called once each, forwards in order, backwards in reverse, a head between;
// each unit with 6 options (keep, recompute, 3 selective levels, offload)
// whose kept bytes fall as their added time rises, costs drawn at random
// (seed 1). For each U, budgets at 5 points from the leanest feasible peak
// to the plain peak: solve time (ms, one solve each), rows and columns of the
// integer program, optimal or the gap. Writes JSON lines to
// bench/results/step_solve.json ({"kind": "meta"} then one {"kind": "solve"}
// per U and budget) and prints a table. Torch-free.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "remat/plan/error.h"
#include "remat/plan/step.h"

namespace rp = remat::plan;

namespace {

rp::StepModel transformer_like(int units, std::mt19937& rng) {
  std::uniform_int_distribution<int> mib(8, 64);
  std::uniform_real_distribution<double> ms(20, 80), frac(0.05, 0.95);
  const int64_t MiB = 1 << 20;
  rp::StepModel m;
  const int64_t n = 4 * units + 3;
  m.segment_peak_bytes.assign(n, 512 * MiB);  // parameters, gradients, optimizer state
  m.step_time_ms = 0;
  for (int u = 0; u < units; ++u) {
    rp::StepUnit unit{"blocks." + std::to_string(u), {"keep", "recompute", "sel1", "sel2", "sel3", "offload"}, {}};
    rp::StepCall c{2 * u + 1, 2 * u + 2, n - 2 * u - 3, n - 2 * u - 2, {}};
    const double f = ms(rng);
    const int64_t kept = mib(rng) * MiB, out = kept / 16;
    c.costs.push_back({3 * f, kept + kept / 4, kept, kept + kept / 2});
    c.costs.push_back({4 * f, out + kept / 4, out, kept + kept / 2 + kept / 8});
    for (int l = 1; l <= 3; ++l) {
      const double keep_frac = l / 4.0 * frac(rng);
      const int64_t k = out + static_cast<int64_t>(keep_frac * static_cast<double>(kept - out));
      c.costs.push_back({3 * f + f * (1 - keep_frac) * frac(rng), k + kept / 4, k, kept + kept / 2 + kept / 16});
    }
    c.costs.push_back({3 * f + f * frac(rng), kept / 4, 0, kept + kept / 2 + kept / 4});
    m.step_time_ms += 3 * f;
    unit.calls.push_back(c);
    m.units.push_back(unit);
  }
  for (const auto& unit : m.units) {
    const rp::StepCall& c = unit.calls[0];
    for (int64_t s = c.forward_begin; s < c.backward_end; ++s) {
      m.segment_peak_bytes[s] += s < c.forward_end      ? c.costs[0].forward_peak_bytes
                                 : s < c.backward_begin ? c.costs[0].kept_bytes
                                                        : c.costs[0].backward_peak_bytes;
    }
  }
  return m;
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  std::string out_path = "bench/results/step_solve.json";
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::string(argv[i]) == "--out") out_path = argv[i + 1];
  }
  std::ofstream out(out_path);
  out << "{\"kind\": \"meta\", \"program\": \"remat_step_solve\", \"options_per_unit\": 6, \"seed\": 1}\n";
  std::printf("%6s %8s %10s %8s %8s %10s %s\n", "units", "budget", "solve ms", "rows", "cols", "time ms", "status");
  for (int units : {10, 25, 50, 100, 200, 400}) {
    std::mt19937 rng(1);
    const rp::StepModel m = transformer_like(units, rng);
    const auto t0 = std::chrono::steady_clock::now();
    const rp::StepPlan lean = rp::min_peak_step(m);
    const double lean_ms = ms_since(t0);
    const int64_t low = lean.prediction.peak_bytes;
    const int64_t high = rp::simulate_step(m, std::vector<int>(m.units.size(), 0)).peak_bytes;
    for (double f : {0.0, 0.25, 0.5, 0.75, 1.0}) {
      const int64_t budget = low + static_cast<int64_t>(f * static_cast<double>(high - low));
      const rp::StepPlan p = rp::solve_step(m, budget);
      const std::string status = p.optimal ? "optimal" : "gap " + std::to_string(p.relative_gap);
      std::printf("%6d %8.2f %10.1f %8lld %8lld %10.1f %s\n", units, f, p.solve_ms, static_cast<long long>(p.rows),
                  static_cast<long long>(p.columns), p.prediction.time_ms, status.c_str());
      out << "{\"kind\": \"solve\", \"units\": " << units << ", \"budget_fraction\": " << f
          << ", \"budget\": " << budget << ", \"solve_ms\": " << p.solve_ms << ", \"rows\": " << p.rows
          << ", \"columns\": " << p.columns << ", \"optimal\": " << (p.optimal ? "true" : "false")
          << ", \"relative_gap\": " << p.relative_gap << ", \"leanest_ms\": " << lean_ms << "}\n";
    }
  }
  std::printf("wrote %s\n", out_path.c_str());
}
