// Tests of the algorithms: optimal() against an exhaustive search over all
// schedules (exact bytes, tests/plan/exhaustive.h), feasibility and
// monotonicity in the budget, optimal vs the heuristics, Revolve's counts in
// the homogeneous model, and the infeasible-budget error. Leaves out the
// simulator's own checks (simulate_test.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <random>

#include "exhaustive.h"
#include "remat/plan/plan.h"

namespace rp = remat::plan;

namespace {

/** Heterogeneous random chain; sizes are multiples of unit_bytes in [1, max_units]. */
rp::Chain random_chain(std::mt19937& rng, int L, int64_t unit_bytes, int max_units, bool tmps, bool freed = false) {
  std::uniform_int_distribution<int> units(1, max_units), extra(0, max_units), tmp(0, max_units / 2);
  std::uniform_real_distribution<double> ms(0.1, 5.0);
  rp::Chain c;
  c.input_bytes = units(rng) * unit_bytes;
  for (int i = 0; i < L; ++i) {
    rp::Stage s;
    s.name = "s" + std::to_string(i);
    s.forward_ms = std::round(ms(rng) * 100) / 100;
    s.backward_ms = std::round(2 * ms(rng) * 100) / 100;
    s.output_bytes = units(rng) * unit_bytes;
    s.saved_bytes = s.output_bytes + extra(rng) * unit_bytes;
    if (tmps) {
      s.forward_tmp_bytes = tmp(rng) * unit_bytes;
      s.backward_tmp_bytes = tmp(rng) * unit_bytes;
    }
    if (freed) {  // what a runtime that frees as it goes has released when the backward peaks
      std::uniform_int_distribution<int64_t> f(0, (s.saved_bytes + s.output_bytes) / unit_bytes);
      s.backward_freed_bytes = f(rng) * unit_bytes;
    }
    c.stages.push_back(s);
  }
  return c;
}

std::string error_of(auto&& fn) {
  try {
    fn();
  } catch (const rp::Error& e) {
    return e.what();
  }
  return "(no error)";
}

int64_t beta(int64_t c, int64_t r) {  // (c+r)! / (c! r!)
  if (r < 0) return 0;
  int64_t v = 1;
  for (int64_t k = 1; k <= r; ++k) v = v * (c + k) / k;
  return v;
}

int64_t revolve_t(int64_t l, int64_t c) {  // Griewank & Walther's minimal recomputations
  if (l == 1) return 0;
  int64_t r = 1;
  while (!(beta(c, r - 1) < l && l <= beta(c, r))) ++r;
  return r * l - beta(c + 1, r - 1);
}

}  // namespace

// Exact comparison: sizes are small integers, so the DP's unit is the sizes'
// gcd and its discretization is exact; the exhaustive searches use exact bytes.
// optimal() (OptimalScope::kAll, what kAuto picks at this size) must equal the
// search over all schedules; OptimalScope::kPersistent (rotor's recursion) must
// equal the search over the persistent class, which all schedules sometimes
// beat (a checkpoint dropped after its last use and its range redone from an
// earlier one).
TEST(Optimal, EqualsExhaustiveSearchOnSmallChains) {
  std::mt19937 rng(20240601);
  int compared = 0, below_store_all = 0, beats_persistent = 0;
  double most = 0;
  for (int trial = 0; trial < 210; ++trial) {
    const int L = 1 + trial % 7;
    const rp::Chain c = random_chain(rng, L, 1, 12, trial % 3 != 0);
    const rp::testing::Exhaustive persistent(c, rp::testing::Space::kPersistent);
    const rp::testing::Exhaustive all(c, rp::testing::Space::kAll);
    const int64_t min_peak = all.min_peak_bytes();
    ASSERT_EQ(rp::min_feasible_peak_bytes(c), min_peak) << "trial " << trial;
    ASSERT_EQ(persistent.min_peak_bytes(), min_peak) << "trial " << trial;
    EXPECT_EQ(rp::min_memory(c).prediction.peak_bytes, min_peak) << "trial " << trial;
    const int64_t all_peak = rp::store_all(c).prediction.peak_bytes;
    EXPECT_TRUE(std::isinf(all.min_time_ms(min_peak - 1)));
    EXPECT_NE(error_of([&] { rp::optimal(c, min_peak - 1); }).find("no schedule fits"), std::string::npos);
    for (int k = 0; k <= 6; ++k) {
      const int64_t budget = min_peak + (all_peak - min_peak) * k / 6 + (k == 1 ? 1 : 0);
      const rp::Plan p = rp::optimal(c, budget);
      const rp::Plan p_all = rp::optimal(c, budget, 500, rp::OptimalScope::kAll);
      const rp::Plan p_rotor = rp::optimal(c, budget, 500, rp::OptimalScope::kPersistent);
      const double best = all.min_time_ms(budget);
      ASSERT_NEAR(p.prediction.time_ms, best, 1e-9) << "trial " << trial << " L " << L << " budget " << budget;
      ASSERT_EQ(p.schedule, p_all.schedule) << "trial " << trial;
      ASSERT_NEAR(p_rotor.prediction.time_ms, persistent.min_time_ms(budget), 1e-9)
          << "trial " << trial << " L " << L << " budget " << budget;
      EXPECT_LE(p.prediction.peak_bytes, budget);
      EXPECT_LE(p_rotor.prediction.peak_bytes, budget);
      // Exact units (gcd 1, span within 500 slots): proven optimal.
      EXPECT_EQ(p.optimality_gap_ms, 0) << "trial " << trial;
      EXPECT_EQ(p.memory_unit_bytes, budget < all_peak ? 1 : 0) << "trial " << trial;  // 0: store-all, no DP
      if (p_rotor.prediction.time_ms > best + 1e-9) {
        ++beats_persistent;
        most = std::max(most, p_rotor.prediction.time_ms / best - 1);
      }
      ++compared;
      below_store_all += budget < all_peak;
    }
  }
  // The class gap is real in this sample (the chains are fixed by the seed).
  EXPECT_GT(beats_persistent, 0);
  std::printf(
      "optimal == exhaustive over all schedules on %d (chain, budget) pairs, %d below the store-all "
      "peak; the persistent class is slower in %d of them (by up to %.1f%%)\n",
      compared, below_store_all, beats_persistent, 100 * most);
}

