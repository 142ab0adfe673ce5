// remat::parallel::Pipeline: pipeline parallelism on c10d. The model is cut
// into stages, one per rank of a process group; a step splits the batch into
// M micro-batches, each rank runs its stage's forwards and backwards in the
// order of a schedule, and activations (forward) and their gradients
// (backward) go between neighbouring ranks by c10d send/recv.
//
//   auto pg = remat::parallel::init_process_group(InitOptions(rank, P));
//   remat::parallel::Pipeline pipe(pg, stage_fn, PipelineOptions().microbatches(8));
//   torch::optim::AdamW opt(stage_parameters, ...);
//   for (...) {
//     opt.zero_grad();
//     auto loss = pipe.step({x}, {y}, loss_fn);  // x used on rank 0, y on rank P-1
//     opt.step();
//   }
//
// Checkpointing inside a stage is any remat lever (Checkpointable switches,
// policies, offload, CheckpointedSequential). Planned per stage: wrap the
// step in remat::auto_checkpoint(stage_module, budget) on each rank; the
// profiled step then runs the schedule, so the planner sees every micro-batch
// the stage holds at once (1F1B: P - rank on rank `rank`; GPipe: M) and
// picks what fits the rank's budget with all of them live. explain(&planner)
// shows it per stage.
//
// NOTE [a failing stage]: a stage whose forward, loss or backward throws, or
// whose neighbour's message is not what it sent for, queues an abort
// carrying its message to each neighbour after what it already sent; a
// neighbour that receives one passes it on. Every rank ends its schedule in
// a small status all-reduce, so a stage that had nothing more to receive
// learns of the failure there. Every rank then throws remat::Error: its own
// message, the one passed to it, or "stopped because stage S failed". A
// rank that dies is seen by its neighbours as a failed receive (Gloo reports
// the closed connection) or fails the status all-reduce. A rank that stops
// answering fails the others at the group's timeout. The stage's gradients
// hold what ran before the failure (tied ones are as before the step). After
// such an error the group is not usable for further steps: sends the
// failed step left queued stay alive with the Pipeline (and past it).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>

#include <remat/parallel/data_parallel.h>

namespace remat {
class AutoCheckpoint;
}  // namespace remat

namespace remat::parallel {

/** The order in which a stage runs its micro-batches' forwards (F) and
 *  backwards (B). */
enum class PipelineSchedule {
  /** All forwards, then all backwards: every stage holds M micro-batches'
   *  activations at its peak. */
  kGPipe,
  /** One forward, one backward (PipeDream-flush, as Megatron's
   *  non-interleaved schedule): min(P - rank, M) forwards before the first
   *  backward, then alternating, so rank r holds at most P - r micro-batches
   *  at once. The same bubble as GPipe, less memory. */
  k1F1B,
};

/** "gpipe" or "1f1b". */
const char* to_string(PipelineSchedule s);
/** Parses "gpipe" or "1f1b" (case-insensitive); throws remat::Error naming
 *  the value and the two choices otherwise. */
PipelineSchedule parse_pipeline_schedule(const std::string& name);

/** How a Pipeline runs a step. */
struct PipelineOptions {
  /** Micro-batches per step, M >= 1: each tensor given to step() is split
   *  into M equal parts along dim 0 (its size must be divisible by M).
   *  Default 4. */
  TORCH_ARG(int, microbatches) = 4;
  /** Default k1F1B. */
  TORCH_ARG(PipelineSchedule, schedule) = PipelineSchedule::k1F1B;
  /** Parameters that several stages use (a GPT's embedding, tied to its
   *  head). Every rank gives the same list in the same order (its own copy
   *  of each; a rank that does not use one gives it anyway): the
   *  constructor broadcasts rank 0's values, and each step sums their
   *  gradients over the ranks (an all-reduce; a rank whose stage did not
   *  use one adds zeros). Default none. */
  TORCH_ARG(std::vector<at::Tensor>, tied) = {};
};

/** The last step on this rank. Times in ms (steady clock). */
struct PipelineStats {
  double step_ms = 0;      ///< the whole step, schedule and loss broadcast
  double forward_ms = 0;   ///< in this stage's forwards (loss included on the last)
  double backward_ms = 0;  ///< in this stage's backwards
  /** Waiting for a neighbour's activations or gradients (receives). */
  double recv_ms = 0;
  /** Waiting for sends to complete, and the tied gradients' all-reduce. */
  double send_ms = 0;
  /** Share of the step this stage computed nothing: 1 - (forward_ms +
   *  backward_ms) / step_ms. */
  double bubble = 0;
  /** Most micro-batches whose forward had run and backward had not, at once. */
  int max_in_flight = 0;
  int64_t sent_bytes = 0;      ///< activations and gradients sent
  int64_t received_bytes = 0;  ///< activations and gradients received
  /** Peak CPU bytes above the step's start (remat::memory; tracking must be
   *  on, else 0): activations of the micro-batches in flight, boundary
   *  tensors, gradients allocated in the step. */
  int64_t peak_bytes = 0;
};

/** A stage: its inputs (the previous stage's outputs, or on rank 0 one
 *  micro-batch of step()'s inputs) to its outputs. */
using StageFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& inputs)>;
/** The loss of one micro-batch on the last stage: its outputs and that
 *  micro-batch of step()'s targets to a scalar. Use a mean over the
 *  micro-batch: step() divides it by M, so the gradients are those of the
 *  mean over the whole batch. */
