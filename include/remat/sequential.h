// remat::CheckpointedSequential: runs any planner schedule on a
// torch::nn::Sequential. The user gives a memory budget (or an algorithm,
// a segment count, or an explicit schedule); forward runs the schedule's
// forward part, the ordinary loss.backward() runs the rest, including
// checkpoints created during recomputation (multi-level schedules).
// In auto mode (a budget), the first batch of each input shape (and dtype,
// device, autocast state, train/eval mode, requires_grad pattern) is
// profiled, the plan solved and cached. Gradients flow through autograd as
// in a plain run: parameter hooks fire once per backward, autograd::grad,
// backward(inputs=), retain_graph and create_graph (higher-order gradients,
// which recompute the chain whole with its graph) work.
// Drop-in: the Sequential's modules are registered on the wrapper under
// their own names ("0", "1", ...), so a model whose `body` Sequential becomes
// a CheckpointedSequential keeps its parameter names ("body.0.weight") and
// its saved weights load either way (docs/runtime.md).
// Budgets: for the chain (bytes, or a fraction of its plain peak), or for
// the whole training step (step_memory_budget_bytes with begin_step()
// scopes: what lies outside the chain is measured and subtracted).
// Several tensors: a stage may take and return a std::vector<at::Tensor> or
// a std::tuple of 2 to 4 tensors (hidden state and mask, a skip tensor); the
// planner counts every tensor at a boundary. forward_values() runs a chain
// whose first module takes a vector. Several modules: the constructor that
// takes {layer1, layer2, ...} plans them as one chain and registers none of
// them, so they stay registered (and named) where they were.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <remat/memory.h>
#include <remat/plan/solve.h>
#include <remat/plan/transfer.h>
#include <remat/profile.h>

