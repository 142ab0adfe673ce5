// Internal: what the files of the whole-step planner (src/auto/) share:
// the step's units and their options, the record of one observed call,
// and AutoCheckpoint::Impl. Each file defines the Impl members of one stage
// of the planner, in the order a step takes them: profiled_step.cpp (the
// profiled step and its timeline), menu.cpp (each unit's options and their
// measured bytes and times), step_model.cpp (the plan::StepModel, solved),
// apply.cpp (units switched to the plan, planned steps) and explain.cpp
// (reports and the text of errors); auto.cpp holds the public API. Leaves
// out the helpers that one file uses alone: they stay in that file.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include <remat/auto.h>
#include <remat/checkpointable.h>
#include <remat/chunked.h>
#include <remat/memory.h>
#include <remat/offload.h>
#include <remat/optim.h>
#include <remat/plan/transfer.h>
#include <remat/sequential.h>

#include "../chain/observe.h"
#include "../core/memory_source.h"
#include "../offload/offload_internal.h"

namespace remat::detail {

using Clock = std::chrono::steady_clock;
inline double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

inline std::string shown(const std::string& name) { return name.empty() ? std::string("(root)") : name; }

/** One option of a unit's menu: its name and the switch state that runs it. */
struct Option {
  std::string name;
  std::optional<CheckpointOptions> switch_state;  // nullopt: not recomputed
  std::optional<OffloadOptions> offload;          // with switch_state nullopt: saves go to this store
  bool inner = false;                             // the unit's inner units recompute too (nested)
  std::optional<plan::Schedule> schedule;         // a chain's: nullopt = store-all
  int store = -1;       // index in AutoOptions::offload of the store it sends to, or -1; such options end the menu
  int64_t chunks = -1;  // a chunked call's: the slices it runs with (-1: its own count)

  Option() = default;
  Option(std::string n, std::optional<CheckpointOptions> s, std::optional<OffloadOptions> o, bool in = false)
      : name(std::move(n)), switch_state(std::move(s)), offload(std::move(o)), inner(in) {}
};

/** Runs one call of a unit again under an option (a Checkpointable's
 *  UnitRun or a chain's ChainRun, as the option says). */
using RunOption = std::function<std::vector<at::Tensor>(const Option&, const std::vector<at::Tensor>&)>;

/** Where a unit's calls ran: the enclosing unit's index, or one of these. */
constexpr int64_t kTop = -1;       // outside every unit
constexpr int64_t kNotSeen = -2;   // not called yet
constexpr int64_t kDisagree = -3;  // calls inside different units (or at the top and inside one)
// plan().solver of a choice the user put in force (apply_choice): repricing
// keeps that choice rather than solving another.
inline constexpr const char* kGivenSolver = "given";

/** A checkpointable module of the tree, a CheckpointedSequential, or a
 *  chunked call (NOTE [chunked calls as units], chunks.cpp). */
struct Unit {
  std::string name;
  Checkpointable* c = nullptr;                  // nullptr for a chain or a chunked call
  CheckpointedSequentialImpl* chain = nullptr;  // a chain: its options are its schedules
  torch::nn::Module* module = nullptr;          // whose parameters and buffers it uses (nullptr: a chunked call)
  std::string kind;                             // a chunked call's: "chunked" or "chunked_cross_entropy"
  int64_t own_chunks = 0, limit = 0;            // a chunked call's: its own count, the length it slices
  std::vector<Option> menu;                     // built at its first observed call
  bool plannable = false;                       // has a backward and more than one option
  std::vector<size_t> calls;
  std::vector<size_t> inner;    // units below it in the module tree
  int64_t parent = kNotSeen;    // the unit its calls ran inside (NOTE [units inside units])
  std::vector<size_t> offered;  // menu indices the step model offers, in order
};

/** One observed call of a unit in the profiled step (its methods:
 *  profiled_step.cpp). */
struct CallRecord {
  size_t unit = 0;
  std::shared_ptr<CallRecord> enclosing;  // the call of the unit it ran inside
  double forward_begin_us = 0, forward_end_us = -1;
  std::mutex mu;
  // Its backward: from its first unpack to its last unpack, or later, to
  // where the node that unpacked last returned (NOTE [a backward ends with
  // its last node]).
  double first_unpack_us = -1, backward_end_us = -1;
  std::vector<plan::StepCost> costs;
  // Per menu option: its isolated run's writes and reads to a disk store
  // (all zero for an option that sends nothing to disk; NOTE [in flight
  // planned]).
  std::vector<plan::TransferRun> transfers;

