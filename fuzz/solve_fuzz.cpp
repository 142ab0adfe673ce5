// libFuzzer harness for the planner (include/remat/plan/solve.h, schedule.h):
// decodes a chain, a budget and a list of algorithms from the input and runs
// them through the public API. Checks, for every plan a solver returns:
//  - no crash or sanitizer finding, no exception but remat::Error;
//  - simulate() accepts the schedule and agrees with plan.prediction;
//  - a budget given (greedy, optimal) is respected by the simulated peak;
//  - no persistent schedule beats min_feasible_peak_bytes (optimal over all
//    schedules may), and min_memory() reaches it;
//  - optimal() with a budget >= store-all's peak returns store-all's time;
//  - exact cases (budget - input_bytes <= memory_slots, so one slot per byte
//    unit and the DP is exact, scope kAll): optimal() is at least as fast as
//    every other plan that fits the budget, and kPersistent never faster (to
//    the float precision of the DP's costs, kDpRel);
//  - a chain with a menu (Stage::options, on some stages): kAll refused, and
//    the persistent optimum, options included, is the one the others meet.
// Also replays random op sequences: simulate() must accept or throw Error.
// Leaves out JSON (chain_json_fuzz) and text parsing (parse_fuzz).
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

#include "common.h"
#include "remat/plan/plan.h"

namespace rp = remat::plan;
using remat::fuzz::fail;

namespace {

/** Sizes of k units, k in [0, 16], the unit in a few magnitudes (1 B to 1 TiB):
 *  tiny ones make exact DP cases and ties, large ones 64-bit arithmetic. With
 *  `rough`, a jitter below the unit breaks the common divisor, so optimal()
 *  discretizes and refines (slower: rough chains are kept short). */
int64_t fuzz_bytes(FuzzedDataProvider& in, int64_t unit, bool rough) {
  int64_t v = in.ConsumeIntegralInRange<int64_t>(0, 16) * unit;
  if (rough) v += in.ConsumeIntegralInRange<int64_t>(0, unit - 1);
  return v;
}

double fuzz_ms(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange<int>(0, 3)) {
    case 0: return 0;
    case 1: return in.ConsumeIntegralInRange<int>(1, 8);  // small integers: ties between schedules
    case 2: return in.ConsumeFloatingPointInRange<double>(0, 100);
    default: return in.ConsumeFloatingPointInRange<double>(0, 1e6);
  }
}

rp::Chain fuzz_chain(FuzzedDataProvider& in, int max_stages) {
  rp::Chain c;
  const int64_t units[] = {1, 1000, int64_t{1} << 20, int64_t{1} << 40};
  const int64_t unit = units[in.ConsumeIntegralInRange<int>(0, 3)];
  const bool rough = unit > 1 && in.ConsumeIntegralInRange<int>(0, 3) == 0;
  // optimal()'s refinement on a rough chain costs up to kOptimalRefineWork DP
  // cell updates: fine in a release build, seconds under ASan + coverage.
  const int L = in.ConsumeIntegralInRange<int>(1, rough ? 3 : max_stages);
  c.input_bytes = fuzz_bytes(in, unit, rough);
  for (int i = 0; i < L; ++i) {
    rp::Stage s;
    s.name = "s" + std::to_string(i);
    s.forward_ms = fuzz_ms(in);
    s.backward_ms = fuzz_ms(in);
    s.output_bytes = fuzz_bytes(in, unit, rough);
    s.saved_bytes = s.output_bytes + fuzz_bytes(in, unit, rough);
    if (in.ConsumeBool()) s.forward_tmp_bytes = fuzz_bytes(in, unit, rough);
    if (in.ConsumeBool()) s.backward_tmp_bytes = fuzz_bytes(in, unit, rough);
    if (in.ConsumeBool()) s.backward_freed_bytes = fuzz_bytes(in, unit, rough);
    if (in.ConsumeBool())  // a residual head passing its input on
      s.shared_input_bytes = std::min({fuzz_bytes(in, unit, rough), c.value_bytes(i), s.output_bytes});
    if (in.ConsumeBool()) s.output_grad_bytes = fuzz_bytes(in, unit, rough);
    s.backward_freed_bytes = std::min(s.backward_freed_bytes, s.saved_bytes + s.grad_bytes() - s.shared_input_bytes);
    // A menu (Stage::options) on some stages: keeps between the output and
    // everything, costs at least what keeping everything costs.
    for (int k = in.ConsumeIntegralInRange<int>(0, 7) == 0 ? in.ConsumeIntegralInRange<int>(1, 2) : 0; k > 0; --k) {
      rp::StageOption o;
      o.name = "o" + std::to_string(k);
      o.saved_bytes = std::min(s.saved_bytes, s.output_bytes + fuzz_bytes(in, unit, rough));
      o.forward_ms = s.forward_ms + fuzz_ms(in);
      o.backward_ms = s.backward_ms + fuzz_ms(in);
      if (in.ConsumeBool()) o.forward_tmp_bytes = fuzz_bytes(in, unit, rough);
      if (in.ConsumeBool()) o.backward_tmp_bytes = fuzz_bytes(in, unit, rough);
      if (in.ConsumeBool())
        o.backward_freed_bytes =
            std::min(fuzz_bytes(in, unit, rough), o.saved_bytes + s.grad_bytes() - s.shared_input_bytes);
      s.options.push_back(o);
    }
    c.stages.push_back(s);
  }
  return c;
}

