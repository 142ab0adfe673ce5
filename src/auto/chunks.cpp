// Chunked calls as units of the whole-step planner: each
// remat::chunked_cross_entropy and remat::chunked call of the step (a
// model's loss head) is a unit whose options are chunk counts.
//
// NOTE [chunked calls as units]: a chunked call has no module to switch,
// so the planner sees it through its own observer (detail::ChunkObserver),
// installed while step() runs the user's step. Calls are told apart by
// their order in the step, counted outside recomputes, outside the
// isolated runs and outside another chunked call (whose count decides how
// often it runs; the chunked functions do not ask the observer there),
// with grad on or off: the k-th call of every step is the same unit. In
// the profiled step a call is a unit when it runs with grad on, outside a
// checkpointed region's forward (a user's region recomputes it with its
// own count) and where a Checkpointable's call would be observed (not
// inside a chain, nor inside another unit without inner_units); its menu is its own count, then
// AutoOptions::chunk_counts capped at the length it slices, each measured
// in isolated runs like any option (begin_call). In a planned step the
// call runs with the count of the option chosen. A call inside another
// unit is that unit's inner unit (plan::StepUnit::parent): it takes
// another count only while the unit keeps everything, so a unit that
// recomputes runs it with its own count, the same in forward and in the
// recompute (which the observer never sees).
#include "internal.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <string>

#include "../region/region_depth.h"

namespace remat {

using detail::shown;

std::vector<int64_t> default_chunk_counts() { return {1, 2, 4, 8, 16, 32}; }

std::unique_ptr<detail::UnitObserver::Call> AutoCheckpoint::Impl::begin(const char* kind, int64_t limit,
                                                                        const std::vector<at::Tensor>& inputs,
                                                                        const detail::ChunkRun& run, int64_t* chunks) {
  if (in_trial) return nullptr;  // a unit's isolated run: not a call of the step
  const size_t ord = sites_seen++;
  // Numbered with grad off too (a chain's stages run their first forward
  // so in planned steps), but planned only with grad on, and never inside
  // a checkpointed region's forward, whose recompute runs the call again
  // with its own count.
  const bool plannable = at::GradMode::is_enabled() && !detail::in_region_forward();
  if (timeline != nullptr) {  // the profiled step
    if (site_units.size() <= ord) site_units.resize(ord + 1, -1);
    if (options.chunk_counts().empty() || !plannable || !observing()) {
      site_units[ord] = -1;
      return nullptr;
    }
    int64_t unit = site_units[ord];
    if (unit < 0 || units[static_cast<size_t>(unit)].kind != kind) {
      // A new unit, named after its kind and the unit it runs in.
      std::string name = active.empty() ? std::string(kind) : shown(units[active.back()->unit].name) + "/" + kind;
      int same = 0;
      for (const Unit& u : units) same += u.name == name || u.name.rfind(name + " #", 0) == 0 ? 1 : 0;
      if (same > 0) name += " #" + std::to_string(same + 1);
      Unit u;
      u.name = std::move(name);
      u.kind = kind;
      unit = static_cast<int64_t>(units.size());
      units.push_back(std::move(u));
      before.emplace_back();
      site_units[ord] = unit;
    }
    Unit& u = units[static_cast<size_t>(unit)];
    u.own_chunks = *chunks;
    u.limit = limit;
    RunOption again = [&run](const Option& o, const std::vector<at::Tensor>& in) { return run(o.chunks, in); };
    return begin_call(static_cast<size_t>(unit), inputs, again, nullptr);
  }
  if (planned && plannable && ord < site_units.size() && site_units[ord] >= 0) {
    const size_t unit = static_cast<size_t>(site_units[ord]);
    if (unit < chunks_plan.size() && chunks_plan[unit] >= 0 && units[unit].kind == kind) *chunks = chunks_plan[unit];
  }
  return nullptr;
}

/** A chunked call's menu: its own count ("as called"), then each of
 *  AutoOptions::chunk_counts, capped at the length it slices, that runs
 *  differently. */
void AutoCheckpoint::Impl::build_chunk_menu(Unit& u) {
  auto label = [&](int64_t c) {
    if (c == 0) return std::string("unchunked");
    return std::to_string(c) + (c == 1 ? " chunk" : " chunks");
  };
  const int64_t own = u.own_chunks == 0 ? 0 : std::min(u.own_chunks, u.limit);
  Option first;
  first.name = label(own) + " (as called)";
  u.menu.push_back(std::move(first));
  std::vector<int64_t> seen{own};
  // A chunked() region checkpoints each slice: another count is a recompute.
  const bool recomputes = u.kind == "chunked";
  for (int64_t c : options.chunk_counts()) {
    if (recomputes && !options.recompute()) break;
    const int64_t k = std::min(c, u.limit);
    if (std::find(seen.begin(), seen.end(), k) != seen.end()) continue;
    seen.push_back(k);
    Option o;
    o.name = label(k);
    o.chunks = k;
    u.menu.push_back(std::move(o));
  }
  u.plannable = u.menu.size() > 1;
}

}  // namespace remat