namespace {

struct Compared {
  int changed = 0;       // optimal()'s schedules that differ from those on `before`
  int64_t min_peak = 0;  // the exhaustive search's least peak
};

/** Both DP scopes equal the exhaustive searches on c at six budgets from its
 *  least peak to store-all's (plans within budget, no gap, times those of
 *  simulate()). Adds the pairs compared to *compared, and counts the
 *  schedules that differ from optimal()'s on `before` (c without the field
 *  under test) where that is feasible. */
Compared expect_optimal_equals_exhaustive(const rp::Chain& c, const rp::Chain& before, int trial, int* compared) {
  const rp::testing::Exhaustive persistent(c, rp::testing::Space::kPersistent);
  const rp::testing::Exhaustive all(c, rp::testing::Space::kAll);
  const int64_t min_peak = all.min_peak_bytes(), all_peak = rp::store_all(c).prediction.peak_bytes;
  Compared r;
  r.min_peak = min_peak;
  for (int k = 0; k < 6; ++k) {
    const int64_t budget = min_peak + (all_peak - min_peak) * k / 6;
    const rp::Plan p_all = rp::optimal(c, budget, 500, rp::OptimalScope::kAll);
    const rp::Plan p_rotor = rp::optimal(c, budget, 500, rp::OptimalScope::kPersistent);
    EXPECT_NEAR(p_all.prediction.time_ms, all.min_time_ms(budget), 1e-9) << "trial " << trial << " budget " << budget;
    EXPECT_NEAR(p_rotor.prediction.time_ms, persistent.min_time_ms(budget), 1e-9)
        << "trial " << trial << " budget " << budget;
    EXPECT_LE(p_all.prediction.peak_bytes, budget);
    EXPECT_LE(p_rotor.prediction.peak_bytes, budget);
    EXPECT_EQ(p_all.optimality_gap_ms, 0) << "trial " << trial;
    EXPECT_DOUBLE_EQ(p_all.prediction.time_ms, rp::simulate(c, p_all.schedule).time_ms);
    if (budget >= rp::min_feasible_peak_bytes(before))
      r.changed += p_all.schedule != rp::optimal(before, budget, 500, rp::OptimalScope::kAll).schedule;
    ++*compared;
  }
  return r;
}

}  // namespace

// Early stop's cut recomputes (Stage::recompute_ms, a forward_save followed by
// its own backward once backward has started) enter the DPs' base case: both
// scopes still equal the exhaustive searches, which price each op on its own
// (tests/plan/exhaustive.h), and the DP prefers the schedules whose
// recomputes are cut (here recompute_ms is 5-40% of forward_ms).
TEST(Optimal, EqualsExhaustiveSearchWithCutRecomputes) {
  std::mt19937 rng(20261202);
  std::uniform_real_distribution<double> share(0.05, 0.4);
  int compared = 0, changed = 0;
  for (int trial = 0; trial < 140; ++trial) {
    const int L = 2 + trial % 6;
    rp::Chain c = random_chain(rng, L, 1, 12, trial % 2 == 0);
    const rp::Chain uncut = c;
    for (auto& s : c.stages)
      if (trial % 4 != 3 || s.name != "s0") s.recompute_ms = std::round(s.forward_ms * share(rng) * 100) / 100;
    changed += expect_optimal_equals_exhaustive(c, uncut, trial, &compared).changed;
  }
  // Pricing the cut changes the chosen schedule on part of the sample.
  EXPECT_GT(changed, 0);
  std::printf(
      "with cut recomputes: optimal == exhaustive on %d (chain, budget) pairs; %d schedules differ from "
      "the uncut DP's\n",
      compared, changed);
}

// A plain forward's temporaries differ from a forward_save's (without
// autograd the intermediates are freed as they die instead of being saved):
// Stage::plain_forward_tmp_bytes prices the sweeps' forwards apart, and the
// min-peak recursion and both DP scopes still equal the exhaustive searches.
TEST(Optimal, EqualsExhaustiveSearchWithPlainForwardTemporaries) {
  std::mt19937 rng(20261203);
  int compared = 0, changed = 0;
  for (int trial = 0; trial < 140; ++trial) {
    const int L = 2 + trial % 6;
    rp::Chain c = random_chain(rng, L, 1, 12, true);
    const rp::Chain same = c;
    std::uniform_int_distribution<int> units(0, 36);  // up to 3x the largest value: sweeps can bind
    for (auto& s : c.stages) s.plain_forward_tmp_bytes = units(rng);
    const Compared r = expect_optimal_equals_exhaustive(c, same, trial, &compared);
    changed += r.changed;
    ASSERT_EQ(rp::min_feasible_peak_bytes(c), r.min_peak) << "trial " << trial;
    ASSERT_EQ(rp::min_memory(c).prediction.peak_bytes, r.min_peak) << "trial " << trial;
  }
  EXPECT_GT(changed, 0);
  std::printf(
      "with plain-forward temporaries: optimal == exhaustive on %d (chain, budget) pairs; %d schedules differ\n",
      compared, changed);
}

// Stage::shared_input_bytes (a residual head passing its input on, (h, x)):
// the bytes count once while a value and the predecessor it came from are
// both live; on odd trials also Stage::output_grad_bytes, a gradient of
// another size than its value. simulate(), the min-peak recursion and both DP scopes (FullDp
// with its two kinds of Q rows) equal the exhaustive searches, which track
// the pairs on their own; and the sharing changes the chosen schedules.
TEST(Optimal, EqualsExhaustiveSearchWithSharedInputBytes) {
  std::mt19937 rng(20261204);
  int compared = 0, changed = 0, lower = 0;
  for (int trial = 0; trial < 140; ++trial) {
    const int L = 2 + trial % 6;
    rp::Chain c = random_chain(rng, L, 1, 12, trial % 2 == 0, /*freed=*/trial % 3 == 0);
    const rp::Chain unshared = c;
    for (int i = 0; i < L; ++i) {
      if ((trial + i) % 3 == 2) continue;  // some stages share nothing
      std::uniform_int_distribution<int64_t> h(1, std::min(c.value_bytes(i), c.stages[i].output_bytes));
      rp::Stage& st = c.stages[i];
      st.shared_input_bytes = h(rng);
      if (trial % 2 == 1) {  // a gradient other than the value's size (a chain input passed on, a mask)
        std::uniform_int_distribution<int64_t> g(0, 2 * st.output_bytes);
        st.output_grad_bytes = g(rng);
      }
      // What the input still holds is not the backward's to free.
      st.backward_freed_bytes =
          std::min(st.backward_freed_bytes, st.saved_bytes + st.grad_bytes() - st.shared_input_bytes);
    }
    const Compared r = expect_optimal_equals_exhaustive(c, unshared, trial, &compared);
    changed += r.changed;
    ASSERT_EQ(rp::min_feasible_peak_bytes(c), r.min_peak) << "trial " << trial;
    ASSERT_EQ(rp::min_memory(c).prediction.peak_bytes, r.min_peak) << "trial " << trial;
    ASSERT_EQ(rp::testing::Exhaustive(c, rp::testing::Space::kPersistent).min_peak_bytes(), r.min_peak);
    lower += r.min_peak < rp::min_feasible_peak_bytes(unshared);
  }
  EXPECT_EQ(compared, 140 * 6);
  EXPECT_GT(changed, 0);
  EXPECT_GT(lower, 0);  // sharing lowers the smallest feasible peak on part of the sample
  std::printf(
      "with shared input bytes: optimal == exhaustive on %d (chain, budget) pairs; %d schedules differ, "
      "%d smallest peaks lower\n",
      compared, changed, lower);
}

