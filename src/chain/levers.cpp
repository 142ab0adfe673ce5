// The per-stage menu of a planned chain (levers.h).
#include "levers.h"

#include <algorithm>

#include <remat/hooks.h>

#include "../offload/offload_internal.h"

namespace remat::detail {

int64_t Levers::inflight_margin() const {
  // Per store, as the options share them (OffloadStore::shared's key).
  std::vector<const OffloadStore*> seen;
  int64_t margin = 0;
  for (const auto& menu : stages) {
    for (const StageLever& l : menu) {
      if (!l.disk()) continue;
      const OffloadStore* store = OffloadStore::shared(*l.offload).get();
      if (std::find(seen.begin(), seen.end(), store) != seen.end()) continue;
      seen.push_back(store);
      margin += std::max(l.offload->max_inflight_bytes(), largest_saved);
    }
  }
  return margin;
}

plan::Chain Levers::without_disk(const plan::Chain& chain) const {
  plan::Chain c = chain;
  for (size_t i = 0; i < stages.size() && i < c.stages.size(); ++i) {
    size_t keep = 0;
    while (keep < stages[i].size() && !stages[i][keep].disk()) ++keep;
    c.stages[i].options.resize(std::min(keep, c.stages[i].options.size()));
  }
  return c;
}

bool Levers::uses_disk(const plan::Schedule& schedule) const {
  return std::any_of(schedule.ops.begin(), schedule.ops.end(), [&](const plan::Op& op) {
    return op.option > 0 && static_cast<size_t>(op.stage) < stages.size() &&
           static_cast<size_t>(op.option) <= stages[op.stage].size() && stages[op.stage][op.option - 1].disk();
  });
}

Values run_stage_under(torch::nn::AnyModule& m, const Values& in, bool writes_input, const std::string& who,
                       const StageLever* lever, bool trial) {
  if (lever == nullptr) return run_stage_module(m, in, writes_input, who);
  if (lever->offload) {
    OffloadOptions o = *lever->offload;
    if (trial && o.target() == OffloadTarget::kDisk) o.max_inflight_bytes(1);
    Values y;
    {
      // Hooks pushed here, not through OffloadCall: a planned re-run is a
      // replay (is_recomputing()), whose saves are still the stage's own.
      ScopedHooks to_store(make_offload_hooks(OffloadStore::shared(o)));
      y = run_stage_module(m, in, writes_input, who);
    }
    if (trial) wait_checkpoint_offloads();
    return y;
  }
  // A region over the stage: the module's parameters are version-checked
  // before its recompute and its buffers put back after it. The recompute
  // runs in backward, after this call: fn holds copies, never references.
  auto kind = std::make_shared<Values::Kind>(in.kind);
  auto fn = [m, k = in.kind, writes_input, who, kind](const std::vector<at::Tensor>& ts) mutable {
    Values y = run_stage_module(m, Values(k, ts), writes_input, who);
    *kind = y.kind;
    return y.ts;
  };
  const auto* module = m.ptr().get();
  std::vector<at::Tensor> out = checkpoint_impl(
      *lever->region, ModuleState{module->parameters(), module->buffers(), module_tree(*module)}, fn, in.ts);
  return Values(*kind, std::move(out));
}

}  // namespace remat::detail
