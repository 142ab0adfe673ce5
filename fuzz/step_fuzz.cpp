// libFuzzer harness for the whole-step solver (include/remat/plan/step.h):
// decodes a step model from the input (units with 1-3 options, run for 1-3
// micro-batches; a chain of blocks, blocks with inner units, or free
// windows; release points, inputs two calls hold; bytes from 1 B to 1 TiB)
// and checks solve_step and min_peak_step against a brute force over every
// choice (tests/plan/step_brute.h, the memory rule written again):
//  - no crash or sanitizer finding, no exception but remat::Error;
//  - validate() refuses the model with Error, or every solver call agrees:
//  - simulate_step() of a returned choice is the brute force's evaluation
//    of it, and its peak is within the budget;
//  - a plan marked optimal is as fast as the fastest choice within the
//    budget (to 1e-9 of the model's summed times), and min_peak_step's
//    peak is the least one;
//  - a budget some choice fits gets a plan (GLPK may stop at its time limit
//    and say so); one that no choice fits gets Error;
//  - over 1-3 variants of the model (plan::StepVariant: trailing options
//    withheld, each segment shifted, time added, options priced), solve_step_variants and
//    min_peak_step_variants agree with the same brute force, the variant
//    applied by the oracle itself.
// Leaves out the auto layer (torch): its tests cover the profile.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "../tests/plan/step_brute.h"
#include "common.h"
#include "remat/plan/error.h"
#include "remat/plan/step.h"

namespace rp = remat::plan;
using remat::fuzz::fail;
namespace rs = remat_test::step;

namespace {

int64_t fuzz_bytes(FuzzedDataProvider& in, int64_t unit) { return in.ConsumeIntegralInRange<int64_t>(0, 16) * unit; }

double fuzz_ms(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange<int>(0, 2)) {
    case 0: return in.ConsumeIntegralInRange<int>(0, 8);  // small integers: ties between choices
    case 1: return in.ConsumeFloatingPointInRange<double>(0, 100);
    default: return in.ConsumeFloatingPointInRange<double>(0, 1e6);
  }
}

rp::StepCall fuzz_call(FuzzedDataProvider& in, size_t options, int64_t unit, int64_t fb, int64_t fe, int64_t bb,
                       int64_t be) {
  rp::StepCall c;
  c.forward_begin = fb, c.forward_end = fe, c.backward_begin = bb, c.backward_end = be;
  for (size_t k = 0; k < options; ++k) {
    rp::StepCost cost;
    cost.time_ms = fuzz_ms(in);
    cost.forward_peak_bytes = fuzz_bytes(in, unit);
    cost.kept_bytes = fuzz_bytes(in, unit);
    cost.backward_peak_bytes = fuzz_bytes(in, unit);
    cost.released_bytes = in.ConsumeBool() ? fuzz_bytes(in, unit) : 0;
    c.costs.push_back(cost);
  }
  return c;
}

// A shared input (NOTE [inputs two calls hold]) with call `call` of unit
// `other`, from `begin` on, each option of both letting go at random.
void fuzz_pair(FuzzedDataProvider& in, rp::StepModel& m, rp::StepCall& c, size_t u, size_t other, int64_t call,
               int64_t begin, int64_t unit) {
  c.pair_unit = static_cast<int64_t>(other);
  c.pair_call = call;
  c.pair_bytes = fuzz_bytes(in, unit);
  c.pair_begin = begin;
  c.pair_lets_go.assign(m.units[u].options.size(), false);
  c.pair_other_lets_go.assign(m.units[other].options.size(), false);
  for (size_t k = 1; k < c.pair_lets_go.size(); ++k) c.pair_lets_go[k] = in.ConsumeBool();
  for (size_t k = 1; k < c.pair_other_lets_go.size(); ++k) c.pair_other_lets_go[k] = in.ConsumeBool();
}

