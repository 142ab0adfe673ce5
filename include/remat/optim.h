// The optimizer step inside backward: each parameter is updated as soon as
// its gradient is final in the current backward (every use of the
// parameter in the graph has contributed), and that gradient is freed right
// after, so the gradients of a model never all live at once. Optionally,
// each parameter's optimizer state (Adam's moments, SGD's momentum) lives
// in a store between its updates and is read back ahead of the next one.
// The update math is the optimizer's own, one parameter at a time: the
// result is bitwise the plain step's for LibTorch's SGD, Adam, AdamW,
// RMSprop and Adagrad. See docs/training.md ("Optimizer step in backward").
// Leaves out: LBFGS (its step re-evaluates the whole loss), global-norm
// clipping (it needs every gradient before any update), higher-order
// gradients (create_graph).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/optim/optimizer.h>

#include <remat/offload.h>

namespace remat {

/** Options of a StepInBackward; every field optional, validated when the
 *  StepInBackward is created. */
class StepInBackwardOptions {
 public:
  /** Where each parameter's optimizer state goes between its updates: a
   *  store with these options (kDisk with a directory; kMemory with
   *  Codec::kBFloat16 for state compressed in memory; kHost on a GPU). Each
   *  state comes back before its parameter's next update, read ahead in the
   *  order the previous backward updated the parameters. A backward that
   *  sent states ends once their writes are done, so that the next
   *  forward holds none of them in flight. Lossless unless a lossy codec
   *  is chosen. Default: the state stays where the optimizer keeps it. */
  StepInBackwardOptions& state_offload(OffloadOptions options) {
    state_offload_ = std::move(options);
    return *this;
  }
  /** The state store's options, if the state is offloaded. */
  const std::optional<OffloadOptions>& state_offload() const { return state_offload_; }
  /** Parameters whose state is read ahead of their update (state_offload).
   *  Default 2. */
  StepInBackwardOptions& state_prefetch(int64_t parameters) {
    state_prefetch_ = parameters;
    return *this;
  }
  /** Parameters whose state is read ahead. Default 2. */
  int64_t state_prefetch() const { return state_prefetch_; }
  /** The state tensors of your own optimizer's per-parameter state, for
   *  state_offload (LibTorch's SGD, Adam, AdamW, RMSprop and Adagrad are
   *  known). Return pointers into the state object; undefined tensors are
   *  skipped. */
  using StateTensors = std::function<std::vector<at::Tensor*>(torch::optim::OptimizerParamState&)>;
  /** Sets the function that lists your optimizer's state tensors (see
   *  StateTensors). Default: none (LibTorch's optimizers only). */
  StepInBackwardOptions& state_tensors(StateTensors fn) {
    state_tensors_ = std::move(fn);
    return *this;
  }
  /** The function set by state_tensors(StateTensors), or empty. */
  const StateTensors& state_tensors() const { return state_tensors_; }
  /** How your training loop zeroes gradients (the optimizer's
   *  zero_grad(set_to_none)), which decides what happens to a parameter
   *  that was trained before and that a backward which updates does not
   *  reach (a branch not taken this step). true (zero_grad(), LibTorch's
   *  default): it has no gradient, and step() leaves it as it is. false
   *  (zero_grad(false)): in plain training its zeroed gradient stays, and
   *  step() still moves it (momentum, Adam's moments, weight decay); so
   *  such a backward ends by giving each of them a zero gradient (and its
   *  state back from the store) for the optimizer's step() after it, which
   *  updates it as the plain loop would. With false, every backward of a
   *  step but the last runs under accumulate() (a second backward that
   *  updates would give the first one's parameters a second update). Unset:
   *  as true, and the first such parameter prints a warning naming this
   *  option, since with the other style that parameter trains differently
   *  from the plain loop. */
  StepInBackwardOptions& zero_grad_set_to_none(bool set_to_none) {
    zero_grad_set_to_none_ = set_to_none;
    return *this;
  }
  /** The loop's zero_grad style as given, or unset. */
  const std::optional<bool>& zero_grad_set_to_none() const { return zero_grad_set_to_none_; }

