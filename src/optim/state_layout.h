// Internal: what LibTorch's optimizers keep per parameter, known before
// any state exists (the whole-step planner sizes its state store with it,
// src/auto/state.cpp). Next to it, step_in_backward.cpp reads the state
// tensors themselves once they exist.
#pragma once

#include <cstdint>

#include <torch/optim/optimizer.h>

namespace remat::detail {

/** How many tensors of its parameter's size one parameter's state holds
 *  under a param group's options: Adam and AdamW two (three with AMSGrad),
 *  SGD one with momentum (none without), RMSprop one to three (square
 *  average, momentum, centered average), Adagrad one; three, the most any
 *  of them keeps, for another optimizer. */
int64_t state_tensors_per_parameter(const torch::optim::OptimizerOptions& options);

}  // namespace remat::detail