  // NOTE [released inputs]: an option that does not hold an input that keep
  // holds (an offload sends it away) frees it once its caller lets it go,
  // if nothing else holds it then. The profiled step sees when: the input's
  // storage is referenced only by tensors this call's saves (its inner
  // calls' included) packed. Checked at every later unit call's start and
  // forward end and at its own first unpack, so the time seen is never
  // earlier than the true one; a packed tensor freed early (a dead branch)
  // is not counted, so another holder is never taken for it.
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> inputs;  // per input slot
  std::vector<double> exclusive_us;                               // per input slot: -1, or when seen held only here
  std::vector<std::vector<char>> lets_go;                         // per menu option, per input slot
  std::vector<const c10::StorageImpl*> input_ids;                 // per input slot: its storage (nullptr: none)
  std::vector<double> alive_us;      // per input slot: the last unpack of the call that saw its storage still live
  std::vector<int64_t> input_bytes;  // per input slot: its storage's bytes
  double release_us = -1;            // the latest exclusive_us of an input some option lets go; -1: none
  double release_end_us = -1;        // where the credit for those inputs ends (in the call's backward)
  std::vector<std::pair<const c10::StorageImpl*, c10::weak_intrusive_ptr<c10::TensorImpl>>> packs;

  // NOTE [inputs two calls hold]: an input that an earlier call's saves
  // hold too (its output, which it saved: a ResNet block's ReLU) is free to
  // go once only the packs of the two hold it, if both let go of it.
  std::vector<std::pair<const c10::StorageImpl*, c10::weak_intrusive_ptr<c10::TensorImpl>>> out_packs;
  std::vector<const c10::StorageImpl*> output_ids;  // per output slot: its storage (nullptr: none)
  std::shared_ptr<CallRecord> pair;                 // that earlier call, or null
  size_t pair_slot = 0, pair_out = 0;               // the input's slot here, the output's slot there
  double pair_us = -1;                              // when seen held only by the two calls' packs
  std::vector<std::vector<char>> out_lets_go;       // per menu option, per output slot

  static size_t live_on(
      const std::vector<std::pair<const c10::StorageImpl*, c10::weak_intrusive_ptr<c10::TensorImpl>>>& list,
      const c10::StorageImpl* st);
  void packed(const at::Tensor& t);
  void note_exclusive(double now);
  void unpacked(double t);
  void node_done(double t);
};

/** Which inputs and outputs of an isolated run are held elsewhere (menu.cpp). */
struct Held;

}  // namespace remat::detail

namespace remat {

struct AutoCheckpoint::Impl : detail::UnitObserver, detail::ChainObserver, detail::ChunkObserver {
  using CallRecord = detail::CallRecord;
  using Held = detail::Held;
  using Option = detail::Option;
  using RunOption = detail::RunOption;
  using Unit = detail::Unit;

  /** The planner whose step this thread is profiling (its backward ops are
   *  events: NOTE [released inputs]), or nullptr. */
  static inline thread_local Impl* t_profiling = nullptr;

  torch::nn::Module& model;
  AutoOptions options;
  std::vector<Unit> units;
  std::unordered_map<const Checkpointable*, size_t> index;
  std::unordered_map<const CheckpointedSequentialImpl*, size_t> chain_index;
  int steps_run = 0;
  bool planned = false;
  int64_t budget = 0;
  int replans = 0;
  int reprices = 0;               // NOTE [offload priced by the step]
  double offload_ms_per_gib = 0;  // what repricing added to the offload options, ms per GiB sent (largest store)
  std::vector<double> surcharge_ms_per_byte;  // per store of options.offload(): what repricing added in force
  plan::TransferPrice transfer_price{2};      // its streaks: two slow steps in a row charge
  int64_t measured_peak = -1;
  double measured_ms = -1;
  double warmup_ms = -1;  // the last warm-up step's time
  // NOTE [plain time calibrated]: the plain time the last planned step
  // implied (-1: none trusted), the plan in force's steps so far, and how
  // many times two trusted steps in a row set the plain time.
  double plain_last = -1;
  int plain_plan_steps = 0;
  int plain_calibrations = 0;