 private:
  std::optional<OffloadOptions> state_offload_;
  int64_t state_prefetch_ = 2;
  StateTensors state_tensors_;
  std::optional<bool> zero_grad_set_to_none_;
};

/** Counters of a StepInBackward since it was created. */
struct StepInBackwardStats {
  /** Parameter updates applied inside backward. */
  int64_t updates = 0;
  /** Backward passes that only accumulated (under accumulate()): the
   *  parameters' hooks that kept their gradient. */
  int64_t accumulated = 0;
  /** Bytes of optimizer state the store took out of the parameters'
   *  memory now (state_offload): in files (kDisk), in pinned host memory
   *  from a GPU (kHost), or what a kMemory codec saved (its encoding stays
   *  in memory: a quarter of float32 state with Codec::kInt8Block). */
  int64_t state_offloaded_bytes = 0;
  /** Gradients left to the optimizer's step() because a parallel wrapper
   *  finishes them after backward (DataParallel). */
  int64_t deferred = 0;
  /** Bytes of stored optimizer state the store holds in this process's
   *  memory: a kMemory codec's encoding, and the tensors a store keeps as
   *  they are (below its min_bytes; kHost from a CPU tensor). The state's
   *  memory is then what the optimizer holds plus these bytes. */
  int64_t state_held_in_store_bytes = 0;
  /** Highest state_offloaded_bytes. */
  int64_t peak_state_offloaded_bytes = 0;
  /** States read back when their update needed them (not read ahead). */
  int64_t state_misses = 0;
  /** States whose write to the store failed: they stayed in memory, the
   *  update was applied; the last such error is in last_state_error. */
  int64_t state_write_failures = 0;
  /** The last failed write's error; "" when none failed. */
  std::string last_state_error;
  /** Milliseconds backward waited on the state store (state_offload):
   *  reading back a state that was not read ahead in time, handing one to
   *  a store whose bytes in flight are at its cap, and the writes finished
   *  as a backward ends (host wall time; fetch_state() and the like,
   *  between steps, do not count). What keeping the state in a store
   *  added to the steps, beside the compute it overlaps (its threads may
   *  slow that compute too: auto_checkpoint prices its store by this or
   *  by the step's time over its prediction, the larger). */
  double state_wait_ms = 0;
};

namespace detail {
struct StepInBackwardImpl;

/** For the parallel wrappers. While a DeferredGradients lives, a
 *  StepInBackward leaves its parameters' gradients to the optimizer's own
 *  step() after backward: their gradients are final only once backward has
 *  ended (DataParallel's Reducer averages them then). */
class DeferredGradients {
 public:
  /** `why` completes "left to the optimizer's step(): ..." in describe(). */
  DeferredGradients(std::vector<at::Tensor> params, std::string why);
  ~DeferredGradients();
  DeferredGradients(const DeferredGradients&) = delete;
  DeferredGradients& operator=(const DeferredGradients&) = delete;

 private:
  std::vector<at::Tensor> params_;
};

/** For Pipeline: while one lives (any thread), every StepInBackward keeps
 *  the gradients of the backward passes that run, as under accumulate():
 *  the micro-batches before a stage's last. */
class AccumulateEverywhere {
 public:
  AccumulateEverywhere();
  ~AccumulateEverywhere();
  AccumulateEverywhere(const AccumulateEverywhere&) = delete;
  AccumulateEverywhere& operator=(const AccumulateEverywhere&) = delete;
};

/** Whether a DeferredGradients leaves p to the optimizer's step(). */
bool is_deferred(const at::Tensor& p);

/** Updates p now, as its hook would, also under update_at_backward_end (FullyShard, once the shard's gradient
 *  is reduced; it never passes through an AccumulateGrad): false when no
 *  StepInBackward owns p or its gradient is undefined. */
bool step_in_backward_now(const at::Tensor& p);

/** Before a gradient reaches p through a nested Engine::execute (a chain's
 *  early delivery): the StepInBackward that owns p, if any, ends its
 *  updates at the end of the current (outer) graph task. */
void queue_end_of_updates(const at::Tensor& p);
}  // namespace detail

/** Applies the optimizer's update to each parameter inside backward, as soon
 *  as the parameter's gradient is final, then frees that gradient:
 *
 *    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
 *    remat::StepInBackward in_backward(opt);
 *    for (auto& batch : data) {
 *      loss_fn(model, batch).backward();  // each parameter steps here
 *      opt.step();                        // no-op for the parameters stepped in backward
 *      opt.zero_grad();
 *    }
 *
 *  A parameter's gradient is final once the backward's engine has summed
 *  every use of it (tied weights, a module called twice, recomputed
 *  regions): the update runs in the parameter's post-accumulate-grad hook,
 *  once per backward (one backward at a time: not one run inside another's
 *  node, e.g. a reentrant checkpoint of your own, unless
 *  update_at_backward_end(true) — a parameter updated there and reached
 *  again by the backward around it throws remat::Error; not two threads'
 *  at once). A parameter
 *  that gets no gradient in a backward is not
 *  updated, as with zero_grad(set_to_none = true), LibTorch's default; a
 *  loop that calls zero_grad(false) says so in
 *  StepInBackwardOptions::zero_grad_set_to_none(false), and step() then
 *  updates such a parameter with a zero gradient as plain training does; a
 *  gradient left by an accumulate() pass is stepped by the optimizer's own
 *  step(), which is why the loop above keeps calling it. The optimizer's
 *  options are read at each update, so learning-rate schedulers work.
 *  Gradient accumulation: backward passes while accumulate()'s guard lives
 *  keep their gradients; the next one outside it updates (with a state
 *  store, call fetch_state() before a step() that follows only such
 *  passes). A backward that reaches none of the parameters is not seen:
 *  under zero_grad(false), the step() after it moves nothing.
 *
 *  Your own optimizer works if its step() updates each parameter of
 *  param_groups() that has a gradient from that parameter's gradient and
 *  state alone, and skips parameters whose gradient is undefined (as
 *  LibTorch's do): each update calls step() with one parameter left in its
 *  group.
 *
 *  Refused with remat::Error: LBFGS; a parameter that already has a
 *  post-accumulate-grad hook (another StepInBackward); a backward with
 *  create_graph (thrown from the first parameter's update, before anything
 *  changed); state_offload with an optimizer whose state remat does not know
 *  and no state_tensors(). Global-norm clipping cannot work (it needs every
 *  gradient before any update); remat's own clip_grad_norm functions refuse
 *  parameters stepped in backward, and torch::nn::utils::clip_grad_norm_
 *  (or anything else reading .grad) after backward sees no gradients. Not copyable or movable; destroying it
 *  brings every offloaded state back into the optimizer and removes the
 *  hooks. */
class StepInBackward {
 public:
  /** Hooks every parameter of optimizer's param_groups() (add groups
   *  before this); validates options and opens the state store (throws
   *  remat::Error, changing nothing). The optimizer must outlive it. */
  explicit StepInBackward(torch::optim::Optimizer& optimizer,
                          const StepInBackwardOptions& options = StepInBackwardOptions());
  ~StepInBackward();
  StepInBackward(const StepInBackward&) = delete;
  StepInBackward& operator=(const StepInBackward&) = delete;