namespace remat {

/** Options of CheckpointedSequential: a budget (bytes, fraction or whole
 *  step), an algorithm or segment count, or an explicit schedule, and how
 *  the chain is profiled and executed. All optional; with none set the
 *  chain runs the sqrt schedule. */
struct SequentialOptions {
  /** Peak activation bytes allowed (the planner's peak: chain input, kept
   *  values, saved sets, gradients, temporaries); > 0 selects auto mode with
   *  `algorithm` (default optimal). Default -1: no budget. */
  TORCH_ARG(int64_t, memory_budget_bytes) = -1;
  /** The budget as a fraction of the chain's plain peak (the store-all
   *  prediction of the profiled chain, per input shape), in (0, 1]; like
   *  memory_budget_bytes otherwise, and not together with it. Default -1:
   *  none. */
  TORCH_ARG(double, memory_budget_fraction) = -1;
  /** "optimal", "greedy", "sqrt", "store-all", "uniform:K", "revolve:S".
   *  Default "optimal" with a budget, else "sqrt". */
  TORCH_ARG(std::string, algorithm) = "";
  /** > 0: checkpoint_sequential's k segments (uniform:k). Default 0. */
  TORCH_ARG(int, segments) = 0;
  /** An explicit schedule (validated against each profiled chain). */
  TORCH_ARG(std::optional<plan::Schedule>, schedule) = std::nullopt;
  /** Discretization of the optimal DP. Default 500. */
  TORCH_ARG(int, memory_slots) = 500;
  /** Which schedules optimal searches (plan::OptimalScope). Default kAuto. */
  TORCH_ARG(plan::OptimalScope, scope) = plan::OptimalScope::kAuto;
  /** Replay each stage's RNG state when it is recomputed. Default true. */
  TORCH_ARG(bool, preserve_rng_state) = true;
  /** Cut a recompute right before its backward short after the last op
   *  whose result backward reads (the later ops leave only their graph; as
   *  remat::checkpoint's early stop does). The first such recompute of each
   *  stage runs in full and records its ops; gradients are unchanged.
   *  Default true. */
  TORCH_ARG(bool, early_stop) = true;
  /** Peak bytes allowed for the whole training step: everything a
   *  begin_step() scope sees above the bytes live when it opened (the
   *  model's other layers, the loss, gradients, the optimizer step; not
   *  what was live before: parameters, optimizer state, .grad kept between
   *  steps). The bytes outside the chain are measured on the first step of
   *  each input shape, which runs the leanest schedule, and subtracted: the
   *  chain is then planned for what is left. Needs measure_memory and every
   *  step inside a begin_step() scope; not together with the chain budgets.
   *  Default -1: none. */
  TORCH_ARG(int64_t, step_memory_budget_bytes) = -1;
  /** Count in the plan the parameter gradients that the chain's backward
   *  allocates: with a .grad undefined when the step starts (the first
   *  step, or zero_grad() setting gradients to none, LibTorch's default),
   *  each stage's backward allocates its parameters' gradients, which stay
   *  until the optimizer step. On: the chain is planned with them (charged
   *  to the gradients at the boundaries), so the budget bounds them too; a
   *  step with every .grad kept (zero_grad(false)) gets a plan without
   *  them, solved from the same profile. Off: the plan leaves parameter
   *  gradients out, and a step that allocates them peaks up to their bytes
   *  above the budget (for a chain whose budget covers its activations
   *  only). Default true. */
  TORCH_ARG(bool, count_parameter_gradients) = true;
  /** Count the chain's output as held by the caller until backward()
   *  returns: a named output (`auto y = net->forward(x);`) or a step
   *  written as one expression (`net->forward(x).square().mean().backward()`,
   *  whose temporaries live to the statement's end) keeps it, |a_L| bytes,
   *  through the whole backward, and the budget then still bounds the
   *  chain's peak. false: the caller lets it go once the loss is computed
   *  (`auto loss = criterion(net->forward(x), y);`), and the plan frees it
   *  with the last stage's backward (|a_L| more room for the rest of the
   *  backward; a caller that holds it anyway peaks up to |a_L| above the
   *  plan). Default true. */
  TORCH_ARG(bool, count_held_output) = true;
  /** Measure the peak of each step with remat::memory (allocations are
   *  counted from forward to the end of backward). Default true. */
  TORCH_ARG(bool, measure_memory) = true;
  /** How the chain is profiled in auto mode (repeats, warm-up) and each
   *  stage's menu (selective_levels, offload). Default ProfileOptions(). */
  TORCH_ARG(ProfileOptions, profile) = ProfileOptions();
};

/** What one step did, for explain() and tests. */
struct StepReport {
  /** Peak bytes above the pre-forward baseline plus the input's bytes, from
   *  the chain's forward to the end of its backward: everything allocated
   *  meanwhile, the model's head and loss included; -1 when not measured. */
  int64_t measured_peak_bytes = -1;
  /** The chain's own peak, comparable to the prediction: the input's bytes
   *  plus what the chain's forward part and its stage backwards allocate
   *  and still hold (the gradient it receives included), without what other
   *  code allocates between them; -1 when not measured. */
  int64_t chain_peak_bytes = -1;
  /** The whole step's peak, seen by the begin_step() scope that ended last
   *  (above the bytes live when it opened); -1 without one. */
  int64_t step_peak_bytes = -1;
  /** With a step budget: the bytes outside the chain at its peak, as
   *  measured (step peak minus the chain's own peak); -1 otherwise. */
  int64_t outside_bytes = -1;
  /** Per schedule op, the chain's own bytes at most while it ran (as
   *  chain_peak_bytes counts them), comparable to the plan's
   *  Prediction::op_bytes; empty when not measured. The max over the ops is
   *  chain_peak_bytes, unless bytes were handed in between ops. */
  std::vector<int64_t> op_peak_bytes;
  /** Forward executions per stage in the step (the schedule's count). */
  std::vector<int> forwards_per_stage;
  /** Ops of recomputes that early stop produced without running them. */
  int64_t recompute_ops_skipped = 0;
  /** The chain's own time in the step, ms: its forward part and its
   *  stages' backwards (recomputes included), wall clock; -1 before a step. */
  double chain_ms = -1;
};

namespace detail {
struct ChainAccess;
struct ChainOption;
struct Execution;
struct ForcedSchedule;
struct Levers;
struct Values;
class StopRecords;
struct Tripwire;
}  // namespace detail

class CheckpointedSequentialImpl;

/** One training step's memory scope (CheckpointedSequentialImpl::
 *  begin_step()): measures the step's peak from its creation to its end
 *  and reports it to the chain (last_step(), explain(), and the step
 *  budget's planning). Movable, not copyable. */
class StepScope {
 public:
  /** Moves the scope; the moved-from one reports nothing. */
  StepScope(StepScope&&) noexcept;
  StepScope& operator=(StepScope&&) = delete;
  ~StepScope();

