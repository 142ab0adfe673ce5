// Tests of the step solver over variants (StepVariant in remat/plan/step.h):
// solve_step_variants and min_peak_step_variants against a brute force over
// every variant and every choice, the variant's options withheld, its
// shifts and time applied by the brute force itself (not by apply_variant),
// on random chains, GAN-like steps and blocks with inner units; the errors
// pinned.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <random>

#include "remat/plan/error.h"
#include "remat/plan/step.h"
#include "step_brute.h"
#include "step_random.h"

namespace rp = remat::plan;
using remat_test::step::brute_segment;
using remat_test::step::nesting_ok;

namespace {

constexpr int64_t MiB = 1 << 20;

// Random variants as the auto layer makes them: the first is the model as
// it is; the others withhold the trailing options of some units (an
// offload tier), shift every segment by its own bytes (state taken off,
// less what is in flight there: -48..+8 MiB), add 0..30 ms, and some
// price each option of some units -20..+5 ms (a disk store's options cost
// less with more in flight).
std::vector<rp::StepVariant> random_variants(std::mt19937& rng, const rp::StepModel& m, int count) {
  std::vector<rp::StepVariant> out(1);
  std::uniform_int_distribution<int64_t> shift(-48, 8);
  std::uniform_real_distribution<double> ms(0, 30);
  for (int v = 1; v < count; ++v) {
    rp::StepVariant x;
    for (const rp::StepUnit& u : m.units) {
      x.options_offered.push_back(std::uniform_int_distribution<size_t>(0, u.options.size())(rng));
    }
    if (v % 3 != 1) {  // some variants shift nothing
      // Never below the segment's own bytes (state is taken off where it is).
      for (int64_t b : m.segment_peak_bytes) x.segment_shift_bytes.push_back(std::max(-b, shift(rng) * MiB));
    }
    x.time_ms = ms(rng);
    if (v % 2 == 0) {
      std::uniform_real_distribution<double> priced(-20, 5);
      for (const rp::StepUnit& u : m.units) {
        std::vector<double> d(u.options.size(), 0.0);
        if (rng() % 2 == 0) {
          for (size_t k = 1; k < d.size(); ++k) d[k] = priced(rng);
        }
        x.option_time_ms.push_back(std::move(d));
      }
    }
    out.push_back(std::move(x));
  }
  return out;
}

struct Best {
  double time = std::numeric_limits<double>::infinity();  // fastest within the budget, over every variant
  int64_t min_peak = std::numeric_limits<int64_t>::max();
};

// Over every variant and every choice it offers, from step.h's rule.
Best brute_variants(const rp::StepModel& m, const std::vector<rp::StepVariant>& vs, int64_t budget) {
  Best out;
  for (const rp::StepVariant& v : vs) {
    auto offered = [&](size_t u) {
      const size_t n = m.units[u].options.size();
      return u < v.options_offered.size() && v.options_offered[u] > 0 ? std::min(n, v.options_offered[u]) : n;
    };
    std::vector<int> choice(m.units.size(), 0);
    while (true) {
      if (nesting_ok(m, choice)) {
        int64_t peak = std::numeric_limits<int64_t>::min();
        for (int64_t s = 0; s < static_cast<int64_t>(m.segment_peak_bytes.size()); ++s) {
          const int64_t shift = v.segment_shift_bytes.empty() ? 0 : v.segment_shift_bytes[static_cast<size_t>(s)];
          peak = std::max(peak, brute_segment(m, choice, s) + shift);
        }
        double time = m.step_time_ms + v.time_ms;
        for (size_t u = 0; u < m.units.size(); ++u) {
          for (const rp::StepCall& c : m.units[u].calls) time += c.costs[choice[u]].time_ms - c.costs[0].time_ms;
          if (u < v.option_time_ms.size() && static_cast<size_t>(choice[u]) < v.option_time_ms[u].size())
            time += v.option_time_ms[u][static_cast<size_t>(choice[u])];
        }
        out.min_peak = std::min(out.min_peak, peak);
        if (peak <= budget) out.time = std::min(out.time, time);
      }
      size_t u = 0;
      for (; u < choice.size(); ++u) {
        if (++choice[u] < static_cast<int>(offered(u))) break;
        choice[u] = 0;
      }
      if (u == choice.size()) break;
    }
  }
  return out;
}

// Returns how many of its plans took a variant other than the first.
int check_variants(const rp::StepModel& m, const std::vector<rp::StepVariant>& vs, const std::string& what) {
  int other = 0;
  const Best all = brute_variants(m, vs, std::numeric_limits<int64_t>::max());
  const rp::StepPlan low = rp::min_peak_step_variants(m, vs);
  EXPECT_EQ(low.prediction.peak_bytes, all.min_peak) << what;
  EXPECT_GE(low.variant, 0) << what;
  other += low.variant > 0;
  EXPECT_NEAR(low.prediction.time_ms, brute_variants(m, vs, all.min_peak).time, 1e-9) << what;
  int64_t top = 0;  // the highest segment of the model as profiled, and a little more
  for (int64_t b : m.segment_peak_bytes) top = std::max(top, b);
  top += 64 * MiB;
  for (int i = 0; i <= 6; ++i) {
    const int64_t budget = all.min_peak + (top - all.min_peak) * i / 6;
    const Best b = brute_variants(m, vs, budget);
    EXPECT_TRUE(std::isfinite(b.time)) << what;
    const rp::StepPlan plan = rp::solve_step_variants(m, vs, budget);
    EXPECT_LE(plan.prediction.peak_bytes, budget) << what << " budget " << budget;
    EXPECT_NEAR(plan.prediction.time_ms, b.time, 1e-9) << what << " budget " << budget;
    // The prediction is the chosen variant's own: simulate it there.
    if (plan.variant < 0) {
      ADD_FAILURE() << what << ": no variant named";
      continue;
    }
    other += plan.variant > 0;
    const rp::StepModel chosen = rp::apply_variant(m, vs[static_cast<size_t>(plan.variant)]);
    const rp::StepPrediction again = rp::simulate_step(chosen, plan.prediction.choice);
    EXPECT_EQ(again.peak_bytes, plan.prediction.peak_bytes) << what;
    EXPECT_TRUE(nesting_ok(m, plan.prediction.choice)) << what;
  }
  if (all.min_peak > 1) {
    EXPECT_THROW(rp::solve_step_variants(m, vs, all.min_peak - 1), remat::Error) << what;
  }
  return other;
}

}  // namespace

