// The whole-step planner: one budget for a whole training step of any module
// tree, a menu per unit (keep, full recompute, selective at several saved-byte
// levels, offload of its saved tensors when given a store), planned from one
// profiled step of the user's own step function.
//
//   auto planner = remat::auto_checkpoint(model, remat::AutoOptions().memory_budget_bytes(1 << 30));
//   for (int i = 0; i < steps; ++i) {
//     planner.step([&] {
//       optimizer.zero_grad();
//       auto loss = loss_fn(model->forward(x), y);
//       loss.backward();
//       optimizer.step();
//     });
//   }
//   std::cout << planner.explain();
//
// The units are the model's Checkpointable modules and its
// CheckpointedSequential chains (a chain's options are its own planner's
// schedules: store-all, and its optimal schedule at several budgets; what
// runs inside a chain is not planned apart). A unit may be called
// several times per step (a GAN's discriminator), in any order, with skip
// connections across units, and inside another unit (a GPT block's
// attention and MLP inside the block): such an inner unit takes an option
// of its own only while every unit around it keeps everything (inside a
// recomputed or offloaded unit it runs as part of it), and a unit with
// inner units may also recompute with them checkpointed inside its
// recompute ("recompute, inner units too": a lower backward peak for a
// third run of the inner units' forwards).
//
// step() runs the user's step: the first `warmup_steps` plainly (every unit
// off), then one profiled step (still plain: it must fit), which records the
// step's memory over time with each unit call's forward and backward marked,
// and measures each call under every option of its unit by running it
// again, in isolation, before its real forward (RNG, gradients and every
// tensor the run writes put back, wherever its module sits, so the step
// itself is the plain step, bitwise). The solver (remat/plan/step.h) picks
// one option per unit: the fastest step whose predicted peak fits the
// budget. Later steps run the plan and are measured;
// a step whose peak exceeds the budget by more than 1% makes the planner
// solve again with the budget lowered by the excess, and step() throws when
// no plan fits that. A profiled step that ends holding more than it started
// with (no warm-up: the optimizer's state it creates) has that growth
// counted at every point of the step.
//
// What the budget covers: every byte of tensors live in the process on the
// CPU at the step's peak, as remat::memory counts them: parameters,
// gradients, optimizer state, activations, the loss. Counting starts at
// remat::memory::enable_tracking(), which auto_checkpoint() calls: tensors
// allocated before (e.g. parameters of a model built earlier) are not in
// the figures; call enable_tracking() first thing in main() to count them.
// Two planned steps in a row that offload and run more than 10% over their
// predicted time charge the second one's excess to the offload options,
// per byte they send, and the plan is solved again (the real step's
// transfer rate, which isolated runs through a warm page cache do not
// show; explain() says so); one slow step (a store's first writes) charges
// nothing.
// Offload is priced conservatively: an input that an option sends away is
// credited only from when the profiled step saw nothing but the unit's own
// saves hold it (its caller moved on) to the end of its backward, never
// when something else holds it (a skip, a ReLU's saved output); writes are
// priced as if they did not overlap compute.
// Memory is measured on the device of the model's parameters (the first
// CUDA one, else the CPU): on CUDA, in a build with REMAT_WITH_CUDA, the
// caching allocator's allocated bytes (docs/gpu.md), units timed with CUDA
// events; a unit whose inputs are on another device is refused.
// Leaves out: a model spread over several devices.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>

#include <remat/checkpoint.h>
#include <remat/offload.h>
#include <remat/optim.h>
#include <remat/plan/step.h>
#include <remat/policy.h>