// The same field at sizes the DP must round (no common unit): every plan fits
// its budget, and its lower bound, a bound on the exact optimum of the
// chain with sharing, is at most the time of the optimal plan for the chain
// without it (sharing only ever lowers a schedule's peak).
TEST(Optimal, SharedInputBytesRoundedPlansFitAndNeverLoseToUnshared) {
  std::mt19937 rng(20261205);
  int compared = 0;
  for (int trial = 0; trial < 8; ++trial) {
    rp::Chain c = random_chain(rng, 10 + 2 * trial, 1, 1 << 20, true);
    const rp::Chain unshared = c;
    for (int i = 1; i < c.size(); i += 2) {  // every other stage a residual head passing its input on
      rp::Stage& st = c.stages[i];
      st.shared_input_bytes = std::min(c.value_bytes(i), st.output_bytes);
    }
    const int64_t lo = rp::min_feasible_peak_bytes(unshared), hi = rp::store_all(unshared).prediction.peak_bytes;
    EXPECT_LE(rp::min_feasible_peak_bytes(c), lo);
    for (int k = 0; k <= 4; ++k) {
      const int64_t budget = lo + (hi - lo) * k / 4;
      for (auto scope : {rp::OptimalScope::kAll, rp::OptimalScope::kPersistent}) {
        const rp::Plan p = rp::optimal(c, budget, 500, scope);
        const rp::Plan q = rp::optimal(unshared, budget, 500, scope);
        EXPECT_LE(p.prediction.peak_bytes, budget) << "trial " << trial << " k " << k;
        EXPECT_EQ(p.prediction.peak_bytes, rp::simulate(c, p.schedule).peak_bytes);
        EXPECT_LE(p.lower_bound_ms, q.prediction.time_ms * (1 + 1e-9)) << "trial " << trial << " k " << k;
        ++compared;
      }
    }
  }
  EXPECT_EQ(compared, 80);
}

// backward_freed_bytes (the profiler's measure of what remat's runtime frees
// inside a backward) enters the DP's rounded backward term once: optimal and
// its persistent scope still equal the exhaustive searches.
TEST(Optimal, EqualsExhaustiveSearchWithBackwardFreedBytes) {
  std::mt19937 rng(20261201);
  int compared = 0;
  for (int trial = 0; trial < 120; ++trial) {
    const int L = 1 + trial % 7;
    const rp::Chain c = random_chain(rng, L, 1, 12, trial % 2 == 0, /*freed=*/true);
    const rp::testing::Exhaustive persistent(c, rp::testing::Space::kPersistent);
    const rp::testing::Exhaustive all(c, rp::testing::Space::kAll);
    const int64_t min_peak = all.min_peak_bytes();
    ASSERT_EQ(rp::min_feasible_peak_bytes(c), min_peak) << "trial " << trial;
    ASSERT_EQ(persistent.min_peak_bytes(), min_peak) << "trial " << trial;
    const int64_t all_peak = rp::store_all(c).prediction.peak_bytes;
    for (int k = 0; k <= 4; ++k) {
      const int64_t budget = min_peak + (all_peak - min_peak) * k / 4;
      const rp::Plan p = rp::optimal(c, budget);
      const rp::Plan p_rotor = rp::optimal(c, budget, 500, rp::OptimalScope::kPersistent);
      ASSERT_NEAR(p.prediction.time_ms, all.min_time_ms(budget), 1e-9) << "trial " << trial << " budget " << budget;
      ASSERT_NEAR(p_rotor.prediction.time_ms, persistent.min_time_ms(budget), 1e-9) << "trial " << trial;
      EXPECT_LE(p.prediction.peak_bytes, budget);
      ++compared;
    }
  }
  EXPECT_EQ(compared, 600);
}

// The same at L = 8 (the exhaustive search's limit) with a wider size range,
// where the persistent class loses more often.
TEST(Optimal, EqualsExhaustiveSearchOnEightStagesWideSizes) {
  std::mt19937 rng(8);
  int compared = 0, beats_persistent = 0;
  for (int trial = 0; trial < 40; ++trial) {
    const rp::Chain c = random_chain(rng, 8, 1, 40, trial % 2 == 0);
    const rp::testing::Exhaustive all(c, rp::testing::Space::kAll);
    const int64_t lo = all.min_peak_bytes(), hi = rp::store_all(c).prediction.peak_bytes;
    ASSERT_EQ(rp::min_feasible_peak_bytes(c), lo) << "trial " << trial;
    for (int k = 0; k <= 6; ++k) {
      const int64_t budget = lo + (hi - lo) * k / 6 + (k == 1 ? 1 : 0);
      const rp::Plan p = rp::optimal(c, budget);
      ASSERT_NEAR(p.prediction.time_ms, all.min_time_ms(budget), 1e-9) << "trial " << trial << " budget " << budget;
      EXPECT_LE(p.prediction.peak_bytes, budget);
      beats_persistent +=
          rp::optimal(c, budget, 500, rp::OptimalScope::kPersistent).prediction.time_ms > p.prediction.time_ms + 1e-9;
      ++compared;
    }
  }
  EXPECT_GT(beats_persistent, 0);
  std::printf("L = 8, sizes 1..40: optimal == exhaustive over all schedules on %d pairs; persistent slower in %d\n",
              compared, beats_persistent);
}

// The schedules that need the larger class: on the first chain the search
// found where the persistent recursion loses, optimal's schedule drops a
// checkpoint before its backward (a_j dropped while stage j's backward is
// still to come) and recomputes it later.
TEST(Optimal, AllSchedulesDropACheckpointBeforeItsBackward) {
  std::mt19937 rng(20240601);
  for (int trial = 0; trial < 210; ++trial) {
    const int L = 1 + trial % 7;
    const rp::Chain c = random_chain(rng, L, 1, 12, trial % 3 != 0);
    const int64_t lo = rp::min_feasible_peak_bytes(c), hi = rp::store_all(c).prediction.peak_bytes;
    for (int k = 0; k <= 6; ++k) {
      const int64_t budget = lo + (hi - lo) * k / 6 + (k == 1 ? 1 : 0);
      const rp::Plan p = rp::optimal(c, budget, 500, rp::OptimalScope::kAll);
      const rp::Plan q = rp::optimal(c, budget, 500, rp::OptimalScope::kPersistent);
      if (q.prediction.time_ms <= p.prediction.time_ms + 1e-9) continue;
      // Some a_j (j >= 1) is live across a backward and then dropped while
      // backward(j) is still to come: never the case in a persistent schedule,
      // whose only early drops are a sweep's intermediates.
      std::vector<bool> live(L + 1, false), crossed(L + 1, false);
      int next_backward = L - 1;
      bool early_drop = false;
      for (const rp::Op& op : p.schedule.ops) {
        if (op.kind == rp::OpKind::kForward || op.kind == rp::OpKind::kForwardSave) {
          live[op.stage + 1] = true;
          crossed[op.stage + 1] = false;
        } else if (op.kind == rp::OpKind::kBackward) {
          live[op.stage + 1] = false;
          next_backward = op.stage - 1;
          for (int j = 1; j <= L; ++j) crossed[j] = crossed[j] || live[j];
        } else {
          early_drop = early_drop || (op.stage <= next_backward && crossed[op.stage]);
          live[op.stage] = false;
        }
      }
      EXPECT_TRUE(early_drop) << "trial " << trial << " budget " << budget;
      std::printf("trial %d, L %d, budget %lld: all schedules %.2f ms, persistent %.2f ms\n", trial, L,
                  static_cast<long long>(budget), p.prediction.time_ms, q.prediction.time_ms);
      return;
    }
  }
  FAIL() << "no chain in the sample separates the classes";
}