TEST(StepVariants, ChainsMatchBruteForce) {
  std::mt19937 rng(41);
  int other = 0;
  for (int trial = 0; trial < 24; ++trial) {
    const rp::StepModel m = remat_test::step::random_chain(rng, 1 + trial % 6, 3);
    other += check_variants(m, random_variants(rng, m, 1 + trial % 5), "chain trial " + std::to_string(trial));
  }
  EXPECT_GT(other, 10);  // the variants are exercised, not only the first
}

TEST(StepVariants, GanStepsMatchBruteForce) {
  std::mt19937 rng(43);
  int other = 0;
  for (int trial = 0; trial < 16; ++trial) {
    const rp::StepModel m = remat_test::step::random_gan(rng, 3, /*nest=*/trial % 2 == 1);
    other += check_variants(m, random_variants(rng, m, 2 + trial % 3), "gan trial " + std::to_string(trial));
  }
  EXPECT_GT(other, 20);
}

TEST(StepVariants, UnitsInsideUnitsMatchBruteForce) {
  std::mt19937 rng(47);
  int other = 0;
  for (int trial = 0; trial < 16; ++trial) {
    const rp::StepModel m = remat_test::step::random_nested(rng, 1 + trial % 2, 1 + trial % 2, 3);
    other += check_variants(m, random_variants(rng, m, 2 + trial % 4), "nested trial " + std::to_string(trial));
  }
  EXPECT_GT(other, 20);
}

// A shift that varies by segment moves the peak: the variant that takes the
// most off where the step peaks wins, not the one that takes the most off
// on average.
TEST(StepVariants, ShiftsPerSegmentAreWhereThePeakIs) {
  rp::StepModel m;
  m.step_time_ms = 10;
  m.segment_peak_bytes = {100 * MiB, 300 * MiB, 100 * MiB};
  m.units.push_back({"u", {"keep"}, {{0, 1, 1, 2, {{0, 0, 0, 0}}}}});
  rp::StepVariant flat, at_peak;
  flat.segment_shift_bytes = {-60 * MiB, -60 * MiB, -60 * MiB};
  at_peak.segment_shift_bytes = {0, -80 * MiB, 0};
  const rp::StepPlan low = rp::min_peak_step_variants(m, {flat, at_peak});
  EXPECT_EQ(low.variant, 1);
  EXPECT_EQ(low.prediction.peak_bytes, 220 * MiB);
  const rp::StepPlan fits = rp::solve_step_variants(m, {flat, at_peak}, 230 * MiB);
  EXPECT_EQ(fits.variant, 1);
  // Equal times: the earlier variant among those that fit.
  EXPECT_EQ(rp::solve_step_variants(m, {flat, at_peak}, 400 * MiB).variant, 0);
}

