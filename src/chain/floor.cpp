// What sets a chain's least peak (floor.h).
#include "floor.h"

#include <remat/error.h>
#include <remat/plan/solve.h>

namespace remat::detail {

std::string least_peak_reason(const plan::Chain& chain, int64_t param_grad_bytes, int64_t without_grads_peak) {
  const plan::PeakSite site = plan::min_peak_site(chain);
  const plan::Op& op = site.op;
  const std::string stage = "stage '" + chain.stages[static_cast<size_t>(op.stage)].name + "' (" +
                            std::to_string(op.stage + 1) + " of " + std::to_string(chain.size()) + ")";
  const bool backward = op.kind == plan::OpKind::kBackward;
  std::string out = " That peak is reached in the " + std::string(backward ? "backward" : "forward") + " of " + stage +
                    ", whose own working set there is " + format_bytes(site.stage_bytes) +
                    (backward ? " (its input, what it saved for backward, the gradients at its output and input, "
                                "its backward's temporaries)"
                              : " (its input, what it keeps, its temporaries)") +
                    "; the chain's input holds " + format_bytes(chain.input_bytes) + " throughout";
  if (param_grad_bytes > 0) {
    out += ", and the plan counts " + format_bytes(param_grad_bytes) +
           " of parameter gradients that this step's backward allocates";
  }
  out +=
      ". What lowers it: cutting that stage into smaller stages (its children as stages of the chain) or "
      "checkpointing inside it (enable_checkpointing on its blocks)";
  if (param_grad_bytes > 0 && without_grads_peak < site.peak_bytes) {
    out +=
        "; leaving the parameter gradients out of the budget (allocate them before the first step and zero them "
        "with zero_grad(false), or count_parameter_gradients(false)), which lowers it to " +
        format_bytes(without_grads_peak);
  }
  return out + "; a smaller input (batch).";
}

}  // namespace remat::detail