TEST(Optimal, FeasibleAndMonotoneInBudget) {
  std::mt19937 rng(7);
  int all_faster = 0;
  for (int trial = 0; trial < 12; ++trial) {
    // Exact unit (MiB multiples) and arbitrary byte sizes (rounded discretization).
    const bool exact = trial % 2 == 0;
    rp::Chain c = random_chain(rng, 8 + 3 * trial, exact ? (1 << 20) : 1, exact ? 16 : 1 << 30, true);
    const int64_t lo = rp::min_feasible_peak_bytes(c), hi = rp::store_all(c).prediction.peak_bytes;
    double last_ms = std::numeric_limits<double>::infinity();
    for (int k = 0; k <= 20; ++k) {
      const int64_t budget = lo + (hi - lo) * k / 20;
      const rp::Plan p = rp::optimal(c, budget);
      EXPECT_LE(p.prediction.peak_bytes, budget) << "trial " << trial << " k " << k;
      if (exact) {
        EXPECT_LE(p.prediction.time_ms, last_ms * (1 + 1e-6)) << "trial " << trial << " k " << k;
        // kAuto is kAll at these sizes: a superset of rotor's class.
        const rp::Plan q = rp::optimal(c, budget, 500, rp::OptimalScope::kPersistent);
        EXPECT_LE(q.prediction.peak_bytes, budget);
        EXPECT_LE(p.prediction.time_ms, q.prediction.time_ms * (1 + 1e-6)) << "trial " << trial << " k " << k;
        all_faster += p.prediction.time_ms < q.prediction.time_ms * (1 - 1e-6);
      }
      last_ms = p.prediction.time_ms;
    }
  }
  std::printf("optimal over all schedules faster than the persistent class at %d of 126 exact budgets (L 8..41)\n",
              all_faster);
}

TEST(Optimal, NeverSlowerThanHeuristicsAtTheirPeak) {
  std::mt19937 rng(99);
  int compared = 0;
  for (int trial = 0; trial < 8; ++trial) {
    const rp::Chain c = random_chain(rng, 6 + 4 * trial, 1 << 20, 20, trial % 2 == 1);
    std::vector<rp::Plan> heuristics{rp::store_all(c), rp::sqrt_schedule(c)};
    for (int k = 2; k <= 5; ++k) heuristics.push_back(rp::uniform(c, k));
    for (int s = 1; s <= 4; ++s) heuristics.push_back(rp::revolve(c, s));
    const int64_t hi = rp::store_all(c).prediction.peak_bytes, lo = rp::min_feasible_peak_bytes(c);
    for (int k = 1; k <= 3; ++k) {
      try {
        heuristics.push_back(rp::greedy(c, lo + (hi - lo) * k / 4));
      } catch (const rp::Error&) {
      }
    }
    for (const rp::Plan& h : heuristics) {
      const rp::Plan o = rp::optimal(c, h.prediction.peak_bytes);
      // The DP compares times in float: a relative 1e-6 slack.
      EXPECT_LE(o.prediction.time_ms, h.prediction.time_ms * (1 + 1e-6)) << h.algorithm << " trial " << trial;
      EXPECT_LE(o.prediction.peak_bytes, h.prediction.peak_bytes);
      ++compared;
    }
  }
  std::printf("optimal <= heuristic time at the heuristic's peak in %d cases\n", compared);
}

TEST(Heuristics, SchedulesMatchTheirDefinitions) {
  rp::Chain c;
  c.input_bytes = 8;
  for (int i = 0; i < 10; ++i) c.stages.push_back({"l" + std::to_string(i), 1, 2, 8, 16, 0, 0});
  const rp::Plan all = rp::store_all(c);
  EXPECT_EQ(all.prediction.forward_executions, 10);
  EXPECT_DOUBLE_EQ(all.prediction.time_ms, 30);
  // checkpoint_sequential(10 stages, 4 segments): segments of 2, the last of 4 runs plain.
  const rp::Plan u = rp::uniform(c, 4);
  EXPECT_EQ(u.prediction.forwards_per_stage, (std::vector<int>{2, 2, 2, 2, 2, 2, 1, 1, 1, 1}));
  EXPECT_EQ(rp::sqrt_schedule(c).prediction.forwards_per_stage,
            (std::vector<int>{2, 2, 2, 2, 2, 2, 1, 1, 1, 1}));  // round(sqrt(10)) = 3 segments of 3, last 4
  EXPECT_EQ(rp::sqrt_schedule(c).algorithm, "sqrt");
  EXPECT_EQ(rp::uniform(c, 1).prediction.forward_executions, 10);
  EXPECT_EQ(rp::uniform(c, 50).prediction.forward_executions, 19);
  EXPECT_LT(u.prediction.peak_bytes, all.prediction.peak_bytes);
  // Greedy fits the budget it is given and is no faster than store-all.
  const rp::Plan g = rp::greedy(c, u.prediction.peak_bytes);
  EXPECT_LE(g.prediction.peak_bytes, u.prediction.peak_bytes);
  EXPECT_LE(g.prediction.time_ms, u.prediction.time_ms);
  EXPECT_EQ(error_of([&] { rp::greedy(c, 50); }),
            "[remat::plan] greedy: no segmentation fits in 50 B; greedy's smallest peak is 88 B and the smallest "
            "feasible peak is " +
                rp::format_bytes(rp::min_feasible_peak_bytes(c)) +
                ". Raise memory_budget_bytes or use the optimal algorithm.");
  EXPECT_EQ(error_of([&] { rp::uniform(c, 0); }), "[remat::plan] uniform: segments is 0; it must be >= 1.");
  EXPECT_EQ(error_of([&] { rp::revolve(c, 0); }),
            "[remat::plan] revolve: slots is 0; it must be >= 1 (a_0 occupies one).");
}

TEST(Optimal, BudgetTooSmallNamesTheSmallestFeasiblePeak) {
  rp::Chain c;
  c.input_bytes = int64_t{1} << 28;
  for (int i = 0; i < 6; ++i)
    c.stages.push_back({"b" + std::to_string(i), 1, 2, int64_t{1} << 28, int64_t{3} << 28, 0, 0});
  const int64_t min_peak = rp::min_feasible_peak_bytes(c);
  EXPECT_EQ(min_peak, int64_t{7} << 28);  // a_0 + a_1 + s_1 + grad_2 + grad_1, or the like: 1.75 GiB
  EXPECT_EQ(error_of([&] { rp::optimal(c, int64_t{3} << 29); }),
            "[remat::plan] no schedule fits in 1.50 GiB; the smallest feasible peak is 1.75 GiB. Raise "
            "memory_budget_bytes.");
  EXPECT_EQ(rp::optimal(c, min_peak).prediction.peak_bytes, min_peak);
  EXPECT_EQ(error_of([&] { rp::optimal(c, min_peak - 1); }),
            "[remat::plan] no schedule fits in 1.75 GiB (1879048191 bytes); the smallest feasible peak is 1.75 GiB "
            "(1879048192 bytes). Raise memory_budget_bytes.");
}

