// The plan put in force (the last stage of the whole-step planner): the
// units' switches noted and given back, every unit switched to its chosen
// option (a Checkpointable's checkpoint and offload options, a chain's
// forced schedule, nested recompute), and the planned steps measured, with
// a new solve when offload runs slow or the step overruns its budget.
// Leaves out the solving (step_model.cpp) and the text of the reports
// (explain.cpp).
//
// NOTE [switches given back]: the planner owns the units' switches while
// it lives (every unit plain until planned, then the plan). What they
// were before (a Checkpointable's checkpoint and offload options, a
// chain's forced schedule, or none: its own budget's plan) is noted at
// construction and put back when the planner is destroyed, so that a
// model outliving its planner runs as it did before (a chain with a
// budget of its own plans under it again). A moved-from AutoCheckpoint
// holds no Impl: only the planner that owns the switches gives them back.
#include "internal.h"

#include <remat/error.h>
#include <remat/memory.h>

namespace remat {

using detail::Clock;
using detail::ms_since;

void AutoCheckpoint::Impl::note_switches() {
  before.clear();
  for (const Unit& u : units) {
    Switches s;
    if (u.chain != nullptr) {
      s.forced = detail::ChainAccess::forced(*u.chain);
    } else if (u.c != nullptr) {
      s.checkpointing = u.c->checkpointing_options();
      s.offloading = u.c->offloading_options();
    }
    before.push_back(std::move(s));
  }
}

AutoCheckpoint::Impl::~Impl() {
  for (size_t i = 0; i < before.size() && i < units.size(); ++i) {
    Unit& u = units[i];
    if (u.chain != nullptr) {
      detail::ChainAccess::force(*u.chain, before[i].forced);
    } else if (u.c != nullptr) {
      u.c->set_checkpointing(before[i].checkpointing);
      u.c->set_offloading(before[i].offloading);
    }
  }
}

void AutoCheckpoint::Impl::solve_and_apply(int64_t target) { put_in_force(solve(target)); }

void AutoCheckpoint::Impl::give_and_apply(const std::vector<int>& choice) { put_in_force(given(choice)); }

/** A new plan in force: its own steps count from its first. */
void AutoCheckpoint::Impl::put_in_force(plan::StepPlan p) {
  transfer_price.restart();
  plain_last = -1;  // NOTE [plain time calibrated]
  plain_plan_steps = 0;
  state_price_planned = state_ms_per_byte;  // NOTE [state priced by the step]
  step_plan = std::move(p);
  planned = true;
  apply();
}

void AutoCheckpoint::Impl::apply() {
  switch_off();
  apply_state();
  const std::vector<size_t> mu = model_units();
  for (size_t j = 0; j < mu.size(); ++j) {
    Unit& u = units[mu[j]];
    const Option& o = u.menu[u.offered[static_cast<size_t>(step_plan.prediction.choice[j])]];
    if (u.chain != nullptr) {
      auto forced = std::make_shared<detail::ForcedSchedule>();
      forced->store_all = !o.schedule.has_value();
      if (o.schedule) forced->schedule = *o.schedule;
      detail::ChainAccess::force(*u.chain, std::move(forced));
      continue;
    }
    if (u.c == nullptr) {  // a chunked call (NOTE [chunked calls as units])
      chunks_plan[mu[j]] = o.chunks;
      continue;
    }
    // A disk store runs at the plan's in-flight cap (NOTE [in flight planned]).
    std::optional<CheckpointOptions> cp = o.switch_state;
    std::optional<OffloadOptions> off = o.offload;
    if (o.store >= 0 && static_cast<size_t>(o.store) < plan_caps.size() &&
        options.offload()[static_cast<size_t>(o.store)].target() == OffloadTarget::kDisk) {
      const int64_t cap = plan_caps[static_cast<size_t>(o.store)];
      if (off) off->max_inflight_bytes(cap);
      if (cp && cp->offload()) cp->offload(OffloadOptions(*cp->offload()).max_inflight_bytes(cap));
    }
    u.c->set_checkpointing(cp);
    u.c->set_offloading(off);
  }
  // Nested recompute: the inner units are at option 0 (the nesting rule).
  for (size_t j = 0; j < mu.size(); ++j) {
    const Unit& u = units[mu[j]];
    if (!u.menu[u.offered[static_cast<size_t>(step_plan.prediction.choice[j])]].inner) continue;
    for (size_t i : u.inner) units[i].c->set_checkpointing(options.checkpoint_options());
  }
}

/** Every unit plain: no recompute, nothing offloaded, chunked calls as called. */
void AutoCheckpoint::Impl::switch_off() {
  chunks_plan.assign(units.size(), -1);  // chunked calls: their own counts
  for (auto& u : units) {
    if (u.chain != nullptr) {
      detail::ChainAccess::force(*u.chain, std::make_shared<detail::ForcedSchedule>());  // store-all
      continue;
    }
    if (u.c == nullptr) continue;
    u.c->set_checkpointing(std::nullopt);
    u.c->set_offloading(std::nullopt);
  }
}

void AutoCheckpoint::Impl::measured_step(const std::function<void()>& fn) {
  mem->enable();
  mem->reset_peak();
  const double waited0 = state_waited_ms();
  memory::DeviceTimer t0(mem->device());
  fn();
  measured_ms = t0.elapsed_ms();
  measured_peak = mem->peak_bytes();
  const bool overrun = static_cast<double>(measured_peak) > 1.01 * static_cast<double>(budget);
  if (overrun) transfer_price.restart();
  calibrate_plain(measured_ms);
  state_wait_last_ms = state_waited_ms() - waited0;
  const bool state_moved = reprice_state(state_wait_last_ms, measured_ms);
  if (!overrun && (reprice_offload(measured_ms) || state_moved)) {
    try {
      if (step_plan.solver == detail::kGivenSolver) {
        give_and_apply(step_plan.prediction.choice);  // the same choice at the new prices, a fresh streak
      } else {
        solve_and_apply(step_plan.budget_bytes);
      }
    } catch (const Error&) {
      // The plan in force stays.
    }
    return;
  }
  if (options.replan_on_overrun() && overrun) {
    const int64_t excess = measured_peak - budget;
    const int64_t target = step_plan.budget_bytes - excess;
    try {
      solve_and_apply(target);
      ++replans;
    } catch (const Error&) {
      // NOTE [overruns reported]: nothing fits a lower target. The plan
      // in force stays, and the user hears of it: the budget is a bound
      // on the measured peak, and this step broke it.
      const std::string report = overrun_report(excess, target);
      overrun_reports.push_back(report);
      if (options.overrun_throws()) throw Error(report);
      TORCH_WARN(report);
    }
  }
}

}  // namespace remat