 private:
  friend class CheckpointedSequentialImpl;
  StepScope(std::shared_ptr<CheckpointedSequentialImpl> owner, int64_t chain_steps);
  std::shared_ptr<CheckpointedSequentialImpl> owner_;
  std::unique_ptr<memory::Probe> probe_;
  int64_t chain_steps_ = 0;  // the owner's completed chain steps when it opened
};

/** A Sequential run under a planner schedule (see the file comment); use
 *  it through its holder CheckpointedSequential. */
class CheckpointedSequentialImpl : public torch::nn::Cloneable<CheckpointedSequentialImpl> {
 public:
  /** Wraps seq (its modules are registered here under their own names);
   *  nothing is profiled or planned until the first forward. */
  CheckpointedSequentialImpl(torch::nn::Sequential seq, SequentialOptions options = SequentialOptions());
  /** One chain over the modules of several Sequentials, in order (e.g. a
   *  ResNet's layer1..layer4). The modules stay registered where they are
   *  (in the model that owns them): this wrapper registers none, so its
   *  parameters() is empty and registering it adds nothing twice. */
  CheckpointedSequentialImpl(std::vector<torch::nn::Sequential> parts, SequentialOptions options = SequentialOptions());

  ~CheckpointedSequentialImpl() override;

  /** Internal: how many CheckpointedSequential holders hold this module
   *  now. A module alive with none is held by something else only (a
   *  model's registry after replace_module with a temporary holder): the
   *  drop-in check (docs/runtime.md, "Drop-in inside a model") counts it as
   *  registered. */
  const std::shared_ptr<std::atomic<int>>& holder_count() const { return holders_; }

  /** Cloneable's reset(): registers the wrapped modules on this wrapper
   *  (none for a chain over several Sequentials) and drops the plans, which
   *  are made again on first use. */
  void reset() override;
  /** Also sets the wrapped Sequential's own mode (the plan depends on it). */
  void train(bool on = true) override;
  /** A deep copy: its own Sequential (cloned), the same options; the
   *  original is left untouched. Plans are made again on first use. */
  std::shared_ptr<torch::nn::Module> clone(const std::optional<c10::Device>& device = std::nullopt) const override;
  /** Runs the schedule's forward part; backward runs the rest. The last
   *  stage must return one tensor (else forward_values). */
  at::Tensor forward(const at::Tensor& x);
  /** The same for a chain whose first module takes a std::vector<at::Tensor>;
   *  returns the last stage's tensors (a vector or a tuple's elements, in
   *  order). Tensors that are not floating point (masks, indices) carry no
   *  gradient. */
  std::vector<at::Tensor> forward_values(const std::vector<at::Tensor>& xs);