TEST(Optimal, CoarseDiscretizationIsRefined) {
  // 2 slots reject what exact bytes allow (it used to return the min-peak
  // schedule); optimal() refines the slots instead: the budget is met, and
  // the plan is no slower than the min-peak schedule and reports its bound.
  std::mt19937 rng(3);
  const rp::Chain c = random_chain(rng, 12, 1, 1000003, true);
  const int64_t min_peak = rp::min_feasible_peak_bytes(c);
  const rp::Plan p = rp::optimal(c, min_peak, 2);
  EXPECT_EQ(p.prediction.peak_bytes, min_peak);
  EXPECT_LE(p.prediction.time_ms, rp::min_memory(c).prediction.time_ms);
  EXPECT_LT(p.memory_unit_bytes, (min_peak - c.input_bytes) / 2);  // finer than 2 slots
  EXPECT_GE(p.optimality_gap_ms, 0);
  EXPECT_NEAR(p.lower_bound_ms + p.optimality_gap_ms, p.prediction.time_ms, 1e-9);
  const rp::Plan q = rp::optimal(c, (min_peak + rp::store_all(c).prediction.peak_bytes) / 2, 2);
  EXPECT_LE(q.relative_gap(), rp::kOptimalGapTarget);
}

// At 500 slots the rounded DP can reject budgets just above the smallest
// feasible peak; optimal() must then refine rather than fall back to the
// min-peak schedule, which is 48% slower than the exact optimum on this
// 24-stage chain (525 bytes: 423.75 ms against 286.50 ms). It must land
// within 1% of the exact DP (here equal).
TEST(Optimal, NoFallbackLossNearTheSmallestPeak) {
  std::mt19937 rng(95);
  const rp::Chain c = random_chain(rng, 24, 1, 100, true);
  const int64_t lo = rp::min_feasible_peak_bytes(c);
  ASSERT_EQ(lo, 525);
  EXPECT_NEAR(rp::min_memory(c).prediction.time_ms, 423.75, 1e-9);  // the old fallback
  for (int64_t budget = lo; budget <= lo + 3; ++budget) {
    const rp::Plan p = rp::optimal(c, budget);
    const rp::Plan exact = rp::optimal(c, budget, 1000000, rp::OptimalScope::kAll);
    EXPECT_EQ(exact.memory_unit_bytes, 1);
    EXPECT_EQ(exact.optimality_gap_ms, 0);
    EXPECT_LE(p.prediction.peak_bytes, budget);
    EXPECT_LE(p.prediction.time_ms, exact.prediction.time_ms * 1.01) << "budget " << budget;
    if (budget == lo) {
      EXPECT_NEAR(exact.prediction.time_ms, 286.50, 1e-9);
    }
  }
}

// The default optimal() against the exact optimum (the same DP at the sizes'
// gcd, 1 byte) on random chains of up to 30 stages, budgets from the smallest
// feasible peak up: within 1%, or the reported bound covers the difference;
// and the lower bound never exceeds the exact optimum (for both scopes).
// Sizes up to 1000 bytes leave some budgets where refinement stops short of
// exact units, so the rounded-down bound is exercised.
TEST(Optimal, DefaultWithinOnePercentOfExactOrBounded) {
  std::mt19937 rng(17);
  int cases = 0, over_1pct = 0, bounded = 0;
  double worst = 0, widest = 0;
  for (int trial = 0; trial < 24; ++trial) {
    const int L = 2 + (trial * 11) % 29;
    const int max_units = std::vector<int>{12, 40, 100, 1000}[trial % 4];
    const rp::Chain c = random_chain(rng, L, 1, max_units, trial % 3 != 0);
    const int64_t lo = rp::min_feasible_peak_bytes(c), hi = rp::store_all(c).prediction.peak_bytes;
    std::vector<int64_t> budgets{lo, lo + 1, lo + 3};
    for (int k = 1; k < 8; ++k) budgets.push_back(lo + (hi - lo) * k / 8);
    for (const int64_t budget : budgets) {
      if (budget >= hi) continue;
      const rp::Plan p = rp::optimal(c, budget);
      const rp::Plan exact = rp::optimal(c, budget, 1000000, rp::OptimalScope::kAll);
      ASSERT_EQ(exact.memory_unit_bytes, 1);
      EXPECT_LE(p.prediction.peak_bytes, budget);
      EXPECT_LE(p.lower_bound_ms, exact.prediction.time_ms * (1 + 1e-6)) << "trial " << trial << " budget " << budget;
      EXPECT_NEAR(p.lower_bound_ms + p.optimality_gap_ms, p.prediction.time_ms, 1e-9);
      const double loss = p.prediction.time_ms / exact.prediction.time_ms - 1;
      EXPECT_TRUE(loss <= 0.01 || p.prediction.time_ms - exact.prediction.time_ms <=
                                      p.optimality_gap_ms + 1e-6 * exact.prediction.time_ms)
          << "trial " << trial << " budget " << budget << " loss " << loss;
      over_1pct += loss > 0.01;
      worst = std::max(worst, loss);
      bounded += p.optimality_gap_ms > 0;
      widest = std::max(widest, p.relative_gap());
      if (trial % 4 == 3 && budget == budgets[1]) {
        // The persistent class's bound holds against its own exact optimum.
        const rp::Plan q = rp::optimal(c, budget, 500, rp::OptimalScope::kPersistent);
        const rp::Plan q_exact = rp::optimal(c, budget, 1000000, rp::OptimalScope::kPersistent);
        EXPECT_LE(q.lower_bound_ms, q_exact.prediction.time_ms * (1 + 1e-6)) << "trial " << trial;
        EXPECT_LE(q.prediction.peak_bytes, budget);
      }
      ++cases;
    }
  }
  EXPECT_GT(bounded, 0);  // the sample reaches the rounded (non-exact) path
  std::printf(
      "default optimal vs exact on %d (chain, budget) pairs: worst loss %.3f%%, %d over 1%%; "
      "nonzero bound in %d (widest %.3f%%)\n",
      cases, 100 * worst, over_1pct, bounded, 100 * widest);
}

TEST(Homogeneous, RevolveAndOptimalMatchGriewankWalther) {
  int checked = 0;
  for (int C = 1; C <= 8; ++C) {
    for (int L = 1; L <= 100; ++L) {
      const int64_t want = L + revolve_t(L, C);
      const rp::HomogeneousProblem h = rp::homogeneous_problem(L, C);
      ASSERT_EQ(rp::revolve(h.chain, C).prediction.forward_executions, want) << "L " << L << " C " << C;
      const rp::Plan o = rp::optimal(h.chain, h.budget_bytes);
      ASSERT_EQ(o.prediction.forward_executions, want) << "L " << L << " C " << C;
      const rp::Plan p = rp::optimal(h.chain, h.budget_bytes, 500, rp::OptimalScope::kPersistent);
      ASSERT_EQ(p.prediction.forward_executions, want) << "L " << L << " C " << C;
      ASSERT_LE(rp::revolve(h.chain, C).prediction.peak_bytes, h.budget_bytes) << "L " << L << " C " << C;
      ++checked;
    }
  }
  std::printf("revolve and optimal give L + t(L, C) forwards for %d (L, C) pairs\n", checked);
}

