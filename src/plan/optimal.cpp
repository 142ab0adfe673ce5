// optimal(): discretization and the choice between the two DPs (dp.h), the
// persistent one (rotor, Beaumont et al.) defined here, plus the exact min-peak
// recursion behind min_feasible_peak_bytes(). FullDp is in optimal_full.cpp;
// the other algorithms in heuristics.cpp. See docs/planner.md, "The DP"; the
// persistent subproblem is P(s, t, m).
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
// Time: forward_ms per forward, backward_ms per backward, except the base case
// (s == t < L-1), whose forward_save early stop cuts short: recompute_ms
// (Slots::base_ms). No other forward_save of a schedule is cut (its output
// feeds stage s+1's next forward), so the sums equal simulate()'s time.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "dp.h"
#include "internal.h"
#include "remat/plan/error.h"
#include "remat/plan/solve.h"

namespace remat::plan {
namespace internal {

namespace {
/** Option B's sweep from a_s (held) towards a_{s2}: forward(s..k) keeping
 *  only the newest value, grad_{t+1} (D units) live. One definition for the
 *  fill and choice(), so both see the same peak and the same float sums. */
struct Sweep {
  const Slots& d;
  int s, D;
  int peak = 0;  // units
  double ms = 0;
  void step(int k) {
    // a_k (dropped after this forward) shares with a_s only when k == s + 1.
    peak = std::max(peak, D + (k > s ? d.val(k, k == s + 1) : 0) + d.an[k + 1] + d.fp[k]);
    ms += d.f[k];
  }
};
}  // namespace

double PersistentDp::table_bytes(int L, int M) {
  return static_cast<double>(L) * (L + 1) / 2 * (static_cast<double>(M) + 1) * sizeof(Cost);
}

double PersistentDp::work(int L, int M) {
  const double l = L;
  return l * l * l / 6 * (static_cast<double>(M) + 1);
}

PersistentDp::PersistentDp(const Slots& s) : d_(s), width_(static_cast<size_t>(s.M) + 1) {
  const int L = d_.L, M = d_.M;
  const auto &sv = d_.sv, &ft = d_.ft, &bk = d_.bk;
  const auto &f = d_.f, &b = d_.b;
  const size_t width = width_;
  const size_t rows = static_cast<size_t>(L) * (L + 1) / 2;
  cost_.assign(rows * width, kInf);
  need_.assign(rows, M + 1);
  sat_.assign(rows, 0);
  for (int d = 0; d < L; ++d) {
    for (int s = 0; s + d < L; ++s) {
      const int t = s + d;
      const size_t r = row(s, t);
      Cost* out = &cost_[r * width];
      const int D = d_.dst(t);
      // Option A (and the base case s == t).
      {
        int lo = std::max(D + sv[s] + ft[s], bk[s]);
        sat_[r] = d == 0 ? lo : std::max(lo, sv[s] + sat_[row(s + 1, t)]);
        const Cost fb = static_cast<Cost>(f[s] + b[s]);
        if (d == 0) {
          const Cost base = static_cast<Cost>(d_.base_ms(s));
          for (int m = lo; m <= M; ++m) out[m] = base;
        } else {
          const size_t rc = row(s + 1, t);
          lo = std::max(lo, need_[rc] + sv[s]);
          const Cost* child = &cost_[rc * width] - sv[s];
          for (int m = lo; m <= M; ++m) out[m] = fb + child[m];
        }
        // The stage's other options (never cut short: no early stop under them).
        for (const Slots::Opt& o : d_.opt[s]) {
          int olo = std::max(D + o.sv + o.ft, o.bk);
          const Cost ofb = static_cast<Cost>(o.f + o.b);
          if (d == 0) {
            for (int m = olo; m <= M; ++m) out[m] = std::min(out[m], ofb);
          } else {
            const size_t rc = row(s + 1, t);
            olo = std::max(olo, need_[rc] + o.sv);
            const Cost* child = &cost_[rc * width] - o.sv;
            for (int m = olo; m <= M; ++m) out[m] = std::min(out[m], ofb + child[m]);
          }
        }
      }
      // Option B(s2): checkpoint a_{s2}. From m = sat on, option A already
      // gives the least possible time (each stage forward and backward once;
      // stage t's forward_save is cut in every schedule, the others feed
      // their successor and cannot be).
      const int hi = std::min(M, sat_[r] - 1);
      Sweep sweep{d_, s, D};
      for (int s2 = s + 1; s2 <= t; ++s2) {
        sweep.step(s2 - 1);
        if (sweep.peak > hi) break;
        const size_t rr = row(s2, t), rl = row(s, s2 - 1);
        const int as2 = d_.val(s2, s2 == s + 1);  // a_s and a_{s2} held
        const int lo = std::max({sweep.peak, need_[rr] + as2, need_[rl]});
        const Cost* right = &cost_[rr * width] - as2;
        const Cost* left = &cost_[rl * width];
        min_sum(out, right, left, static_cast<Cost>(sweep.ms), lo, hi);
      }
      int first = 0;
      while (first <= M && out[first] == kInf) ++first;
      need_[r] = first;
    }
  }
}

bool PersistentDp::feasible() const { return need_[row(0, d_.L - 1)] <= d_.M; }

Schedule PersistentDp::schedule(int m) const {
  Schedule s;
  emit(s.ops, 0, d_.L - 1, m);
  return s;
}

/** The option the fill kept for (s, t, m): -1 for A (or the base), else s'.
 *  Same arithmetic in the same order as the fill, so the match is exact. */
int PersistentDp::choice(int s, int t, int m) const {
  const auto &sv = d_.sv, &ft = d_.ft, &bk = d_.bk;
  const auto &f = d_.f, &b = d_.b;
  const size_t width = width_;
  const Cost target = cost_[row(s, t) * width + m];
  const int D = d_.dst(t);
  if (s == t) {
    if (m >= std::max(D + sv[s] + ft[s], bk[s]) && static_cast<Cost>(d_.base_ms(s)) == target) return -1;
    for (size_t k = 0; k < d_.opt[s].size(); ++k) {
      const Slots::Opt& o = d_.opt[s][k];
      if (m >= std::max(D + o.sv + o.ft, o.bk) && static_cast<Cost>(o.f + o.b) == target)
        return -2 - static_cast<int>(k);
    }
    throw Error("[remat::plan] optimal: internal error: no option reproduces the DP value.");
  }
  if (m >= std::max(D + sv[s] + ft[s], bk[s]) && m - sv[s] >= 0 &&
      static_cast<Cost>(f[s] + b[s]) + cost_[row(s + 1, t) * width + (m - sv[s])] == target)
    return -1;
  for (size_t k = 0; k < d_.opt[s].size(); ++k) {
    const Slots::Opt& o = d_.opt[s][k];
    if (m >= std::max(D + o.sv + o.ft, o.bk) && m - o.sv >= 0 &&
        static_cast<Cost>(o.f + o.b) + cost_[row(s + 1, t) * width + (m - o.sv)] == target)
      return -2 - static_cast<int>(k);
  }
  Sweep sweep{d_, s, D};
  for (int s2 = s + 1; s2 <= t; ++s2) {
    sweep.step(s2 - 1);
    if (sweep.peak > m) break;
    const int as2 = d_.val(s2, s2 == s + 1);
    if (m - as2 < 0) continue;
    const Cost c =
        static_cast<Cost>(sweep.ms) + cost_[row(s2, t) * width + (m - as2)] + cost_[row(s, s2 - 1) * width + m];
    if (c == target) return s2;
  }
  throw Error("[remat::plan] optimal: internal error: no option reproduces the DP value.");
}

void PersistentDp::emit(std::vector<Op>& ops, int s, int t, int m) const {
  while (true) {
    const int c = choice(s, t, m);
    if (c < 0) {
      const int k = -1 - c;  // the stage option
      ops.push_back({OpKind::kForwardSave, s, k});
      if (s < t) emit(ops, s + 1, t, m - (k == 0 ? d_.sv[s] : d_.opt[s][k - 1].sv));
      ops.push_back({OpKind::kBackward, s});
      return;
    }
    emit_sweep(ops, s, c);
    emit(ops, c, t, m - d_.val(c, c == s + 1));
    ops.push_back({OpKind::kDrop, c});
    t = c - 1;
  }
}

}  // namespace internal

namespace {

int64_t gcd_sizes(const Chain& chain) {
  int64_t g = std::gcd(chain.input_bytes, chain.grad_bytes(0));
  for (const Stage& s : chain.stages)
    for (int64_t v : {s.output_bytes, s.saved_bytes, s.forward_tmp_bytes, s.plain_tmp_bytes(), s.backward_tmp_bytes,
                      s.backward_freed_bytes, s.shared_input_bytes, s.grad_bytes()})
      g = std::gcd(g, v);
  for (const Stage& s : chain.stages)
    for (const StageOption& o : s.options)
      for (int64_t v : {o.saved_bytes, o.forward_tmp_bytes, o.backward_tmp_bytes, o.backward_freed_bytes})
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
    auto G = [&](int j) { return c.grad_bytes(j); };
    for (int d = 0; d < L; ++d) {
      for (int s = 0; s + d < L; ++s) {
        const int t = s + d;
        const Stage& st = c.stages[s];
        const int64_t D = t == L - 1 ? 0 : G(t + 1);
        // a_s is live at forward_save(s): s_s adds saved_bytes net of what a_{s+1} shares with it.
        const int64_t sv = st.saved_bytes - st.shared_input_bytes;
        int64_t best = std::max(D + sv + st.forward_tmp_bytes,
                                sv + G(s + 1) + G(s) + st.backward_tmp_bytes - st.backward_freed_bytes);
        // The base case's forward_save is cut short (recompute_ms) once the
        // backward has started, as in simulate().
        double best_ms =
            (d == 0 && t < L - 1 && st.recompute_ms >= 0 ? st.recompute_ms : st.forward_ms) + st.backward_ms;
        if (d > 0) {
          best = std::max(best, sv + need[row(s + 1, t)]);
          best_ms += time[row(s + 1, t)];
        }
        int best_choice = -1;
        // The stage's other options, as option A.
        for (size_t k = 0; k < st.options.size(); ++k) {
          const StageOption& o = st.options[k];
          const int64_t osv = o.saved_bytes - st.shared_input_bytes;
          int64_t v = std::max(D + osv + o.forward_tmp_bytes,
                               osv + G(s + 1) + G(s) + o.backward_tmp_bytes - o.backward_freed_bytes);
          double ms = o.forward_ms + o.backward_ms;
          if (d > 0) {
            v = std::max(v, osv + need[row(s + 1, t)]);
            ms += time[row(s + 1, t)];
          }
          if (v < best || (v == best && ms < best_ms)) {
            best = v;
            best_ms = ms;
            best_choice = -2 - static_cast<int>(k);
          }
        }
        int64_t sweep_peak = 0;
        double sweep_ms = 0;
        for (int s2 = s + 1; s2 <= t; ++s2) {
          const int k = s2 - 1;
          // As internal::Sweep: a value counts net of its predecessor while that is live.
          sweep_peak = std::max(sweep_peak, D + (k > s ? (k == s + 1 ? c.new_value_bytes(s) : A(k)) : 0) +
                                                c.new_value_bytes(k) + c.stages[k].plain_tmp_bytes());
          sweep_ms += c.stages[k].forward_ms;
          const int64_t held = s2 == s + 1 ? c.new_value_bytes(s) : A(s2);
          const int64_t v = std::max({sweep_peak, held + need[row(s2, t)], need[row(s, s2 - 1)]});
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
        ops.push_back({OpKind::kForwardSave, s, -1 - c});
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
         ". Raise memory_budget_bytes.";
}

void check_memory_slots(int memory_slots) {
  if (memory_slots < 1 || memory_slots > 1000000)
    throw Error("[remat::plan] optimal: memory_slots is " + std::to_string(memory_slots) +
                "; it must be in [1, 1000000].");
}

struct Discrete {
  int64_t unit;  // bytes per memory slot
  int M;         // slots available besides a_0
  bool exact;    // unit is the sizes' gcd: every size is a whole number of slots
};

/** unit = g (exact) when the budget spans at most memory_slots of the sizes'
 *  gcd g, else the least multiple of g giving at most memory_slots slots. */
Discrete discretize(const Chain& chain, int64_t budget_bytes, int64_t memory_slots) {
  const int64_t span = std::max<int64_t>(0, budget_bytes - chain.input_bytes);
  const int64_t g = std::max<int64_t>(1, gcd_sizes(chain));
  const int64_t unit = g * std::max<int64_t>(1, (span / g + memory_slots - 1) / memory_slots);
  return {unit, static_cast<int>(span / unit), unit == g};
}

/** The chain in slots of disc.unit, sizes rounded up (every schedule the DP
 *  accepts fits the budget) or down (every schedule that fits the budget is
 *  accepted: a sum of floors is at most the floor of the sum). */
internal::Slots to_slots(const Chain& chain, const Discrete& disc, bool round_up) {
  internal::Slots d;
  d.L = chain.size();
  d.M = disc.M;
  const int64_t unit = disc.unit;
  auto slots = [&](int64_t bytes) {
    const int64_t v = round_up ? (bytes + unit - 1) / unit : bytes / unit;
    return static_cast<int32_t>(std::min<int64_t>(v, static_cast<int64_t>(d.M) + 1));
  };
  d.a.resize(d.L + 1);
  d.an.resize(d.L + 1);
  d.g.resize(d.L + 1);
  for (int j = 0; j <= d.L; ++j) {
    d.a[j] = slots(chain.value_bytes(j));
    d.g[j] = slots(chain.grad_bytes(j));
    d.an[j] = j == 0 ? d.a[0] : slots(chain.new_value_bytes(j - 1));
    d.shared = d.shared || d.an[j] != d.a[j];
  }
  for (const Stage& st : chain.stages) {
    d.sv.push_back(slots(st.saved_bytes - st.shared_input_bytes));
    d.ft.push_back(slots(st.forward_tmp_bytes));
    d.fp.push_back(slots(st.plain_tmp_bytes()));
    const int k = static_cast<int>(d.sv.size()) - 1;
    d.bk.push_back(slots(st.saved_bytes - st.shared_input_bytes + chain.grad_bytes(k + 1) + chain.grad_bytes(k) +
                         st.backward_tmp_bytes - st.backward_freed_bytes));
    d.f.push_back(st.forward_ms);
    d.b.push_back(st.backward_ms);
    d.fr.push_back(st.recompute_ms >= 0 ? st.recompute_ms : st.forward_ms);
    d.opt.emplace_back();
    for (const StageOption& o : st.options) {
      const int64_t osv = o.saved_bytes - st.shared_input_bytes;
      d.opt.back().push_back(
          {slots(osv), slots(o.forward_tmp_bytes),
           slots(osv + chain.grad_bytes(k + 1) + chain.grad_bytes(k) + o.backward_tmp_bytes - o.backward_freed_bytes),
           o.forward_ms, o.backward_ms});
    }
  }
  return d;
}

/** Some stage shares bytes with its input (FullDp's second kind of Q rows). */
bool has_shared(const Chain& chain) {
  return std::any_of(chain.stages.begin(), chain.stages.end(), [](const Stage& s) { return s.shared_input_bytes > 0; });
}

OptimalScope resolve_scope(int L, int M, bool shared, OptimalScope scope) {
  if (scope != OptimalScope::kAuto) return scope;
  const bool cheap = internal::FullDp::work(L, M, shared) <= kOptimalAutoWork &&
                     internal::FullDp::table_bytes(L, M, shared) <= kOptimalAutoTableBytes;
  return cheap ? OptimalScope::kAll : OptimalScope::kPersistent;
}

double dp_work(OptimalScope scope, int L, double M, bool shared) {
  const int m = static_cast<int>(std::min(M, 2e9));
  return scope == OptimalScope::kAll ? internal::FullDp::work(L, m, shared) : internal::PersistentDp::work(L, m);
}

double dp_table_bytes(OptimalScope scope, int L, double M, bool shared) {
  const int m = static_cast<int>(std::min(M, 2e9));
  return scope == OptimalScope::kAll ? internal::FullDp::table_bytes(L, m, shared)
                                     : internal::PersistentDp::table_bytes(L, m);
}

/** Rounded-down schedules optimal() reconstructs (at M, M - 1, ...) and
 *  simulates, looking for one that fits in bytes. */
constexpr int kLowerTries = 64;

/** NOTE [Discretization and its bound]
 *  optimal()'s search below the store-all peak, in one scope (one DP class).
 *  best: the fastest schedule seen that fits the budget in bytes (first the
 *  exact min-peak one, which is persistent, so in both classes). lower: a
 *  lower bound on the time of every schedule of the class that fits: the
 *  store-all time at first, then the optimum of a DP over sizes rounded DOWN
 *  (each op's live bytes, <= budget - |a_0|, floor to at most M slots, so it
 *  accepts every schedule that fits), or the exact DP's optimum. A pass over
 *  sizes rounded UP returns a schedule that fits. The gap best - lower bounds
 *  what the plan can lose to the exact optimum. */
class Search {
 public:
  Search(const Chain& chain, int64_t budget_bytes, OptimalScope scope, Plan fallback, double lower_ms)
      : chain_(chain), budget_(budget_bytes), scope_(scope), best_(std::move(fallback)), lower_(lower_ms) {}

  double work() const { return work_; }
  bool done() const { return best_.prediction.time_ms - lower_ <= kOptimalGapTarget * lower_; }

  /** Sizes rounded up (exact when disc.exact): its schedule fits. */
  void fitting_pass(const Discrete& disc) {
    const internal::Slots d = to_slots(chain_, disc, true);
    account(disc);
    with_dp(d, [&](const auto& dp) {
      if (!dp.feasible()) return;
      Plan p = internal::make_plan(chain_, "optimal", dp.schedule());
      if (disc.exact) lower_ = std::max(lower_, p.prediction.time_ms);
      consider(std::move(p));
    });
  }

  /** Sizes rounded down: its optimum is a lower bound; its schedules at M,
   *  M - 1, ... may fit in bytes (the first that does is the fastest of them). */
  void lower_pass(const Discrete& disc) {
    const internal::Slots d = to_slots(chain_, disc, false);
    account(disc);
    with_dp(d, [&](const auto& dp) {
      if (!dp.feasible()) return;  // not expected: the min-peak schedule fits
      Plan top = internal::make_plan(chain_, "optimal", dp.schedule(d.M));
      lower_ = std::max(lower_, top.prediction.time_ms);
      Schedule last;
      for (int m = d.M, tries = 0; m >= dp.need() && tries < kLowerTries; --m) {
        if (static_cast<double>(dp.cost(m)) >= best_.prediction.time_ms) break;
        Schedule s = m == d.M ? top.schedule : dp.schedule(m);
        if (m < d.M && s == last) continue;  // same schedule, same peak
        ++tries;
        Plan p = m == d.M ? std::move(top) : internal::make_plan(chain_, "optimal", s);
        if (p.prediction.peak_bytes <= budget_) {
          consider(std::move(p));
          break;
        }
        last = std::move(s);
      }
    });
  }

  Plan finish() && {
    Plan p = std::move(best_);
    p.lower_bound_ms = std::min(lower_, p.prediction.time_ms);
    p.optimality_gap_ms = p.prediction.time_ms - p.lower_bound_ms;
    p.memory_unit_bytes = unit_;
    return p;
  }

 private:
  template <class Fn>
  void with_dp(const internal::Slots& d, Fn&& fn) {
    if (scope_ == OptimalScope::kAll) fn(internal::FullDp(d));
    else fn(internal::PersistentDp(d));
  }
  void account(const Discrete& disc) {
    work_ += dp_work(scope_, chain_.size(), disc.M, has_shared(chain_));
    unit_ = unit_ == 0 ? disc.unit : std::min(unit_, disc.unit);
  }
  void consider(Plan p) {
    if (p.prediction.peak_bytes <= budget_ && p.prediction.time_ms <= best_.prediction.time_ms) best_ = std::move(p);
  }

  const Chain& chain_;
  int64_t budget_;
  OptimalScope scope_;
  Plan best_;
  double lower_;
  double work_ = 0;
  int64_t unit_ = 0;
};

/** Stage options are planned by the persistent DP only: kAuto resolves to
 *  it, kAll is refused. */
OptimalScope scope_for_options(const Chain& chain, OptimalScope requested) {
  if (!chain.has_options()) return requested;
  if (requested == OptimalScope::kAll) {
    size_t i = 0;
    while (chain.stages[i].options.empty()) ++i;
    throw Error("[remat::plan] optimal: OptimalScope::kAll does not plan stage options (stage " + std::to_string(i) +
                " (\"" + chain.stages[i].name + "\") has " + std::to_string(chain.stages[i].options.size()) +
                "); use OptimalScope::kAuto or kPersistent, or leave the options out.");
  }
  return OptimalScope::kPersistent;
}

}  // namespace

OptimalScope optimal_scope(const Chain& chain, int64_t budget_bytes, int memory_slots, OptimalScope requested) {
  chain.validate();
  check_memory_slots(memory_slots);
  requested = scope_for_options(chain, requested);
  // Store-all is the least time of any schedule: optimal over all of them.
  if (store_all(chain).prediction.peak_bytes <= budget_bytes) return OptimalScope::kAll;
  return resolve_scope(chain.size(), discretize(chain, budget_bytes, memory_slots).M, has_shared(chain), requested);
}

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

PeakSite min_peak_site(const Chain& chain) {
  const Plan p = min_memory(chain);
  PeakSite site;
  site.peak_bytes = p.prediction.peak_bytes;
  const auto& ops = p.schedule.ops;
  const auto& bytes = p.prediction.op_bytes;
  size_t at = ops.size();
  for (size_t k = 0; k < ops.size(); ++k) {
    if (ops[k].kind == OpKind::kDrop) continue;
    if (at == ops.size() || bytes[k] > bytes[at]) at = k;
  }
  if (at == ops.size()) return site;  // a_0 alone
  site.op = ops[at];
  const int i = site.op.stage;
  const Stage st = chain.stages[static_cast<size_t>(i)].with_option(site.op.option);
  int64_t own = i == 0 ? 0 : chain.value_bytes(i);
  switch (site.op.kind) {
    case OpKind::kForward: own += chain.new_value_bytes(i) + st.plain_tmp_bytes(); break;
    case OpKind::kForwardSave: own += st.saved_bytes - st.shared_input_bytes + st.forward_tmp_bytes; break;
    default:
      own += st.saved_bytes - st.shared_input_bytes + chain.grad_bytes(i + 1) + chain.grad_bytes(i) +
             st.backward_tmp_bytes - st.backward_freed_bytes;
      break;
  }
  site.stage_bytes = std::clamp<int64_t>(own, 0, site.peak_bytes);
  return site;
}

Plan optimal(const Chain& chain, int64_t budget_bytes, int memory_slots, OptimalScope scope) {
  chain.validate();
  check_memory_slots(memory_slots);
  const int L = chain.size();
  if (L > 32767) throw Error("[remat::plan] optimal: " + std::to_string(L) + " stages; at most 32767.");
  scope = scope_for_options(chain, scope);
  Plan all = store_all(chain);
  if (all.prediction.peak_bytes <= budget_bytes) {
    all.algorithm = "optimal";
    all.lower_bound_ms = all.prediction.time_ms;  // each stage forward and backward once: the least
    all.optimality_gap_ms = 0;
    return all;
  }
  MinPeak mp;
  mp.run(chain);
  const int64_t min_peak = mp.peak_bytes();
  if (budget_bytes < min_peak) throw Error(budget_error(budget_bytes, min_peak));

  const Discrete first = discretize(chain, budget_bytes, memory_slots);
  const bool shared = has_shared(chain);
  scope = resolve_scope(L, first.M, shared, scope);
  const double first_table = dp_table_bytes(scope, L, first.M, shared);
  if (first_table > static_cast<double>(int64_t{4} << 30))
    throw Error("[remat::plan] optimal: the DP tables for " + std::to_string(L) + " stages and " +
                std::to_string(first.M) + " memory slots need " + format_bytes(static_cast<int64_t>(first_table)) +
                "; lower memory_slots" + (scope == OptimalScope::kAll ? " or use OptimalScope::kPersistent." : "."));

  Schedule fallback;
  mp.emit(fallback.ops, 0, L - 1);
  Search search(chain, budget_bytes, scope, internal::make_plan(chain, "optimal", std::move(fallback)),
                all.prediction.time_ms);
  // Refinement (NOTE [Discretization and its bound]): the gcd unit when it
  // costs one pass within the work bound, else twice the slots, while the
  // gap exceeds kOptimalGapTarget and the next passes stay within
  // kOptimalRefineWork (the first discretization always runs).
  const double cap = std::max(kOptimalRefineWork, 2 * dp_work(scope, L, first.M, shared));
  const double table_cap = std::max(first_table, kOptimalAutoTableBytes);
  const int64_t g = std::max<int64_t>(1, gcd_sizes(chain));
  const int64_t exact_slots = std::max<int64_t>(1, (budget_bytes - chain.input_bytes) / g);
  auto affordable = [&](double M, int passes, double budget_work) {
    return M <= 1e6 && search.work() + passes * dp_work(scope, L, M, shared) <= budget_work &&
           dp_table_bytes(scope, L, M, shared) <= table_cap;
  };
  Discrete disc = first;
  // Exact at once when that costs no more than the rounded pair.
  if (!disc.exact && affordable(static_cast<double>(exact_slots), 1, 2 * dp_work(scope, L, first.M, shared)))
    disc = discretize(chain, budget_bytes, exact_slots);
  int64_t slots = memory_slots;
  while (true) {
    if (disc.exact) {
      search.fitting_pass(disc);
      break;
    }
    search.lower_pass(disc);
    if (search.done()) break;
    search.fitting_pass(disc);
    if (search.done()) break;
    if (affordable(static_cast<double>(exact_slots), 1, cap)) {
      disc = discretize(chain, budget_bytes, exact_slots);
      continue;
    }
    slots *= 2;
    const Discrete next = discretize(chain, budget_bytes, slots);
    if (next.M <= disc.M || !affordable(next.M, 2, cap)) break;
    disc = next;
  }
  return std::move(search).finish();
}

}  // namespace remat::plan
