// The whole-step planner (auto.h): profiles one step of the user's step
// function through the units' checkpoint switch (Checkpointable's
// UnitObserver) and its chains (CheckpointedSequential's ChainObserver),
// turns it into a plan::StepModel, solves it and applies the choice through
// the same switches (and a forced schedule per chain). Memory is read and
// work timed on the device of the model's parameters (NOTE [memory sources],
// core/memory_source.h; auto.h says what that means for users).
//
// This file is the public API: AutoCheckpoint's construction (the units
// found in the module tree, the options checked), step(), replan() and the
// accessors. The planner's stages are files of their own, in the order a
// step takes them: profiled_step.cpp (the profiled step), menu.cpp (each unit's
// options and their costs), step_model.cpp (the step model, solved),
// apply.cpp (the plan put in force, planned steps) and explain.cpp (reports
// and errors); internal.h has what they share.
#include <remat/auto.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <unordered_map>

#include <remat/checkpoint.h>
#include <remat/checkpointable.h>
#include <remat/error.h>
#include <remat/memory.h>
#include <remat/offload.h>
#include <remat/sequential.h>

#include "../offload/offload_internal.h"
#include "../region/levels.h"
#include "internal.h"

namespace remat {

using detail::Clock;
using detail::ms_since;
using detail::shown;
using detail::Unit;

AutoCheckpoint::AutoCheckpoint(torch::nn::Module& model, AutoOptions options)
    : impl_(std::make_unique<Impl>(model, std::move(options))) {
  const AutoOptions& o = impl_->options;
  if (o.memory_budget_bytes() < 0) {
    throw Error("[remat::auto] memory_budget_bytes is " + std::to_string(o.memory_budget_bytes()) +
                "; give a positive number of bytes, or 0 to use memory_budget_fraction.");
  }
  if (o.memory_budget_bytes() == 0 && !(o.memory_budget_fraction() > 0 && o.memory_budget_fraction() <= 1)) {
    throw Error("[remat::auto] no budget: memory_budget_bytes is 0 and memory_budget_fraction is " +
                std::to_string(o.memory_budget_fraction()) +
                "; give AutoOptions().memory_budget_bytes(b) or memory_budget_fraction(f) with f in (0, 1].");
  }
  if (o.selective_levels() < 0 || o.warmup_steps() < 0 || o.profile_repeats() < 1 || !(o.solver_time_limit_s() > 0)) {
    throw Error("[remat::auto] selective_levels " + std::to_string(o.selective_levels()) + ", warmup_steps " +
                std::to_string(o.warmup_steps()) + ", profile_repeats " + std::to_string(o.profile_repeats()) +
                ", solver_time_limit_s " + std::to_string(o.solver_time_limit_s()) +
                ": the first two must be >= 0, profile_repeats >= 1 and the time limit > 0.");
  }
  if (!(o.compression_margin() >= 0) || !std::isfinite(o.compression_margin())) {
    throw Error("[remat::auto] compression_margin " + std::to_string(o.compression_margin()) +
                " must be a finite number >= 0 (the share added to what a compressing store held in the profiled "
                "step; default 0.5).");
  }
  for (size_t k = 0; k < o.offload().size(); ++k) {
    const OffloadOptions& off = o.offload()[k];
    const std::string which = "[remat::auto] offload option " + std::to_string(k) + " (" + to_string(off.target()) +
                              ", codec " + to_string(off.codec()) + ")";
    detail::check_menu_offload(which, off, /*on_cpu=*/true);
  }
  for (int64_t c : o.chunk_counts()) {
    if (c < 1) {
      throw Error("[remat::auto] chunk_counts holds " + std::to_string(c) +
                  "; each count must be >= 1 (a call's own count, 0 included, is always its first option). Pass "
                  "e.g. remat::default_chunk_counts().");
    }
  }
  if (!o.recompute() && o.offload().empty() && o.chunk_counts().empty() && !o.optimizer_state_store()) {
    throw Error(
        "[remat::auto] recompute(false) leaves every unit only keep: nothing to plan. Give the units an offload "
        "store (AutoOptions().offload({remat::OffloadOptions(remat::OffloadTarget::kDisk).directory(dir)})), "
        "chunk_counts for the loss head, or an optimizer_state_store; or leave recompute on.");
  }
  if (o.optimizer_state_store()) {
    if (o.optimizers().empty()) {
      throw Error(
          "[remat::auto] optimizer_state_store needs the optimizers whose state it would hold: give "
          "AutoOptions().optimizers({&opt}) too.");
    }
    // Its options and directory, checked now rather than after the profiled step.
    detail::OffloadStore::create_isolated(*o.optimizer_state_store());
  }
  std::unordered_map<const torch::nn::Module*, bool> seen;
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    torch::nn::Module* m = item.value().get();
    auto* c = dynamic_cast<Checkpointable*>(m);
    auto* chain = dynamic_cast<CheckpointedSequentialImpl*>(m);
    if ((c == nullptr && chain == nullptr) || !seen.emplace(m, true).second) continue;
    Unit u;
    u.name = item.key();
    u.c = c;
    u.module = m;
    if (chain != nullptr) {
      if (detail::ChainAccess::step_budget(*chain) > 0) {
        throw Error("[remat::auto] the CheckpointedSequential '" + shown(item.key()) +
                    "' has a step budget (step_memory_budget_bytes " +
                    std::to_string(detail::ChainAccess::step_budget(*chain)) +
                    "), and the whole-step planner plans its schedule under the planner's own budget; build it "
                    "without step_memory_budget_bytes.");
      }
      u.c = nullptr;
      u.chain = chain;
      u.module = chain->sequential().ptr().get();  // a chain over several Sequentials registers none of them
      impl_->chain_index[chain] = impl_->units.size();
    } else {
      impl_->index[c] = impl_->units.size();
    }
    impl_->units.push_back(std::move(u));
  }
  for (Unit& u : impl_->units) {
    if (u.chain != nullptr) continue;  // what runs inside a chain runs as its schedule says
    // Not below a chain: what runs inside one runs as its schedule says.
    std::vector<const torch::nn::Module*> in_chains;
    for (const auto& sub : u.module->modules(/*include_self=*/false)) {
      if (auto* chain = dynamic_cast<CheckpointedSequentialImpl*>(sub.get())) {
        for (const auto& m : chain->sequential()->modules(/*include_self=*/true)) in_chains.push_back(m.get());
      }
    }
    for (const auto& sub : u.module->modules(/*include_self=*/false)) {
      if (std::find(in_chains.begin(), in_chains.end(), sub.get()) != in_chains.end()) continue;
      auto* c = dynamic_cast<Checkpointable*>(sub.get());
      auto it = c == nullptr ? impl_->index.end() : impl_->index.find(c);
      if (it != impl_->index.end() && std::find(u.inner.begin(), u.inner.end(), it->second) == u.inner.end()) {
        u.inner.push_back(it->second);
      }
    }
  }
  if (impl_->units.empty()) {
    throw Error("[remat::auto] the model (" + model.name() +
                ") has no Checkpointable module and no CheckpointedSequential: the planner's units are modules "
                "deriving from remat::Checkpointable whose forward calls checkpointed(), and chains.");
  }
  // Counted from here on: the warm-up's gradients and optimizer state are
  // then in every step's figures, the profiled one's included.
  memory::enable_tracking();
  // NOTE [model state in the plan]: every step runs with the updates in backward.
  impl_->start_in_backward();
  // The planner owns the switches: every unit runs plain until planned
  // (NOTE [switches given back]).
  impl_->note_switches();
  impl_->switch_off();
}