namespace remat {

/** Options of auto_checkpoint(). Give a budget: memory_budget_bytes or
 *  memory_budget_fraction. */
struct AutoOptions {
  /** The bound on the step's peak, bytes of tracked CPU tensors. 0: use
   *  memory_budget_fraction. Default 0. */
  TORCH_ARG(int64_t, memory_budget_bytes) = 0;
  /** The budget as a fraction of the profiled (plain) step's peak, in
   *  (0, 1]; used when memory_budget_bytes is 0. Default 0 (unset). */
  TORCH_ARG(double, memory_budget_fraction) = 0;
  /** Selective options per unit: the outputs of which operators to keep,
   *  chosen by a knapsack on the operators' measured output bytes and
   *  times, at this many saved-byte levels (1/(n+1), ..., n/(n+1) of what
   *  the unit keeps plainly). 0: none. Default 3. */
  TORCH_ARG(int, selective_levels) = 3;
  /** More options for every unit: each policy as a selective option of its
   *  own (e.g. a model's Megatron policy), beside the knapsack's levels, so
   *  that a plan can mix it per unit with the rest. Default none. */
  TORCH_ARG(std::vector<Policy>, policies);
  /** Offload options for every unit but chains (whose options are their
   *  schedules): each adds the option "offload disk"
   *  (OffloadTarget::kDisk) or "offload memory <codec>" (kMemory with a
   *  codec), under which what the unit saves for backward goes to the
   *  store and nothing is recomputed (Checkpointable::set_offloading), and,
   *  for units outside other units, "recompute, inputs to disk" (or
   *  "... to memory <codec>"): recompute, with the inputs it keeps for it
   *  in the store (CheckpointOptions::offload). Their
   *  cost is measured as the others': bytes kept right after the forward
   *  (writes still pending count), and time with one tensor in flight at a
   *  time. What a kDisk store holds in flight is the plan's to choose: one
   *  entry at a time (the largest tensor a call sends), 4x, 16x, 64x that,
   *  its max_inflight_bytes as given, 4x, 16x, 64x the larger of the two,
   *  or as much as one call sends at most (no rung above: it would price
   *  no call lower), where the
   *  budget has room for those bytes at every point of the step (never
   *  counted above what the whole step sends to the store); more in
   *  flight lets the writes run beside the
   *  compute, priced from the store's measured pace. explain() says which
   *  cap runs. Lossless codecs keep the step bitwise
   *  equal to the plain one; a lossy one (kBFloat16, kFloat8, kInt8Block) is taken as
   *  asked and changes the gradients. kHost (a no-op for CPU tensors) and
   *  kMemory without a codec (nothing saved) are refused. Default none: a
   *  disk needs a directory only the user can name. */
  TORCH_ARG(std::vector<OffloadOptions>, offload);
  /** Offer the options that run a unit's forward again in its backward:
   *  recompute, "recompute, inner units too", the selective levels, the
   *  policies, "recompute, inputs to ..."; a chain's schedules but
   *  store-all; a chunked() call's counts but its own (each slice is
   *  checkpointed). false: each unit keeps what it saves or sends it to an
   *  offload store, and chunked_cross_entropy calls take chunk counts
   *  (their gradient is computed in forward, nothing runs twice): for a
   *  step whose forward must run once (an op with side effects the
   *  replay does not undo, or one too slow to run twice); selective_levels,
   *  policies and checkpoint_options then have nothing to act on, and a
   *  chunked() region still checkpoints its slices as called. Needs a
   *  lever that is left: offload, chunk_counts or optimizer_state_store.
   *  This is for the planned steps: the profiled step runs each unit's
   *  forward again to measure its options with either value (tensors put
   *  back; a C++ counter, a logging hook or I/O in the forward run again).
   *  Default true. */
  TORCH_ARG(bool, recompute) = true;
  /** A compressing store (a codec, on kMemory or kHost) holds as many bytes
   *  as the data compresses to, which changes from batch to batch: its
   *  options are charged the bytes the profiled step's data took times
   *  1 + compression_margin. Mostly-zero activations whose zeros move can
   *  take a quarter more on another batch. 0 trusts the profiled batch.
   *  Default 0.5. */
  TORCH_ARG(double, compression_margin) = 0.5;
  /** Plan the checkpointable modules called inside other units as units of
   *  their own, and offer units with inner units "recompute, inner units
   *  too". Each inner unit's calls are measured under its whole menu, so
   *  the profiled step takes longer. false: only the outermost units are
   *  planned; the inner ones run as part of them. Default true. */
  TORCH_ARG(bool, inner_units) = true;
  /** The options of the recompute options (RNG replay, determinism check);
   *  a policy here is combined with each level's (any_of). Default
   *  CheckpointOptions(). */
  TORCH_ARG(CheckpointOptions, checkpoint_options) = CheckpointOptions();
  /** Plain steps before the profiled one, so that the profiled step holds
   *  what every later step holds (the optimizer's state, kept gradients).
   *  With 0, what the profiled step ends holding more than it started
   *  with is counted at every point of the step (a bound on later steps,
   *  not the leanest plan). Default 1. */
  TORCH_ARG(int, warmup_steps) = 1;
  /** How many times each option of each call is timed (the minimum is
   *  kept). Default 2. */
  TORCH_ARG(int, profile_repeats) = 2;
  /** The solver's time limit, s, for each plan it solves: every placement
   *  of the optimizer state and every in-flight tier of the disk stores,
   *  all their integer programs together (a step that is not a chain; a
   *  chain's exact program takes milliseconds). At the limit, the best
   *  plan found and its gap are reported. Default 30. */
  TORCH_ARG(double, solver_time_limit_s) = 30;
  /** Solve again, with the budget lowered by the excess, after a step whose
   *  measured peak exceeds the budget by more than 1%; when no plan fits
   *  that, the overrun is reported (overrun_throws; the step ran, the plan
   *  in force stays). Default true. */
  TORCH_ARG(bool, replan_on_overrun) = true;
  /** An overrun no plan can fix (replan_on_overrun): false (default)
   *  reports it as a c10 warning (TORCH_WARN: printed to stderr by
   *  LibTorch's default handler, or caught with a c10::WarningHandler) and
   *  in overruns(), and training goes on; true makes step() throw it as
   *  remat::Error. The warning suits runs where a rank that throws takes the
   *  job down (a collective's buffers freed late can push one rank over). */
  TORCH_ARG(bool, overrun_throws) = false;
  /** The optimizers the step function steps (a GAN's two). Each then
   *  updates its parameters inside backward (remat::StepInBackward, made by
   *  the planner before the first step and kept while it lives): each
   *  gradient is freed once its parameter is updated, so the gradients
   *  never all live at once and every step, the profiled one included,
   *  measures that; the step's own optimizer.step() finds nothing left to
   *  do. Not with a step that reads the gradients after backward
   *  (global-norm clipping: leave the optimizer out). Each must outlive the
   *  planner. Default none. */
  TORCH_ARG(std::vector<torch::optim::Optimizer*>, optimizers);
  /** With optimizers: a store the optimizers' state may live in between a
   *  parameter's updates (StepInBackwardOptions::state_offload). Where each
   *  param group's state lives, kept or in the store, is then part of the
   *  plan: the store saves that state's bytes at every point of the step
   *  but what it holds in flight, and costs what it adds to the planned
   *  steps (optimizer_state_wait_ms()). Default none: the state stays with
   *  the optimizer. */
  TORCH_ARG(std::optional<OffloadOptions>, optimizer_state_store);
  /** With optimizers: how the step function zeroes gradients
   *  (StepInBackwardOptions::zero_grad_set_to_none): false for a step that
   *  calls zero_grad(false), so that a parameter a step does not reach is
   *  updated with its zero gradient as in plain training. Unset: as true,
   *  with a warning at the first such parameter. */
  TORCH_ARG(std::optional<bool>, zero_grad_set_to_none);
  /** Chunk counts (each >= 1) offered to every remat::chunked_cross_entropy
   *  and remat::chunked call of the step (a model's loss head: GptImpl::loss
   *  with any loss_chunks, 0 included): each such call outside a recompute
   *  is a unit named after its kind (inside a unit: "blocks.3.mlp/chunked"),
   *  with its own count as option 0 and these, capped at the length it
   *  slices, as its other options; more slices lower the peak of its
   *  forward (one slice's logits at a time) for the time of smaller
   *  products. A call inside another unit takes another count only while
   *  that unit keeps everything. Calls are told apart by their order in
   *  the step, so the step must make the same calls each time. Another count sums
   *  the gradients over other slices: the step then equals the plain one
   *  up to floating-point reassociation, not bitwise, and a region with
   *  dropout inside draws other masks. A call with its own count 0 that
   *  gets a count >= 1 computes its gradient in forward, which a backward
   *  with create_graph refuses: leave chunk_counts empty for a step that
   *  differentiates through the loss twice. Calls inside a checkpointed
   *  region of your own, or inside another chunked call, keep their own
   *  count. default_chunk_counts() is a good list. Default none: every
   *  call runs with its own count. */
  TORCH_ARG(std::vector<int64_t>, chunk_counts);
};

/** The chunk counts AutoOptions::chunk_counts() can offer: 1, 2, 4, ..., 32. */
std::vector<int64_t> default_chunk_counts();

/** One unit of a plan, as explain() shows it. */
struct AutoUnit {
  std::string name;                  ///< qualified module name ("blocks.3"; "(root)")
  int64_t calls = 0;                 ///< calls per step
  std::vector<std::string> options;  ///< its menu; [0] is "keep"
  int choice = 0;                    ///< the option chosen
  /** Summed over its calls, for the chosen option: bytes held from forward
   *  to backward (with what its inner units' options save taken off), and
   *  time added to the step, ms. */
  ///@{
  int64_t kept_bytes = 0;
  double time_added_ms = 0;
  ///@}
  /** The unit around it whose option covers it (one that does not keep
   *  everything: it runs as part of that unit, its own choice is 0 and its
   *  figures 0), or empty. */
  std::string runs_in;
};

/** A planned step: made by auto_checkpoint(); step() runs the user's step
 *  function under it. Keeps a reference to the model, which must outlive it. */
class AutoCheckpoint {
 public:
  /** As auto_checkpoint(model, options), which also installs remat's
   *  engine: prefer that. Validates options (throws remat::Error naming the
   *  field and value) and switches every checkpointable module off. */
  AutoCheckpoint(torch::nn::Module& model, AutoOptions options);
  /** Gives the switches back as the constructor found them: each
   *  Checkpointable's checkpoint and offload options, each chain's forced
   *  schedule (none: its own budget's plan). A moved-from planner gives
   *  back nothing. */
  ~AutoCheckpoint();
  /** Movable (the plan and profile move with it), not copyable. */
  ///@{
  AutoCheckpoint(AutoCheckpoint&&) noexcept;
  AutoCheckpoint& operator=(AutoCheckpoint&&) noexcept;
  ///@}