TEST(Solve, DispatchesByName) {
  rp::Chain c;
  c.input_bytes = 4;
  for (int i = 0; i < 9; ++i) c.stages.push_back({"x" + std::to_string(i), 1, 1, 4, 12, 0, 0});
  // solve() ran the named algorithm with its parameter: the same schedule and
  // prediction as the direct call, and those differ between the algorithms
  // (and parameters) on this chain, so a wrong dispatch cannot pass.
  const std::vector<std::pair<std::string, rp::Plan>> direct{
      {"store-all", rp::store_all(c)}, {"uniform", rp::uniform(c, 4)},   {"uniform:3", rp::uniform(c, 3)},
      {"revolve", rp::revolve(c, 4)},  {"revolve:2", rp::revolve(c, 2)}, {"sqrt", rp::sqrt_schedule(c)},
      {"optimal", rp::optimal(c, 90)}, {"greedy", rp::greedy(c, 80)}};
  for (size_t k = 0; k < direct.size(); ++k) {
    const auto& [spec, want] = direct[k];
    const int64_t budget = spec == "optimal" ? 90 : spec == "greedy" ? 80 : -1;
    const rp::Plan got = rp::solve(c, spec, budget);
    EXPECT_EQ(got.algorithm, want.algorithm) << spec;
    EXPECT_EQ(got.schedule, want.schedule) << spec;
    EXPECT_EQ(got.prediction.peak_bytes, want.prediction.peak_bytes) << spec;
    EXPECT_EQ(got.prediction.time_ms, want.prediction.time_ms) << spec;
    EXPECT_EQ(got.prediction.forwards_per_stage, want.prediction.forwards_per_stage) << spec;
    for (size_t o = 0; o < k; ++o) {
      if (spec != "sqrt" || direct[o].first != "uniform:3") {  // round(sqrt(9)) = 3 segments
        EXPECT_NE(want.schedule, direct[o].second.schedule) << spec << " vs " << direct[o].first;
      }
    }
  }
  EXPECT_EQ(rp::solve(c, "sqrt").schedule, rp::uniform(c, 3).schedule);
  // Options reach the algorithm too: optimal's budget, revolve's slots.
  const rp::Plan tight = rp::solve(c, rp::SolveOptions(rp::Algorithm::kOptimal).with_budget_bytes(60));
  EXPECT_EQ(tight.schedule, rp::optimal(c, 60).schedule);
  EXPECT_NE(tight.schedule, rp::optimal(c, 90).schedule);
  EXPECT_EQ(rp::solve(c, rp::SolveOptions(rp::Algorithm::kRevolve).with_param(3)).schedule, rp::revolve(c, 3).schedule);
  // Only optimal reports a bound on its gap to the exact optimum.
  EXPECT_EQ(rp::solve(c, "optimal", 80).optimality_gap_ms, 0);
  EXPECT_EQ(rp::solve(c, "uniform:3").optimality_gap_ms, -1);
  EXPECT_EQ(rp::solve(c, "uniform:3").relative_gap(), -1);
  EXPECT_EQ(error_of([&] { rp::solve(c, "optimal"); }),
            "[remat::plan] optimal: needs a memory budget; set budget_bytes.");
  EXPECT_EQ(error_of([&] { rp::solve(c, "magic"); }),
            "[remat::plan] algorithm: unknown \"magic\"; expected optimal, greedy, sqrt, store-all, uniform:K or "
            "revolve:S.");
  EXPECT_EQ(error_of([&] { rp::solve(c, "uniform:x"); }),
            "[remat::plan] algorithm: \"uniform:x\" needs a positive integer after ':'.");
  const auto front = rp::pareto(c, 12);
  ASSERT_GE(front.size(), 2u);
  for (size_t k = 1; k < front.size(); ++k) {
    EXPECT_GT(front[k].plan.prediction.peak_bytes, front[k - 1].plan.prediction.peak_bytes);
    EXPECT_LT(front[k].plan.prediction.time_ms, front[k - 1].plan.prediction.time_ms);
  }
}

TEST(Optimal, AllSchedulesTableTooLargeNamesTheRemedy) {
  rp::Chain c;
  c.input_bytes = 1;
  for (int i = 0; i < 300; ++i) c.stages.push_back({"x", 1, 1, 1, 2, 0, 0});
  ASSERT_LT(500, rp::store_all(c).prediction.peak_bytes);
  // 499 slots of 1 byte: (L (L+1) / 2 + L (L-1) (L-2) / 6) rows of 500 floats.
  EXPECT_EQ(error_of([&] { rp::optimal(c, 500, 500, rp::OptimalScope::kAll); }),
            "[remat::plan] optimal: the DP tables for 300 stages and 499 memory slots need " +
                rp::format_bytes(static_cast<int64_t>((300.0 * 301 / 2 + 298.0 * 299 * 300 / 6) * 500 * 4)) +
                "; lower memory_slots or use OptimalScope::kPersistent.");
  EXPECT_EQ(error_of([&] { rp::parse_optimal_scope("everything"); }),
            "[remat::plan] scope: unknown \"everything\"; expected auto, all or persistent.");
  EXPECT_EQ(rp::parse_optimal_scope("persistent"), rp::OptimalScope::kPersistent);
  const std::string slots_error = "[remat::plan] optimal: memory_slots is 0; it must be in [1, 1000000].";
  EXPECT_EQ(error_of([&] { rp::optimal(c, 500, 0); }), slots_error);
  EXPECT_EQ(error_of([&] { rp::optimal_scope(c, 500, 0); }), slots_error);
}

// SolveOptions::scope reaches optimal(): the 7-stage chain of docs/planner.md
// ("Which schedules") at 53 bytes, 78.32 ms over all schedules, 91.94 ms
// persistent.
TEST(Solve, ScopeReachesOptimal) {
  rp::Chain c;
  c.input_bytes = 11;
  const double f[] = {0.98, 4.42, 0.27, 2.55, 4.55, 0.30, 2.18}, b[] = {8.90, 8.85, 1.81, 5.82, 5.80, 2.21, 3.57};
  const int64_t out[] = {2, 1, 10, 6, 10, 7, 6}, saved[] = {10, 4, 19, 15, 20, 13, 14};
  for (int i = 0; i < 7; ++i) c.stages.push_back({"s" + std::to_string(i), f[i], b[i], out[i], saved[i], 0, 0});
  auto solve_ms = [&](rp::OptimalScope scope) {
    return rp::solve(c, rp::SolveOptions(rp::Algorithm::kOptimal).with_budget_bytes(53).with_scope(scope))
        .prediction.time_ms;
  };
  EXPECT_NEAR(solve_ms(rp::OptimalScope::kAuto), 78.32, 1e-9);
  EXPECT_NEAR(solve_ms(rp::OptimalScope::kAll), 78.32, 1e-9);
  EXPECT_NEAR(solve_ms(rp::OptimalScope::kPersistent), 91.94, 1e-9);
  EXPECT_EQ(rp::optimal_scope(c, 53), rp::OptimalScope::kAll);
  EXPECT_EQ(rp::optimal_scope(c, 53, 500, rp::OptimalScope::kPersistent), rp::OptimalScope::kPersistent);
  EXPECT_STREQ(rp::optimal_scope_name(rp::OptimalScope::kPersistent), "persistent");
  // kAuto's switch: about L^4 M / 24 cell updates, at most 1e9 (L = 83 at 500 slots).
  std::mt19937 rng(5);
  const rp::Chain c83 = random_chain(rng, 83, 1, 1 << 30, false), c84 = random_chain(rng, 84, 1, 1 << 30, false);
  auto mid = [](const rp::Chain& x) {
    return (rp::min_feasible_peak_bytes(x) + rp::store_all(x).prediction.peak_bytes) / 2;
  };
  EXPECT_EQ(rp::optimal_scope(c83, mid(c83)), rp::OptimalScope::kAll);
  EXPECT_EQ(rp::optimal_scope(c84, mid(c84)), rp::OptimalScope::kPersistent);
  EXPECT_EQ(rp::optimal_scope(c84, rp::store_all(c84).prediction.peak_bytes), rp::OptimalScope::kAll);
  const auto front = rp::pareto(c, 40, 500, rp::OptimalScope::kPersistent);
  const auto front_all = rp::pareto(c, 40);
  // Over all schedules the frontier is nowhere worse, and better somewhere.
  bool better = false;
  for (const auto& p : front) {
    double best_all = std::numeric_limits<double>::infinity();
    for (const auto& q : front_all)
      if (q.plan.prediction.peak_bytes <= p.plan.prediction.peak_bytes)
        best_all = std::min(best_all, q.plan.prediction.time_ms);
    EXPECT_LE(best_all, p.plan.prediction.time_ms + 1e-9);
    better |= best_all < p.plan.prediction.time_ms - 1e-9;
  }
  EXPECT_TRUE(better);
}

