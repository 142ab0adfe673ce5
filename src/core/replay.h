// Internal: the state a recomputation must replay to match the first run
// (RNG streams, autocast, module buffers), shared by remat::checkpoint and
// CheckpointedSequential, and the test for tensors that need no recompute.
#pragma once

#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/GradMode.h>
#include <c10/core/Stream.h>

#include <torch/nn/module.h>

#include "rng_lock.h"

namespace remat::detail {

/** Leaf tensors that require grad (parameters) and views of them: alive
 *  anyway, so saved by reference. */
bool is_parameter_like(const at::Tensor& t);

/** True on a thread while a ReplayGuard lives (remat::is_recomputing()). */
bool recomputing();

/** CPU and CUDA autocast state of this thread. */
struct AutocastState {
  bool cpu_enabled = false, cuda_enabled = false, cache_enabled = true;
  at::ScalarType cpu_dtype = at::kBFloat16, cuda_dtype = at::kHalf;
  static AutocastState capture();
  void apply() const;
};

/** NOTE [RNG devices]: the generators a region's RNG state covers, as
 *  torch.utils.checkpoint picks them and a little more: the CPU generator
 *  always; the default generator of every device of the region's inputs
 *  that has one (CUDA and the other accelerators; meta and other
 *  generator-less device types are skipped, not an error); and every CUDA
 *  device already in use, i.e. with a primary context (`in_use`, from
 *  cuda_devices_in_use()), which covers the current device and a region
 *  that draws on a device none of its inputs lives on (torch.randn(...,
 *  device="cuda") inside fn). Not covered: a device first initialized
 *  inside the region (its generator is at its initial state then, but a
 *  manual_seed before would not be replayed). Order: CPU, inputs' devices
 *  in order, then `in_use`; no duplicates. A pure function, so the CPU
 *  build tests the same code path with made-up device lists. */
std::vector<c10::Device> rng_devices(const std::vector<c10::Device>& inputs, const std::vector<c10::Device>& in_use);
/** CUDA devices with a primary context; empty when CUDA is not available
 *  (always in a CPU build: at::hasCUDA() is false there). */
std::vector<c10::Device> cuda_devices_in_use();

/** NOTE [recompute streams]: the autograd engine runs a node's backward
 *  (and so the unpack that triggers a re-run) with the stream of the node's
 *  forward current (Engine::evaluate_function guards onto Node::stream()),
 *  on the CPU thread of the backward's caller or on autograd's device
 *  thread for that GPU. The re-run therefore runs on the stream the
 *  backward runs on, with no guard of remat's. When a region's forward used
 *  several streams, a tensor re-run for one node may be unpacked by a node
 *  on another stream: stream_of() records where it was produced, and
 *  use_on_current_stream() makes the current stream wait for that one (an
 *  event) and tells the caching allocator the storage is used there
 *  (recordDataPtrOnStream), as autograd's InputBuffer does for gradients.
 *  Device-generic (c10::Event, VirtualGuardImpl): CPU and meta tensors
 *  have no stream and cost nothing. */
std::optional<c10::Stream> stream_of(const at::Tensor& t);
void use_on_current_stream(const at::Tensor& t, const std::optional<c10::Stream>& produced_on);

/** Drops this thread's memory of its last RNG captures, so that the next
 *  region's capture is a copy of its own (the whole-step profiler's
 *  isolated runs: each counts the bytes a region's capture may cost). */
void forget_rng_captures();

/** The device a chain's memory is measured on (the profiler,
 *  CheckpointedSequential): the first CUDA device among `inputs`, else
 *  among `parameters`, else the CPU. A CUDA chain is then planned and
 *  measured in CUDA bytes (remat::memory::Probe(device)). */
c10::Device memory_device(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& parameters);

/** What a first run looked like: RNG states of its devices (shared with
 *  the previous capture on this thread when unchanged), autocast state, and
 *  the module buffers with their values before the first run (a re-run
 *  starts from those and puts the current ones back after). */
/** A module whose train/eval flag a re-run replays: by address (first),
 *  or, when first is null, by weak_ptr (a descendant, skipped once freed).
 *  remat::detail::ModuleRef of checkpoint.h. */
using ModuleRef = std::pair<torch::nn::Module*, std::weak_ptr<torch::nn::Module>>;

struct ReplayState {
  std::vector<std::pair<at::Generator, at::Tensor>> rng;  // generator, state
  AutocastState autocast;
  std::vector<at::Tensor> buffers;
  std::vector<at::Tensor> buffer_values;  // clones, taken at capture
  /** Modules in pre-order and their is_training() at capture. */
  std::vector<ModuleRef> modules;
  std::vector<char> training;
  /** Captures the generators of rng_devices(devices, cuda_devices_in_use()),
   *  the buffers' values and the modules' train/eval flags. */
  static ReplayState capture(bool preserve_rng, const std::vector<c10::Device>& devices,
                             std::vector<at::Tensor> buffers, std::vector<ModuleRef> modules = {});
};

/** For its lifetime: RNG, autocast, buffer values and the modules'
 *  train/eval flags as captured (and grad mode on when asked: checkpoint
 *  re-runs must save), marks the thread as recomputing; then restores all
 *  and puts the buffers' current values back (without bumping their
 *  version counters). */
class ReplayGuard {
 public:
  ReplayGuard(const ReplayState& state, bool enable_grad);
  ~ReplayGuard();
  ReplayGuard(const ReplayGuard&) = delete;
  ReplayGuard& operator=(const ReplayGuard&) = delete;

 private:
  RngRegionLock rng_lock_;  // first: held while the state is swapped
  const ReplayState& state_;
  c10::AutoGradMode grad_;  // the current mode unless enable_grad
  AutocastState autocast_now_;
  /** A generator's state as the guard found it. The CPU generator's is
   *  its engine, copied as is: get_state() would allocate a 5056-byte
   *  tensor inside every replay, bytes no plan counts (a tight budget went
   *  over by them). Other devices' come from get_state() (a small CPU
   *  tensor, not counted on the device). */
  struct RngNow {
    at::Tensor state;
    std::optional<at::mt19937> engine;
    std::optional<float> next_float;
    std::optional<double> next_double;
  };
  std::vector<RngNow> rng_now_;
  std::vector<at::Tensor> buffers_now_;
  /** The modules (null: freed since capture) and their flags as found,
   *  when any differed from the capture's. */
  std::vector<std::shared_ptr<torch::nn::Module>> modules_;
  std::vector<char> training_now_;
};

}  // namespace remat::detail