AutoCheckpoint::~AutoCheckpoint() = default;
AutoCheckpoint::AutoCheckpoint(AutoCheckpoint&&) noexcept = default;
AutoCheckpoint& AutoCheckpoint::operator=(AutoCheckpoint&&) noexcept = default;

void AutoCheckpoint::step(const std::function<void()>& fn) {
  Impl& m = *impl_;
  Impl::StepScope chunked_calls(m);  // NOTE [chunked calls as units]
  if (m.planned) {
    m.measured_step(fn);
  } else if (m.steps_run < m.options.warmup_steps()) {
    memory::DeviceTimer t0(memory::measured_device(m.model.parameters()));
    fn();
    m.warmup_ms = t0.elapsed_ms();
    ++m.steps_run;
  } else {
    profile_step(fn);
  }
}

void AutoCheckpoint::profile_step(const std::function<void()>& fn) {
  Impl& m = *impl_;
  Impl::StepScope chunked_calls(m);
  m.switch_off();
  m.planned = false;
  m.placement = Impl::Placement{};  // NOTE [model state in the plan]: profiled with every state kept
  m.apply_state();
  m.profile(fn);
  m.measure_state();
  ++m.steps_run;
  if (m.step_model.units.empty()) {
    throw Error("[remat::auto] the profiled step called none of the model's " + std::to_string(m.units.size()) +
                " units (Checkpointable modules and chains) with grad enabled (first: '" + shown(m.units[0].name) +
                "'); run the step function that trains this model, with its Checkpointable modules' forward routed "
                "through checkpointed().");
  }
  m.budget = m.options.memory_budget_bytes() > 0
                 ? m.options.memory_budget_bytes()
                 : static_cast<int64_t>(m.options.memory_budget_fraction() * static_cast<double>(m.profiled_peak));
  m.solve_and_apply(m.budget);
}

void AutoCheckpoint::replan(int64_t budget_bytes) {
  Impl& m = *impl_;
  if (m.step_model.units.empty()) {
    throw Error("[remat::auto] replan(" + std::to_string(budget_bytes) +
                ") before a profiled step; run step() (or profile_step()) first.");
  }
  if (budget_bytes <= 0) {
    throw Error("[remat::auto] replan(" + std::to_string(budget_bytes) + "): give a positive budget in bytes.");
  }
  m.solve_and_apply(budget_bytes);
  m.budget = budget_bytes;
  m.measured_peak = -1;
  m.measured_ms = -1;
}