  /** RAII: while it lives, backward passes keep their gradients (earlier
   *  micro-batches of an accumulated step). */
  class Accumulating {
   public:
    ~Accumulating();
    Accumulating(const Accumulating&) = delete;
    Accumulating& operator=(const Accumulating&) = delete;
    /** Moves the guard: other no longer counts. */
    Accumulating(Accumulating&& other) noexcept;
    Accumulating& operator=(Accumulating&&) = delete;

   private:
    friend class StepInBackward;
    explicit Accumulating(std::shared_ptr<detail::StepInBackwardImpl> impl);
    std::shared_ptr<detail::StepInBackwardImpl> impl_;
  };
  /** Backward passes while the returned guard lives only accumulate. */
  [[nodiscard]] Accumulating accumulate();

  /** Brings every offloaded state back into the optimizer (before reading
   *  it, or saving an optimizer of your own; torch::save of LibTorch's
   *  five writes the stored states as they are, read back for the write);
   *  each goes to the store again after its parameter's next update.
   *  Throws remat::Error naming the parameter whose state cannot be read;
   *  the others are brought back. */
  void fetch_state();
  /** Blocks until every state write to the store is done (a failed write
   *  keeps its state in memory; stats() counts it). */
  void wait();
  /** Which of the optimizer's param_groups() send their state to the store
   *  (state_offload): one flag per group; all of them unless set here. A
   *  group turned off gets its state back now; one turned on sends it now
   *  (and after each update). Throws remat::Error without
   *  state_offload, or for a size other than the number of groups. */
  void offload_groups(const std::vector<bool>& groups);
  /** Per param group, bytes of optimizer state its parameters have now,
   *  wherever it lives (with the optimizer or in the store). */
  std::vector<int64_t> state_bytes_per_group() const;
  /** Per param group, the most state bytes one parameter has. */
  std::vector<int64_t> largest_state_bytes_per_group() const;
  /** The counters so far (a snapshot). */
  StepInBackwardStats stats() const;
  /** Each parameter's updates wait for the end of the backward (true) and
   *  then run one after another, in the order the gradients became final,
   *  each gradient freed after its update; or run as each gradient is
   *  final (false, the default). The updates and their results are the
   *  same either way. At the end, every gradient lives at once, as in plain
   *  training, but the update's temporaries (Adam's: about two parameters'
   *  bytes) come after the activations are gone instead of while backward
   *  holds them: at tiny activations and large parameters that can peak
   *  lower. remat::auto_checkpoint chooses this per plan. A gradient
   *  reaching a parameter outside any backward is updated at once. */
  void update_at_backward_end(bool on);
  /** What update_at_backward_end() last set (false by default). */
  bool updates_at_backward_end() const;
  /** What on_update() hears after each update inside backward. */
  struct UpdateEvent {
    size_t group = 0;         ///< the parameter's param group
    int64_t state_bytes = 0;  ///< its optimizer state's bytes after the update, wherever they go next
    int64_t param_bytes = 0;  ///< its gradient's bytes, freed by the update
    double update_ms = 0;     ///< how long the optimizer's update took (host wall time), store reads not included
  };
  /** The function on_update() calls after each update. */
  using UpdateListener = std::function<void(const UpdateEvent&)>;
  /** Calls fn after each parameter's update inside backward (an
   *  UpdateEvent); an empty fn stops. fn runs on the backward's thread with
   *  this object locked: keep it short and do not call this object from
   *  it. remat::auto_checkpoint uses it to learn when each state is in use
   *  and what each update holds. */
  void on_update(UpdateListener fn);
  /** What it does: the optimizer, the parameters, where the state lives,
   *  the counters. */
  std::string describe() const;
  /** Whether any live StepInBackward updates p in backward (remat's
   *  clip_grad_norm functions refuse such parameters). */
  static bool steps_in_backward(const at::Tensor& p);

 private:
  std::shared_ptr<detail::StepInBackwardImpl> impl_;
};

}  // namespace remat