  /** The plan for the last input shape (profiling and solving if needed
   *  when given x). Throws if no forward has run and no x is given. */
  const plan::Plan& plan() const;
  /** The plan for x's shape, profiling and solving first if needed. */
  const plan::Plan& plan(const at::Tensor& x);
  /** plan(x) for a chain whose first module takes a std::vector<at::Tensor>. */
  const plan::Plan& plan_values(const std::vector<at::Tensor>& xs);
  /** The profiled chain for the last input shape. */
  const plan::Chain& chain() const;
  /** Per stage: name, forward runs, kept after forward, output and saved
   *  bytes; then the predicted peak and, after a step, the measured one. */
  std::string explain() const;
  /** The last completed step (after its backward); a copy, since another
   *  thread's step may complete meanwhile. */
  StepReport last_step() const {
    std::lock_guard<std::mutex> lock(*mu_);
    return last_step_;
  }
  /** Opens one training step's scope: keep it until the step ends (after
   *  backward and the optimizer step). Needed with step_memory_budget_bytes;
   *  otherwise optional, for the step's peak in last_step() and explain(). */
  StepScope begin_step();
  /** How many times a chain was profiled (once per input shape and state). */
  int profiles() const {
    std::lock_guard<std::mutex> lock(*mu_);
    return profiles_;
  }

  /** The options it was built with. */
  const SequentialOptions& options() const { return options_; }
  /** The wrapped Sequential (for several Sequentials: one holding all their modules). */
  torch::nn::Sequential& sequential() { return seq_; }

 private:
  std::shared_ptr<std::atomic<int>> holders_ = std::make_shared<std::atomic<int>>(0);
  friend struct detail::Execution;
  friend struct detail::ChainAccess;
  struct Entry {
    plan::Chain profiled;          // as measured
    plan::Chain chain;             // as planned: profiled, or with parameter gradients charged (sequential.cpp)
    int64_t param_grad_bytes = 0;  // the parameter gradients charged in `chain`, bytes (0: none)
    plan::Plan plan;
    std::shared_ptr<const detail::Values> result;  // kind and size of the last stage's result
    std::shared_ptr<detail::StopRecords> stops;    // early stop's per-stage records
    std::vector<char> writes_input;                // per stage: writes its input in place (profiled)
    bool own_plan = false;                         // `plan` is the options' (else store-all, for a forced schedule)
    std::shared_ptr<const detail::Levers> levers;  // per stage: how its options run (plan::Stage::options)
    // Step budget: bytes outside the chain (measured), steps measured, and
    // why the budget cannot be met (thrown by the next forward).
    int64_t outside_bytes = -1;
    int steps_measured = 0;
    std::string step_error;
    // NOTE [chain offload priced by the step]: how the plan was solved,
    // what measured steps added to the disk options' time (ms per GiB
    // sent), the streaks of slow and fast steps, and a charge waiting for the next
    // forward (ms per byte sent).
    std::optional<plan::SolveOptions> solve;
    double offload_ms_per_gib = 0;
    int reprices = 0;
    plan::TransferPrice transfer_price{2};  // its streaks: two slow steps in a row charge
    double pending_ms_per_byte = 0;
  };
  // NOTE [chain offload priced by the step]; both with mu_ held.
  void note_step_time(Entry& e, const plan::Schedule& ran, double predicted_ms, double chain_ms);
  void apply_reprice(Entry& e);
  friend class StepScope;
  void end_step(int64_t step_peak, int64_t chain_steps_before);
  CheckpointedSequentialImpl(torch::nn::Sequential seq, SequentialOptions options, bool own_children);
  // With mu_ held. forced: the whole-step planner's schedule runs, so the
  // options' plan is not solved (solve_own does, on a later call without).
  const Entry& entry_for(const detail::Values& x, bool forced = false);
  void solve_own(Entry& e);
  /** The chain as planned: `chain` with the caller's output counted
   *  (count_held_output; NOTE [the caller's output]). */
  plan::Chain planned(
      const plan::Chain& chain) const;  // the options' plan into e.plan; throws when the options cannot be met
  void solve_own_budget(Entry& e);      // solve_own without the parameter gradients' remedy
  const Entry& last_entry() const;
  detail::Values run(const detail::Values& x, bool want_tensor);
  /** The whole-step planner's options for x (src/chain/observe.h's ChainMenu). */
  std::vector<detail::ChainOption> menu_for(const detail::Values& x, int budgets);
  /** run() without the whole-step observer: under `trial` when given (an
   *  isolated run of the whole-step profiler), else under forced_ or the
   *  options' plan. */
  detail::Values run_planned(const detail::Values& x, bool want_tensor, const detail::ForcedSchedule* trial);