void AutoCheckpoint::apply_choice(const std::vector<int>& choice) {
  Impl& m = *impl_;
  const plan::StepModel& sm = m.step_model;
  if (sm.units.empty())
    throw Error("[remat::auto] apply_choice before a profiled step; run step() (or profile_step()) first.");
  if (choice.size() != sm.units.size()) {
    throw Error("[remat::auto] apply_choice got " + std::to_string(choice.size()) + " option indices for the step's " +
                std::to_string(sm.units.size()) + " units; give one per entry of units(), in its order.");
  }
  for (size_t j = 0; j < choice.size(); ++j) {
    const size_t n = sm.units[j].options.size();
    if (choice[j] < 0 || static_cast<size_t>(choice[j]) >= n) {
      throw Error("[remat::auto] apply_choice: option " + std::to_string(choice[j]) + " of unit '" + sm.units[j].name +
                  "', which has " + std::to_string(n) + " (0 to " + std::to_string(n - 1) + ", as units()[" +
                  std::to_string(j) + "].options lists them).");
    }
  }
  for (size_t j = 0; j < choice.size(); ++j) {
    for (int64_t a = sm.units[j].parent; a >= 0 && choice[j] != 0; a = sm.units[static_cast<size_t>(a)].parent) {
      if (choice[static_cast<size_t>(a)] != 0) {
        throw Error("[remat::auto] apply_choice: unit '" + sm.units[j].name + "' runs inside '" +
                    sm.units[static_cast<size_t>(a)].name + "', which takes option " +
                    std::to_string(choice[static_cast<size_t>(a)]) +
                    " (not keep): it runs as part of it, so give it option 0, or give the outer unit option 0.");
      }
    }
  }
  m.give_and_apply(choice);
  m.measured_peak = -1;
  m.measured_ms = -1;
}

void AutoCheckpoint::apply() {
  if (!impl_->planned) throw Error("[remat::auto] apply() before a plan exists; run step() until planned().");
  impl_->apply();
}

bool AutoCheckpoint::planned() const { return impl_->planned; }

std::vector<StepInBackward::Accumulating> AutoCheckpoint::accumulate() {
  std::vector<StepInBackward::Accumulating> guards;
  for (auto& s : impl_->in_backward) guards.push_back(s->accumulate());
  return guards;
}

int64_t AutoCheckpoint::optimizer_state_in_store_bytes() const {
  int64_t bytes = 0;
  for (const auto& s : impl_->in_backward) bytes += s->stats().state_offloaded_bytes;
  return bytes;
}

double AutoCheckpoint::optimizer_state_wait_ms() const { return impl_->state_wait_last_ms; }

std::vector<StepInBackwardStats> AutoCheckpoint::optimizer_stats() const {
  std::vector<StepInBackwardStats> out;
  for (const auto& s : impl_->in_backward) out.push_back(s->stats());
  return out;
}

void AutoCheckpoint::fetch_optimizer_state() {
  for (auto& s : impl_->in_backward) s->fetch_state();
}
int64_t AutoCheckpoint::leanest_peak_bytes() const {
  if (impl_->step_model.units.empty()) {
    throw Error("[remat::auto] leanest_peak_bytes() before a profiled step; run step() (or profile_step()) first.");
  }
  return impl_->leanest().peak;
}
int64_t AutoCheckpoint::budget_bytes() const { return impl_->budget; }
const plan::StepModel& AutoCheckpoint::step_model() const { return impl_->step_model; }
const plan::StepPlan& AutoCheckpoint::plan() const { return impl_->step_plan; }
int64_t AutoCheckpoint::profiled_peak_bytes() const { return impl_->profiled_peak; }
double AutoCheckpoint::profiled_time_ms() const { return impl_->profiled_ms; }
double AutoCheckpoint::plain_time_ms() const { return impl_->step_model.step_time_ms; }
int64_t AutoCheckpoint::inflight_bytes() const {
  const Impl& m = *impl_;
  if (!m.planned || m.step_plan.budget_bytes == 0) return 0;
  return m.activations_inflight() + m.plan_state_writes;
}

/** The activation stores' part of inflight_bytes(): the margin, when a unit
 *  of the plan sends to a disk store. */
int64_t AutoCheckpoint::Impl::activations_inflight() const {
  if (plan_margin <= 0 || !planned) return 0;
  const std::vector<int>& c = step_plan.prediction.choice;
  for (size_t j = 0; j < step_model.units.size() && j < c.size(); ++j) {
    const int store = store_of(j, static_cast<size_t>(c[j]));
    if (store >= 0 && options.offload()[static_cast<size_t>(store)].target() == OffloadTarget::kDisk)
      return plan_margin;
  }
  return 0;
}

int64_t AutoCheckpoint::measured_peak_bytes() const { return impl_->measured_peak; }
double AutoCheckpoint::measured_time_ms() const { return impl_->measured_ms; }
int AutoCheckpoint::replans() const { return impl_->replans; }

std::vector<std::string> AutoCheckpoint::overruns() const { return impl_->overrun_reports; }

AutoCheckpoint auto_checkpoint(torch::nn::Module& model, AutoOptions options) {
  ensure_engine_installed();
  return AutoCheckpoint(model, std::move(options));
}

}  // namespace remat