std::string describe(const rp::Chain& c, const std::string& what) {
  return what + "\nchain: " + rp::chain_to_json(c, -1);
}

/** How often each check had something to check; printed at exit when
 *  REMAT_FUZZ_STATS is set (e.g. over a corpus: solve_fuzz -runs=0 DIR). */
struct Stats {
  long inputs = 0, plans = 0, optimal_ok = 0, exact = 0, exact_compared = 0, random_ops = 0;
  ~Stats() {
    if (std::getenv("REMAT_FUZZ_STATS"))
      std::fprintf(stderr,
                   "solve_fuzz stats: %ld inputs, %ld plans checked, %ld optimal() plans, %ld exact cases, "
                   "%ld exact comparisons with another plan, %ld random op sequences\n",
                   inputs, plans, optimal_ok, exact, exact_compared, random_ops);
  }
} stats;

bool le_time(double a, double b, double rel = 1e-9) { return a <= b + rel * (std::abs(a) + std::abs(b) + 1); }

/** optimal()'s DP adds times as float (src/plan/dp.h, Cost): ~2L roundings of
 *  2^-24 relative each, so "at least as fast" holds to about 1e-6 of the total
 *  at L = 10 (fuzz/FINDINGS.md). A real DP error costs a whole stage time. */
constexpr double kDpRel = 4e-6;

struct Checker {
  const rp::Chain& chain;
  int64_t min_peak;
  const rp::Plan& all;  // store-all

  /** The checks every returned plan must pass; returns its simulated prediction. */
  /** below_min_allowed: the plan may come from a search over every schedule
   *  (optimal with scope all or auto), which can peak below
   *  min_feasible_peak_bytes, the minimum over persistent schedules. */
  rp::Prediction check(const rp::Plan& plan, const std::string& label, int64_t budget,
                       bool below_min_allowed = false) const {
    ++stats.plans;
    rp::Prediction p;
    try {
      p = rp::simulate(chain, plan.schedule);
    } catch (const rp::Error& e) {
      fail(describe(chain, label + ": returned a schedule the simulator refuses: " + e.what()));
    }
    if (p.peak_bytes != plan.prediction.peak_bytes || p.forward_executions != plan.prediction.forward_executions ||
        p.time_ms != plan.prediction.time_ms)
      fail(describe(chain, label + ": plan.prediction differs from simulate(): peak " +
                               std::to_string(plan.prediction.peak_bytes) + " vs " + std::to_string(p.peak_bytes)));
    if (budget >= 0 && p.peak_bytes > budget)
      fail(describe(
          chain, label + ": peak " + std::to_string(p.peak_bytes) + " exceeds the budget " + std::to_string(budget)));
    if (p.peak_bytes < min_peak && !below_min_allowed)
      fail(describe(chain, label + ": peak " + std::to_string(p.peak_bytes) + " below min_feasible_peak_bytes " +
                               std::to_string(min_peak)));
    if (!le_time(all.prediction.time_ms, p.time_ms)) fail(describe(chain, label + ": faster than store-all"));
    return p;
  }
};