// A model: `shape` 0 is a chain, 1 blocks with inner units, 2 free windows
// (units called once or twice anywhere: validate or GLPK decide).
rp::StepModel fuzz_model(FuzzedDataProvider& in) {
  const int64_t units_of[] = {1, 1000, int64_t{1} << 20, int64_t{1} << 40};
  const int64_t unit = units_of[in.ConsumeIntegralInRange<int>(0, 3)];
  const int shape = in.ConsumeIntegralInRange<int>(0, 2);
  rp::StepModel m;
  m.step_time_ms = fuzz_ms(in);
  auto add_unit = [&](int64_t parent) {
    rp::StepUnit u;
    u.name = "u" + std::to_string(m.units.size());
    u.parent = parent;
    const size_t options = in.ConsumeIntegralInRange<size_t>(1, 3);
    for (size_t k = 0; k < options; ++k) u.options.push_back(k == 0 ? "keep" : "opt" + std::to_string(k));
    m.units.push_back(u);
    return m.units.size() - 1;
  };
  if (shape == 2) {
    const int64_t segments = in.ConsumeIntegralInRange<int64_t>(1, 12);
    const size_t count = in.ConsumeIntegralInRange<size_t>(1, 4);
    for (size_t i = 0; i < count; ++i) {
      const size_t u = add_unit(i > 0 && in.ConsumeBool() ? in.ConsumeIntegralInRange<int64_t>(0, i - 1) : -1);
      const int calls = in.ConsumeIntegralInRange<int>(1, 2);
      for (int k = 0; k < calls; ++k) {
        int64_t w[4];
        for (int64_t& x : w) x = in.ConsumeIntegralInRange<int64_t>(0, segments);
        std::sort(w, w + 4);
        rp::StepCall c = fuzz_call(in, m.units[u].options.size(), unit, w[0], w[1], w[2], w[3]);
        if (in.ConsumeBool()) c.release_begin = in.ConsumeIntegralInRange<int64_t>(w[1], w[2]);
        if (c.release_begin >= 0 && in.ConsumeBool()) c.release_end = in.ConsumeIntegralInRange<int64_t>(w[2], w[3]);
        if (u > 0 && in.ConsumeBool()) {
          fuzz_pair(in, m, c, u, in.ConsumeIntegralInRange<size_t>(0, u - 1), 0,
                    in.ConsumeIntegralInRange<int64_t>(w[1], w[2]), unit);
        }
        m.units[u].calls.push_back(c);
      }
    }
    for (int64_t s = 0; s < segments; ++s) m.segment_peak_bytes.push_back(fuzz_bytes(in, unit));
    return m;
  }
  // A chain of blocks (each with 0-2 inner units under shape 1), forwards
  // in order, backwards in reverse: block b's forward covers `per`
  // segments (its inner units' forwards, then its own tail), its backward
  // as many; releases and credits settle before the next block's forward.
  const int64_t blocks = in.ConsumeIntegralInRange<int64_t>(1, shape == 1 ? 2 : 4);
  const int64_t inner = shape == 1 ? in.ConsumeIntegralInRange<int64_t>(0, 2) : 0;
  const int64_t per = inner + 1, n = 2 * blocks * per + 2;
  std::vector<size_t> outer;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t f0 = b * per, b0 = n - 2 - (b + 1) * per;
    const size_t u = add_unit(-1);
    outer.push_back(u);
    rp::StepCall c = fuzz_call(in, m.units[u].options.size(), unit, f0, f0 + per, b0, b0 + per);
    if (in.ConsumeBool()) c.release_begin = f0 + per;
    if (c.release_begin >= 0 && in.ConsumeBool()) c.release_end = in.ConsumeIntegralInRange<int64_t>(b0, b0 + per);
    if (b > 0 && in.ConsumeBool()) fuzz_pair(in, m, c, u, outer[b - 1], 0, f0 + per, unit);
    m.units[u].calls.push_back(c);
    for (int64_t i = 0; i < inner; ++i) {
      const size_t v = add_unit(static_cast<int64_t>(u));
      rp::StepCall ic =
          fuzz_call(in, m.units[v].options.size(), unit, f0 + i, f0 + i + 1, b0 + per - 1 - i, b0 + per - i);
      if (in.ConsumeBool()) ic.release_begin = f0 + per;
      m.units[v].calls.push_back(ic);
    }
  }
  for (int64_t s = 0; s < n; ++s) m.segment_peak_bytes.push_back(fuzz_bytes(in, unit));
  // Micro-batches: the chain again after itself, with other bytes at random.
  const int64_t phases = in.ConsumeIntegralInRange<int64_t>(1, 3);
  for (int64_t p = 1; p < phases; ++p) {
    for (int64_t s = 0; s < n; ++s) m.segment_peak_bytes.push_back(fuzz_bytes(in, unit));
    for (rp::StepUnit& u : m.units) {
      rp::StepCall c = u.calls[0];
      for (int64_t* w : {&c.forward_begin, &c.forward_end, &c.backward_begin, &c.backward_end}) *w += p * n;
      for (int64_t* w : {&c.release_begin, &c.release_end, &c.pair_begin}) {
        if (*w >= 0) *w += p * n;
      }
      if (c.pair_unit >= 0) c.pair_call = in.ConsumeBool() ? p : 0;
      if (in.ConsumeBool()) {
        for (rp::StepCost& cost : c.costs) cost.kept_bytes = fuzz_bytes(in, unit);
      }
      u.calls.push_back(c);
    }
  }
  return m;
}

