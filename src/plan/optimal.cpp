// optimal(): the rotor dynamic program (Beaumont et al.) over discretized
// memory, plus the exact min-peak recursion behind min_feasible_peak_bytes().
// Leaves out the other algorithms (heuristics.cpp). See docs/planner.md,
// "The DP", for the recurrence; the subproblem below is P(s, t, m).
//
// NOTE [Subproblem P(s, t, m)]
// Stages s..t must be taken from "a_s live (held by the caller), grad_{t+1}
// live" to "a_s and grad_s live", everything of stages s..t freed, while the
// bytes the subproblem adds (grad_{t+1}, grad_s, its values, saved sets and
// temporaries) never exceed m. For t = L-1 grad_L only appears at backward(L-1)
// (it is the loss gradient), so dst(t) below is 0 then. Options:
//  A: forward_save(s), P(s+1, t, m - saved_s), backward(s).
//  B(s'): forward s..s'-1 keeping only a_{s'}, P(s', t, m - |a_{s'}|),
//         drop(s'), P(s, s'-1, m).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "internal.h"
#include "remat/plan/error.h"
#include "remat/plan/solve.h"

namespace remat::plan {
namespace {

/** The DP's time type: float halves the table's memory traffic (the DP is
 *  bandwidth-bound) at a relative precision of ~6e-8 on times. */
using Cost = float;
constexpr Cost kInf = std::numeric_limits<Cost>::infinity();

struct Dp {
  int L = 0;
  int M = 0;  // slots available to P(0, L-1)
  std::vector<int32_t> a;   // |a_j| (and |grad_j|) in slots, j in [0, L]
  std::vector<int32_t> sv;  // saved_bytes in slots
  std::vector<int32_t> ft, bt;
  std::vector<double> f, b;
  std::vector<Cost> cost;         // (row, m) -> minimal time, kInf if infeasible
  std::vector<int32_t> need;      // row -> smallest feasible m (M + 1 if none)
  std::vector<int32_t> sat;       // row -> m from which store-all (option A all the way) fits
  // No argmin table: emit() re-evaluates the options of the few cells it visits,
  // which keeps the inner loop a plain vectorizable min.

  size_t row(int s, int t) const { return static_cast<size_t>(t) * (t + 1) / 2 + s; }
  int dst(int t) const { return t == L - 1 ? 0 : a[t + 1]; }

  void run() {
    const size_t width = static_cast<size_t>(M) + 1;
    const size_t rows = static_cast<size_t>(L) * (L + 1) / 2;
    cost.assign(rows * width, kInf);
    need.assign(rows, M + 1);
    sat.assign(rows, 0);
    for (int d = 0; d < L; ++d) {
      for (int s = 0; s + d < L; ++s) {
        const int t = s + d;
        const size_t r = row(s, t);
        Cost* out = &cost[r * width];
        const int D = dst(t);
        // Option A (and the base case s == t).
        {
          int lo = std::max(D + sv[s] + ft[s], sv[s] + a[s + 1] + a[s] + bt[s]);
          sat[r] = d == 0 ? lo : std::max(lo, sv[s] + sat[row(s + 1, t)]);
          const Cost fb = static_cast<Cost>(f[s] + b[s]);
          if (d == 0) {
            for (int m = lo; m <= M; ++m) out[m] = fb;
          } else {
            const size_t rc = row(s + 1, t);
            lo = std::max(lo, need[rc] + sv[s]);
            const Cost* child = &cost[rc * width] - sv[s];
            for (int m = lo; m <= M; ++m) out[m] = fb + child[m];
          }
        }
        // Option B(s2): checkpoint a_{s2}. From m = sat on, option A already
        // gives the least possible time (each stage forward and backward once).
        const int hi = std::min(M, sat[r] - 1);
        int sweep_peak = 0;
        double sweep_ms = 0;
        for (int s2 = s + 1; s2 <= t; ++s2) {
          const int k = s2 - 1;
          sweep_peak = std::max(sweep_peak, D + (k > s ? a[k] : 0) + a[k + 1] + ft[k]);
          sweep_ms += f[k];
          if (sweep_peak > hi) break;
          const size_t rr = row(s2, t), rl = row(s, s2 - 1);
          const int lo = std::max({sweep_peak, need[rr] + a[s2], need[rl]});
          const Cost* right = &cost[rr * width] - a[s2];
          const Cost* left = &cost[rl * width];
          const Cost sweep = static_cast<Cost>(sweep_ms);
          for (int m = lo; m <= hi; ++m) {
            const Cost c = sweep + right[m] + left[m];
            out[m] = c < out[m] ? c : out[m];
          }
        }
        int first = 0;
        while (first <= M && out[first] == kInf) ++first;
        need[r] = first;
      }
    }
  }

