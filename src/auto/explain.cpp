// What the whole-step planner tells its user: explain() (the plan, unit
// by unit, against the profiled and the last measured step), units(), the
// Chrome trace of the profiled step (write_trace) and the text of the
// errors and reports the planner's stages raise (no plan fits, an overrun
// no plan fixes). Leaves out the checks of the user's arguments (auto.cpp,
// where they are made) and the figures themselves (the other stages).
#include "internal.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <sstream>

#include <remat/error.h>
#include <remat/plan/error.h>

#include "../region/levels.h"

namespace remat {

using detail::shown;

namespace {

std::string fmt_ms(double ms) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f ms", ms);
  return b;
}
std::string fmt_pct(double x) {
  char b[32];
  std::snprintf(b, sizeof b, "%+.1f%%", 100 * x);
  return b;
}

}  // namespace

/** The error of solve() when no plan fits `target`: the leanest peak, where
 *  it is reached, and what to change. */
std::string AutoCheckpoint::Impl::no_plan_fits(int64_t target) const {
  const Leanest low = leanest();
  std::ostringstream limit;
  limit << options.solver_time_limit_s();
  return "[remat::auto] no plan of the step fits in " + plan::format_bytes(target) + "; the smallest " +
         (low.proven ? "feasible peak is " : "peak found is ") + plan::format_bytes(low.peak) + ", reached " +
         plan::describe_segment(step_model, low.segment) +
         (low.margin > 0 ? " (with " + plan::format_bytes(low.margin) + " for offload writes and reads in flight)"
                         : std::string()) +
         (low.proven      ? std::string()
          : low.timed_out ? "; the solver stopped at its time limit of " + limit.str() +
                                " s: a longer solver_time_limit_s may find a leaner plan"
                          : "; not proved the least: the solver's tolerances blur bytes at this size, and a leaner "
                            "plan may exist") +
         ". Raise the memory budget to at least that, or make what runs there smaller (fewer tokens or "
         "images per step).";
}

/** NOTE [overruns reported]: the report of a planned step whose measured peak
 *  was `excess` over the budget, when no plan fits the lowered `target`. */
std::string AutoCheckpoint::Impl::overrun_report(int64_t excess, int64_t target) const {
  const int64_t low = leanest().peak;
  return std::string("[remat::auto] the planned step's measured peak was ") + plan::format_bytes(measured_peak) + ", " +
         plan::format_bytes(excess) + " over the budget of " + plan::format_bytes(budget) +
         ", and no plan of the profiled step fits the budget lowered by that (" + plan::format_bytes(target) +
         "; the smallest feasible peak is " + plan::format_bytes(low) +
         "). The step ran and its update stands; the plan in force stays. Give replan() a budget of at "
         "least " +
         plan::format_bytes(low + excess) +
         ", or profile a step that holds what every later step holds (profile_step(), "
         "AutoOptions::warmup_steps).";
}

std::vector<AutoUnit> AutoCheckpoint::units() const {
  const Impl& m = *impl_;
  std::vector<AutoUnit> out;
  const std::vector<size_t> mu = m.model_units();
  for (size_t j = 0; j < mu.size(); ++j) {
    const plan::StepUnit& su = m.step_model.units[j];
    AutoUnit a;
    a.name = su.name;
    a.calls = static_cast<int64_t>(su.calls.size());
    a.options = su.options;
    a.choice = m.planned ? m.step_plan.prediction.choice[j] : 0;
    for (const plan::StepCall& c : su.calls) {
      a.kept_bytes += c.costs[a.choice].kept_bytes;
      a.time_added_ms += c.costs[a.choice].time_ms - c.costs[0].time_ms;
    }
    // At the in-flight bytes the plan runs its stores with (NOTE [in flight planned]).
    if (m.planned && j < m.plan_option_ms.size() && static_cast<size_t>(a.choice) < m.plan_option_ms[j].size())
      a.time_added_ms += m.plan_option_ms[j][static_cast<size_t>(a.choice)] - m.plan_option_ms[j][0];
    out.push_back(std::move(a));
  }
  // A unit inside one that does not keep runs as part of it.
  for (size_t j = 0; j < out.size(); ++j) {
    for (int64_t a = m.step_model.units[j].parent; a >= 0; a = m.step_model.units[a].parent) {
      if (out[static_cast<size_t>(a)].choice != 0) out[j].runs_in = out[static_cast<size_t>(a)].name;
    }
    if (!out[j].runs_in.empty()) out[j].kept_bytes = 0;
  }
  // What inner units keep less is kept less by the units around them.
  for (size_t j = 0; j < out.size(); ++j) {
    int64_t saved = 0;
    for (const plan::StepCall& c : m.step_model.units[j].calls) {
      saved += c.costs[0].kept_bytes - c.costs[out[j].choice].kept_bytes;
    }
    for (int64_t a = m.step_model.units[j].parent; a >= 0 && saved != 0; a = m.step_model.units[a].parent) {
      out[static_cast<size_t>(a)].kept_bytes -= saved;
    }
  }
  return out;
}