  // The profiled step.
  plan::StepModel step_model;
  plan::StepPlan step_plan;
  int64_t profiled_peak = 0;
  double profiled_ms = 0;
  std::vector<std::shared_ptr<CallRecord>> calls;
  std::vector<std::pair<double, double>> trial_windows;  // us on the timeline
  std::vector<memory::Sample> samples;                   // the step's, trials cut out
  std::vector<double> points_us;                         // segment boundaries
  memory::Recording* timeline = nullptr;                 // while profiling
  int64_t largest_input_sent = 0;       // bytes of the largest input of a unit that may send its inputs
  std::vector<int64_t> inflight_seen;   // per store of options.offload(): NOTE [offload margin measured]
  std::vector<int64_t> inflight_trial;  // the same, for the profile under way
  int64_t plan_margin = 0;              // the in-flight margin the plan in force was solved with
  int64_t plan_state_writes = 0;        // the state writes in flight it kept room for above its prediction
  // The step model's units (indices into units) and, per unit and call, the
  // bytes of its inputs (each storage once): as of the last profile that
  // completed, so that a profile that throws leaves them matching step_model.
  std::vector<size_t> modeled;
  std::vector<std::vector<double>> input_bytes_of;
  // The same, per unit and call, per menu option: its isolated run's
  // transfers (NOTE [in flight planned]).
  std::vector<std::vector<std::vector<plan::TransferRun>>> transfers_of;
  std::vector<int64_t> plan_caps;  // per store of options.offload(): the max_inflight_bytes the plan in force runs
  std::vector<std::vector<double>> plan_option_ms;    // its tier's prices: per unit, per offered option, ms added
  std::shared_ptr<memory::Recording> timeline_owner;  // the same, for the unpack hooks (weakly)
  // NOTE [memory sources]: the bytes of the units' device (the model's parameters'), set by each profile.
  std::shared_ptr<memory::Source> mem = memory::source_for(c10::Device(c10::kCPU));
  std::vector<std::shared_ptr<CallRecord>> active;  // observed calls running now, outermost first
  bool in_trial = false;

  std::vector<std::string> overrun_reports;  // NOTE [overruns reported]

  // NOTE [model state in the plan] (state.cpp).
  std::vector<std::unique_ptr<StepInBackward>> in_backward;  // per options.optimizers()
  struct StateGroup {
    size_t opt = 0, group = 0;  // options.optimizers()[opt]->param_groups()[group]
    int64_t bytes = 0;          // its parameters' optimizer state
    int64_t largest = 0;        // the most one parameter has
    bool float32 = true;        // every parameter float32 (a lossy codec shrinks only those)
  };
  std::vector<StateGroup> state_groups;  // as of the last profile
  double state_ms_per_byte = 0;          // its price per byte sent: NOTE [state priced by the step]
  int state_reprices = 0;                // planned steps that priced it
  int state_steps = 0;                   // steps run with the placement in force
  double state_last = -1;                // the last step's price (-1: none yet)
  double state_price_planned = 0;        // the price the plan in force was solved with
  double state_wait_last_ms = 0;         // what the last planned step's backward waited on the store
  /** One update inside the profiled step's backward: optimizers()[opt]'s
   *  parameter of param group `group`, its state bytes, and when. */
  struct StateUpdate {
    size_t opt = 0, group = 0;
    int64_t bytes = 0;
    double time_us = 0;      // its end, on the profiled step's timeline
    double begin_us = 0;     // its start (the optimizer's update alone)
    int64_t grad_bytes = 0;  // the gradient it freed
    int64_t segment = 0;     // of the step model (measure_state)
  };
  std::mutex updates_mu;
  std::vector<StateUpdate> updates_trial;  // the profile under way's
  std::vector<StateUpdate> state_updates;  // as of the last profile, in order
  void note_update(size_t opt, const StepInBackward::UpdateEvent& e);
  void listen_to_updates(bool on);  // on_update of every in_backward, while profiling
  /** One placement of the state groups: which go to the store, the bytes
   *  that adds to each segment of the step (below 0: their state off, less
   *  what the stores hold in flight there) and the time it costs. */
  struct Placement {
    std::vector<bool> in_store;   // per state_groups
    std::vector<int64_t> shift;   // per segment of step_model; empty: none
    std::vector<int64_t> writes;  // of shift, the writes in flight (NOTE [state writes in flight])
    int64_t state_bytes = 0;      // of the groups in the store, what the store takes off
    double ms = 0;
    bool at_end = false;  // the updates wait for the backward's end (NOTE [updates placed])
  };
  Placement at_end_placement() const;  // NOTE [updates placed]
  std::vector<Placement> placements() const;
  Placement placement;               // of the plan in force
  std::vector<bool> state_in_force;  // per state_groups, as applied
  /** Per segment of step_model: what the state stores hold in flight
   *  (held) and, of it, the writes not yet on disk (NOTE [state writes in
   *  flight]). */
  struct StateInflight {
    std::vector<int64_t> held, writes;
  };
  StateInflight state_inflight(const std::vector<bool>& in_store) const;
  void start_in_backward();
  void measure_state();
  void apply_state();
  double state_waited_ms() const;                        // the optimizers' StepInBackwardStats::state_wait_ms, summed
  bool reprice_state(double waited_ms, double step_ms);  // NOTE [state priced by the step]
  std::string explain_state() const;