namespace {

/** c with 0-2 options on each stage: a selective-like one (keeps part of the
 *  saved set, its backward recomputes the rest) and an offload-like one
 *  (keeps the output only; its forward writes, its backward reads). */
rp::Chain with_random_options(std::mt19937& rng, rp::Chain c, int64_t unit_bytes = 1) {
  std::uniform_int_distribution<int> count(0, 2), coin(0, 1), small(0, 3);
  std::uniform_real_distribution<double> ms(0.0, 3.0);
  for (rp::Stage& s : c.stages) {
    const int n = count(rng);
    for (int k = 0; k < n; ++k) {
      rp::StageOption o;
      const bool offload = coin(rng) == 1;
      o.name = offload ? "offload" : "selective";
      std::uniform_int_distribution<int64_t> keep(s.output_bytes, s.saved_bytes);
      o.saved_bytes = offload ? s.output_bytes : keep(rng);
      o.forward_ms = std::round((s.forward_ms + (offload ? ms(rng) : 0.0)) * 100) / 100;
      o.backward_ms = std::round((s.backward_ms + ms(rng)) * 100) / 100;
      o.forward_tmp_bytes = s.forward_tmp_bytes + small(rng) * unit_bytes;
      o.backward_tmp_bytes = small(rng) * unit_bytes;
      s.options.push_back(o);
    }
  }
  return c;
}

}  // namespace

// Per-stage options (selective levels, offload) planned by the persistent DP
// equal an exhaustive search over persistent schedules whose forward_saves
// may each take any option: same least peak, same least time at six budgets
// from it to store-all's; the plans fit and simulate to the DP's time.
TEST(StageOptions, OptimalEqualsExhaustiveSearch) {
  std::mt19937 rng(20261204);
  int compared = 0, faster = 0, lower_peak = 0, used = 0;
  for (int trial = 0; trial < 120; ++trial) {
    const int L = 1 + trial % 6;
    const rp::Chain plain = random_chain(rng, L, 1, 10, trial % 2 == 0);
    const rp::Chain c = with_random_options(rng, plain);
    const rp::testing::Exhaustive persistent(c, rp::testing::Space::kPersistent);
    const int64_t min_peak = persistent.min_peak_bytes();
    ASSERT_EQ(rp::min_feasible_peak_bytes(c), min_peak) << "trial " << trial;
    ASSERT_EQ(rp::min_memory(c).prediction.peak_bytes, min_peak) << "trial " << trial;
    ASSERT_LE(min_peak, rp::min_feasible_peak_bytes(plain)) << "trial " << trial;
    lower_peak += min_peak < rp::min_feasible_peak_bytes(plain);
    EXPECT_NE(error_of([&] { rp::optimal(c, min_peak - 1); }).find("no schedule fits"), std::string::npos);
    const int64_t all_peak = rp::store_all(c).prediction.peak_bytes;
    for (int k = 0; k <= 6; ++k) {
      const int64_t budget = min_peak + (all_peak - min_peak) * k / 6;
      const rp::Plan p = rp::optimal(c, budget);
      const double best = persistent.min_time_ms(budget);
      ASSERT_NEAR(p.prediction.time_ms, best, 1e-6) << "trial " << trial << " L " << L << " budget " << budget;
      EXPECT_LE(p.prediction.peak_bytes, budget);
      EXPECT_NEAR(rp::simulate(c, p.schedule).time_ms, p.prediction.time_ms, 1e-9);
      for (const rp::Op& op : p.schedule.ops) used += op.option != 0;
      if (budget >= rp::min_feasible_peak_bytes(plain)) {
        const rp::Plan q = rp::optimal(plain, budget, 500, rp::OptimalScope::kPersistent);
        ASSERT_LE(p.prediction.time_ms, q.prediction.time_ms + 1e-6) << "trial " << trial;
        faster += p.prediction.time_ms < q.prediction.time_ms - 1e-6;
      }
      ++compared;
    }
  }
  // The options matter in this sample: lower peaks and faster plans.
  EXPECT_GT(lower_peak, 10);
  EXPECT_GT(faster, 10);
  EXPECT_GT(used, 50);
  std::printf(
      "stage options: %d (chain, budget) pairs equal to exhaustive search; %d chains with a lower least "
      "peak, %d plans faster than without options, %d forward_saves under an option\n",
      compared, lower_peak, faster, used);
}

TEST(StageOptions, SimulateTakesTheOptionsBytesAndTimes) {
  rp::Chain c;
  c.input_bytes = 10;
  rp::Stage s0{"a", 1.0, 2.0, 20, 100};
  s0.options.push_back({"offload", 20, 1.5, 3.0, 0, 7, 0});
  rp::Stage s1{"b", 1.0, 2.0, 5, 30};
  c.stages = {s0, s1};
  const rp::Schedule keep{{{rp::OpKind::kForwardSave, 0},
                           {rp::OpKind::kForwardSave, 1},
                           {rp::OpKind::kBackward, 1},
                           {rp::OpKind::kBackward, 0}}};
  rp::Schedule off = keep;
  off.ops[0].option = 1;
  const rp::Prediction a = rp::simulate(c, keep), b = rp::simulate(c, off);
  EXPECT_EQ(a.peak_bytes, 10 + 100 + 30 + 5 + 20);  // a_0, s_0, s_1, grad_2 and grad_1 at backward(1)
  EXPECT_EQ(b.peak_bytes, 10 + 20 + 30 + 5 + 20);
  EXPECT_DOUBLE_EQ(a.time_ms, 6.0);
  EXPECT_DOUBLE_EQ(b.time_ms, 6.0 + 0.5 + 1.0);
  EXPECT_EQ(b.op_bytes[3], 10 + 20 + 20 + 10 + 7);  // backward(0): a_0, s_0, grad_1, grad_0, its temporaries
  EXPECT_EQ(rp::to_string(off.ops[0]), "forward_save(0, option 1)");

  rp::Schedule bad = keep;
  bad.ops[1].option = 1;
  EXPECT_EQ(error_of([&] { rp::simulate(c, bad); }),
            "[remat::plan] invalid schedule at op 1, forward_save(1, option 1) (stage \"b\"): no option 1; the stage "
            "has 0 (1..0; 0 keeps everything).");
  bad = keep;
  bad.ops[2].option = 1;
  EXPECT_EQ(error_of([&] { rp::simulate(c, bad); }),
            "[remat::plan] invalid schedule at op 2, backward(1, option 1) (stage \"b\"): only a forward_save takes an "
            "option (a backward follows its forward_save's).");
}