std::string AutoCheckpoint::explain() const {
  const Impl& m = *impl_;
  std::ostringstream os;
  if (m.step_model.units.empty()) return "remat::auto_checkpoint: not profiled yet\n";
  const plan::StepPrediction& p = m.step_plan.prediction;
  os << "remat::auto_checkpoint: budget " << plan::format_bytes(m.budget) << "; profiled step (plain): peak "
     << plan::format_bytes(m.profiled_peak) << ", " << fmt_ms(m.profiled_ms);
  // NOTE [plain time calibrated]
  const double plain_ms = m.step_model.step_time_ms;
  if (m.plain_calibrations > 0) os << "; plain as measured by planned steps since: " << fmt_ms(plain_ms);
  os << "\n";
  if (m.planned) {
    os << "plan: predicted peak " << plan::format_bytes(p.peak_bytes) << " (reached "
       << plan::describe_segment(m.step_model, p.peak_segment) << "), " << fmt_ms(p.time_ms) << " ("
       << fmt_pct(p.time_ms / std::max(1e-9, plain_ms) - 1) << " on plain); solver: " << m.step_plan.solver << ", "
       << (m.step_plan.solver == detail::kGivenSolver ? "your choice (apply_choice)"
           : m.step_plan.optimal                      ? "optimal"
           : std::isfinite(m.step_plan.relative_gap)  ? "gap " + fmt_pct(m.step_plan.relative_gap)
                                                      : "stopped at its time limit, gap not known")
       << ", "
       << (m.step_plan.solver == "GLPK"
               ? std::to_string(m.step_plan.rows) + " rows x " + std::to_string(m.step_plan.columns) + " columns, "
               : std::string())
       << fmt_ms(m.step_plan.solve_ms)
       << (m.replans ? ", solved again " + std::to_string(m.replans) + "x after overruns" : "") << "\n";
    if (m.grown > 0) {
      os << "profiled step: held " << plan::format_bytes(m.grown)
         << " more at its end than at its start (the optimizer's state, gradients): counted at every point of the "
            "step\n";
    }
    if (m.reprices > 0) {
      char b[160];
      std::snprintf(b, sizeof b, "offload repriced %dx from measured steps: +%.0f ms per GiB sent\n", m.reprices,
                    m.offload_ms_per_gib);
      os << b;
    }
    os << m.explain_state();
    if (const int64_t inflight = inflight_bytes(); inflight > 0 && p.peak_bytes + inflight <= m.budget) {
      os << "offload: up to " << plan::format_bytes(inflight)
         << " of writes and reads in flight on top of the prediction, within the budget";
      if (m.plan_state_writes > 0) {
        os << " (" << plan::format_bytes(m.plan_state_writes) << " of them optimizer state being written";
        if (const int64_t a = m.activations_inflight(); a > 0) os << ", " << plan::format_bytes(a) << " activations";
        os << ")";
      }
      // NOTE [in flight planned]: a cap other than the one given is the plan's.
      for (size_t i = 0; i < m.plan_caps.size() && i < m.options.offload().size(); ++i) {
        const OffloadOptions& o = m.options.offload()[i];
        if (o.target() != OffloadTarget::kDisk || m.plan_caps[i] == o.max_inflight_bytes()) continue;
        os << "; " << detail::offload_name(o) << " runs with max_inflight_bytes " << plan::format_bytes(m.plan_caps[i])
           << " (planned; given " << plan::format_bytes(o.max_inflight_bytes()) << ")";
      }
      os << "\n";
    }
    if (m.measured_peak >= 0) {
      os << "last step: measured peak " << plan::format_bytes(m.measured_peak) << " ("
         << fmt_pct(static_cast<double>(m.measured_peak) / static_cast<double>(m.budget) - 1) << " on the budget, "
         << fmt_pct(static_cast<double>(m.measured_peak) / static_cast<double>(p.peak_bytes) - 1)
         << " on the prediction), " << fmt_ms(m.measured_ms) << " ("
         << fmt_pct(m.measured_ms / std::max(1e-9, p.time_ms) - 1) << " on the prediction)\n";
    }
  }
  size_t width = 4, owidth = 6;
  for (const auto& u : units()) {
    width = std::max(width, u.name.size());
    owidth = std::max(owidth, u.options[u.choice].size());
  }
  const int ow = static_cast<int>(owidth) + 2;
  os << std::left << std::setw(static_cast<int>(width) + 2) << "unit" << std::setw(7) << "calls" << std::setw(ow)
     << "option" << std::setw(14) << "kept/step"
     << "time added\n";
  for (const auto& u : units()) {
    os << std::left << std::setw(static_cast<int>(width) + 2) << u.name << std::setw(7) << u.calls;
    if (!u.runs_in.empty()) {
      os << "part of " << u.runs_in << "\n";
      continue;
    }
    char added[32];
    std::snprintf(added, sizeof added, "%+.1f ms", u.time_added_ms);
    os << std::setw(ow) << u.options[u.choice] << std::setw(14) << plan::format_bytes(u.kept_bytes) << added << "\n";
  }
  for (const detail::Unit& u : m.units) {
    if (u.calls.empty())
      os << shown(u.name) << ": not called with grad enabled in the profiled step"
         << (m.options.inner_units() ? "" : " outside another unit") << ": off\n";
  }
  return os.str();
}