/** Random ops: the simulator refuses (remat::Error) or accepts; nothing else. */
void replay_random_ops(FuzzedDataProvider& in, const rp::Chain& chain) {
  rp::Schedule s;
  const int n = in.ConsumeIntegralInRange<int>(0, 4 * chain.size() + 4);
  for (int k = 0; k < n && in.remaining_bytes() > 0; ++k) {
    const auto kind = static_cast<rp::OpKind>(in.ConsumeIntegralInRange<int>(0, 3));
    s.ops.push_back({kind, in.ConsumeIntegralInRange<int>(-1, chain.size() + 1)});
  }
  try {
    rp::simulate(chain, s);
  } catch (const rp::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  // L <= 10 keeps optimal()'s full DP (O(L^4 M)) at well under a millisecond.
  const rp::Chain chain = fuzz_chain(in, 10);
  ++stats.inputs;
  if (in.ConsumeIntegralInRange<int>(0, 7) == 0) {
    ++stats.random_ops;
    replay_random_ops(in, chain);
    return 0;
  }
  const rp::Plan all = rp::store_all(chain);
  const rp::Plan least = rp::min_memory(chain);
  const int64_t min_peak = rp::min_feasible_peak_bytes(chain);
  const Checker checker{chain, min_peak, all};
  checker.check(all, "store_all", -1);
  if (checker.check(least, "min_memory", -1).peak_bytes != min_peak)
    fail(describe(chain, "min_memory() does not reach min_feasible_peak_bytes " + std::to_string(min_peak)));

  // The budget: around the interesting range [min_peak, store-all peak], or anywhere.
  const int64_t hi = all.prediction.peak_bytes;
  int64_t budget;
  switch (in.ConsumeIntegralInRange<int>(0, 4)) {
    case 0: budget = min_peak; break;
    case 1: budget = min_peak - 1; break;
    case 2: budget = hi; break;
    case 3: budget = in.ConsumeIntegralInRange<int64_t>(-1, std::numeric_limits<int64_t>::max()); break;
    default: budget = in.ConsumeIntegralInRange<int64_t>(min_peak, std::max(min_peak, hi)); break;
  }
  const int slots = in.ConsumeBool() ? 500 : in.ConsumeIntegralInRange<int>(-1, 64);
  const bool exact = budget >= chain.input_bytes && budget - chain.input_bytes <= slots;
  // A chain with a menu is planned over persistent schedules only: kAll is
  // refused, and the persistent optimum is the one every other plan meets.
  const bool menu = chain.has_options();
  const int best = menu ? 1 : 0;

  // optimal() under both explicit scopes (and auto), against everything else.
  std::vector<rp::Plan> others;
  double best_ms[3] = {-1, -1, -1};
  const rp::OptimalScope scopes[3] = {rp::OptimalScope::kAll, rp::OptimalScope::kPersistent, rp::OptimalScope::kAuto};
  for (int k = 0; k < 3; ++k) {
    const std::string label = std::string("optimal(budget ") + std::to_string(budget) + ", slots " +
                              std::to_string(slots) + ", " + rp::optimal_scope_name(scopes[k]) + ")";
    try {
      const rp::Plan plan = rp::optimal(chain, budget, slots, scopes[k]);
      if (menu && scopes[k] == rp::OptimalScope::kAll) fail(describe(chain, label + ": a menu not refused in kAll"));
      best_ms[k] = checker.check(plan, label, budget, !menu && scopes[k] != rp::OptimalScope::kPersistent).time_ms;
      ++stats.optimal_ok;
      if (budget >= hi && plan.prediction.time_ms != all.prediction.time_ms)
        fail(describe(chain, label + ": store-all fits but the plan is slower"));
    } catch (const rp::Error&) {
      if (menu && scopes[k] == rp::OptimalScope::kAll) continue;
      if (budget >= hi && slots >= 1) fail(describe(chain, label + ": refused although store-all fits"));
    }
  }
  if (exact && best_ms[best] >= 0) ++stats.exact;
  if (exact && best_ms[best] < 0 && budget >= min_peak && slots >= 1)
    fail(describe(chain, "exact optimal refused a budget >= min_feasible_peak_bytes " + std::to_string(budget)));
  if (!menu && exact && best_ms[0] >= 0 && best_ms[1] >= 0 && !le_time(best_ms[0], best_ms[1], kDpRel))
    fail(describe(chain, "exact optimal: kAll slower than kPersistent, budget " + std::to_string(budget)));

  // The other algorithms, by spec (solve's parser included) or directly.
  const int runs = in.ConsumeIntegralInRange<int>(1, 6);
  for (int r = 0; r < runs; ++r) {
    const int param = in.ConsumeIntegralInRange<int>(-2, 24);
    std::string label;
    rp::Plan plan;
    int64_t plan_budget = -1;
    try {
      switch (in.ConsumeIntegralInRange<int>(0, 5)) {
        case 0:
          label = "uniform:" + std::to_string(param);
          plan = rp::uniform(chain, param);
          break;
        case 1:
          label = "sqrt";
          plan = rp::sqrt_schedule(chain);
          break;
        case 2:
          label = "revolve:" + std::to_string(param);
          plan = rp::revolve(chain, param);
          break;
        case 3:
          label = "greedy(" + std::to_string(budget) + ")";
          plan_budget = budget;
          plan = rp::greedy(chain, budget);
          break;
        case 4: {
          const char* specs[] = {"optimal", "greedy", "sqrt", "store-all", "uniform:3", "revolve:2", "bogus"};
          label = specs[in.ConsumeIntegralInRange<int>(0, 6)];
          const bool with_budget = in.ConsumeBool();
          plan_budget = with_budget ? budget : -1;
          plan = rp::solve(chain, label, plan_budget);
          if (plan_budget < 0 && (label == "optimal" || label == "greedy"))
            fail(describe(chain, "solve(\"" + label + "\") without a budget did not refuse"));
          if (label != "optimal" && label != "greedy") plan_budget = -1;
          break;
        }
        default: {
          label = "pareto";
          for (const rp::ParetoPoint& pt :
               rp::pareto(chain, in.ConsumeIntegralInRange<int>(1, 4), in.ConsumeIntegralInRange<int>(1, 64))) {
            checker.check(pt.plan, "pareto point " + std::to_string(pt.budget_bytes), pt.budget_bytes, true);
          }
          continue;
        }
      }
    } catch (const rp::Error&) {
      continue;
    }
    const rp::Prediction p = checker.check(plan, label, plan_budget, !menu && label == "optimal");
    if (exact && best_ms[best] >= 0 && p.peak_bytes <= budget) ++stats.exact_compared;
    if (exact && best_ms[best] >= 0 && p.peak_bytes <= budget && !le_time(best_ms[best], p.time_ms, kDpRel))
      fail(describe(chain, "exact optimal(budget " + std::to_string(budget) + ") slower than " + label));
  }
  return 0;
}
