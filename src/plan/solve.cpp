// Dispatch by name (solve, parse_algorithm), the Pareto frontier and Revolve's
// homogeneous model as a Chain. Leaves out the algorithms themselves.
#include <algorithm>
#include <charconv>
#include <string>
#include <vector>

#include "remat/plan/error.h"
#include "remat/plan/solve.h"

namespace remat::plan {

SolveOptions parse_algorithm(std::string_view spec) {
  auto fail = [&]() -> SolveOptions {
    throw Error("[remat::plan] algorithm: unknown \"" + std::string(spec) +
                "\"; expected optimal, greedy, sqrt, store-all, uniform:K or revolve:S.");
  };
  const size_t colon = spec.find(':');
  const std::string_view name = spec.substr(0, colon);
  int param = 0;
  if (colon != std::string_view::npos) {
    const std::string_view num = spec.substr(colon + 1);
    auto [ptr, ec] = std::from_chars(num.data(), num.data() + num.size(), param);
    if (num.empty() || ec != std::errc() || ptr != num.data() + num.size() || param < 1)
      throw Error("[remat::plan] algorithm: \"" + std::string(spec) + "\" needs a positive integer after ':'.");
  }
  const bool has_param = colon != std::string_view::npos;
  if (name == "optimal" && !has_param) return SolveOptions(Algorithm::kOptimal);
  if (name == "greedy" && !has_param) return SolveOptions(Algorithm::kGreedy);
  if (name == "sqrt" && !has_param) return SolveOptions(Algorithm::kSqrt);
  if ((name == "store-all" || name == "store_all") && !has_param) return SolveOptions(Algorithm::kStoreAll);
  if (name == "uniform") return SolveOptions(Algorithm::kUniform).with_param(has_param ? param : 4);
  if (name == "revolve") return SolveOptions(Algorithm::kRevolve).with_param(has_param ? param : 4);
  return fail();
}

Plan solve(const Chain& chain, const SolveOptions& o) {
  auto need_budget = [&](const char* name) {
    if (o.budget_bytes < 0)
      throw Error(std::string("[remat::plan] ") + name + ": needs a memory budget; set budget_bytes.");
  };
  switch (o.algorithm) {
    case Algorithm::kStoreAll: return store_all(chain);
    case Algorithm::kUniform: return uniform(chain, o.param > 0 ? o.param : 4);
    case Algorithm::kSqrt: return sqrt_schedule(chain);
    case Algorithm::kGreedy: need_budget("greedy"); return greedy(chain, o.budget_bytes);
    case Algorithm::kRevolve: return revolve(chain, o.param > 0 ? o.param : 4);
    case Algorithm::kOptimal: need_budget("optimal"); return optimal(chain, o.budget_bytes, o.memory_slots, o.scope);
  }
  throw Error("[remat::plan] solve: unknown algorithm.");
}

OptimalScope parse_optimal_scope(std::string_view text) {
  if (text == "auto") return OptimalScope::kAuto;
  if (text == "all") return OptimalScope::kAll;
  if (text == "persistent") return OptimalScope::kPersistent;
  throw Error("[remat::plan] scope: unknown \"" + std::string(text) + "\"; expected auto, all or persistent.");
}

const char* optimal_scope_name(OptimalScope scope) {
  switch (scope) {
    case OptimalScope::kAuto: return "auto";
    case OptimalScope::kAll: return "all";
    case OptimalScope::kPersistent: return "persistent";
  }
  return "?";
}

Plan solve(const Chain& chain, std::string_view spec, int64_t budget_bytes) {
  return solve(chain, parse_algorithm(spec).with_budget_bytes(budget_bytes));
}

std::vector<ParetoPoint> pareto(const Chain& chain, int points, int memory_slots, OptimalScope scope) {
  chain.validate();
  if (points < 2) throw Error("[remat::plan] pareto: points is " + std::to_string(points) + "; it must be >= 2.");
  const int64_t lo = min_feasible_peak_bytes(chain);
  const int64_t hi = store_all(chain).prediction.peak_bytes;
  std::vector<ParetoPoint> all;
  for (int k = 0; k < points; ++k) {
    const int64_t budget = lo + static_cast<int64_t>(static_cast<long double>(hi - lo) * k / (points - 1));
    all.push_back({budget, optimal(chain, budget, memory_slots, scope)});
    if (budget >= hi) break;
  }
  std::vector<ParetoPoint> front;
  for (const ParetoPoint& p : all) {
    const auto& q = p.plan.prediction;
    bool dominated = false;
    for (const ParetoPoint& o : all) {
      const auto& r = o.plan.prediction;
      if ((r.peak_bytes <= q.peak_bytes && r.time_ms < q.time_ms) ||
          (r.peak_bytes < q.peak_bytes && r.time_ms <= q.time_ms))
        dominated = true;
    }
    const bool duplicate = std::any_of(front.begin(), front.end(), [&](const ParetoPoint& f) {
      return f.plan.prediction.peak_bytes == q.peak_bytes && f.plan.prediction.time_ms == q.time_ms;
    });
    if (!dominated && !duplicate) front.push_back(p);
  }
  std::sort(front.begin(), front.end(), [](const ParetoPoint& x, const ParetoPoint& y) {
    return x.plan.prediction.peak_bytes < y.plan.prediction.peak_bytes;
  });
  return front;
}

HomogeneousProblem homogeneous_problem(int steps, int slots) {
  if (steps < 1) throw Error("[remat::plan] homogeneous: steps is " + std::to_string(steps) + "; it must be >= 1.");
  if (slots < 1)
    throw Error("[remat::plan] homogeneous: slots is " + std::to_string(slots) +
                "; it must be >= 1 (a_0 occupies one).");
  HomogeneousProblem h;
  h.chain.input_bytes = 1;
  for (int i = 0; i < steps; ++i) h.chain.stages.push_back({"step" + std::to_string(i), 1.0, 0.0, 1, slots + 1, 0, 0});
  h.budget_bytes = 2 * static_cast<int64_t>(slots) + 4;
  return h;
}

}  // namespace remat::plan