TEST(StageOptions, InvalidOptionsAndTheAllScopeAreRefused) {
  rp::Chain c;
  c.input_bytes = 10;
  rp::Stage s0{"a", 1.0, 2.0, 20, 100};
  s0.options.push_back({"half", 10, 1.0, 3.0});
  c.stages = {s0};
  EXPECT_EQ(error_of([&] { c.validate(); }),
            "[remat::plan] chain: stage 0 (\"a\"): options[0] (\"half\").saved_bytes (10) < output_bytes (20); an "
            "option keeps at least the stage's output.");
  c.stages[0].options[0] = {"fast", 50, 0.5, 3.0};
  EXPECT_EQ(error_of([&] { c.validate(); }),
            "[remat::plan] chain: stage 0 (\"a\"): options[0] (\"fast\").forward_ms or backward_ms below the stage's "
            "own (1.000000, 2.000000 ms); an option costs at least what keeping everything costs (the profiler raises "
            "a faster measurement to the stage's).");
  c.stages[0].options[0] = {"half", 50, 1.0, 3.0};
  c.validate();
  EXPECT_EQ(error_of([&] { rp::optimal(c, 100, 500, rp::OptimalScope::kAll); }),
            "[remat::plan] optimal: OptimalScope::kAll does not plan stage options (stage 0 (\"a\") has 1); use "
            "OptimalScope::kAuto or kPersistent, or leave the options out.");
  EXPECT_EQ(rp::optimal_scope(c, 100), rp::OptimalScope::kPersistent);
  // Store-all fits: it is optimal over every schedule.
  EXPECT_EQ(rp::optimal_scope(c, 1000), rp::OptimalScope::kAll);
  const rp::Plan p = rp::optimal(c, 10 + 50 + 20 + 10);
  ASSERT_EQ(p.schedule.ops.size(), 2u);
  EXPECT_EQ(p.schedule.ops[0].option, 1);
}

TEST(StageOptions, JsonRoundTrip) {
  std::mt19937 rng(7);
  const rp::Chain c = with_random_options(rng, random_chain(rng, 5, 3, 9, true));
  const rp::Chain back = rp::chain_from_json(rp::chain_to_json(c));
  ASSERT_EQ(back.size(), c.size());
  for (int i = 0; i < c.size(); ++i) {
    ASSERT_EQ(back.stages[i].options.size(), c.stages[i].options.size());
    for (size_t k = 0; k < c.stages[i].options.size(); ++k) {
      const rp::StageOption &a = c.stages[i].options[k], &b = back.stages[i].options[k];
      EXPECT_EQ(a.name, b.name);
      EXPECT_EQ(a.saved_bytes, b.saved_bytes);
      EXPECT_DOUBLE_EQ(a.forward_ms, b.forward_ms);
      EXPECT_DOUBLE_EQ(a.backward_ms, b.backward_ms);
      EXPECT_EQ(a.forward_tmp_bytes, b.forward_tmp_bytes);
      EXPECT_EQ(a.backward_tmp_bytes, b.backward_tmp_bytes);
    }
  }
  const int64_t budget = rp::min_feasible_peak_bytes(c);
  const rp::Plan p = rp::optimal(c, budget);
  EXPECT_EQ(rp::optimal(back, budget).schedule, p.schedule);
  EXPECT_NE(rp::chain_to_json(c).find("\"options\""), std::string::npos);
  // A plan's JSON names the options its forward_saves run under.
  const bool uses =
      std::any_of(p.schedule.ops.begin(), p.schedule.ops.end(), [](const rp::Op& op) { return op.option; });
  EXPECT_EQ(rp::plan_to_json(c, p).find("\"option_name\"") != std::string::npos, uses);
}

// Sizes that no few hundred slots divide: the rounded passes keep the plan
// within budget and its bound within kOptimalGapTarget (or report the gap).
TEST(StageOptions, RoundedSizesFitAndBoundTheGap) {
  std::mt19937 rng(99);
  for (int trial = 0; trial < 20; ++trial) {
    const rp::Chain c = with_random_options(rng, random_chain(rng, 12 + trial % 8, 1000003, 40, true), 1000003);
    const int64_t lo = rp::min_feasible_peak_bytes(c), hi = rp::store_all(c).prediction.peak_bytes;
    for (int k = 0; k < 4; ++k) {
      const int64_t budget = lo + (hi - lo) * k / 4;
      const rp::Plan p = rp::optimal(c, budget);
      EXPECT_LE(p.prediction.peak_bytes, budget) << "trial " << trial;
      EXPECT_GE(p.lower_bound_ms, 0);
      EXPECT_LE(p.lower_bound_ms, p.prediction.time_ms + 1e-9);
      EXPECT_LE(p.relative_gap(), rp::kOptimalGapTarget) << "trial " << trial << " budget " << budget;
    }
  }
}

// min_peak_site: the op where the least-peak schedule peaks, and the share
// of its stage. A chain of small stages around one heavy stage: its backward
// sets the floor, with its input, saved set, the gradients at both ends and
// its temporaries; the rest is a_0 and checkpoints.
TEST(MinPeakSite, NamesTheHeavyStagesBackwardAndItsShare) {
  rp::Chain c;
  c.input_bytes = 100;
  for (int i = 0; i < 5; ++i) {
    rp::Stage s;
    s.name = std::to_string(i);
    s.forward_ms = s.backward_ms = 1;
    s.output_bytes = 100;
    s.saved_bytes = i == 2 ? 5000 : 200;
    s.backward_tmp_bytes = i == 2 ? 300 : 10;
    c.stages.push_back(s);
  }
  const rp::PeakSite site = rp::min_peak_site(c);
  EXPECT_EQ(site.peak_bytes, rp::min_feasible_peak_bytes(c));
  EXPECT_EQ(site.op.kind, rp::OpKind::kBackward);
  EXPECT_EQ(site.op.stage, 2);
  // a_2 + s_2 + grad_3 + grad_2 + tmp.
  EXPECT_EQ(site.stage_bytes, 100 + 5000 + 100 + 100 + 300);
  EXPECT_LE(site.stage_bytes + c.input_bytes, site.peak_bytes);
  // One stage: its share is everything but a_0.
  rp::Chain one;
  one.input_bytes = 64;
  one.stages.push_back(c.stages[2]);
  const rp::PeakSite s1 = rp::min_peak_site(one);
  EXPECT_EQ(s1.op.stage, 0);
  EXPECT_EQ(s1.peak_bytes - s1.stage_bytes, 64);
}
