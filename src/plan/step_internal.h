// What step.cpp's solvers share with step_variants.cpp; not installed.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <string>

#include "remat/plan/error.h"
#include "remat/plan/step.h"

namespace remat::plan::step_detail {

// NOTE [one deadline]: StepSolveOptions::time_limit_s bounds a whole call
// of solve_step or min_peak_step, not each GLPK program in it (one call may
// run a dozen: default, exact re-solves, the proof, the time program at
// the least peak, least_or_throw's least peak). Each program gets what
// is left, at least 1 ms (GLPK's tm_lim, whole ms), and one that runs out
// reports GLPK's time limit as before. GLPK does not bound the LP
// relaxation it solves after its presolver, so a program started late
// still runs that LP to its end (0.7 s for 200 units called twice).
// The same across the variants of step_variants.cpp: one deadline for all.
class Deadline {
 public:
  explicit Deadline(const StepSolveOptions& o)
      : limit_s_(o.time_limit_s),
        end_(std::chrono::steady_clock::now() +
             std::chrono::milliseconds(static_cast<int64_t>(
                 std::clamp(std::isnan(o.time_limit_s) ? 0.0 : o.time_limit_s * 1000.0, 0.0, kMaxMs)))) {}
  // GLPK's tm_lim for a program started now, ms.
  int ms_left() const {
    const double left = std::chrono::duration<double, std::milli>(end_ - std::chrono::steady_clock::now()).count();
    return static_cast<int>(std::clamp(std::ceil(left), 1.0, kMaxMs));
  }
  double limit_s() const { return limit_s_; }  // as given, for messages

 private:
  static constexpr double kMaxMs = 2e9;  // fits GLPK's int tm_lim (23 days)
  double limit_s_;
  std::chrono::steady_clock::time_point end_;
};

// No plan fits, and that is not proved: a program stopped at the deadline
// (timed_out), or GLPK's tolerances left the least peak unproved. A
// remat::Error like any other to users; solve_step_variants tells it apart.
struct Unproved : Error {
  Unproved(const std::string& what, bool timed_out) : Error(what), timed_out(timed_out) {}
  bool timed_out;
};

// A time limit the solver can keep: above 0 (infinity: none).
void check_limit(const StepSolveOptions& opt);
// solve_step's check of the budget.
void check_budget(int64_t budget_bytes);
// solve_step on a validated model, any budget (min_peak_step's least peak
// may be 0 or less on a model whose segments hold nothing). Throws Unproved
// or Error when no plan fits.
StepPlan solve_within(const StepModel& m, int64_t budget_bytes, const Deadline& dl);
// How min_peak_within's peak stands: proved the least in bytes, or not
// and then whether a program stopped at the deadline (else GLPK's
// tolerances left it unproved).
struct LeastPeak {
  bool proved = false, timed_out = false;
};
// min_peak_step on a validated model.
StepPlan min_peak_within(const StepModel& m, const Deadline& dl, LeastPeak* how = nullptr);

}  // namespace remat::plan::step_detail