using LossFn =
    std::function<at::Tensor(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& targets)>;

/** Rank `rank`'s part of `model` cut before the indices in `cuts` (P - 1
 *  increasing indices in (0, model->size()), P = cuts.size() + 1): modules
 *  [cuts[rank - 1], cuts[rank]) as a Sequential of the same module objects.
 *  Throws remat::Error naming a cut out of order or range, or a rank not in
 *  [0, P). */
torch::nn::Sequential pipeline_part(const torch::nn::Sequential& model, const std::vector<int64_t>& cuts, int rank);

/** A stage that runs `part` (a Sequential of one tensor in, one out). */
StageFn sequential_stage(torch::nn::Sequential part);

/** One stage of a pipeline over `group` (rank r runs stage r of P =
 *  group.world_size()). The constructor is a collective: it checks that
 *  every rank gave the same microbatches, schedule and tied sizes (else
 *  remat::Error on every rank) and broadcasts rank 0's tied values; step()
 *  and clip_grad_norm() are collectives too. */
class Pipeline {
 public:
  /** Rank group.rank()'s stage; throws remat::Error for an empty group or
   *  stage, microbatches < 1, a CUDA group, or tied entries that are not
   *  floating tensors or repeat one. */
  Pipeline(ProcessGroup group, StageFn stage, PipelineOptions options = {});
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  /** Runs one step's forwards and backwards: rank 0 splits `inputs`, the
   *  last rank `targets` (other ranks may pass empty lists), each into M
   *  micro-batches. Gradients accumulate into the stage's parameters'
   *  .grad (sum over micro-batches of the loss / M); tied parameters'
   *  gradients are then summed over the ranks. Returns the step's loss
   *  (mean over micro-batches, a 0-dim double tensor) on every rank.
   *  Throws remat::Error on every rank when a stage fails (NOTE [a failing
   *  stage]), or for inputs or targets that do not split into M. */
  at::Tensor step(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets, const LossFn& loss);

  /** Clips the gradients of `parameters` (this stage's, tied ones included)
   *  so that the norm over every stage is at most max_norm, as
   *  torch::nn::utils::clip_grad_norm_ over the whole model would (tied
   *  parameters counted once). A collective. Returns the total norm. */
  double clip_grad_norm(const std::vector<at::Tensor>& parameters, double max_norm);

  /** This rank's stage (its rank). */
  int stage() const;
  /** The number of stages (the group's world size). */
  int stages() const;
  /** As given to the constructor. */
  const PipelineOptions& options() const;
  /** Micro-batches this stage holds at most at once under the schedule:
   *  1F1B min(P - stage, M), GPipe M. */
  int planned_in_flight() const;
  /** The last step's figures on this rank. */
  PipelineStats stats() const;
  /** A few lines about this stage: schedule, micro-batches in flight, the
   *  last step's times, bubble and peak; with the stage's planner, its plan
   *  (per unit: option, bytes kept, time added) and its predicted and
   *  measured peak. */
  std::string explain(const AutoCheckpoint* planner = nullptr) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace remat::parallel