std::string fmt_g(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", x);
  return buf;
}

// Times are sums of the model's times in some order: equal to within the
// rounding of terms as large as the largest ones added.
double g_scale = 1;
bool near(double a, double b) { return std::abs(a - b) <= 1e-9 * g_scale; }

double time_scale(const rp::StepModel& m) {
  double scale = std::max(1.0, std::abs(m.step_time_ms));
  for (const rp::StepUnit& u : m.units) {
    for (const rp::StepCall& c : u.calls) {
      for (const rp::StepCost& cost : c.costs) scale += std::abs(cost.time_ms);
    }
  }
  return scale;
}

/** How often each check had something to check; printed at exit when
 *  REMAT_FUZZ_STATS is set (e.g. over a corpus: step_fuzz -runs=0 DIR). */
struct Stats {
  long inputs = 0, valid = 0, micro_batched = 0, plans = 0, dp = 0, dp_micro = 0, glpk = 0, fastest = 0, other = 0,
       refused = 0;
  ~Stats() {
    if (std::getenv("REMAT_FUZZ_STATS"))
      std::fprintf(stderr,
                   "step_fuzz stats: %ld inputs, %ld valid models (%ld with units called more than once), %ld plans "
                   "checked: %ld by the chain DP (%ld of them with units called more than once), %ld by GLPK, %ld "
                   "fastest fits, %ld other; %ld budgets refused where no choice fits\n",
                   inputs, valid, micro_batched, plans, dp, dp_micro, glpk, fastest, other, refused);
  }
} stats;

bool called_more_than_once(const rp::StepModel& m) {
  return std::any_of(m.units.begin(), m.units.end(), [](const rp::StepUnit& u) { return u.calls.size() > 1; });
}

// One solver answer against the brute force.
void check_plan(const rp::StepModel& m, const rp::StepPlan& p, const std::vector<rs::Evaluated>& all, int64_t budget,
                const std::string& what) {
  const rs::Evaluated e = rs::evaluate(m, p.prediction.choice);
  if (!rs::nesting_ok(m, p.prediction.choice)) fail(what + ": the choice breaks the nesting rule");
  if (e.peak != p.prediction.peak_bytes) {
    fail(what + ": predicted peak " + std::to_string(p.prediction.peak_bytes) + " but the rule gives " +
         std::to_string(e.peak));
  }
  if (!near(e.time_ms, p.prediction.time_ms)) fail(what + ": predicted time differs from the rule's");
  if (e.peak > budget) fail(what + ": peak " + std::to_string(e.peak) + " over the budget " + std::to_string(budget));
  ++stats.plans;
  if (p.solver == "chain DP") {
    ++stats.dp;
    stats.dp_micro += called_more_than_once(m);
  } else if (p.solver == "GLPK") {
    ++stats.glpk;
  } else if (p.solver == "fastest fits") {
    ++stats.fastest;
  } else {
    ++stats.other;
  }
  const rs::Brute b = rs::best_of(all, budget);
  if (p.optimal && !near(e.time_ms, b.best_time) && e.time_ms > b.best_time) {
    fail(what + " (" + p.solver + "): optimal plan takes " + fmt_g(e.time_ms - b.best_time) +
         " ms more than the fastest within " + std::to_string(budget) + " B, which takes " + fmt_g(b.best_time) +
         " ms");
  }
  if (e.time_ms < b.best_time && !near(e.time_ms, b.best_time)) fail(what + ": faster than every choice that fits");
}