void AutoCheckpoint::write_trace(const std::string& path) const {
  const Impl& m = *impl_;
  std::ofstream f(path);
  if (!f) throw Error("[remat::auto] cannot write the trace to '" + path + "'; give a writable path.");
  f << "{\"traceEvents\":[\n";
  bool first = true;
  auto sep = [&] {
    if (!first) f << ",\n";
    first = false;
  };
  for (const auto& s : m.samples) {
    sep();
    f << "{\"name\":\"profiled bytes\",\"ph\":\"C\",\"pid\":1,\"ts\":" << s.time_us
      << ",\"args\":{\"bytes\":" << s.bytes << "}}";
  }
  if (m.planned) {
    const auto& seg = m.step_plan.prediction.segment_bytes;
    for (size_t i = 0; i < seg.size() && i < m.points_us.size(); ++i) {
      sep();
      f << "{\"name\":\"planned peak per segment\",\"ph\":\"C\",\"pid\":1,\"ts\":" << m.points_us[i]
        << ",\"args\":{\"bytes\":" << seg[i] << "}}";
    }
  }
  for (const auto& c : m.calls) {
    const std::string name = shown(m.units[c->unit].name);
    sep();
    f << "{\"name\":\"forward " << name << "\",\"ph\":\"X\",\"pid\":1,\"tid\":1,\"ts\":" << c->forward_begin_us
      << ",\"dur\":" << c->forward_end_us - c->forward_begin_us << "}";
    sep();
    f << "{\"name\":\"backward " << name << "\",\"ph\":\"X\",\"pid\":1,\"tid\":2,\"ts\":" << c->first_unpack_us
      << ",\"dur\":" << c->backward_end_us - c->first_unpack_us << "}";
  }
  for (const auto& [a, b] : m.trial_windows) {
    sep();
    f << "{\"name\":\"isolated runs (cut out)\",\"ph\":\"X\",\"pid\":1,\"tid\":3,\"ts\":" << a << ",\"dur\":" << b - a
      << "}";
  }
  f << "\n],\"displayTimeUnit\":\"ms\"}\n";
  if (!f) throw Error("[remat::auto] writing the trace to '" + path + "' failed; check the disk.");
}

}  // namespace remat
