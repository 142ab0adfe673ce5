// Internal: the state a recomputation must replay to match the first run
// (RNG streams, autocast, module buffers), shared by remat::checkpoint and
// CheckpointedSequential, and the test for tensors that need no recompute.
#pragma once

#include <vector>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/GradMode.h>

namespace remat::detail {

/** Leaf tensors that require grad (parameters) and views of them: alive
 *  anyway, so saved by reference. */
bool is_parameter_like(const at::Tensor& t);

/** CPU and CUDA autocast state of this thread. */
struct AutocastState {
  bool cpu_enabled = false, cuda_enabled = false, cache_enabled = true;
  at::ScalarType cpu_dtype = at::kBFloat16, cuda_dtype = at::kHalf;
  static AutocastState capture();
  void apply() const;
};

/** What a first run looked like: RNG states of its devices (shared with
 *  the previous capture on this thread when unchanged), autocast state, and
 *  the module buffers with their values before the first run (a re-run
 *  starts from those and puts the current ones back after). */
struct ReplayState {
  std::vector<std::pair<at::Generator, at::Tensor>> rng;  // generator, state
  AutocastState autocast;
  std::vector<at::Tensor> buffers;
  std::vector<at::Tensor> buffer_values;  // clones, taken at capture
  /** Captures the CPU generator and those of the devices in `devices`. */
  static ReplayState capture(bool preserve_rng, const std::vector<c10::Device>& devices,
                             std::vector<at::Tensor> buffers);
};

/** NOTE [RNG regions and threads]: LibTorch's default generators are
 *  process-wide. A region's first run and its replay draw the same numbers
 *  only if no other thread draws in between; with two threads running
 *  checkpointed dropout at once, a replayed mask would silently differ from
 *  the first one and the gradients would be wrong. So every piece of remat
 *  that captures or replays RNG state (a checkpoint's first run, a planned
 *  stage's first run, every replay, the profiler) holds one process-wide
 *  recursive lock while it runs: such regions run one at a time across
 *  threads (nested ones on the same thread re-enter). With
 *  preserve_rng_state(false) nothing is locked. Random draws made by other
 *  code outside remat regions while a region runs are not covered. */
class RngRegionLock {
 public:
  explicit RngRegionLock(bool active);
  ~RngRegionLock();
  RngRegionLock(const RngRegionLock&) = delete;
  RngRegionLock& operator=(const RngRegionLock&) = delete;

 private:
  bool held_;
};

/** For its lifetime: RNG, autocast and buffer values as captured (and grad
 *  mode on when asked: checkpoint re-runs must save), marks the thread as
 *  recomputing; then restores all and puts the buffers' current values back
 *  (without bumping their version counters). */
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
  std::vector<at::Tensor> rng_now_;
  std::vector<at::Tensor> buffers_now_;
};

}  // namespace remat::detail