  /** Runs one training step (fn: forwards, loss, backward, optimizer step):
   *  a warm-up, the profiled step (then plans), or a planned step (then
   *  measures its peak and time). Throws remat::Error when no plan fits,
   *  and after a planned step whose overrun no plan fixes. */
  void step(const std::function<void()>& fn);
  /** Runs fn as the profiled step now (skipping what is left of the
   *  warm-up), then plans. Builds every unit's menu again from this step's
   *  calls (after a change of shapes, or of which parameters train). */
  void profile_step(const std::function<void()>& fn);
  /** Solves the profiled step again for another budget (bytes) and applies
   *  that plan; the profile is kept, so this takes the solver's time only
   *  (a sweep over budgets profiles once). Throws remat::Error before a
   *  profiled step, or when no plan fits (the plan in force then stays). */
  void replan(int64_t budget_bytes);
  /** Puts a choice of your own in force instead of a solved plan: one
   *  option index per entry of units(), in its order (0 is keep; a unit
   *  inside one that does not keep takes 0). Takes effect at once, no new
   *  profile: to pin a plan found before, or to measure what one option
   *  does (the prediction is plan().prediction). It stays until replan(), a
   *  new profile or, with replan_on_overrun, a step over the budget;
   *  repricing offload changes its predicted time, not the choice. Throws
   *  remat::Error before a profiled step, for a list of the wrong length,
   *  an index outside a unit's menu, or an option inside a unit that does
   *  not keep. */
  void apply_choice(const std::vector<int>& choice);
  /** Sets the units' switches to the plan in force again (after other code
   *  changed them, e.g. a comparison against a hand-placed strategy). */
  void apply();
  /** True once a plan is applied. */
  bool planned() const;
  /** The budget in bytes (the fraction resolved once profiled; 0 before). */
  int64_t budget_bytes() const;
  /** The smallest step peak a plan of the profiled step reaches, bytes
   *  (predicted; for plans that offload to disk, the stores'
   *  max_inflight_bytes included): the lowest budget replan() accepts.
   *  On a step that is not a chain, where the solver may stop at
   *  solver_time_limit_s, the smallest it found. Throws remat::Error before a
   *  profiled step. */
  int64_t leanest_peak_bytes() const;
  /** Bytes the plan in force keeps room for above its predicted peak: the
   *  writes and reads its disk stores may hold in flight (the
   *  max_inflight_bytes the plan runs them with, or a larger tensor they
   *  send alone, as the profiled step's isolated runs measured it), and
   *  the optimizer states being written to optimizer_state_store (those
   *  read ahead or being updated are in the prediction), which depend on
   *  the disk's pace; 0 when the plan sends nothing to disk. A step's
   *  measured peak is at most plan().prediction.peak_bytes plus this, and
   *  the two fit the budget. */
  int64_t inflight_bytes() const;
  /** The profiled step's model, for remat-plan style inspection. */
  const plan::StepModel& step_model() const;
  /** The plan in force (its prediction, solver figures). */
  const plan::StepPlan& plan() const;
  /** Per planned unit: menu, choice, bytes kept, time added. */
  std::vector<AutoUnit> units() const;
  /** The profiled step's peak and time (plain; the peak with what the step
   *  ended holding more than it started with counted). */
  ///@{
  int64_t profiled_peak_bytes() const;
  double profiled_time_ms() const;
  ///@}
  /** The plain step's time (ms) that every predicted time adds to: the
   *  profiled step's, until planned steps measure it. A step counts when
   *  its plan sends nothing to a store and adds at most 10% to the plain
   *  time, and it is not its plan's first: two in a row set it to the mean
   *  of their times less what their plan adds, and every such step after
   *  updates it with the one before. The profile runs in a process's first
   *  steps, which can be slower than later ones. step_model().step_time_ms
   *  holds the same value. */
  double plain_time_ms() const;
  /** The last planned step's measured peak (bytes of the measured device:
   *  tracked CPU bytes, or the CUDA caching allocator's allocated bytes) and time;
   *  -1 before one ran. */
  ///@{
  int64_t measured_peak_bytes() const;
  double measured_time_ms() const;
  ///@}
  /** How many times the plan was solved again after an overrun. */
  int replans() const;
  /** The overruns no plan could fix, oldest first: each one's message (the
   *  measured peak, the budget, the smallest feasible peak and the budget
   *  that would do), as warned or thrown. */
  std::vector<std::string> overruns() const;
  /** A report: per unit the option chosen, bytes kept and time added;
   *  predicted against measured peak and time; the solver's figures. */
  std::string explain() const;
  /** With AutoOptions::optimizers: backward passes while the returned
   *  guards live keep their gradients (the micro-batches before a step's
   *  last), as StepInBackward::accumulate(). Empty without optimizers. */
  [[nodiscard]] std::vector<StepInBackward::Accumulating> accumulate();
  /** With optimizer_state_store: brings every optimizer state back from the
   *  store (before reading the optimizer, or saving one of your own:
   *  StepInBackward::fetch_state()); each goes again after
   *  its parameter's next update, as the plan says, so the steps until then
   *  hold it. */
  void fetch_optimizer_state();
  /** Bytes of the optimizers' state that optimizer_state_store took out of
   *  this process's memory now (a kMemory codec's encoding stays, and is
   *  not counted; StepInBackwardStats::state_offloaded_bytes). */
  int64_t optimizer_state_in_store_bytes() const;
  /** Milliseconds the last planned step's backward waited on
   *  optimizer_state_store (StepInBackwardStats::state_wait_ms). The plan
   *  prices the store by what it cost planned steps: from a placement's
   *  second step, the mean over the last two steps of the step's time over
   *  its plan's prediction without the store, or this wait if more (the
   *  store's threads share the disk and the cores with the step), per byte
   *  of state; until then, at one state written and read back after the
   *  profiled step, as if backward waited for all of it. 0 before a
   *  planned step or without a store. */
  double optimizer_state_wait_ms() const;
  /** With AutoOptions::optimizers: each one's StepInBackward counters
   *  (updates, the state store's bytes and waits, writes that failed and
   *  kept their state in memory), in that order. Empty without. */
  std::vector<StepInBackwardStats> optimizer_stats() const;
  /** Writes the profiled step's memory, the plan's predicted memory per
   *  segment and the units' windows as Chrome trace JSON (Perfetto). */
  void write_trace(const std::string& path) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/** Plans the training steps of model under options' budget; see the file
 *  comment. Throws remat::Error when the model has no Checkpointable module. */
AutoCheckpoint auto_checkpoint(torch::nn::Module& model, AutoOptions options);

/** auto_checkpoint() on a module holder (e.g. a TORCH_MODULE Gpt). */
template <class M>
AutoCheckpoint auto_checkpoint(torch::nn::ModuleHolder<M>& model, AutoOptions options) {
  return auto_checkpoint(*model, std::move(options));
}

}  // namespace remat
