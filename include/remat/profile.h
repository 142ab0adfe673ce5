// The profiler: measures a chain of modules on a sample batch and produces
// the planner's Chain (per stage: forward/backward time, output, saved and
// temporary bytes). A CUDA chain is measured in CUDA bytes, and its times
// are wall clock with the device synchronized around each timed run.
#pragma once

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <remat/offload.h>
#include <remat/plan/chain.h>

namespace torch::nn {
class Sequential;
}  // namespace torch::nn

namespace remat {

/** How profile() measures a chain: repeats and warm-up runs per stage. */
struct ProfileOptions {
  /** Timed runs per stage; times are their median. Default 3. */
  TORCH_ARG(int, repeats) = 3;
  /** Untimed runs first (allocator and kernel warm-up). Default 1. */
  TORCH_ARG(int, warmup) = 1;
  /** Also time each stage's recompute as CheckpointedSequential's early
   *  stop cuts it (Stage::recompute_ms; one recording run, then repeats
   *  timed runs). Default true. */
  TORCH_ARG(bool, recompute) = true;
  /** > 0: each stage also gets up to this many selective levels on its
   *  menu (plan::Stage::options): which op outputs a forward_save keeps
   *  (the rest is recomputed inside the stage's backward), chosen by a
   *  knapsack on the stage's measured op output bytes and times at 1/(n+1),
   *  ..., n/(n+1) of its saveable bytes. Each level is measured like the
   *  stage (bytes kept, temporaries, times). Default 0: none. */
  TORCH_ARG(int, selective_levels) = 0;
  /** Each stage also gets one option per entry: its forward_save's saves
   *  go to that store (kDisk, or kMemory with a codec), read back in its
   *  backward. Measured with one tensor in flight (its time includes the
   *  writes); a plan that uses a kDisk option must fit with the store's
   *  max_inflight_bytes added (CheckpointedSequential does that). kHost
   *  (a no-op for CPU tensors) and kMemory without a codec are refused.
   *  Default: none. */
  TORCH_ARG(std::vector<OffloadOptions>, offload) = {};
};

/** Profiles seq on x (one stage per module). Runs forward and backward per
 *  stage, then restores everything it touched: parameter gradients, module
 *  buffers (BatchNorm statistics) and the RNG state, so a step after it is
 *  the same as without it. Byte counts come from the saved-tensor hooks
 *  (saved_bytes: distinct storages saved for backward, parameters and the
 *  stage's input excluded, its output included) and remat::memory
 *  (temporaries: peak above what the op leaves behind). */
plan::Chain profile(const torch::nn::Sequential& seq, const at::Tensor& x,
                    const ProfileOptions& options = ProfileOptions());
/** The same for a chain whose first module takes a std::vector<at::Tensor>.
 *  Every boundary may be a tensor, a vector or a tuple of 2 to 4 tensors;
 *  its output_bytes counts each distinct storage once, except storages of
 *  xs (counted in input_bytes). */
plan::Chain profile(const torch::nn::Sequential& seq, const std::vector<at::Tensor>& xs,
                    const ProfileOptions& options = ProfileOptions());

/** The chain as the JSON that `remat-plan` reads. */
std::string chain_to_json(const plan::Chain& chain);

}  // namespace remat
