// Helpers shared by the algorithm sources of remat::plan; not installed.
#pragma once

#include <string>
#include <vector>

#include "remat/plan/solve.h"

namespace remat::plan::internal {

/** Plan with its prediction from simulate(). */
Plan make_plan(const Chain& chain, std::string algorithm, Schedule schedule);

/** Appends forward(from), forward(from+1), drop(from+1), ..., forward(to-1),
 *  drop(to-1): from a_from live to a_to live, nothing else kept. */
void emit_sweep(std::vector<Op>& ops, int from, int to);

/** checkpoint_sequential-style schedule over segments starting at `starts`
 *  (starts[0] == 0, increasing, < L): all but the last segment checkpointed. */
Schedule segmented(int L, const std::vector<int>& starts);

}  // namespace remat::plan::internal
