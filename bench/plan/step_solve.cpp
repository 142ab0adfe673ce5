// remat_step_solve: how long the whole-step solver (remat/plan/step.h) takes
// as the step grows. Synthetic steps shaped like a transformer's: U units
// called once each, forwards in order, backwards in reverse, a head between;
// each unit with 6 options (keep, recompute, 3 selective levels, offload)
// whose kept bytes fall as their added time rises, costs drawn at random
// (seed 1). A second shape shares each unit's input with the unit before
// (as a ResNet's blocks do). A third shape nests units: U/3 blocks, each
// with two inner units (attention, MLP) inside it, as auto_checkpoint sees
// remat's GPT; the blocks get a seventh option (recompute with the inner
// units checkpointed), the inner units five; the chain DP takes each block
// with its inner units as one step. All three are chains for the DP. A
// fourth runs the chain for two micro-batches per step (each unit called
// twice, gradient accumulation), a chain per micro-batch for the DP. A
// fifth runs it on two inputs before one backward (both forwards, then
// both backwards), which GLPK's integer program solves. For each
// shape and U, budgets at 5 points from the leanest feasible peak to the
// plain peak: solve time (ms, one solve each), rows and columns of the
// integer program, optimal or the gap. Writes JSON lines to
// bench/results/step_solve.json ({"kind": "meta"} then one {"kind": "solve"}
// per shape, U and budget) and prints a table. Torch-free.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "remat/plan/error.h"
#include "remat/plan/step.h"

namespace rp = remat::plan;

namespace {

// Adds each outer unit's profiled (keep) bytes to the segments its calls'
// windows cover (an inner unit's are part of its outer unit's).
void add_keep_peaks(rp::StepModel& m) {
  for (const auto& unit : m.units) {
    if (unit.parent >= 0) continue;
    for (const rp::StepCall& c : unit.calls) {
      for (int64_t s = c.forward_begin; s < c.backward_end; ++s) {
        m.segment_peak_bytes[s] += s < c.forward_end      ? c.costs[0].forward_peak_bytes
                                   : s < c.backward_begin ? c.costs[0].kept_bytes
                                                          : c.costs[0].backward_peak_bytes;
      }
    }
  }
}

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
  add_keep_peaks(m);
  return m;
}

// Costs of one call: keep, recompute, `levels` selective levels, offload
// (and nested recompute when `nested`), kept bytes falling as time rises.
rp::StepCall call_costs(std::mt19937& rng, int64_t kept, int levels, bool nested, double* keep_ms) {
  std::uniform_real_distribution<double> ms(20, 80), frac(0.05, 0.95);
  rp::StepCall c;
  const double f = ms(rng);
  const int64_t out = kept / 16;
  c.costs.push_back({3 * f, kept + kept / 4, kept, kept + kept / 2});
  c.costs.push_back({4 * f, out + kept / 4, out, kept + kept / 2 + kept / 8});
  if (nested) c.costs.push_back({4.6 * f, out + kept / 4, out, kept + kept / 4});
  for (int l = 1; l <= levels; ++l) {
    const double keep_frac = l / (levels + 1.0) * frac(rng);
    const int64_t k = out + static_cast<int64_t>(keep_frac * static_cast<double>(kept - out));
    c.costs.push_back({3 * f + f * (1 - keep_frac) * frac(rng), k + kept / 4, k, kept + kept / 2 + kept / 16});
  }
  c.costs.push_back({3 * f + f * frac(rng), kept / 4, 0, kept + kept / 2 + kept / 4});
  *keep_ms = 3 * f;
  return c;
}

// Blocks with an attention and an MLP unit inside each: a block's forward
// covers 3 segments (attention, MLP, its own tail), its backward 3 in
// reverse; the inner units' windows lie in them. About `units` units.
rp::StepModel transformer_nested(int units, std::mt19937& rng) {
  std::uniform_int_distribution<int> mib(8, 64);
  const int64_t MiB = 1 << 20;
  const int blocks = std::max(1, units / 3);
  rp::StepModel m;
  const int64_t n = 6 * blocks + 3;
  m.segment_peak_bytes.assign(n, 512 * MiB);
  m.step_time_ms = 0;
  for (int b = 0; b < blocks; ++b) {
    const int64_t f0 = 3 * b + 1, b0 = n - 3 * b - 5;  // first segment of its forward, of its backward
    const int64_t kept = mib(rng) * MiB;
    const int64_t parent = static_cast<int64_t>(m.units.size());
    double t = 0;
    rp::StepCall c = call_costs(rng, kept, 3, true, &t);
    c.forward_begin = f0, c.forward_end = f0 + 3, c.backward_begin = b0, c.backward_end = b0 + 3;
    m.step_time_ms += t;
    m.units.push_back({"blocks." + std::to_string(b),
                       {"keep", "recompute", "recompute, inner units too", "sel1", "sel2", "sel3", "offload"},
                       {c}});
    const char* names[] = {"attn", "mlp"};
    const int64_t share[] = {kept * 55 / 100, kept * 35 / 100};
    for (int i = 0; i < 2; ++i) {
      double ti = 0;
      rp::StepCall ci = call_costs(rng, share[i], 2, false, &ti);
      ci.forward_begin = f0 + i, ci.forward_end = f0 + i + 1, ci.backward_begin = b0 + 2 - i,
      ci.backward_end = b0 + 3 - i;
      m.units.push_back({"blocks." + std::to_string(b) + "." + names[i],
                         {"keep", "recompute", "sel1", "sel2", "offload"},
                         {ci},
                         parent});
    }
  }
  // The profiled peaks: the blocks' own bytes (the inner units' are part of theirs).
  add_keep_peaks(m);
  return m;
}

