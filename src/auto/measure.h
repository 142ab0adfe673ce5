// Where the whole-step planner measures (internal): the device of its units
// and the refusal of a unit that runs elsewhere. The readings themselves
// come through that device's memory::Source (core/memory_source.h).
#pragma once

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

namespace remat::detail {

/** Throws remat::Error when an input of a unit's call is on a device other
 *  than `measured`, the device whose memory the planner reads (the model's
 *  parameters': the first CUDA one, else the CPU). `unit` is the unit's
 *  name as shown; `chain` says whether it is a CheckpointedSequential (the
 *  message names what works instead). */
void check_unit_device(const std::string& unit, bool chain, const std::vector<at::Tensor>& inputs,
                       c10::Device measured);

}  // namespace remat::detail