// Variants of m against the brute force over every variant and choice.
void check_variants(FuzzedDataProvider& in, const rp::StepModel& m, const std::vector<rs::Evaluated>& all,
                    const rp::StepSolveOptions& opt) {
  const size_t segments = m.segment_peak_bytes.size();
  // What every choice leaves in each segment: a shift takes off at most
  // that (auto's take off state that is there whatever the units do).
  std::vector<int64_t> floor(segments, std::numeric_limits<int64_t>::max());
  for (const rs::Evaluated& e : all) {
    for (size_t s = 0; s < segments; ++s) {
      floor[s] = std::min(floor[s], rs::brute_segment(m, e.choice, static_cast<int64_t>(s)));
    }
  }
  std::vector<rp::StepVariant> vs(static_cast<size_t>(in.ConsumeIntegralInRange<int>(1, 3)));
  for (rp::StepVariant& v : vs) {
    for (const rp::StepUnit& u : m.units) {
      v.options_offered.push_back(in.ConsumeIntegralInRange<size_t>(0, u.options.size()));
    }
    if (in.ConsumeBool()) {
      for (size_t s = 0; s < segments; ++s) {
        v.segment_shift_bytes.push_back(
            in.ConsumeIntegralInRange<int64_t>(-std::max<int64_t>(0, floor[s]), m.segment_peak_bytes[s] / 4));
      }
    }
    v.time_ms = in.ConsumeIntegralInRange<int>(0, 8);
    // Options priced per variant (a store's in-flight cap) on odd times:
    // drawn from the time, not from the input, so that the input means
    // what it meant before (the corpus's cases stay the cases they were).
    if (static_cast<int>(v.time_ms) % 2 == 1) {
      uint32_t seed = 2654435761u * static_cast<uint32_t>(v.time_ms + 1);
      for (const rp::StepUnit& u : m.units) {
        std::vector<double> d(u.options.size(), 0.0);
        for (size_t k = 1; k < d.size(); ++k) {
          seed = seed * 1664525u + 1013904223u;
          d[k] = static_cast<int>(seed >> 28) % 10 - 6;  // -6..3 ms
        }
        v.option_time_ms.push_back(std::move(d));
      }
    }
  }
  // The oracle: each choice the variant offers, its segments shifted.
  int64_t least = std::numeric_limits<int64_t>::max(), most = 0;
  struct Point {
    int64_t peak;
    double time;
  };
  std::vector<Point> points;
  for (const rp::StepVariant& v : vs) {
    for (const rs::Evaluated& e : all) {
      bool offered = true;
      for (size_t u = 0; u < m.units.size(); ++u) {
        offered &= v.options_offered[u] == 0 || static_cast<size_t>(e.choice[u]) < v.options_offered[u];
      }
      if (!offered) continue;
      int64_t peak = std::numeric_limits<int64_t>::min();
      for (size_t s = 0; s < segments; ++s) {
        const int64_t shift = v.segment_shift_bytes.empty() ? 0 : v.segment_shift_bytes[s];
        peak = std::max(peak, rs::brute_segment(m, e.choice, static_cast<int64_t>(s)) + shift);
      }
      double time = e.time_ms + v.time_ms;
      for (size_t u = 0; u < v.option_time_ms.size(); ++u)
        time += v.option_time_ms[u][static_cast<size_t>(e.choice[u])];
      points.push_back({peak, time});
      least = std::min(least, peak);
      most = std::max(most, peak);
    }
  }
  auto fastest_within = [&](int64_t budget) {
    double t = std::numeric_limits<double>::infinity();
    for (const Point& p : points) t = p.peak <= budget ? std::min(t, p.time) : t;
    return t;
  };
  auto agrees = [&](const rp::StepPlan& p, const std::string& what) {
    if (p.variant < 0 || static_cast<size_t>(p.variant) >= vs.size()) fail(what + ": no variant named");
    const rp::StepModel applied = rp::apply_variant(m, vs[static_cast<size_t>(p.variant)]);
    const rp::StepPrediction again = rp::simulate_step(applied, p.prediction.choice);
    if (again.peak_bytes != p.prediction.peak_bytes || !near(again.time_ms, p.prediction.time_ms)) {
      fail(what + ": the prediction is not its variant's");
    }
  };
  const rp::StepPlan lean = rp::min_peak_step_variants(m, vs, opt);
  agrees(lean, "min_peak_step_variants");
  if (lean.optimal && lean.prediction.peak_bytes != least) {
    fail("min_peak_step_variants says " + std::to_string(lean.prediction.peak_bytes) +
         " is the least peak; a variant's choice reaches " + std::to_string(least));
  }
  for (int64_t budget : {least - 1, least, most}) {
    if (budget <= 0) continue;
    const std::string what = "solve_step_variants at " + std::to_string(budget) + " B";
    const double best = fastest_within(budget);
    try {
      const rp::StepPlan p = rp::solve_step_variants(m, vs, budget, opt);
      if (!std::isfinite(best)) fail(what + ": a plan where no choice fits");
      agrees(p, what);
      if (p.prediction.peak_bytes > budget) fail(what + ": over the budget");
      if (p.optimal && !near(p.prediction.time_ms, best) && p.prediction.time_ms > best) {
        fail(what + ": slower than the fastest variant's choice within the budget");
      }
      ++stats.plans;
    } catch (const remat::Error& e) {
      const std::string text = e.what();
      if (std::isfinite(best) && text.find("time limit") == std::string::npos) {
        fail(what + ": refused, but a variant's choice fits: " + text);
      }
      ++stats.refused;
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const rp::StepModel m = fuzz_model(in);
  ++stats.inputs;
  try {
    rp::validate(m);
  } catch (const remat::Error&) {
    return 0;  // the documented refusal
  }
  ++stats.valid;
  const bool micro = called_more_than_once(m);
  stats.micro_batched += micro;
  g_scale = time_scale(m);
  const std::vector<rs::Evaluated> all = rs::every_choice(m);
  const rs::Brute any = rs::best_of(all, std::numeric_limits<int64_t>::max());
  rp::StepSolveOptions opt;
  opt.time_limit_s = 2;  // small programs: GLPK proves them in milliseconds
  const rp::StepPlan lean = rp::min_peak_step(m, opt);
  check_plan(m, lean, all, lean.prediction.peak_bytes, "min_peak_step");
  if (lean.optimal && lean.prediction.peak_bytes != any.min_peak) {
    fail("min_peak_step (" + lean.solver + ") says " + std::to_string(lean.prediction.peak_bytes) +
         " is the least peak; a choice reaches " + std::to_string(any.min_peak));
  }
  // Budgets: below the least peak, at it, a point between, and above all.
  int64_t most = 0;
  for (const rs::Evaluated& e : all) most = std::max(most, e.peak);
  const int64_t step = in.ConsumeIntegralInRange<int64_t>(0, 4);
  for (int64_t budget : {any.min_peak - 1, any.min_peak, any.min_peak + (most - any.min_peak) * step / 4, most}) {
    if (budget <= 0) continue;  // solve_step refuses it (its own test pins that)
    const std::string what = "solve_step at " + std::to_string(budget) + " B";
    const bool fits = rs::best_of(all, budget).best_time < std::numeric_limits<double>::infinity();
    try {
      const rp::StepPlan p = rp::solve_step(m, budget, opt);
      if (!fits) fail(what + ": a plan where no choice fits");
      check_plan(m, p, all, budget, what + " (" + p.solver + ")");
    } catch (const remat::Error& e) {
      const std::string text = e.what();
      if (fits && text.find("time limit") == std::string::npos) fail(what + ": refused, but a choice fits: " + text);
      ++stats.refused;
    }
  }
  check_variants(in, m, all, opt);
  return 0;
}