// The chain with each unit's input shared with the unit before, which
// saves it too (a ResNet block's input, its previous block's ReLU output):
// freed while the later unit offloads and the earlier one recomputes or
// offloads (NOTE [inputs two calls hold] in step.h). The DP carries it.
rp::StepModel resnet_like(int units, std::mt19937& rng) {
  rp::StepModel m = transformer_like(units, rng);
  for (size_t u = 1; u < m.units.size(); ++u) {
    rp::StepCall& c = m.units[u].calls[0];
    c.pair_unit = static_cast<int64_t>(u - 1);
    c.pair_bytes = c.costs[0].kept_bytes / 8;
    c.pair_begin = c.forward_end;
    c.pair_lets_go = {false, false, false, false, false, true};
    c.pair_other_lets_go = {false, true, false, false, false, true};
    for (int64_t s = c.pair_begin; s < c.backward_begin; ++s) m.segment_peak_bytes[s] += c.pair_bytes;
  }
  return m;
}

// The chain run for two micro-batches per step (gradient accumulation):
// every unit called twice, the first micro-batch's forward and backward
// before the second's, the same costs for both calls: a chain per
// micro-batch, one choice for both, for the DP.
rp::StepModel two_micro_batches(int units, std::mt19937& rng) {
  rp::StepModel m = transformer_like(units, rng);
  const int64_t n = static_cast<int64_t>(m.segment_peak_bytes.size());
  m.segment_peak_bytes.assign(2 * n, 512 * (int64_t{1} << 20));
  for (auto& unit : m.units) {
    rp::StepCall second = unit.calls[0];
    second.forward_begin += n, second.forward_end += n, second.backward_begin += n, second.backward_end += n;
    unit.calls.push_back(second);
  }
  m.step_time_ms *= 2;
  add_keep_peaks(m);
  return m;
}

// The chain run on two inputs before one backward (two losses summed):
// both forwards, the loss, then the second input's backward and the
// first's. Each unit's first call keeps its bytes across the second's
// windows: not a chain, GLPK's integer program solves it.
rp::StepModel both_forwards_first(int units, std::mt19937& rng) {
  const rp::StepModel chain = transformer_like(units, rng);
  rp::StepModel m;
  const int64_t u_count = units, n = 4 * u_count + 3;
  m.segment_peak_bytes.assign(n, 512 * (int64_t{1} << 20));
  m.step_time_ms = 2 * chain.step_time_ms;
  for (int64_t u = 0; u < u_count; ++u) {
    rp::StepUnit unit = chain.units[u];
    const int64_t back = u_count - 1 - u;  // its place in each backward
    rp::StepCall first = unit.calls[0], second = unit.calls[0];
    first.forward_begin = 1 + u, first.forward_end = 2 + u;
    first.backward_begin = 3 * u_count + 2 + back, first.backward_end = 3 * u_count + 3 + back;
    second.forward_begin = u_count + 1 + u, second.forward_end = u_count + 2 + u;
    second.backward_begin = 2 * u_count + 2 + back, second.backward_end = 2 * u_count + 3 + back;
    unit.calls = {first, second};
    m.units.push_back(unit);
  }
  add_keep_peaks(m);
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
  std::printf("%7s %6s %8s %10s %8s %8s %10s %s\n", "shape", "units", "budget", "solve ms", "rows", "cols", "time ms",
              "solver status");
  for (const std::string shape : {"chain", "paired", "nested", "twice", "both"}) {
    for (int units : {10, 25, 50, 100, 200, 400}) {
      std::mt19937 rng(1);
      const rp::StepModel m = shape == "chain"    ? transformer_like(units, rng)
                              : shape == "paired" ? resnet_like(units, rng)
                              : shape == "nested" ? transformer_nested(units, rng)
                              : shape == "twice"  ? two_micro_batches(units, rng)
                                                  : both_forwards_first(units, rng);
      const int u_count = static_cast<int>(m.units.size());
      const auto t0 = std::chrono::steady_clock::now();
      const rp::StepPlan lean = rp::min_peak_step(m);
      const double lean_ms = ms_since(t0);
      const int64_t low = lean.prediction.peak_bytes;
      const int64_t high = rp::simulate_step(m, std::vector<int>(m.units.size(), 0)).peak_bytes;
      for (double f : {0.0, 0.25, 0.5, 0.75, 1.0}) {
        const int64_t budget = low + static_cast<int64_t>(f * static_cast<double>(high - low));
        const rp::StepPlan p = rp::solve_step(m, budget);
        // A gap of infinity (no bound: the plan is each unit's leanest
        // option) is written as -1, which JSON can hold.
        const double gap = std::isfinite(p.relative_gap) ? p.relative_gap : -1;
        const std::string status = p.optimal ? "optimal" : gap < 0 ? "gap not known" : "gap " + std::to_string(gap);
        std::printf("%7s %6d %8.2f %10.1f %8lld %8lld %10.1f %s %s\n", shape.c_str(), u_count, f, p.solve_ms,
                    static_cast<long long>(p.rows), static_cast<long long>(p.columns), p.prediction.time_ms,
                    p.solver.c_str(), status.c_str());
        out << "{\"kind\": \"solve\", \"shape\": \"" << shape << "\", \"solver\": \"" << p.solver
            << "\", \"units\": " << u_count << ", \"budget_fraction\": " << f << ", \"budget\": " << budget
            << ", \"solve_ms\": " << p.solve_ms << ", \"rows\": " << p.rows << ", \"columns\": " << p.columns
            << ", \"optimal\": " << (p.optimal ? "true" : "false") << ", \"relative_gap\": " << gap
            << ", \"leanest_ms\": " << lean_ms << ", \"leanest_optimal\": " << (lean.optimal ? "true" : "false")
            << "}\n";
      }
    }
  }
  std::printf("wrote %s\n", out_path.c_str());
}