  /** The option run() kept for (s, t, m): -1 for A (or the base), else s'.
   *  Same arithmetic in the same order as run(), so the match is exact. */
  int choice(int s, int t, int m) const {
    const size_t width = static_cast<size_t>(M) + 1;
    const Cost target = cost[row(s, t) * width + m];
    const int D = dst(t);
    if (s == t) return -1;
    if (m >= std::max(D + sv[s] + ft[s], sv[s] + a[s + 1] + a[s] + bt[s]) && m - sv[s] >= 0 &&
        static_cast<Cost>(f[s] + b[s]) + cost[row(s + 1, t) * width + (m - sv[s])] == target)
      return -1;
    int sweep_peak = 0;
    double sweep_ms = 0;
    for (int s2 = s + 1; s2 <= t; ++s2) {
      const int k = s2 - 1;
      sweep_peak = std::max(sweep_peak, D + (k > s ? a[k] : 0) + a[k + 1] + ft[k]);
      sweep_ms += f[k];
      if (sweep_peak > m) break;
      if (m - a[s2] < 0) continue;
      const Cost c = static_cast<Cost>(sweep_ms) + cost[row(s2, t) * width + (m - a[s2])] + cost[row(s, s2 - 1) * width + m];
      if (c == target) return s2;
    }
    throw Error("[remat::plan] optimal: internal error: no option reproduces the DP value.");
  }

  void emit(std::vector<Op>& ops, int s, int t, int m) const {
    while (true) {
      const int c = choice(s, t, m);
      if (c < 0) {
        ops.push_back({OpKind::kForwardSave, s});
        if (s < t) emit(ops, s + 1, t, m - sv[s]);
        ops.push_back({OpKind::kBackward, s});
        return;
      }
      internal::emit_sweep(ops, s, c);
      emit(ops, c, t, m - a[c]);
      ops.push_back({OpKind::kDrop, c});
      t = c - 1;
    }
  }
};

int64_t gcd_sizes(const Chain& chain) {
  int64_t g = chain.input_bytes;
  for (const Stage& s : chain.stages)
    for (int64_t v : {s.output_bytes, s.saved_bytes, s.forward_tmp_bytes, s.backward_tmp_bytes})
      g = std::gcd(g, v);
  return g;
}

/** Exact (bytes) recursion minimizing the subproblem's added peak; ties broken
 *  by time. Same options as the DP. */
struct MinPeak {
  int L = 0;
  std::vector<int64_t> need;
  std::vector<double> time;
  std::vector<int> choice;
  const Chain* chain = nullptr;

  size_t row(int s, int t) const { return static_cast<size_t>(t) * (t + 1) / 2 + s; }

  void run(const Chain& c) {
    chain = &c;
    L = c.size();
    const size_t rows = static_cast<size_t>(L) * (L + 1) / 2;
    need.assign(rows, 0);
    time.assign(rows, 0);
    choice.assign(rows, -1);
    auto A = [&](int j) { return c.value_bytes(j); };
    for (int d = 0; d < L; ++d) {
      for (int s = 0; s + d < L; ++s) {
        const int t = s + d;
        const Stage& st = c.stages[s];
        const int64_t D = t == L - 1 ? 0 : A(t + 1);
        int64_t best = std::max(D + st.saved_bytes + st.forward_tmp_bytes,
                                st.saved_bytes + A(s + 1) + A(s) + st.backward_tmp_bytes);
        double best_ms = st.forward_ms + st.backward_ms;
        if (d > 0) {
          best = std::max(best, st.saved_bytes + need[row(s + 1, t)]);
          best_ms += time[row(s + 1, t)];
        }
        int best_choice = -1;
        int64_t sweep_peak = 0;
        double sweep_ms = 0;
        for (int s2 = s + 1; s2 <= t; ++s2) {
          const int k = s2 - 1;
          sweep_peak = std::max(sweep_peak, D + (k > s ? A(k) : 0) + A(k + 1) + c.stages[k].forward_tmp_bytes);
          sweep_ms += c.stages[k].forward_ms;
          const int64_t v = std::max({sweep_peak, A(s2) + need[row(s2, t)], need[row(s, s2 - 1)]});
          const double ms = sweep_ms + time[row(s2, t)] + time[row(s, s2 - 1)];
          if (v < best || (v == best && ms < best_ms)) {
            best = v;
            best_ms = ms;
            best_choice = s2;
          }
        }
        need[row(s, t)] = best;
        time[row(s, t)] = best_ms;
        choice[row(s, t)] = best_choice;
      }
    }
  }

