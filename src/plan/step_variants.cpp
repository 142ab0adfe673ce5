// Variants of one step model (remat/plan/step.h, StepVariant): the step
// solver run once per variant, and the best kept. The auto layer's outer
// choices (the optimizers' state placement, the offload tiers) are
// variants; the solver's own choice is one option per unit.
#include <cmath>
#include <optional>
#include <string>

#include <remat/plan/error.h>
#include <remat/plan/step.h>

#include "step_internal.h"

namespace remat::plan {

namespace {

void check_list(const std::vector<StepVariant>& variants, const char* fn) {
  if (variants.empty()) {
    throw Error(std::string("[remat::plan] ") + fn +
                " with no variants; give at least one (a default StepVariant is "
                "the model itself).");
  }
}

/** min_peak_step_variants within the deadline of the call. */
StepPlan min_peak_within_variants(const StepModel& model, const std::vector<StepVariant>& variants,
                                  const step_detail::Deadline& dl) {
  std::optional<StepPlan> best;
  bool proven = true, timed_out = false;
  for (size_t i = 0; i < variants.size(); ++i) {
    const StepModel m = apply_variant(model, variants[i]);
    validate(m);  // as min_peak_step does
    StepPlan p = step_detail::min_peak_within(m, dl);
    proven = proven && p.optimal;
    timed_out = timed_out || p.timed_out;
    const StepPrediction& a = p.prediction;
    if (!best || a.peak_bytes < best->prediction.peak_bytes ||
        (a.peak_bytes == best->prediction.peak_bytes && a.time_ms < best->prediction.time_ms)) {
      p.variant = static_cast<int64_t>(i);
      best = std::move(p);
    }
  }
  best->optimal = best->optimal && proven;
  best->timed_out = !best->optimal && timed_out;
  return *best;
}

}  // namespace

StepModel apply_variant(const StepModel& model, const StepVariant& v) {
  const size_t segments = model.segment_peak_bytes.size();
  if (!v.segment_shift_bytes.empty() && v.segment_shift_bytes.size() != segments) {
    throw Error("[remat::plan] a StepVariant shifts " + std::to_string(v.segment_shift_bytes.size()) +
                " segments of a step model with " + std::to_string(segments) +
                "; give one shift per segment, or none.");
  }
  if (v.options_offered.size() > model.units.size()) {
    throw Error("[remat::plan] a StepVariant offers options of " + std::to_string(v.options_offered.size()) +
                " units of a step model with " + std::to_string(model.units.size()) +
                "; give at most one count per unit.");
  }
  if (!std::isfinite(v.time_ms)) throw Error("[remat::plan] a StepVariant adds a time that is not finite.");
  if (v.option_time_ms.size() > model.units.size()) {
    throw Error("[remat::plan] a StepVariant times options of " + std::to_string(v.option_time_ms.size()) +
                " units of a step model with " + std::to_string(model.units.size()) +
                "; give at most one list per unit.");
  }
  StepModel m = model;
  // Option times first, on the whole menus: option k of unit u costs d[k]
  // more. Its calls' costs count above option 0's (the profiled step's
  // time holds option 0), so d[0] goes to the step's time.
  for (size_t u = 0; u < v.option_time_ms.size(); ++u) {
    const std::vector<double>& d = v.option_time_ms[u];
    StepUnit& unit = m.units[u];
    if (d.size() > unit.options.size()) {
      throw Error("[remat::plan] a StepVariant times " + std::to_string(d.size()) + " options of unit '" + unit.name +
                  "', which has " + std::to_string(unit.options.size()) + "; give at most one time per option.");
    }
    bool any = false;
    for (double t : d) {
      if (!std::isfinite(t)) {
        throw Error("[remat::plan] a StepVariant adds a time to an option of unit '" + unit.name +
                    "' that is not finite.");
      }
      any = any || t != 0;
    }
    if (!any) continue;
    if (unit.calls.empty()) {
      throw Error("[remat::plan] a StepVariant times the options of unit '" + unit.name +
                  "', which has no calls; give it no times.");
    }
    std::vector<StepCost>& costs = unit.calls[0].costs;
    for (size_t k = 0; k < d.size() && k < costs.size(); ++k) costs[k].time_ms += d[k];
    if (!d.empty()) m.step_time_ms += d[0];
  }
  for (size_t u = 0; u < v.options_offered.size(); ++u) {
    if (v.options_offered[u] > 0) truncate_options(m, u, v.options_offered[u]);
  }
  for (size_t s = 0; s < v.segment_shift_bytes.size(); ++s) m.segment_peak_bytes[s] += v.segment_shift_bytes[s];
  m.step_time_ms += v.time_ms;
  return m;
}

// NOTE [one deadline] across variants: the call's time limit bounds every
// variant's solve together; each gets what is left (GLPK at least 1 ms, the
// chain DP as long as it takes), so a list of many variants of a model that
// is not a chain stops near the limit, not at the limit times the list.

StepPlan solve_step_variants(const StepModel& model, const std::vector<StepVariant>& variants, int64_t budget_bytes,
                             const StepSolveOptions& options) {
  check_list(variants, "solve_step_variants");
  validate(model);
  step_detail::check_limit(options);
  step_detail::check_budget(budget_bytes);
  const step_detail::Deadline dl(options);
  std::optional<StepPlan> best;
  bool proven = true, timed_out = false;  // every variant solved to optimality, or proven to have no plan
  for (size_t i = 0; i < variants.size(); ++i) {
    const StepModel m = apply_variant(model, variants[i]);
    try {
      validate(m);  // a variant that breaks the model has no plan, as solve_step says
      StepPlan p = step_detail::solve_within(m, budget_bytes, dl);
      proven = proven && p.optimal;
      timed_out = timed_out || p.timed_out;
      if (!best || p.prediction.time_ms < best->prediction.time_ms) {
        p.variant = static_cast<int64_t>(i);
        best = std::move(p);
      }
    } catch (const step_detail::Unproved& e) {
      // No plan found, none proved not to exist; another variant may have one.
      proven = false;
      timed_out = timed_out || e.timed_out;
    } catch (const Error&) {
      // This variant has no plan within the budget; another may.
    }
  }
  if (best) {
    best->optimal = best->optimal && proven;  // the fastest of all only if each was
    best->timed_out = !best->optimal && timed_out;
    return *best;
  }
  // None fits: the error of the variant that goes lowest, with its floor.
  const StepPlan lean = min_peak_within_variants(model, variants, dl);
  StepPlan p =
      step_detail::solve_within(apply_variant(model, variants[static_cast<size_t>(lean.variant)]), budget_bytes, dl);
  p.variant = lean.variant;  // reached only when that solve now fits (a solver time limit)
  return p;
}

StepPlan min_peak_step_variants(const StepModel& model, const std::vector<StepVariant>& variants,
                                const StepSolveOptions& options) {
  check_list(variants, "min_peak_step_variants");
  validate(model);
  step_detail::check_limit(options);
  return min_peak_within_variants(model, variants, step_detail::Deadline(options));
}

}  // namespace remat::plan