  // NOTE [chunked calls as units] (chunks.cpp).
  std::vector<int64_t> site_units;   // per chunked call of a step, in order: its unit, or -1 (not planned)
  size_t sites_seen = 0;             // chunked calls of the step under way so far
  std::vector<int64_t> chunks_plan;  // per unit: the count the plan in force runs it with (-1: its own)
  std::unique_ptr<Call> begin(const char* kind, int64_t limit, const std::vector<at::Tensor>& inputs,
                              const detail::ChunkRun& run, int64_t* chunks) override;
  void build_chunk_menu(Unit& u);
  /** RAII: this planner sees the chunked calls of one step on this thread. */
  class StepScope {
   public:
    explicit StepScope(Impl& impl) : previous_(detail::set_chunk_observer(&impl)) { impl.sites_seen = 0; }
    ~StepScope() { detail::set_chunk_observer(previous_); }
    StepScope(const StepScope&) = delete;
    StepScope& operator=(const StepScope&) = delete;

   private:
    detail::ChunkObserver* previous_;
  };

  /** What a unit's switch was before the planner (NOTE [switches given back]). */
  struct Switches {
    std::optional<CheckpointOptions> checkpointing;
    std::optional<OffloadOptions> offloading;
    std::shared_ptr<const detail::ForcedSchedule> forced;  // a chain's
  };
  std::vector<Switches> before;  // per unit, as found

  int64_t unit_events = 0;     // unit calls' starts and forward ends, and backward ops checked
  int64_t outside_noted = -1;  // unit_events as of the last backward-op check

  // NOTE [what the profiled step leaves behind] (profiled_step.cpp).
  int64_t grown = 0;             // bytes live at the profiled step's end less at its start, >= 0
  int64_t grown_everywhere = 0;  // of those, counted at every point (the rest before the first unit call)

  Impl(torch::nn::Module& m, AutoOptions o) : model(m), options(std::move(o)) {}
  ~Impl() override;  // apply.cpp: gives the switches back

  // --- profiled_step.cpp: the profiled step, seen through the observers ----
  class ObservedCall;
  void profile(const std::function<void()>& fn);
  void profile_fresh(const std::function<void()>& fn);
  std::unique_ptr<Call> begin(Checkpointable& c, const std::vector<at::Tensor>& inputs,
                              const detail::UnitRun& run) override;
  std::unique_ptr<Call> begin(CheckpointedSequentialImpl& chain, const std::vector<at::Tensor>& inputs,
                              const detail::ChainRun& run, const detail::ChainMenu& menu) override;
  std::unique_ptr<Call> begin_call(size_t unit, const std::vector<at::Tensor>& inputs, const RunOption& run,
                                   const detail::ChainMenu* menu);
  bool observing() const;
  void find_pair(CallRecord& rec);
  void note_exclusive(double now);
  void note_backward_op();

