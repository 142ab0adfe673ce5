// Internal: what sets a chain's least peak, said in the error of a budget
// below it (the stage and op where it is reached, that stage's own bytes,
// the chain's input, the parameter gradients counted) with what lowers it.
#pragma once

#include <cstdint>
#include <string>

#include <remat/plan/chain.h>

namespace remat::detail {

/** Sentences to append to "the smallest feasible peak is X": `chain` as
 *  planned; `without_grads_peak` its least peak without the parameter
 *  gradients counted in it (param_grad_bytes of them; 0: none counted). */
std::string least_peak_reason(const plan::Chain& chain, int64_t param_grad_bytes, int64_t without_grads_peak);

}  // namespace remat::detail