  int64_t peak_bytes() const { return chain->input_bytes + need[row(0, L - 1)]; }

  void emit(std::vector<Op>& ops, int s, int t) const {
    while (true) {
      const int c = choice[row(s, t)];
      if (c < 0) {
        ops.push_back({OpKind::kForwardSave, s});
        if (s < t) emit(ops, s + 1, t);
        ops.push_back({OpKind::kBackward, s});
        return;
      }
      internal::emit_sweep(ops, s, c);
      emit(ops, c, t);
      ops.push_back({OpKind::kDrop, c});
      t = c - 1;
    }
  }
};

std::string budget_error(int64_t budget_bytes, int64_t min_peak) {
  std::string b = format_bytes(budget_bytes), p = format_bytes(min_peak);
  if (b == p) {
    b += " (" + std::to_string(budget_bytes) + " bytes)";
    p += " (" + std::to_string(min_peak) + " bytes)";
  }
  return "[remat::plan] no schedule fits in " + b + "; the smallest feasible peak is " + p +
         ". Raise memory_budget_bytes or allow offload.";
}

}  // namespace

int64_t min_feasible_peak_bytes(const Chain& chain) {
  chain.validate();
  MinPeak mp;
  mp.run(chain);
  return mp.peak_bytes();
}

Plan min_memory(const Chain& chain) {
  chain.validate();
  MinPeak mp;
  mp.run(chain);
  Schedule s;
  mp.emit(s.ops, 0, chain.size() - 1);
  return internal::make_plan(chain, "min-memory", std::move(s));
}

Plan optimal(const Chain& chain, int64_t budget_bytes, int memory_slots) {
  chain.validate();
  if (memory_slots < 1 || memory_slots > 1000000)
    throw Error("[remat::plan] optimal: memory_slots is " + std::to_string(memory_slots) +
                "; it must be in [1, 1000000].");
  const int L = chain.size();
  if (L > 32767) throw Error("[remat::plan] optimal: " + std::to_string(L) + " stages; at most 32767.");
  Plan all = store_all(chain);
  if (all.prediction.peak_bytes <= budget_bytes) {
    all.algorithm = "optimal";
    return all;
  }
  MinPeak mp;
  mp.run(chain);
  const int64_t min_peak = mp.peak_bytes();
  if (budget_bytes < min_peak) throw Error(budget_error(budget_bytes, min_peak));

  // Discretize: unit = g (exact) when the budget spans at most memory_slots of
  // the sizes' gcd, else a multiple of g; sizes round up, so a schedule the DP
  // accepts has simulated peak <= budget.
  const int64_t span = budget_bytes - chain.input_bytes;
  const int64_t g = std::max<int64_t>(1, gcd_sizes(chain));
  const int64_t unit = g * std::max<int64_t>(1, (span / g + memory_slots - 1) / memory_slots);
  Dp dp;
  dp.L = L;
  dp.M = static_cast<int>(span / unit);
  const size_t table_bytes = static_cast<size_t>(L) * (L + 1) / 2 * (dp.M + 1) * sizeof(Cost);
  if (table_bytes > (size_t{4} << 30))
    throw Error("[remat::plan] optimal: the DP table for " + std::to_string(L) + " stages and " +
                std::to_string(dp.M) + " memory slots needs " + format_bytes(static_cast<int64_t>(table_bytes)) +
                "; lower memory_slots.");
  auto slots = [&](int64_t bytes) {
    const int64_t v = (bytes + unit - 1) / unit;
    return static_cast<int32_t>(std::min<int64_t>(v, static_cast<int64_t>(dp.M) + 1));
  };
  dp.a.resize(L + 1);
  for (int j = 0; j <= L; ++j) dp.a[j] = slots(chain.value_bytes(j));
  for (const Stage& st : chain.stages) {
    dp.sv.push_back(slots(st.saved_bytes));
    dp.ft.push_back(slots(st.forward_tmp_bytes));
    dp.bt.push_back(slots(st.backward_tmp_bytes));
    dp.f.push_back(st.forward_ms);
    dp.b.push_back(st.backward_ms);
  }
  dp.run();

  Schedule fallback;
  mp.emit(fallback.ops, 0, L - 1);
  Plan best = internal::make_plan(chain, "optimal", std::move(fallback));
  if (dp.need[dp.row(0, L - 1)] <= dp.M) {
    Schedule s;
    dp.emit(s.ops, 0, L - 1, dp.M);
    Plan p = internal::make_plan(chain, "optimal", std::move(s));
    if (p.prediction.time_ms <= best.prediction.time_ms) best = std::move(p);
  }
  return best;
}

}  // namespace remat::plan