  struct Grads {
    int64_t bytes = 0;
    std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> storages;
  };
  Grads grads_now() const;

  // --- menu.cpp: each unit's options, measured in isolated runs ------------
  void measure(Unit& u, const std::vector<at::Tensor>& inputs, const RunOption& run, const detail::ChainMenu* menu,
               CallRecord& rec);
  void build_chain_menu(Unit& u, const detail::ChainMenu& menu);
  void build_menu(Unit& u, const std::vector<at::Tensor>& inputs, const RunOption& run);
  plan::StepCost measure_one(Unit& u, const std::vector<at::Tensor>& inputs, const RunOption& run, const Option& opt,
                             bool* has_backward, Held* io_kept, plan::TransferRun* transfer = nullptr);
  void note_inflight(const Option& opt, const std::shared_ptr<detail::OffloadStore>& store);
  static OffloadOptions trial_store(OffloadOptions o);

  // --- step_model.cpp: the step model, solved and repriced -----------------
  void build_model(const memory::Recording& tl, int64_t start_bytes, double begin_us, double end_us);
  int64_t profile_start_bytes = 0;  // the bytes live as the profiled step began (build_model)
  bool inner_calls_inside(size_t i) const;
  /** Units of the step model, in model order, as indices into units. */
  std::vector<size_t> model_units() const { return modeled; }
  /** caps: per store of options.offload(), its max_inflight_bytes (empty:
   *  as the options say). */
  int64_t inflight_margin(bool inputs_only = false, const std::vector<int64_t>& caps = {}) const;
  int64_t sent_per_step(size_t store, bool inputs_only) const;
  int64_t activations_inflight() const;

  /** The plans solve() compares: without options that send to a store (no
   *  margin); with those sending only inputs (the inputs' margin); with
   *  every option (the whole margin); the last two at each in-flight cap
   *  of the ladder (NOTE [in flight planned]). offered: per unit of the
   *  step model, how many options (plan::StepVariant::options_offered). */
  struct Tier {
    std::vector<size_t> offered;
    int64_t margin = 0;
    std::vector<int64_t> caps;                   // per store of options.offload(): its max_inflight_bytes
    std::vector<std::vector<double>> option_ms;  // per unit, per offered option: its transfers' time at caps
  };
  std::vector<std::vector<int64_t>> cap_ladder() const;
  std::vector<std::vector<double>> priced_at(const std::vector<int64_t>& caps) const;
  std::vector<Tier> tiers() const;
  int store_of(size_t j, size_t k) const;
  std::vector<size_t> without_offload(bool plain_only = false) const;
  /** Every (tier, placement) pair as a variant of step_model, with the
   *  tier and the placement of each. */
  struct Variants {
    std::vector<plan::StepVariant> list;
    std::vector<std::pair<Tier, Placement>> of;
  };
  Variants variants() const;
  plan::StepPlan solve(int64_t target);
  void adopt(const Variants& v, plan::StepPlan* plan);
  plan::StepPlan given(const std::vector<int>& choice);

  struct Leanest {
    int64_t peak = 0, segment = 0;
    int64_t margin = 0;      // the in-flight margin of the plan that reaches it (included)
    bool proven = false;     // the solver proved it least
    bool timed_out = false;  // not proven: it stopped at its time limit (else GLPK's tolerances)
  };
  Leanest leanest() const;
  bool reprice_offload(double step_ms);
  void calibrate_plain(double step_ms);

  // --- apply.cpp: the switches, the plan put in force, planned steps -------
  void note_switches();
  void solve_and_apply(int64_t target);
  void give_and_apply(const std::vector<int>& choice);
  void put_in_force(plan::StepPlan p);
  void apply();
  void switch_off();
  void measured_step(const std::function<void()>& fn);

  // --- explain.cpp: the text of the errors and reports ---------------------
  std::string no_plan_fits(int64_t target) const;
  std::string overrun_report(int64_t excess, int64_t target) const;
};

}  // namespace remat