  torch::nn::Sequential seq_;
  SequentialOptions options_;
  bool own_children_ = true;  // false: a chain over several modules
  // Guards plans_, last_, profiles_ and last_step_: one model may run
  // forward/backward on several threads at once (shared, not copied, by
  // the base class's copy in clone(), which this class overrides).
  std::shared_ptr<std::mutex> mu_ = std::make_shared<std::mutex>();
  std::map<std::vector<int64_t>, Entry> plans_;  // key: see plan_key()
  const Entry* last_ = nullptr;
  StepReport last_step_;
  int profiles_ = 0;
  Entry* last_chain_entry_ = nullptr;  // the plan the last completed step ran
  int open_steps_ = 0;                 // begin_step() scopes alive
  int64_t chain_steps_ = 0;            // forward+backward steps completed
  // NOTE [drop-in through a Sequential member]: shared by the wrappers of
  // one Sequential; a backward through its modules before any of them ran
  // throws (the model calls its own Sequential member, not the wrapper).
  std::shared_ptr<detail::Tripwire> tripwire_;
  // The whole-step planner's schedule (auto.h), overriding the options'
  // plan; nullptr: none. Guarded by mu_.
  std::shared_ptr<const detail::ForcedSchedule> forced_;
};

/** The module holder (as TORCH_MODULE would define it), plus the
 *  constructor from a braced list of Sequentials:
 *  `remat::CheckpointedSequential({layer1, layer2, layer3}, opts)`. */
class CheckpointedSequential : public torch::nn::ModuleHolder<CheckpointedSequentialImpl> {
 public:
  using torch::nn::ModuleHolder<CheckpointedSequentialImpl>::ModuleHolder;
  using Impl = CheckpointedSequentialImpl;  ///< the module class
  // The options are not optional here: with a braced list as the only
  // argument, a copy of a holder built from the list would be as good a
  // match, and an initializer_list constructor would capture `{nullptr}`.
  /** One chain over several Sequentials (CheckpointedSequentialImpl's
   *  constructor from parts). */
  CheckpointedSequential(std::vector<torch::nn::Sequential> parts, SequentialOptions options)
      : ModuleHolder(std::make_shared<CheckpointedSequentialImpl>(std::move(parts), std::move(options))) {}

 private:
  /** Counts this holder in its module's holder_count() (a member, so that
   *  the inherited constructors count too; it holds the counter, not the
   *  module, so an assignment that drops the last reference is safe). */
  class Counted {
   public:
    explicit Counted(std::shared_ptr<std::atomic<int>> c) : c_(std::move(c)) {
      if (c_) c_->fetch_add(1);
    }
    Counted(const Counted& o) : Counted(o.c_) {}
    Counted(Counted&& o) noexcept : c_(std::move(o.c_)) {}
    Counted& operator=(const Counted& o) {
      if (this != &o) *this = Counted(o);
      return *this;
    }
    Counted& operator=(Counted&& o) noexcept {
      if (this != &o) {
        drop();
        c_ = std::move(o.c_);
      }
      return *this;
    }
    ~Counted() { drop(); }

   private:
    void drop() {
      if (c_) c_->fetch_sub(1);
      c_.reset();
    }
    std::shared_ptr<std::atomic<int>> c_;
  };
  Counted counted_{is_empty() ? nullptr : get()->holder_count()};
};

}  // namespace remat