// A variant that prices an option lower (a store with more in flight)
// while costing bytes everywhere: taken where its bytes fit, and its
// option's time is its own there.
TEST(StepVariants, OptionTimesPriceAnOptionPerVariant) {
  rp::StepModel m;
  m.step_time_ms = 10;
  m.segment_peak_bytes = {100 * MiB, 300 * MiB, 100 * MiB};
  // keep: 200 MiB kept; "offload": 20 MiB kept, 6 ms more.
  m.units.push_back({"u",
                     {"keep", "offload"},
                     {{0, 1, 1, 2, {{0, 200 * MiB, 200 * MiB, 200 * MiB}, {6, 20 * MiB, 20 * MiB, 20 * MiB}}}}});
  rp::StepVariant small_cap, large_cap;
  large_cap.segment_shift_bytes = {16 * MiB, 16 * MiB, 16 * MiB};
  large_cap.option_time_ms = {{0, -5}};
  const rp::StepPlan roomy = rp::solve_step_variants(m, {small_cap, large_cap}, 200 * MiB);
  EXPECT_EQ(roomy.variant, 1);
  EXPECT_EQ(roomy.prediction.choice[0], 1);
  EXPECT_DOUBLE_EQ(roomy.prediction.time_ms, 11);
  const rp::StepPlan tight = rp::solve_step_variants(m, {small_cap, large_cap}, 125 * MiB);
  EXPECT_EQ(tight.variant, 0) << "the large cap's 16 MiB do not fit";
  EXPECT_DOUBLE_EQ(tight.prediction.time_ms, 16);
  // Option 0's time goes to the step's: keep under a variant that slows it.
  rp::StepVariant slow_keep;
  slow_keep.option_time_ms = {{3, 0}};
  const rp::StepModel applied = rp::apply_variant(m, slow_keep);
  EXPECT_DOUBLE_EQ(rp::simulate_step(applied, {0}).time_ms, 13);
  EXPECT_DOUBLE_EQ(rp::simulate_step(applied, {1}).time_ms, 16);
}

TEST(StepVariants, ErrorsNameTheProblem) {
  rp::StepModel m;
  m.step_time_ms = 10;
  m.segment_peak_bytes = {100 * MiB, 300 * MiB, 100 * MiB};
  m.units.push_back({"u", {"keep"}, {{0, 1, 1, 2, {{0, 0, 0, 0}}}}});
  auto message = [](const std::function<void()>& fn) {
    try {
      fn();
    } catch (const remat::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message([&] { rp::solve_step_variants(m, {}, 1 << 30); }),
            "[remat::plan] solve_step_variants with no variants; give at least one (a default StepVariant is the "
            "model itself).");
  rp::StepVariant wrong;
  wrong.segment_shift_bytes = {1, 2};
  EXPECT_EQ(message([&] { rp::apply_variant(m, wrong); }),
            "[remat::plan] a StepVariant shifts 2 segments of a step model with 3; give one shift per segment, or "
            "none.");
  rp::StepVariant too_many;
  too_many.options_offered = {1, 1};
  EXPECT_EQ(message([&] { rp::min_peak_step_variants(m, {too_many}); }),
            "[remat::plan] a StepVariant offers options of 2 units of a step model with 1; give at most one count "
            "per unit.");
  rp::StepVariant timed;
  timed.option_time_ms = {{0}, {0}};
  EXPECT_EQ(message([&] { rp::apply_variant(m, timed); }),
            "[remat::plan] a StepVariant times options of 2 units of a step model with 1; give at most one list per "
            "unit.");
  timed.option_time_ms = {{0, 1}};
  EXPECT_EQ(message([&] { rp::apply_variant(m, timed); }),
            "[remat::plan] a StepVariant times 2 options of unit 'u', which has 1; give at most one time per "
            "option.");
  timed.option_time_ms = {{std::nan("")}};
  EXPECT_EQ(message([&] { rp::apply_variant(m, timed); }),
            "[remat::plan] a StepVariant adds a time to an option of unit 'u' that is not finite.");
  rp::StepModel no_calls = m;
  no_calls.units[0].calls.clear();
  timed.option_time_ms = {{2}};
  EXPECT_EQ(message([&] { rp::apply_variant(no_calls, timed); }),
            "[remat::plan] a StepVariant times the options of unit 'u', which has no calls; give it no times.");
  // None fits: the floor of the variant that goes lowest, and who sets it.
  rp::StepVariant lower;
  lower.segment_shift_bytes = {0, -50 * MiB, 0};
  const std::string none = message([&] { rp::solve_step_variants(m, {rp::StepVariant{}, lower}, 200 * MiB); });
  EXPECT_NE(none.find("no plan of the step fits in 200.00 MiB; the smallest feasible peak is 250.00 MiB"),
            std::string::npos)
      << none;
}
