// The planner's measured device (measure.h).
#include "measure.h"

#include <remat/error.h>

namespace remat::detail {

void check_unit_device(const std::string& unit, bool chain, const std::vector<at::Tensor>& inputs,
                       c10::Device measured) {
  for (const auto& x : inputs) {
    if (!x.defined() || x.device() == measured) continue;
    if (measured.is_cpu()) {
      throw Error("[remat::auto] unit '" + unit + "' runs on " + x.device().str() +
                  "; the whole-step planner measures CPU memory only. On a CUDA device, use " +
                  (chain ? "the chain's own memory budget (SequentialOptions) without auto_checkpoint."
                         : "CheckpointedSequential's memory budget or the per-module switch "
                           "(enable_checkpointing)."));
    }
    throw Error("[remat::auto] unit '" + unit + "' runs on " + x.device().str() + "; the whole-step planner measures " +
                measured.str() +
                " (the device of the model's parameters) and plans units whose inputs are there. Move the "
                "unit's inputs to " +
                measured.str() + ", or its parameters to " + x.device().str() + ".");
  }
}

}  // namespace remat::detail
