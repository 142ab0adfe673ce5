// JSON for chains, plans and frontiers (the remat-plan format). nlohmann-json
// is used inside the library only; this header exposes strings.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "remat/plan/chain.h"
#include "remat/plan/solve.h"

namespace remat::plan {

/** Parses {"input_bytes": N, "stages": [{"name", "forward_ms", "backward_ms",
 *  "output_bytes", "saved_bytes", optional "forward_tmp_bytes",
 *  "plain_forward_tmp_bytes", "backward_tmp_bytes", "backward_freed_bytes",
 *  "shared_input_bytes", "output_grad_bytes", "recompute_ms"}, ...]} and validates it. Throws Error naming the
 *  field, e.g. "stages[2].saved_bytes: missing". */
Chain chain_from_json(std::string_view text);

/** The same format; parses back with chain_from_json. */
std::string chain_to_json(const Chain& chain, int indent = 2);

/** {"algorithm", "prediction": {"peak_bytes", "time_ms", "forward_executions",
 *  "forwards_per_stage"}, "schedule": [{"op": "forward_save", "stage": 0,
 *  "bytes": live bytes during the op}, ...]}; for optimal also
 *  "lower_bound_ms", "optimality_gap_ms" and "memory_unit_bytes" (Plan). */
std::string plan_to_json(const Chain& chain, const Plan& plan, int indent = 2);

}  // namespace remat::plan
