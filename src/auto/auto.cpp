// The whole-step planner (auto.h): profiles one step of the user's step
// function through the units' checkpoint switch (Checkpointable's
// UnitObserver) and its chains (CheckpointedSequential's ChainObserver),
// turns it into a plan::StepModel, solves it and applies the choice through
// the same switches (and a forced schedule per chain). Memory is read and
// work timed on the device of the model's parameters (NOTE [memory sources],
// core/memory_source.h; auto.h says what that means for users).
//
// NOTE [what a profiled step measures]: the step runs plain. Each unit call
// is first run again in isolation under every option of its unit, on clones
// of its inputs (so in-place ops on them touch nothing), with the RNG and
// every tensor the run wrote put back after each run (NOTE [isolated runs
// write nothing]) and gradients taken with autograd::grad (nothing
// accumulates into .grad): the step that follows is the plain step, bitwise.
//
// NOTE [isolated runs write nothing]: a unit's forward may write state it
// does not own: a BatchNorm its model holds and its forward calls (a block
// normalising with `owner->bn`), a user's counter tensor. Its own buffers
// are not enough to put back. Each isolated run runs under the write guard
// that recomputes use (NOTE [recompute side effects], core/write_guard.h):
// every op is intercepted, and a tensor the run did not make is copied
// before its first write and written back when the run ends, wherever its
// module sits. The copies are made inside the run, so they count in its
// bytes (a BatchNorm's statistics: 2 x channels floats), never under. Those runs give each option's forward peak, the
// bytes it keeps, its backward peak (a probe each, above the bytes live at
// the call's start) and its time. The real call then runs under a
// saved-tensor hook that only notes the time of the first and last unpack:
// the call's backward window. A memory::Recording records every allocation
// of the step, with the isolated runs' windows cut out; the windows of all
// calls cut it into segments, whose peaks are the model's baseline.
//
// NOTE [units inside units]: a unit called inside another one's forward in
// the profiled step (a GPT block's attention) is a unit of its own, with
// the enclosing unit as its parent (plan::StepUnit::parent): its isolated
// runs happen inside the parent's real forward, under a hook scope of their
// own so that their unpacks are not taken for the parent's backward, and
// every unpack of its real call counts for the parent's backward window too
// (a block's backward starts with its MLP's). A unit with inner units gets
// one more option, "recompute, inner units too": its recompute runs the
// inner units checkpointed (nested checkpoints), so its backward holds one
// inner unit's working set at a time instead of all of them.
#include <remat/auto.h>

#include <ATen/Context.h>
#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <limits>
#include <map>
#include <mutex>
#include <sstream>
#include <tuple>
#include <unordered_map>

#include <remat/checkpointable.h>
#include <remat/error.h>
#include <remat/memory.h>
#include <remat/offload.h>
#include <remat/plan/error.h>
#include <remat/plan/transfer.h>
#include <remat/policy.h>
#include <remat/sequential.h>

#include "../chain/observe.h"
#include "../core/dispatch.h"
#include "../core/memory_source.h"
#include "../core/replay.h"
#include "../core/write_guard.h"
#include "../offload/offload_internal.h"
#include "../region/levels.h"
#include "measure.h"

namespace remat {
namespace {

std::string shown(const std::string& name) { return name.empty() ? std::string("(root)") : name; }

/** One option of a unit's menu: its name and the switch state that runs it. */
struct Option {
  std::string name;
  std::optional<CheckpointOptions> switch_state;  // nullopt: not recomputed
  std::optional<OffloadOptions> offload;          // with switch_state nullopt: saves go to this store
  bool inner = false;                             // the unit's inner units recompute too (nested)
  std::optional<plan::Schedule> schedule;         // a chain's: nullopt = store-all
  int store = -1;  // index in AutoOptions::offload of the store it sends to, or -1; such options end the menu

  Option() = default;
  Option(std::string n, std::optional<CheckpointOptions> s, std::optional<OffloadOptions> o, bool in = false)
      : name(std::move(n)), switch_state(std::move(s)), offload(std::move(o)), inner(in) {}
};

/** Runs one call of a unit again under an option (a Checkpointable's
 *  UnitRun or a chain's ChainRun, as the option says). */
using RunOption = std::function<std::vector<at::Tensor>(const Option&, const std::vector<at::Tensor>&)>;

/** Schedules a chain unit offers besides store-all: its optimal schedule at
 *  this many budgets from its leanest feasible peak up (duplicates dropped). */
constexpr int kChainBudgets = 6;

/** Where a unit's calls ran: the enclosing unit's index, or one of these. */
constexpr int64_t kTop = -1;       // outside every unit
constexpr int64_t kNotSeen = -2;   // not called yet
constexpr int64_t kDisagree = -3;  // calls inside different units (or at the top and inside one)

/** A checkpointable module of the tree, or a CheckpointedSequential. */
struct Unit {
  std::string name;
  Checkpointable* c = nullptr;                  // nullptr for a chain
  CheckpointedSequentialImpl* chain = nullptr;  // a chain: its options are its schedules
  torch::nn::Module* module = nullptr;          // whose parameters and buffers it uses
  std::vector<Option> menu;                     // built at its first observed call
  bool plannable = false;                       // has a backward and more than one option
  std::vector<size_t> calls;
  std::vector<size_t> inner;    // units below it in the module tree
  int64_t parent = kNotSeen;    // the unit its calls ran inside (NOTE [units inside units])
  std::vector<size_t> offered;  // menu indices the step model offers, in order
};

/** One observed call of a unit in the profiled step. */
struct CallRecord {
  size_t unit = 0;
  std::shared_ptr<CallRecord> enclosing;  // the call of the unit it ran inside
  double forward_begin_us = 0, forward_end_us = -1;
  std::mutex mu;
  double first_unpack_us = -1, last_unpack_us = -1;
  std::vector<plan::StepCost> costs;

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

  /** Live tensors packed (per `list`) on storage `st`. */
  static size_t live_on(
      const std::vector<std::pair<const c10::StorageImpl*, c10::weak_intrusive_ptr<c10::TensorImpl>>>& list,
      const c10::StorageImpl* st) {
    size_t live = 0;
    for (const auto& [impl, weak] : list) live += impl == st && !weak.expired() ? 1 : 0;
    return live;
  }

  /** A tensor this call's saves (or an inner call's) packed: noted where
   *  it shares an input's storage. */
  void packed(const at::Tensor& t) {
    if (!t.has_storage()) return;
    const c10::StorageImpl* st = t.storage().unsafeGetStorageImpl();
    for (CallRecord* r = this; r != nullptr; r = r->enclosing.get()) {
      std::lock_guard<std::mutex> lock(r->mu);
      // Until its forward ends (then kept for its outputs only).
      if (r->forward_end_us < 0)
        r->out_packs.emplace_back(st, c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr()));
      if (std::find(r->input_ids.begin(), r->input_ids.end(), st) == r->input_ids.end()) continue;
      r->packs.emplace_back(st, c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr()));
    }
  }
  /** Notes the inputs that only the tensors packed here hold now; mu held. */
  void note_exclusive(double now) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (exclusive_us[i] >= 0) continue;
      c10::intrusive_ptr<c10::StorageImpl> st = inputs[i].lock();
      if (!st) continue;
      const size_t live = live_on(packs, st.get());
      // Each live packed tensor holds one reference, and `st` one.
      if (live > 0 && st.use_count() == live + 1) exclusive_us[i] = now;
    }
    if (pair && pair_us < 0 && exclusive_us[pair_slot] < 0) {
      c10::intrusive_ptr<c10::StorageImpl> st = inputs[pair_slot].lock();
      if (!st) return;
      const size_t here = live_on(packs, st.get());
      std::lock_guard<std::mutex> lock(pair->mu);  // the earlier call's forward is over: it packs no more
      const size_t there = live_on(pair->out_packs, st.get());
      if (here > 0 && there > 0 && st.use_count() == here + there + 1) pair_us = now;
    }
  }
  /** An unpack of this call's saves: part of its backward and of every
   *  enclosing call's. */
  void unpacked(double t) {
    for (CallRecord* r = this; r != nullptr; r = r->enclosing.get()) {
      std::lock_guard<std::mutex> lock(r->mu);
      if (r->first_unpack_us < 0) {
        r->note_exclusive(t);
        r->first_unpack_us = t;
      }
      r->last_unpack_us = std::max(r->last_unpack_us, t);
      // Keep may let an input go inside its backward: credit it no longer
      // than it is seen live (NOTE [released inputs]).
      for (size_t i = 0; i < r->inputs.size(); ++i) {
        if (r->exclusive_us[i] >= 0 && !r->inputs[i].expired()) r->alive_us[i] = t;
      }
    }
  }
};

/** What the planner's hooks keep of a saved tensor: the tensor detached.
 *  Autograd puts the graph back on unpack; the tensor itself would hold its
 *  own grad_fn when it is an output (a cycle that leaks the graph of a
 *  forward never run backward: a menu's op-timing run). */
std::any keep_detached(const at::Tensor& t) { return t.detach(); }

/** A saved-tensor hook scope that does nothing: a nested unit's isolated
 *  runs save under it, not under the enclosing call's recorder. */
std::shared_ptr<HookFactory> quiet_hooks() {
  return detail::make_function_hooks(
      keep_detached, [](const std::any& p) -> at::Tensor { return std::any_cast<const at::Tensor&>(p); });
}

/** While alive, an isolated run: puts back the CPU RNG when destroyed, and
 *  every tensor that existed before it and that an op wrote meanwhile
 *  (NOTE [isolated runs write nothing]). */
class Restore {
 public:
  Restore() : gen_(at::detail::getDefaultCPUGenerator()) {
    {
      std::lock_guard<std::mutex> lock(gen_.mutex());
      state_ = gen_.get_state();
    }
    scope_.emplace(interceptor_.get());
  }
  ~Restore() {
    scope_.reset();  // the copies go back uninterrupted, and after every inner scope
    guard_.restore();
    std::lock_guard<std::mutex> lock(gen_.mutex());
    gen_.set_state(state_);
  }
  Restore(const Restore&) = delete;
  Restore& operator=(const Restore&) = delete;

 private:
  at::Generator gen_;
  at::Tensor state_;
  detail::WriteGuard guard_;
  std::unique_ptr<dispatch::Interceptor> interceptor_ = detail::make_write_guard_interceptor(&guard_);
  std::optional<dispatch::Scope> scope_;
};

/** Inputs for an isolated run: clones (in-place ops on them touch nothing),
 *  with the leaves gradients are taken for. */
struct TrialInputs {
  std::vector<at::Tensor> leaves;  // requires grad, one per input that did
  std::vector<at::Tensor> in;      // what the unit sees
};
TrialInputs trial_inputs(const std::vector<at::Tensor>& inputs) {
  TrialInputs t;
  for (const auto& x : inputs) {
    if (!x.defined()) {
      t.in.push_back(x);
      continue;
    }
    at::Tensor c = x.detach().clone();
    if (x.requires_grad()) {
      c.requires_grad_(true);
      t.leaves.push_back(c);
      at::AutoGradMode on(true);
      t.in.push_back(c.clone());  // not a leaf: in-place ops on it are allowed
    } else {
      t.in.push_back(c);
    }
  }
  return t;
}

/** Per input, then per output of an isolated run: held by something besides
 *  the run's own references (NOTE [inputs an option keeps]), and bytes. */
struct Held {
  std::vector<char> held;
  std::vector<int64_t> bytes;
};

/** Which of a run's inputs and outputs are held elsewhere: through one of
 *  these tensors (autograd saves an input as the tensor itself; a policy
 *  keeps an op's output), through another tensor on the same storage (a
 *  detached alias, a view), or through a view's base. A tensor whose
 *  references cannot be told apart reads as held (over-counted, never
 *  under). */
Held held_elsewhere(const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& out) {
  struct Ours {
    std::unordered_map<const c10::TensorImpl*, std::pair<size_t, at::Tensor>> tensors;  // with expected refs
    at::Storage storage;
  };
  std::unordered_map<const c10::StorageImpl*, Ours> ours;
  auto note = [&](const at::Tensor& x) {  // one expected reference to x
    Ours& o = ours[x.storage().unsafeGetStorageImpl()];
    auto& [refs, tensor] = o.tensors[x.unsafeGetTensorImpl()];
    ++refs;
    tensor = x;
    o.storage = x.storage();
  };
  std::vector<const c10::TensorImpl*> views;  // distinct views: each holds its base once
  std::vector<const c10::TensorImpl*> no_base;
  for (const auto* v : {&in, &out}) {
    for (const auto& x : *v) {
      if (!x.defined() || !x.has_storage()) continue;
      note(x);
      if (!x.is_view()) continue;
      if (std::find(views.begin(), views.end(), x.unsafeGetTensorImpl()) != views.end()) continue;
      views.push_back(x.unsafeGetTensorImpl());
      try {
        note(at::Tensor(x._base()));  // a view (an output reshaped from a matmul's) holds its base
      } catch (const c10::Error&) {
        no_base.push_back(x.unsafeGetTensorImpl());
      }
    }
  }
  auto held = [&](const at::Tensor& x) -> bool {
    if (!x.defined()) return false;
    if (!x.has_storage()) return true;
    const Ours& o = ours.at(x.storage().unsafeGetStorageImpl());
    if (o.storage.use_count() > o.tensors.size() + 1) return true;  // use_count counts the copies here too
    for (const auto& [ti, rt] : o.tensors) {
      if (static_cast<size_t>(rt.second.use_count()) > rt.first + 1) return true;
    }
    return std::find(no_base.begin(), no_base.end(), x.unsafeGetTensorImpl()) != no_base.end();
  };
  Held h;
  for (const auto* v : {&in, &out}) {
    for (const auto& x : *v) {
      h.held.push_back(held(x) ? 1 : 0);
      h.bytes.push_back(x.defined() && x.has_storage() ? static_cast<int64_t>(x.storage().nbytes()) : 0);
    }
  }
  return h;
}

}  // namespace

struct AutoCheckpoint::Impl : detail::UnitObserver, detail::ChainObserver {
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
  plan::TransferPrice transfer_price{1};      // its streaks: one slow step charges
  int64_t measured_peak = -1;
  double measured_ms = -1;
  double warmup_ms = -1;  // the last warm-up step's time

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
  // The step model's units (indices into units) and, per unit and call, the
  // bytes of its inputs (each storage once): as of the last profile that
  // completed, so that a profile that throws leaves them matching step_model.
  std::vector<size_t> modeled;
  std::vector<std::vector<double>> input_bytes_of;
  std::shared_ptr<memory::Recording> timeline_owner;  // the same, for the unpack hooks (weakly)
  // NOTE [memory sources]: the bytes of the units' device (the model's parameters'), set by each profile.
  std::shared_ptr<memory::Source> mem = memory::source_for(c10::Device(c10::kCPU));
  std::vector<std::shared_ptr<CallRecord>> active;  // observed calls running now, outermost first
  bool in_trial = false;

  std::vector<std::string> overrun_reports;  // NOTE [overruns reported]

  Impl(torch::nn::Module& m, AutoOptions o) : model(m), options(std::move(o)) {}

  // NOTE [switches given back]: the planner owns the units' switches while
  // it lives (every unit plain until planned, then the plan). What they
  // were before (a Checkpointable's checkpoint and offload options, a
  // chain's forced schedule, or none: its own budget's plan) is noted at
  // construction and put back when the planner is destroyed, so that a
  // model outliving its planner runs as it did before (a chain with a
  // budget of its own plans under it again). A moved-from AutoCheckpoint
  // holds no Impl: only the planner that owns the switches gives them back.
  struct Switches {
    std::optional<CheckpointOptions> checkpointing;
    std::optional<OffloadOptions> offloading;
    std::shared_ptr<const detail::ForcedSchedule> forced;  // a chain's
  };
  std::vector<Switches> before;  // per unit, as found

  void note_switches() {
    before.clear();
    for (const Unit& u : units) {
      Switches s;
      if (u.chain != nullptr) {
        s.forced = detail::ChainAccess::forced(*u.chain);
      } else {
        s.checkpointing = u.c->checkpointing_options();
        s.offloading = u.c->offloading_options();
      }
      before.push_back(std::move(s));
    }
  }

  ~Impl() override {
    for (size_t i = 0; i < before.size() && i < units.size(); ++i) {
      Unit& u = units[i];
      if (u.chain != nullptr) {
        detail::ChainAccess::force(*u.chain, before[i].forced);
      } else {
        u.c->set_checkpointing(before[i].checkpointing);
        u.c->set_offloading(before[i].offloading);
      }
    }
  }

  // --- UnitObserver ---------------------------------------------------------
  class ObservedCall : public Call {
   public:
    ObservedCall(Impl& impl, std::shared_ptr<CallRecord> rec)
        : impl_(impl),
          rec_(rec),
          // A graph kept past the profiled step may be unpacked after its
          // timeline is gone: the unpack is then not the step's.
          hooks_(detail::make_function_hooks(
              [rec](const at::Tensor& t) -> std::any {
                std::any kept = keep_detached(t);
                rec->packed(std::any_cast<const at::Tensor&>(kept));  // NOTE [released inputs]
                return kept;
              },
              [rec, weak = std::weak_ptr<memory::Recording>(impl.timeline_owner)](const std::any& p) -> at::Tensor {
                if (auto tl = weak.lock()) rec->unpacked(tl->now_us());
                return std::any_cast<const at::Tensor&>(p);
              })) {
      impl_.active.push_back(rec_);
    }
    ~ObservedCall() override { impl_.active.pop_back(); }
    void finish(const std::vector<at::Tensor>& outputs) override {
      {
        // NOTE [inputs two calls hold]: its outputs' storages, and the
        // packs on them (the rest are not needed).
        std::lock_guard<std::mutex> lock(rec_->mu);
        for (const auto& y : outputs) {
          rec_->output_ids.push_back(y.defined() && y.has_storage() ? y.storage().unsafeGetStorageImpl() : nullptr);
        }
        auto& op = rec_->out_packs;
        op.erase(std::remove_if(op.begin(), op.end(),
                                [&](const auto& p) {
                                  return std::find(rec_->output_ids.begin(), rec_->output_ids.end(), p.first) ==
                                         rec_->output_ids.end();
                                }),
                 op.end());
        rec_->forward_end_us = impl_.timeline->now_us();
      }
      impl_.note_exclusive(rec_->forward_end_us);
    }

   private:
    Impl& impl_;
    std::shared_ptr<CallRecord> rec_;
    ScopedHooks hooks_;
  };

  /** NOTE [inputs two calls hold]: the input of `rec` (the largest) that
   *  is the output of the latest earlier call whose forward is over and
   *  whose saves hold it. */
  void find_pair(CallRecord& rec) {
    int64_t best = 0;
    for (size_t i = 0; i < rec.input_ids.size(); ++i) {
      const c10::StorageImpl* st = rec.input_ids[i];
      if (st == nullptr || rec.input_bytes[i] <= best) continue;
      for (auto it = calls.rbegin(); it != calls.rend(); ++it) {
        CallRecord& a = **it;
        std::lock_guard<std::mutex> lock(a.mu);
        if (a.forward_end_us < 0) continue;  // encloses this call
        const auto o = std::find(a.output_ids.begin(), a.output_ids.end(), st);
        if (o == a.output_ids.end() || CallRecord::live_on(a.out_packs, st) == 0) continue;
        rec.pair = *it;
        rec.pair_slot = i;
        rec.pair_out = static_cast<size_t>(o - a.output_ids.begin());
        best = rec.input_bytes[i];
        break;
      }
    }
  }

  /** NOTE [released inputs]: at an event of the profiled step, every call
   *  between its forward's end and its backward. */
  void note_exclusive(double now) {
    ++unit_events;
    for (const auto& c : calls) {
      std::lock_guard<std::mutex> lock(c->mu);
      if (c->forward_end_us >= 0 && c->first_unpack_us < 0) c->note_exclusive(now);
    }
  }

  /** NOTE [released inputs]: a backward op of the profiled step, outside
   *  the isolated runs: the first since the last unit event checks every
   *  call, so that a step whose last unit is followed by no other (a GPT's
   *  last block, then the head and the loss) sees its inputs freed by the
   *  time the backward starts, where the head's backward may peak. */
  void note_backward_op() {
    if (timeline == nullptr || in_trial || outside_noted == unit_events) return;
    note_exclusive(timeline->now_us());
    outside_noted = unit_events;
  }
  int64_t unit_events = 0;     // unit calls' starts and forward ends, and backward ops checked
  int64_t outside_noted = -1;  // unit_events as of the last backward-op check

  /** True when a call starting now is observed: the profiled step is
   *  running, outside the isolated runs and recomputes, and not inside a
   *  chain (its stages run as its schedule says) or, without inner units,
   *  inside another unit. */
  bool observing() const {
    if (timeline == nullptr || in_trial || is_recomputing() || !at::GradMode::is_enabled()) return false;
    if (!active.empty() && !options.inner_units()) return false;  // runs as part of the enclosing unit
    for (const auto& a : active) {
      if (units[a->unit].chain != nullptr) return false;
    }
    return true;
  }

  std::unique_ptr<Call> begin(Checkpointable& c, const std::vector<at::Tensor>& inputs,
                              const detail::UnitRun& run) override {
    if (!observing()) return nullptr;
    auto it = index.find(&c);
    if (it == index.end()) return nullptr;  // not a module of this model
    RunOption again = [&run](const Option& o, const std::vector<at::Tensor>& in) { return run(o.switch_state, in); };
    return begin_call(it->second, inputs, again, nullptr);
  }

  std::unique_ptr<Call> begin(CheckpointedSequentialImpl& chain, const std::vector<at::Tensor>& inputs,
                              const detail::ChainRun& run, const detail::ChainMenu& menu) override {
    if (!observing()) return nullptr;
    auto it = chain_index.find(&chain);
    if (it == chain_index.end()) return nullptr;  // not a module of this model
    RunOption again = [&run](const Option& o, const std::vector<at::Tensor>& in) { return run(o.schedule, in); };
    return begin_call(it->second, inputs, again, &menu);
  }

  std::unique_ptr<Call> begin_call(size_t unit, const std::vector<at::Tensor>& inputs, const RunOption& run,
                                   const detail::ChainMenu* menu) {
    Unit& u = units[unit];
    detail::check_unit_device(shown(u.name), u.chain != nullptr, inputs, mem->device());
    auto rec = std::make_shared<CallRecord>();
    rec->unit = unit;
    for (const auto& x : inputs) {
      const bool stored = x.defined() && x.has_storage();
      rec->inputs.push_back(stored ? x.storage().getWeakStorageImpl()
                                   : c10::weak_intrusive_ptr<c10::StorageImpl>(c10::intrusive_ptr<c10::StorageImpl>()));
      rec->input_ids.push_back(stored ? x.storage().unsafeGetStorageImpl() : nullptr);
      rec->input_bytes.push_back(stored ? static_cast<int64_t>(x.storage().nbytes()) : 0);
    }
    rec->exclusive_us.assign(inputs.size(), -1);
    rec->alive_us.assign(inputs.size(), -1);
    const int64_t parent = active.empty() ? kTop : static_cast<int64_t>(active.back()->unit);
    if (u.parent == kNotSeen) u.parent = parent;
    if (u.parent != parent) u.parent = kDisagree;
    if (!active.empty()) rec->enclosing = active.back();
    find_pair(*rec);
    const double t0 = timeline->now_us();
    note_exclusive(t0);
    in_trial = true;
    try {
      std::optional<ScopedHooks> quiet;
      if (!active.empty()) quiet.emplace(quiet_hooks());  // NOTE [units inside units]
      measure(u, inputs, run, menu, *rec);
    } catch (...) {
      in_trial = false;
      throw;
    }
    in_trial = false;
    const double t1 = timeline->now_us();
    trial_windows.push_back({t0, t1});
    rec->forward_begin_us = t1;
    u.calls.push_back(calls.size());
    calls.push_back(rec);
    return std::make_unique<ObservedCall>(*this, rec);
  }

  /** Builds u's menu at its first call (the selective levels from this
   *  call's residuals and op times), then measures every option. */
  void measure(Unit& u, const std::vector<at::Tensor>& inputs, const RunOption& run, const detail::ChainMenu* menu,
               CallRecord& rec) {
    if (u.menu.empty()) {
      if (menu != nullptr) {
        build_chain_menu(u, *menu);
      } else {
        build_menu(u, inputs, run);
      }
    }
    // One untimed run first (a call's first run pays for cold caches), then
    // the options in turn, `profile_repeats` times: bytes are exact from the
    // first run, the time is the fastest run's; taking the options in turn
    // spreads any drift of the machine over all of them.
    bool has_backward = true;
    Held retained;
    measure_one(u, inputs, run, Option{}, &has_backward, &retained);
    rec.costs.assign(u.menu.size(), plan::StepCost{});
    std::vector<Held> io_kept(u.menu.size());
    for (int r = 0; r < options.profile_repeats(); ++r) {
      for (size_t k = 0; k < u.menu.size(); ++k) {
        plan::StepCost cost;
        try {
          cost = measure_one(u, inputs, run, u.menu[k], &has_backward, &retained);
        } catch (const Error&) {
          // A chain called with another shape than its first call's, whose
          // schedules name stage options this call's chain lacks: it keeps.
          if (u.chain == nullptr || k == 0) throw;
          u.plannable = false;
        }
        if (r == 0) {
          rec.costs[k] = cost;
          io_kept[k] = retained;
        } else {
          rec.costs[k].time_ms = std::min(rec.costs[k].time_ms, cost.time_ms);
        }
      }
    }
    // NOTE [inputs an option keeps]: the costs count the call's inputs and
    // outputs as held by its caller. An option that keeps more of them than
    // keep does (a checkpoint keeps its inputs for the recompute, where
    // keep under autocast saves only their low-precision copies; a
    // selective policy keeps an output that keep does not save) is charged
    // the difference until its backward: the caller may let them go after
    // the forward. An option that keeps less is not credited (the caller
    // may hold them).
    // NOTE [released inputs]: which inputs each option lets go where keep holds them.
    rec.lets_go.assign(u.menu.size(), std::vector<char>(inputs.size(), 0));
    for (size_t k = 1; k < u.menu.size(); ++k) {
      for (size_t s = 0; s < inputs.size() && s < io_kept[k].held.size() && s < io_kept[0].held.size(); ++s) {
        rec.lets_go[k][s] = io_kept[0].held[s] && !io_kept[k].held[s] ? 1 : 0;
      }
    }
    // NOTE [inputs two calls hold]: and which outputs.
    const size_t outs = io_kept[0].held.size() > inputs.size() ? io_kept[0].held.size() - inputs.size() : 0;
    rec.out_lets_go.assign(u.menu.size(), std::vector<char>(outs, 0));
    for (size_t k = 1; k < u.menu.size(); ++k) {
      for (size_t o = 0; o < outs && inputs.size() + o < io_kept[k].held.size(); ++o) {
        rec.out_lets_go[k][o] = io_kept[0].held[inputs.size() + o] && !io_kept[k].held[inputs.size() + o] ? 1 : 0;
      }
    }
    for (size_t k = 1; k < u.menu.size(); ++k) {
      // Per input and output, so that keeping one does not offset letting
      // another go; an input is charged its whole storage (a view's base).
      int64_t extra = 0;
      std::vector<const c10::StorageImpl*> charged;
      const Held& h = io_kept[k];
      const Held& h0 = io_kept[0];
      for (size_t s = 0; s < h.held.size() && s < h0.held.size(); ++s) {
        if (!h.held[s] || h0.held[s]) continue;
        if (s < inputs.size()) {
          const at::Tensor& x = inputs[s];
          if (!x.defined() || !x.has_storage()) continue;
          const c10::StorageImpl* st = x.storage().unsafeGetStorageImpl();
          if (std::find(charged.begin(), charged.end(), st) != charged.end()) continue;
          charged.push_back(st);
          extra += static_cast<int64_t>(st->nbytes());
        } else {
          extra += h.bytes[s];
        }
      }
      rec.costs[k].kept_bytes += extra;
      rec.costs[k].backward_peak_bytes += extra;
    }
    if (!has_backward) u.plannable = false;
  }

  /** A chain's menu: store-all as keep, then its own planner's schedules. */
  void build_chain_menu(Unit& u, const detail::ChainMenu& menu) {
    for (detail::ChainOption& o : menu(kChainBudgets)) {
      Option opt;
      opt.name = u.menu.empty() ? "keep" : o.name;
      if (!u.menu.empty()) opt.schedule = std::move(o.schedule);
      u.menu.push_back(std::move(opt));
    }
    u.plannable = u.menu.size() > 1;
  }

  void build_menu(Unit& u, const std::vector<at::Tensor>& inputs, const RunOption& run) {
    u.menu.push_back({"keep", std::nullopt, std::nullopt});
    const CheckpointOptions& base = options.checkpoint_options();
    u.menu.push_back({"recompute", base, std::nullopt});
    if (options.inner_units() && !u.inner.empty())
      u.menu.push_back({"recompute, inner units too", base, std::nullopt, true});
    u.plannable = true;
    if (options.selective_levels() > 0) {
      // One run under an op timer: every op call's signature, output bytes and time.
      Restore restore;
      TrialInputs t = trial_inputs(inputs);
      detail::OpTimer timer;
      {
        dispatch::Scope scope(&timer);
        std::vector<at::Tensor> out = run(Option{}, t.in);
      }
      for (const Policy& level : detail::level_policies(timer.items(), options.selective_levels())) {
        CheckpointOptions o = base;
        o.policy(base.policy() ? policy::any_of({*base.policy(), level}) : level);
        u.menu.push_back({level.description(), o, std::nullopt});
      }
    }
    for (const Policy& p : options.policies()) {
      CheckpointOptions o = base;
      o.policy(base.policy() ? policy::any_of({*base.policy(), p}) : p);
      u.menu.push_back({p.description(), o, std::nullopt});
    }
    // Options that send to a store end the menu, those sending only inputs
    // first (the margin tiers of solve() drop them from the end).
    // Recompute with the inputs sent to the store: what it keeps is what
    // recompute keeps less its inputs, which it lets go once the caller
    // does (NOTE [released inputs]). Not for a unit inside another: a
    // region nested in another sends nothing (its inputs are the outer's).
    for (size_t i = 0; i < options.offload().size() && u.parent == kTop; ++i) {
      CheckpointOptions co = base;
      co.offload(options.offload()[i]);
      const std::string where = detail::offload_name(options.offload()[i]).substr(std::string("offload ").size());
      Option o("recompute, inputs to " + where, co, std::nullopt);
      o.store = static_cast<int>(i);
      u.menu.push_back(std::move(o));
    }
    for (size_t i = 0; i < options.offload().size(); ++i) {
      Option o(detail::offload_name(options.offload()[i]), std::nullopt, options.offload()[i]);
      o.store = static_cast<int>(i);
      u.menu.push_back(std::move(o));
    }
  }

  // NOTE [compressed bytes vary]: a lossless codec stores a tensor in as many
  // bytes as its values compress to. The isolated runs see the profiled
  // step's batch; another batch can compress worse (test_auto's blocks with
  // mostly-zero inputs: the zeros of a threshold move with the data, and a
  // planned step held 24% more in its lz4 store than the profiled one, 1.2%
  // over the budget). Options that keep bytes in a compressing store are
  // charged AutoOptions::compression_margin more of what they kept, from
  // their forward to their backward's end.

  /** One isolated run of a call under option `opt`: forward, then backward
   *  by autograd::grad. An offload option runs with one tensor in flight at
   *  a time (trial_store), so that its bytes do not depend on the disk's
   *  pace, and its time includes its writes (no overlap with compute
   *  assumed); what the real store holds in flight beyond that is the
   *  margin of solve(). */
  plan::StepCost measure_one(Unit& u, const std::vector<at::Tensor>& inputs, const RunOption& run, const Option& opt,
                             bool* has_backward, Held* io_kept) {
    Restore restore;
    TrialInputs t = trial_inputs(inputs);
    std::vector<at::Tensor> wrt = t.leaves;
    for (const auto& p : u.module->parameters()) {
      if (p.requires_grad()) wrt.push_back(p);
    }
    struct InnerOn {  // the inner units checkpointed for this run (nested recompute)
      Impl& impl;
      const std::vector<size_t>* inner = nullptr;
      ~InnerOn() {
        if (inner == nullptr) return;
        for (size_t i : *inner) impl.units[i].c->set_checkpointing(std::nullopt);
      }
    } inner_on{*this};
    if (opt.inner) {
      inner_on.inner = &u.inner;
      for (size_t i : u.inner) units[i].c->set_checkpointing(options.checkpoint_options());
    }
    plan::StepCost cost;
    // A plain offload option saves to a store of its own, whose counters
    // say what it held in flight (NOTE [offload margin measured]).
    std::shared_ptr<detail::OffloadStore> own_store;
    if (opt.offload && !is_recomputing()) own_store = detail::OffloadStore::create(trial_store(*opt.offload));
    detail::forget_rng_captures();  // a capture here is counted, not shared with the previous run's
    memory::Probe probe(mem->device());
    memory::DeviceTimer t0(mem->device());
    std::vector<at::Tensor> out;
    const bool sends = opt.offload || (opt.switch_state && opt.switch_state->offload());
    {
      std::optional<ScopedHooks> to_store;
      if (own_store) to_store.emplace(detail::make_offload_hooks(own_store));
      if (opt.switch_state && opt.switch_state->offload()) {
        Option trial = opt;
        trial.switch_state->offload(trial_store(*opt.switch_state->offload()));
        out = run(trial, t.in);
      } else {
        out = run(opt, t.in);
      }
    }
    if (own_store) own_store->wait();
    if (sends) wait_checkpoint_offloads();
    double ms = t0.elapsed_ms();
    cost.kept_bytes = std::max<int64_t>(0, probe.delta_bytes());
    cost.forward_peak_bytes = probe.peak_bytes();
    // What a compressing store holds depends on the batch (NOTE
    // [compressed bytes vary]): charged with a margin from its forward on.
    const OffloadOptions* store = opt.offload                                       ? &*opt.offload
                                  : opt.switch_state && opt.switch_state->offload() ? &*opt.switch_state->offload()
                                                                                    : nullptr;
    int64_t codec_extra = 0;
    if (store != nullptr && store->codec() != Codec::kNone && store->target() != OffloadTarget::kDisk) {
      codec_extra = static_cast<int64_t>(options.compression_margin() * static_cast<double>(cost.kept_bytes));
      cost.kept_bytes += codec_extra;
      cost.forward_peak_bytes += codec_extra;
    }
    // What the call holds of its inputs and outputs besides the references
    // here (NOTE [inputs an option keeps]).
    *io_kept = held_elsewhere(t.in, out);
    std::vector<at::Tensor> roots, grads_out;
    for (const auto& o : out) {
      if (o.defined() && o.requires_grad()) {
        roots.push_back(o);
        grads_out.push_back(at::ones_like(o));
      }
    }
    if (roots.empty() || wrt.empty()) {
      *has_backward = false;
      cost.backward_peak_bytes = cost.kept_bytes;
      cost.time_ms = ms;
      note_inflight(opt, own_store);
      return cost;
    }
    const int64_t at_backward = probe.delta_bytes();
    {
      memory::Probe backward(mem->device());
      t0.restart();
      std::vector<at::Tensor> grads = torch::autograd::grad(roots, wrt, grads_out, /*retain_graph=*/false,
                                                            /*create_graph=*/false, /*allow_unused=*/true);
      ms += t0.elapsed_ms();
      cost.backward_peak_bytes = std::max<int64_t>(0, at_backward + backward.peak_bytes()) + codec_extra;
    }
    cost.time_ms = ms;
    note_inflight(opt, own_store);
    return cost;
  }

  /** NOTE [offload margin measured]: the bytes an offload option's store
   *  held in flight in its isolated run (a tensor at a time: the largest
   *  entry it wrote or read back), per store. */
  void note_inflight(const Option& opt, const std::shared_ptr<detail::OffloadStore>& store) {
    if (!store || opt.store < 0 || static_cast<size_t>(opt.store) >= inflight_trial.size()) return;
    int64_t& seen = inflight_trial[static_cast<size_t>(opt.store)];
    seen = std::max(seen, store->stats().peak_inflight_bytes);
  }

  // --- the profiled step ----------------------------------------------------
  void profile(const std::function<void()>& fn) {
    calls.clear();
    trial_windows.clear();
    // NOTE [menus rebuilt]: a unit's menu is built at its first call of the
    // profiled step, from that call: its selective levels name the ops at
    // its shapes, and whether it has a backward depends on which parameters
    // train. A later profile (another batch size, parameters unfrozen)
    // builds every menu again; the menus in force come back if it throws,
    // so that they keep matching step_model.
    std::vector<std::pair<std::vector<Option>, bool>> menus_before;
    for (auto& u : units) {
      u.calls.clear();
      u.parent = kNotSeen;
      menus_before.emplace_back(std::move(u.menu), u.plannable);
      u.menu.clear();
      u.plannable = false;
    }
    try {
      profile_fresh(fn);
    } catch (...) {
      for (size_t i = 0; i < units.size(); ++i)
        std::tie(units[i].menu, units[i].plannable) = std::move(menus_before[i]);
      throw;
    }
  }

  void profile_fresh(const std::function<void()>& fn) {
    inflight_trial.assign(options.offload().size(), 0);
    mem = memory::source_for(memory::measured_device(model.parameters()));
    mem->enable();
    const int64_t start_bytes = mem->current_bytes();
    const Grads grads_start = grads_now();
    timeline_owner = mem->record();
    memory::Recording& tl = *timeline_owner;
    timeline = &tl;
    detail::UnitObserver* previous = detail::set_unit_observer(this);
    detail::ChainObserver* previous_chain = detail::set_chain_observer(this);
    struct Reset {
      Impl* self;
      detail::UnitObserver* previous;
      detail::ChainObserver* previous_chain;
      ~Reset() {
        detail::set_unit_observer(previous);
        detail::set_chain_observer(previous_chain);
        self->timeline = nullptr;
        self->timeline_owner.reset();
      }
    } reset{this, previous, previous_chain};
    // NOTE [released inputs]: the backward ops of the step (on this
    // thread: CPU graphs run backward on the caller's thread) are events too.
    t_profiling = this;
    const at::CallbackHandle backward_ops = at::addThreadLocalCallback(
        at::RecordFunctionCallback([](const at::RecordFunction&) -> std::unique_ptr<at::ObserverContext> {
          if (t_profiling != nullptr) t_profiling->note_backward_op();
          return nullptr;
        })
            .scopes({at::RecordScope::BACKWARD_FUNCTION})
            .needsInputs(false));
    struct Unhook {
      at::CallbackHandle handle;
      ~Unhook() {
        at::removeCallback(handle);
        t_profiling = nullptr;
      }
    } unhook{backward_ops};
    const double begin_us = tl.now_us();
    fn();
    const double end_us = tl.now_us();
    tl.stop();
    // NOTE [what the profiled step leaves behind]
    grown = std::max<int64_t>(0, mem->current_bytes() - start_bytes);
    grown_everywhere = grown;
    if (grown > 0) {
      const Grads grads_end = grads_now();
      bool freed = false;  // a gradient of the step's start was freed in it: they are made anew each step
      for (const auto& g : grads_start.storages) freed |= g.expired();
      if (freed) grown_everywhere = std::max<int64_t>(0, grown - (grads_end.bytes - grads_start.bytes));
    }
    build_model(tl, start_bytes, begin_us, end_us);
  }

  // NOTE [what the profiled step leaves behind]: a step that ends holding
  // more than it started with (the first step ever: the optimizer's state
  // that its first step() creates, the parameters' gradients; or the state
  // of parameters just unfrozen) differs from every later step, which holds
  // that from its start. Its growth (bytes live at its end less at its
  // start) is counted at every point of the step: a later step holds at
  // most what the profiled one held there plus the growth (the state of
  // the profiled step made in place or anew, never both). Where the step
  // freed a gradient it started with (zero_grad(set_to_none)), gradients
  // are made anew each step at the point the profiled step made them: the
  // growth in gradients is then counted only before the first unit call,
  // where zero_grad runs. A step that started with no gradient at all
  // cannot tell, and counts them everywhere (a bound, not the least one:
  // a warm-up step, AutoOptions::warmup_steps, gives the exact profile).
  int64_t grown = 0;             // bytes live at the profiled step's end less at its start, >= 0
  int64_t grown_everywhere = 0;  // of those, counted at every point (the rest before the first unit call)

  struct Grads {
    int64_t bytes = 0;
    std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> storages;
  };
  /** The model's parameters' gradients now: their bytes, and their storages. */
  Grads grads_now() const {
    Grads g;
    for (const auto& p : model.parameters()) {
      const at::Tensor& grad = p.grad();
      if (!grad.defined() || !grad.has_storage()) continue;
      g.bytes += static_cast<int64_t>(grad.storage().nbytes());
      g.storages.push_back(grad.storage().getWeakStorageImpl());
    }
    return g;
  }

  void build_model(const memory::Recording& tl, int64_t start_bytes, double begin_us, double end_us) {
    // Samples outside the isolated runs.
    samples.clear();
    size_t w = 0;
    for (const memory::Sample& s : tl.samples()) {
      while (w < trial_windows.size() && s.time_us > trial_windows[w].second) ++w;
      if (w < trial_windows.size() && s.time_us >= trial_windows[w].first) continue;
      samples.push_back(s);
    }
    double trials_ms = 0;
    for (const auto& [a, b] : trial_windows) trials_ms += (b - a) / 1000.0;
    // The isolated runs slow the step around them (caches): a plain
    // warm-up step, when one ran, times the plain step better.
    profiled_ms = (end_us - begin_us) / 1000.0 - trials_ms;
    if (warmup_ms > 0) profiled_ms = std::min(profiled_ms, warmup_ms);

    // Segment boundaries: the step's ends and every window's ends.
    points_us = {begin_us, end_us};
    largest_input_sent = 0;
    for (const auto& c : calls) {
      if (c->forward_end_us < 0) c->forward_end_us = c->forward_begin_us;  // threw: never here
      if (c->first_unpack_us < 0) c->first_unpack_us = c->last_unpack_us = c->forward_end_us;
      for (double t : {c->forward_begin_us, c->forward_end_us, c->first_unpack_us, c->last_unpack_us}) {
        points_us.push_back(t);
      }
      // NOTE [released inputs]: from when every input that some option
      // lets go (and that the step saw held only by this call) is free to go.
      // The credit ends at the earliest last sighting of such an input
      // alive in the call's backward (keep may free it there).
      c->release_us = c->release_end_us = -1;
      for (size_t i = 0; i < c->exclusive_us.size(); ++i) {
        bool let_go = false;
        for (const auto& k : c->lets_go) let_go |= i < k.size() && k[i];
        if (!let_go || c->exclusive_us[i] < 0) continue;
        c->release_us = std::max(c->release_us, c->exclusive_us[i]);
        const double alive = std::max(c->alive_us[i], c->first_unpack_us);
        c->release_end_us = c->release_end_us < 0 ? alive : std::min(c->release_end_us, alive);
      }
      if (c->release_us >= 0 && c->forward_end_us <= c->first_unpack_us) {
        c->release_us = std::clamp(c->release_us, c->forward_end_us, c->first_unpack_us);
        c->release_end_us = std::clamp(c->release_end_us, c->first_unpack_us, c->last_unpack_us);
        points_us.push_back(c->release_us);
        points_us.push_back(c->release_end_us);
      } else {
        c->release_us = c->release_end_us = -1;
      }
      // NOTE [inputs two calls hold]: from when only the two hold it.
      if (c->pair && c->pair_us >= 0 && c->exclusive_us[c->pair_slot] < 0 && c->forward_end_us <= c->first_unpack_us) {
        c->pair_us = std::clamp(c->pair_us, c->forward_end_us, c->first_unpack_us);
        points_us.push_back(c->pair_us);
      } else {
        c->pair_us = -1;
      }
      c->packs.clear();  // the weak references are needed no more
      c->out_packs.clear();
      // The largest input of a unit that may send its inputs to a store.
      bool sends_inputs = false;
      for (const Option& o : units[c->unit].menu) sends_inputs |= o.store >= 0 && o.switch_state.has_value();
      if (sends_inputs) {
        for (int64_t b : c->input_bytes) largest_input_sent = std::max(largest_input_sent, b);
      }
    }
    std::sort(points_us.begin(), points_us.end());
    points_us.erase(std::unique(points_us.begin(), points_us.end()), points_us.end());
    auto at = [&](double t) {
      return static_cast<int64_t>(std::lower_bound(points_us.begin(), points_us.end(), t) - points_us.begin());
    };
    const size_t segments = points_us.size() - 1;
    plan::StepModel m;
    m.step_time_ms = profiled_ms;
    m.segment_peak_bytes.assign(segments, 0);
    int64_t level = start_bytes;
    size_t k = 0;
    for (size_t s = 0; s < segments; ++s) {
      int64_t peak = level;
      while (k < samples.size() && samples[k].time_us < points_us[s + 1]) {
        if (samples[k].time_us >= points_us[s]) peak = std::max(peak, samples[k].bytes);
        level = samples[k].bytes;
        ++k;
      }
      m.segment_peak_bytes[s] = peak;
    }
    // NOTE [what the profiled step leaves behind]
    for (size_t s = 0; s < segments; ++s) {
      m.segment_peak_bytes[s] += s == 0 ? grown : grown_everywhere;
    }
    profiled_peak = 0;
    for (int64_t p : m.segment_peak_bytes) profiled_peak = std::max(profiled_peak, p);

    std::vector<int64_t> model_index(units.size(), -1);
    std::vector<size_t> now_modeled;
    std::vector<std::vector<double>> now_input_bytes;
    for (size_t i = 0, j = 0; i < units.size(); ++i) {
      if (units[i].calls.empty()) continue;
      model_index[i] = static_cast<int64_t>(j++);
      now_modeled.push_back(i);
      now_input_bytes.emplace_back();
      for (size_t ci : units[i].calls) {
        const CallRecord& r = *calls[ci];
        double bytes = 0;
        for (size_t x = 0; x < r.input_ids.size(); ++x) {
          const auto first = std::find(r.input_ids.begin(), r.input_ids.end(), r.input_ids[x]);
          if (r.input_ids[x] != nullptr && first == r.input_ids.begin() + static_cast<int64_t>(x)) {
            bytes += static_cast<double>(r.input_bytes[x]);
          }
        }
        now_input_bytes.back().push_back(bytes);
      }
    }
    // NOTE [inputs two calls hold]: the earlier call c shares its input
    // with, and that call's output slot, or null. An inner call's output
    // that the calls around it return as theirs is theirs too: the pair is
    // the outermost plannable one, whose recompute or offload lets go of
    // it (while the inner call's choice is then moot) and which keeps a
    // chain of blocks a chain for the solver.
    auto pair_of = [&](const CallRecord& c) {
      std::pair<const CallRecord*, size_t> found{nullptr, 0};
      if (c.pair_us < 0 || c.pair == nullptr) return found;
      const c10::StorageImpl* st = c.pair->output_ids[c.pair_out];
      size_t out = c.pair_out;
      for (const CallRecord* r = c.pair.get(); r != nullptr; r = r->enclosing.get()) {
        if (r != c.pair.get()) {
          const auto o = std::find(r->output_ids.begin(), r->output_ids.end(), st);
          // Not its output, or a call around c too (its forward goes on).
          if (o == r->output_ids.end() || r->forward_end_us > c.forward_begin_us) break;
          out = static_cast<size_t>(o - r->output_ids.begin());
          if (!units[r->unit].plannable) continue;
        }
        if (model_index[r->unit] >= 0 && r->out_lets_go.size() == units[r->unit].menu.size()) found = {r, out};
      }
      return found;
    };
    for (size_t i = 0; i < units.size(); ++i) {
      Unit& u = units[i];
      if (u.calls.empty()) continue;
      plan::StepUnit su;
      su.name = shown(u.name);
      su.parent = u.parent >= 0 ? model_index[static_cast<size_t>(u.parent)] : -1;
      u.offered.clear();
      for (size_t k = 0; k < u.menu.size(); ++k) {
        // "inner units too" switches them on wherever they run: offered only
        // when each of them runs inside this unit alone.
        if (u.menu[k].inner && !inner_calls_inside(i)) continue;
        u.offered.push_back(k);
        su.options.push_back(u.menu[k].name);
      }
      // Not plannable, or called inside different units (or inside a unit
      // that is, whose options were measured with it plain): kept.
      bool disagrees = u.parent == kDisagree;
      for (int64_t a = u.parent; a >= 0 && !disagrees; a = units[static_cast<size_t>(a)].parent) {
        disagrees = units[static_cast<size_t>(a)].parent == kDisagree;
      }
      if (!u.plannable || disagrees) {
        su.options.resize(1);
        u.offered.resize(1);
      }
      for (size_t ci : u.calls) {
        const CallRecord& c = *calls[ci];
        plan::StepCall sc;
        sc.forward_begin = at(c.forward_begin_us);
        sc.forward_end = at(c.forward_end_us);
        sc.backward_begin = at(c.first_unpack_us);
        sc.backward_end = at(c.last_unpack_us);
        for (size_t k : u.offered) {
          plan::StepCost cost = c.costs[k];
          if (c.release_us >= 0) {  // what it lets go of the inputs held only here, each storage once
            std::vector<const c10::StorageImpl*> counted;
            for (size_t i = 0; i < c.exclusive_us.size(); ++i) {
              if (!c.lets_go[k][i] || c.exclusive_us[i] < 0 || c.input_ids[i] == nullptr) continue;
              if (std::find(counted.begin(), counted.end(), c.input_ids[i]) != counted.end()) continue;
              counted.push_back(c.input_ids[i]);
              cost.released_bytes += c.input_bytes[i];
            }
          }
          sc.costs.push_back(cost);
        }
        if (c.release_us >= 0) {
          sc.release_begin = at(c.release_us);
          sc.release_end = at(c.release_end_us);
        }
        const auto [other, other_out] = pair_of(c);
        const Unit& a = units[other != nullptr ? other->unit : 0];
        const auto pos =
            std::find_if(a.calls.begin(), a.calls.end(), [&](size_t ci2) { return calls[ci2].get() == other; });
        if (other != nullptr && pos != a.calls.end()) {
          sc.pair_unit = model_index[other->unit];
          sc.pair_call = pos - a.calls.begin();
          sc.pair_bytes = c.input_bytes[c.pair_slot];
          sc.pair_begin = at(c.pair_us);
          for (size_t k : u.offered) sc.pair_lets_go.push_back(c.lets_go[k][c.pair_slot] != 0);
          // Per option of the earlier unit's menu (its offered ones below).
          for (size_t k = 0; k < a.menu.size(); ++k) {
            sc.pair_other_lets_go.push_back(other_out < other->out_lets_go[k].size() &&
                                            other->out_lets_go[k][other_out] != 0);
          }
        }
        su.calls.push_back(std::move(sc));
      }
      m.units.push_back(std::move(su));
    }
    // The earlier calls' flags, from their unit's menu to its offered options.
    for (auto& su : m.units) {
      for (auto& sc : su.calls) {
        if (sc.pair_unit < 0) continue;
        const Unit& a = units[now_modeled[static_cast<size_t>(sc.pair_unit)]];
        std::vector<bool> flags;
        for (size_t k : a.offered) flags.push_back(sc.pair_other_lets_go[k]);
        sc.pair_other_lets_go = std::move(flags);
      }
    }
    step_model = std::move(m);
    surcharge_ms_per_byte.assign(options.offload().size(), 0.0);  // fresh prices: nothing added
    offload_ms_per_gib = 0;
    transfer_price.reset();
    modeled = std::move(now_modeled);
    input_bytes_of = std::move(now_input_bytes);
    inflight_seen = inflight_trial;
  }

  /** True when every inner unit of units[i] that ran in the profiled step
   *  ran only inside units[i] (at any depth). */
  bool inner_calls_inside(size_t i) const {
    for (size_t d : units[i].inner) {
      if (units[d].calls.empty()) continue;
      int64_t a = units[d].parent;
      while (a >= 0 && static_cast<size_t>(a) != i) a = units[static_cast<size_t>(a)].parent;
      if (a < 0) return false;
    }
    return true;
  }

  /** Units of the step model, in model order, as indices into units. */
  std::vector<size_t> model_units() const { return modeled; }

  /** The store an offload option's isolated runs use: the option's, with
   *  at most one tensor in flight (the forward waits for each write). */
  static OffloadOptions trial_store(OffloadOptions o) {
    if (o.target() == OffloadTarget::kDisk) o.max_inflight_bytes(1);
    return o;
  }

  /** Bytes the offload stores may hold in flight at once (pending writes,
   *  reads ahead), beyond what the isolated runs measured: each kDisk
   *  store's max_inflight_bytes, or the largest entry it held in flight,
   *  which a store lets go alone (NOTE [offload margin measured]); with
   *  inputs_only (plans whose units send only their inputs), of the inputs. */
  int64_t inflight_margin(bool inputs_only = false) const {
    int64_t m = 0;
    for (size_t i = 0; i < options.offload().size(); ++i) {
      const OffloadOptions& o = options.offload()[i];
      if (o.target() != OffloadTarget::kDisk) continue;
      const int64_t seen = i < inflight_seen.size() ? inflight_seen[i] : 0;
      m += std::max(o.max_inflight_bytes(), inputs_only ? largest_input_sent : std::max(largest_input_sent, seen));
    }
    return m;
  }

  // NOTE [offload margin measured]: a disk store holds a tensor from its
  // save until its file is written, and a read from its prefetch until its
  // unpack: at most max_inflight_bytes at once, or one entry alone when it
  // is larger. The entries are what the store takes: the saved activations
  // (a view's dense base), not the parameters, which it keeps where they
  // are. The largest one is measured, not guessed from the largest tensor a
  // unit saves (a 4 MiB weight where the largest activation is 8 KiB): each
  // plain offload option's isolated runs save to a store of their own with
  // one entry in flight at a time, whose counters give the largest entry it
  // wrote or read back. Options that send a unit's inputs send those
  // storages whole (largest_input_sent).

  /** The plans solve() compares: without options that send to a store (no
   *  margin); with those sending only inputs (the inputs' margin); with
   *  every option (the whole margin). */
  struct Tier {
    plan::StepModel model;
    int64_t margin = 0;
  };
  std::vector<Tier> tiers() const {
    const int64_t all = inflight_margin(), inputs = inflight_margin(/*inputs_only=*/true);
    if (all == 0) return {{step_model, 0}};
    return {
        {without_offload(/*plain_only=*/false), 0}, {without_offload(/*plain_only=*/true), inputs}, {step_model, all}};
  }

  /** The store an option of step-model unit j sends to (an index in
   *  options.offload()), or -1. */
  int store_of(size_t j, size_t k) const {
    const Unit& u = units[model_units()[j]];
    return u.menu[u.offered[k]].store;
  }

  /** The step model with the options that send to a store left out (they
   *  end each menu), or with plain_only those that send what the unit saves
   *  (they end it). */
  plan::StepModel without_offload(bool plain_only = false) const {
    plan::StepModel m = step_model;
    const std::vector<size_t> mu = model_units();
    for (size_t j = 0; j < m.units.size(); ++j) {
      const Unit& unit = units[mu[j]];
      size_t n = m.units[j].options.size();
      while (n > 1 && (plain_only ? unit.menu[unit.offered[n - 1]].offload.has_value() : store_of(j, n - 1) >= 0)) --n;
      plan::truncate_options(m, j, n);
    }
    return m;
  }

  /** The fastest plan whose predicted peak fits target. Plans that offload
   *  through a disk store must fit with the stores' in-flight bytes added
   *  (inflight_margin), so that bound holds whatever the disk's pace. */
  plan::StepPlan solve(int64_t target) {
    const plan::StepSolveOptions so{options.solver_time_limit_s()};
    std::optional<plan::StepPlan> best;
    for (const Tier& t : tiers()) {
      if (target <= t.margin) continue;
      try {
        plan::StepPlan p = plan::solve_step(t.model, target - t.margin, so);
        p.budget_bytes = target;
        if (!best || p.prediction.time_ms < best->prediction.time_ms) {
          best = std::move(p);
          plan_margin = t.margin;
        }
      } catch (const Error&) {
      }
    }
    if (best) return *best;
    const Leanest low = leanest();
    std::ostringstream limit;
    limit << options.solver_time_limit_s();
    throw Error("[remat::auto] no plan of the step fits in " + plan::format_bytes(target) + "; the smallest " +
                (low.proven ? "feasible peak is " : "peak found is ") + plan::format_bytes(low.peak) + ", reached " +
                plan::describe_segment(step_model, low.segment) +
                (low.margin > 0
                     ? " (with " + plan::format_bytes(low.margin) + " for offload writes and reads in flight)"
                     : std::string()) +
                (low.proven ? std::string()
                            : "; the solver stopped at its time limit of " + limit.str() +
                                  " s: a longer solver_time_limit_s may find a leaner plan") +
                ". Raise the memory budget to at least that, or make what runs there smaller (fewer tokens or "
                "images per step).");
  }

  struct Leanest {
    int64_t peak = 0, segment = 0;
    int64_t margin = 0;   // the in-flight margin of the plan that reaches it (included)
    bool proven = false;  // the solver proved it least (else it stopped at its time limit)
  };
  /** The smallest peak a plan reaches, its in-flight margin included. */
  Leanest leanest() const {
    const plan::StepSolveOptions so{options.solver_time_limit_s()};
    std::optional<Leanest> best;
    for (const Tier& t : tiers()) {
      const plan::StepPlan lean = plan::min_peak_step(t.model, so);
      const plan::StepPrediction& p = lean.prediction;
      if (!best || p.peak_bytes + t.margin < best->peak)
        best = Leanest{p.peak_bytes + t.margin, p.peak_segment, t.margin, lean.optimal};
    }
    return *best;
  }

  void solve_and_apply(int64_t target) {
    transfer_price.restart();  // a new plan: its own steps count
    step_plan = solve(target);
    planned = true;
    apply();
  }

  void apply() {
    switch_off();
    const std::vector<size_t> mu = model_units();
    for (size_t j = 0; j < mu.size(); ++j) {
      Unit& u = units[mu[j]];
      const Option& o = u.menu[u.offered[static_cast<size_t>(step_plan.prediction.choice[j])]];
      if (u.chain != nullptr) {
        auto forced = std::make_shared<detail::ForcedSchedule>();
        forced->store_all = !o.schedule.has_value();
        if (o.schedule) forced->schedule = *o.schedule;
        detail::ChainAccess::force(*u.chain, std::move(forced));
        continue;
      }
      u.c->set_checkpointing(o.switch_state);
      u.c->set_offloading(o.offload);
    }
    // Nested recompute: the inner units are at option 0 (the nesting rule).
    for (size_t j = 0; j < mu.size(); ++j) {
      const Unit& u = units[mu[j]];
      if (!u.menu[u.offered[static_cast<size_t>(step_plan.prediction.choice[j])]].inner) continue;
      for (size_t i : u.inner) units[i].c->set_checkpointing(options.checkpoint_options());
    }
  }

  /** Every unit plain: no recompute, nothing offloaded. */
  void switch_off() {
    for (auto& u : units) {
      if (u.chain != nullptr) {
        detail::ChainAccess::force(*u.chain, std::make_shared<detail::ForcedSchedule>());  // store-all
        continue;
      }
      u.c->set_checkpointing(std::nullopt);
      u.c->set_offloading(std::nullopt);
    }
  }

  /** NOTE [offload priced by the step]: an isolated run writes and reads
   *  one call's tensors through a warm page cache; a real step sends every
   *  offloaded unit's at once, and a disk (or a machine whose fresh pages
   *  are slow) can take far longer for that. When a planned step that
   *  offloads runs more than 10% over its predicted time, the excess is
   *  charged to the offload options the plan uses, per byte they send (what
   *  keep would have kept less what the option keeps), on every call of
   *  every unit, and the plan is solved again: the step measures the transfer
   *  bandwidth that the isolated runs could not. Two steps in a row that
   *  offload and run more than 10% under the prediction give the charge
   *  back, down to no surcharge at most (plan::TransferPrice has the rule,
   *  which CheckpointedSequential shares). The isolated runs' own prices (no
   *  overlap assumed: upper ones) are never lowered. Returns true when it
   *  repriced. */
  bool reprice_offload(double step_ms) {
    const plan::StepPrediction& p = step_plan.prediction;
    if (options.offload().empty()) return false;
    const std::vector<size_t> mu = model_units();
    // Bytes option k of unit j sends per call: its inputs when it recomputes
    // (each storage once), else what keep would keep less what it keeps.
    auto sent_by = [&](size_t j, size_t ci, size_t k) -> double {
      const Unit& u = units[mu[j]];
      const plan::StepCall& c = step_model.units[j].calls[ci];
      if (!u.menu[u.offered[k]].switch_state) {
        return static_cast<double>(std::max<int64_t>(0, c.costs[0].kept_bytes - c.costs[k].kept_bytes));
      }
      return input_bytes_of[j][ci];
    };
    double sent = 0;                                          // bytes the plan's offloading calls send
    std::vector<bool> used(options.offload().size(), false);  // which of options.offload() the plan uses
    for (size_t j = 0; j < step_model.units.size(); ++j) {
      const size_t k = static_cast<size_t>(p.choice[j]);
      const int store = store_of(j, k);
      if (store < 0) continue;
      used[static_cast<size_t>(store)] = true;
      for (size_t ci = 0; ci < step_model.units[j].calls.size(); ++ci) sent += sent_by(j, ci, k);
    }
    // The smallest surcharge in force on a store in use: what a give-back
    // may take back at most.
    double room = std::numeric_limits<double>::infinity();
    for (size_t st = 0; st < used.size(); ++st) {
      if (used[st]) room = std::min(room, surcharge_ms_per_byte[st]);
    }
    const double per_byte = transfer_price.observe(step_ms, p.time_ms, sent, std::isfinite(room) ? room : 0.0);
    if (per_byte == 0) return false;
    for (size_t j = 0; j < step_model.units.size(); ++j) {
      plan::StepUnit& su = step_model.units[j];
      for (size_t k = 1; k < su.options.size(); ++k) {
        const int store = store_of(j, k);
        if (store < 0 || !used[static_cast<size_t>(store)]) continue;
        for (size_t ci = 0; ci < su.calls.size(); ++ci) su.calls[ci].costs[k].time_ms += per_byte * sent_by(j, ci, k);
      }
    }
    for (size_t s = 0; s < used.size(); ++s) {
      if (used[s]) surcharge_ms_per_byte[s] = std::max(0.0, surcharge_ms_per_byte[s] + per_byte);
    }
    offload_ms_per_gib = *std::max_element(surcharge_ms_per_byte.begin(), surcharge_ms_per_byte.end()) *
                         static_cast<double>(int64_t{1} << 30);
    ++reprices;
    return true;
  }

  void measured_step(const std::function<void()>& fn) {
    mem->enable();
    mem->reset_peak();
    memory::DeviceTimer t0(mem->device());
    fn();
    measured_ms = t0.elapsed_ms();
    measured_peak = mem->peak_bytes();
    const bool overrun = static_cast<double>(measured_peak) > 1.01 * static_cast<double>(budget);
    if (overrun) transfer_price.restart();
    if (!overrun && reprice_offload(measured_ms)) {
      try {
        solve_and_apply(step_plan.budget_bytes);
      } catch (const Error&) {
        // The plan in force stays.
      }
      return;
    }
    if (options.replan_on_overrun() && overrun) {
      const int64_t excess = measured_peak - budget;
      const int64_t target = step_plan.budget_bytes - excess;
      try {
        solve_and_apply(target);
        ++replans;
      } catch (const Error&) {
        // NOTE [overruns reported]: nothing fits a lower target. The plan
        // in force stays, and the user hears of it: the budget is a bound
        // on the measured peak, and this step broke it.
        const int64_t low = leanest().peak;
        const std::string report =
            std::string("[remat::auto] the planned step's measured peak was ") + plan::format_bytes(measured_peak) +
            ", " + plan::format_bytes(excess) + " over the budget of " + plan::format_bytes(budget) +
            ", and no plan of the profiled step fits the budget lowered by that (" + plan::format_bytes(target) +
            "; the smallest feasible peak is " + plan::format_bytes(low) +
            "). The step ran and its update stands; the plan in force stays. Give replan() a budget of at "
            "least " +
            plan::format_bytes(low + excess) +
            ", or profile a step that holds what every later step holds (profile_step(), "
            "AutoOptions::warmup_steps).";
        overrun_reports.push_back(report);
        if (options.overrun_throws()) throw Error(report);
        TORCH_WARN(report);
      }
    }
  }
};

namespace {
std::string fmt_ms(double ms) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f ms", ms);
  return b;
}
std::string fmt_pct(double x) {
  char b[32];
  std::snprintf(b, sizeof b, "%+.1f%%", 100 * x);
  return b;
}
}  // namespace

AutoCheckpoint::AutoCheckpoint(torch::nn::Module& model, AutoOptions options)
    : impl_(std::make_unique<Impl>(model, std::move(options))) {
  const AutoOptions& o = impl_->options;
  if (o.memory_budget_bytes() < 0) {
    throw Error("[remat::auto] memory_budget_bytes is " + std::to_string(o.memory_budget_bytes()) +
                "; give a positive number of bytes, or 0 to use memory_budget_fraction.");
  }
  if (o.memory_budget_bytes() == 0 && !(o.memory_budget_fraction() > 0 && o.memory_budget_fraction() <= 1)) {
    throw Error("[remat::auto] no budget: memory_budget_bytes is 0 and memory_budget_fraction is " +
                std::to_string(o.memory_budget_fraction()) +
                "; give AutoOptions().memory_budget_bytes(b) or memory_budget_fraction(f) with f in (0, 1].");
  }
  if (o.selective_levels() < 0 || o.warmup_steps() < 0 || o.profile_repeats() < 1 || !(o.solver_time_limit_s() > 0)) {
    throw Error("[remat::auto] selective_levels " + std::to_string(o.selective_levels()) + ", warmup_steps " +
                std::to_string(o.warmup_steps()) + ", profile_repeats " + std::to_string(o.profile_repeats()) +
                ", solver_time_limit_s " + std::to_string(o.solver_time_limit_s()) +
                ": the first two must be >= 0, profile_repeats >= 1 and the time limit > 0.");
  }
  if (!(o.compression_margin() >= 0) || !std::isfinite(o.compression_margin())) {
    throw Error("[remat::auto] compression_margin " + std::to_string(o.compression_margin()) +
                " must be a finite number >= 0 (the share added to what a compressing store held in the profiled "
                "step; default 0.5).");
  }
  for (size_t k = 0; k < o.offload().size(); ++k) {
    const OffloadOptions& off = o.offload()[k];
    const std::string which = "[remat::auto] offload option " + std::to_string(k) + " (" + to_string(off.target()) +
                              ", codec " + to_string(off.codec()) + ")";
    detail::check_menu_offload(which, off, /*on_cpu=*/true);
  }
  std::unordered_map<const torch::nn::Module*, bool> seen;
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    torch::nn::Module* m = item.value().get();
    auto* c = dynamic_cast<Checkpointable*>(m);
    auto* chain = dynamic_cast<CheckpointedSequentialImpl*>(m);
    if ((c == nullptr && chain == nullptr) || !seen.emplace(m, true).second) continue;
    Unit u;
    u.name = item.key();
    u.c = c;
    u.module = m;
    if (chain != nullptr) {
      if (detail::ChainAccess::step_budget(*chain) > 0) {
        throw Error("[remat::auto] the CheckpointedSequential '" + shown(item.key()) +
                    "' has a step budget (step_memory_budget_bytes " +
                    std::to_string(detail::ChainAccess::step_budget(*chain)) +
                    "), and the whole-step planner plans its schedule under the planner's own budget; build it "
                    "without step_memory_budget_bytes.");
      }
      u.c = nullptr;
      u.chain = chain;
      u.module = chain->sequential().ptr().get();  // a chain over several Sequentials registers none of them
      impl_->chain_index[chain] = impl_->units.size();
    } else {
      impl_->index[c] = impl_->units.size();
    }
    impl_->units.push_back(std::move(u));
  }
  for (Unit& u : impl_->units) {
    if (u.chain != nullptr) continue;  // what runs inside a chain runs as its schedule says
    // Not below a chain: what runs inside one runs as its schedule says.
    std::vector<const torch::nn::Module*> in_chains;
    for (const auto& sub : u.module->modules(/*include_self=*/false)) {
      if (auto* chain = dynamic_cast<CheckpointedSequentialImpl*>(sub.get())) {
        for (const auto& m : chain->sequential()->modules(/*include_self=*/true)) in_chains.push_back(m.get());
      }
    }
    for (const auto& sub : u.module->modules(/*include_self=*/false)) {
      if (std::find(in_chains.begin(), in_chains.end(), sub.get()) != in_chains.end()) continue;
      auto* c = dynamic_cast<Checkpointable*>(sub.get());
      auto it = c == nullptr ? impl_->index.end() : impl_->index.find(c);
      if (it != impl_->index.end() && std::find(u.inner.begin(), u.inner.end(), it->second) == u.inner.end()) {
        u.inner.push_back(it->second);
      }
    }
  }
  if (impl_->units.empty()) {
    throw Error("[remat::auto] the model (" + model.name() +
                ") has no Checkpointable module and no CheckpointedSequential: the planner's units are modules "
                "deriving from remat::Checkpointable whose forward calls checkpointed(), and chains.");
  }
  // Counted from here on: the warm-up's gradients and optimizer state are
  // then in every step's figures, the profiled one's included.
  memory::enable_tracking();
  // The planner owns the switches: every unit runs plain until planned
  // (NOTE [switches given back]).
  impl_->note_switches();
  impl_->switch_off();
}

AutoCheckpoint::~AutoCheckpoint() = default;
AutoCheckpoint::AutoCheckpoint(AutoCheckpoint&&) noexcept = default;
AutoCheckpoint& AutoCheckpoint::operator=(AutoCheckpoint&&) noexcept = default;

void AutoCheckpoint::step(const std::function<void()>& fn) {
  Impl& m = *impl_;
  if (m.planned) {
    m.measured_step(fn);
  } else if (m.steps_run < m.options.warmup_steps()) {
    memory::DeviceTimer t0(memory::measured_device(m.model.parameters()));
    fn();
    m.warmup_ms = t0.elapsed_ms();
    ++m.steps_run;
  } else {
    profile_step(fn);
  }
}

void AutoCheckpoint::profile_step(const std::function<void()>& fn) {
  Impl& m = *impl_;
  m.switch_off();
  m.planned = false;
  m.profile(fn);
  ++m.steps_run;
  if (m.step_model.units.empty()) {
    throw Error("[remat::auto] the profiled step called none of the model's " + std::to_string(m.units.size()) +
                " units (Checkpointable modules and chains) with grad enabled (first: '" + shown(m.units[0].name) +
                "'); run the step function that trains this model, with its Checkpointable modules' forward routed "
                "through checkpointed().");
  }
  m.budget = m.options.memory_budget_bytes() > 0
                 ? m.options.memory_budget_bytes()
                 : static_cast<int64_t>(m.options.memory_budget_fraction() * static_cast<double>(m.profiled_peak));
  m.solve_and_apply(m.budget);
}

void AutoCheckpoint::replan(int64_t budget_bytes) {
  Impl& m = *impl_;
  if (m.step_model.units.empty()) {
    throw Error("[remat::auto] replan(" + std::to_string(budget_bytes) +
                ") before a profiled step; run step() (or profile_step()) first.");
  }
  if (budget_bytes <= 0) {
    throw Error("[remat::auto] replan(" + std::to_string(budget_bytes) + "): give a positive budget in bytes.");
  }
  m.solve_and_apply(budget_bytes);
  m.budget = budget_bytes;
  m.measured_peak = -1;
  m.measured_ms = -1;
}

void AutoCheckpoint::apply() {
  if (!impl_->planned) throw Error("[remat::auto] apply() before a plan exists; run step() until planned().");
  impl_->apply();
}

bool AutoCheckpoint::planned() const { return impl_->planned; }
int64_t AutoCheckpoint::leanest_peak_bytes() const {
  if (impl_->step_model.units.empty()) {
    throw Error("[remat::auto] leanest_peak_bytes() before a profiled step; run step() (or profile_step()) first.");
  }
  return impl_->leanest().peak;
}
int64_t AutoCheckpoint::budget_bytes() const { return impl_->budget; }
const plan::StepModel& AutoCheckpoint::step_model() const { return impl_->step_model; }
const plan::StepPlan& AutoCheckpoint::plan() const { return impl_->step_plan; }
int64_t AutoCheckpoint::profiled_peak_bytes() const { return impl_->profiled_peak; }
double AutoCheckpoint::profiled_time_ms() const { return impl_->profiled_ms; }
int64_t AutoCheckpoint::inflight_bytes() const {
  const Impl& m = *impl_;
  if (m.step_plan.budget_bytes == 0 || m.plan_margin <= 0) return 0;
  const std::vector<AutoUnit> us = units();
  for (size_t j = 0; j < us.size(); ++j) {
    const int store = m.store_of(j, static_cast<size_t>(us[j].choice));
    if (store >= 0 && m.options.offload()[static_cast<size_t>(store)].target() == OffloadTarget::kDisk) {
      return m.plan_margin;
    }
  }
  return 0;
}

int64_t AutoCheckpoint::measured_peak_bytes() const { return impl_->measured_peak; }
double AutoCheckpoint::measured_time_ms() const { return impl_->measured_ms; }
int AutoCheckpoint::replans() const { return impl_->replans; }

std::vector<std::string> AutoCheckpoint::overruns() const { return impl_->overrun_reports; }

std::vector<AutoUnit> AutoCheckpoint::units() const {
  const Impl& m = *impl_;
  std::vector<AutoUnit> out;
  const std::vector<size_t> mu = m.model_units();
  for (size_t j = 0; j < mu.size(); ++j) {
    const plan::StepUnit& su = m.step_model.units[j];
    AutoUnit a;
    a.name = su.name;
    a.calls = static_cast<int64_t>(su.calls.size());
    a.options = su.options;
    a.choice = m.planned ? m.step_plan.prediction.choice[j] : 0;
    for (const plan::StepCall& c : su.calls) {
      a.kept_bytes += c.costs[a.choice].kept_bytes;
      a.time_added_ms += c.costs[a.choice].time_ms - c.costs[0].time_ms;
    }
    out.push_back(std::move(a));
  }
  // A unit inside one that does not keep runs as part of it.
  for (size_t j = 0; j < out.size(); ++j) {
    for (int64_t a = m.step_model.units[j].parent; a >= 0; a = m.step_model.units[a].parent) {
      if (out[static_cast<size_t>(a)].choice != 0) out[j].runs_in = out[static_cast<size_t>(a)].name;
    }
    if (!out[j].runs_in.empty()) out[j].kept_bytes = 0;
  }
  // What inner units keep less is kept less by the units around them.
  for (size_t j = 0; j < out.size(); ++j) {
    int64_t saved = 0;
    for (const plan::StepCall& c : m.step_model.units[j].calls) {
      saved += c.costs[0].kept_bytes - c.costs[out[j].choice].kept_bytes;
    }
    for (int64_t a = m.step_model.units[j].parent; a >= 0 && saved != 0; a = m.step_model.units[a].parent) {
      out[static_cast<size_t>(a)].kept_bytes -= saved;
    }
  }
  return out;
}

std::string AutoCheckpoint::explain() const {
  const Impl& m = *impl_;
  std::ostringstream os;
  if (m.step_model.units.empty()) return "remat::auto_checkpoint: not profiled yet\n";
  const plan::StepPrediction& p = m.step_plan.prediction;
  os << "remat::auto_checkpoint: budget " << plan::format_bytes(m.budget) << "; profiled step (plain): peak "
     << plan::format_bytes(m.profiled_peak) << ", " << fmt_ms(m.profiled_ms) << "\n";
  if (m.planned) {
    os << "plan: predicted peak " << plan::format_bytes(p.peak_bytes) << " (reached "
       << plan::describe_segment(m.step_model, p.peak_segment) << "), " << fmt_ms(p.time_ms) << " ("
       << fmt_pct(p.time_ms / std::max(1e-9, m.profiled_ms) - 1) << " on plain); solver: " << m.step_plan.solver << ", "
       << (m.step_plan.optimal                       ? "optimal"
           : std::isfinite(m.step_plan.relative_gap) ? "gap " + fmt_pct(m.step_plan.relative_gap)
                                                     : "stopped at its time limit, gap not known")
       << ", "
       << (m.step_plan.solver == "GLPK"
               ? std::to_string(m.step_plan.rows) + " rows x " + std::to_string(m.step_plan.columns) + " columns, "
               : std::string())
       << fmt_ms(m.step_plan.solve_ms)
       << (m.replans ? ", solved again " + std::to_string(m.replans) + "x after overruns" : "") << "\n";
    if (m.grown > 0) {
      os << "profiled step: held " << plan::format_bytes(m.grown)
         << " more at its end than at its start (the optimizer's state, gradients): counted at every point of the "
            "step\n";
    }
    if (m.reprices > 0) {
      char b[160];
      std::snprintf(b, sizeof b, "offload repriced %dx from measured steps: +%.0f ms per GiB sent\n", m.reprices,
                    m.offload_ms_per_gib);
      os << b;
    }
    if (const int64_t inflight = inflight_bytes(); inflight > 0 && p.peak_bytes + inflight <= m.budget) {
      os << "offload: up to " << plan::format_bytes(inflight)
         << " of writes and reads in flight on top of the prediction, within the budget\n";
    }
    if (m.measured_peak >= 0) {
      os << "last step: measured peak " << plan::format_bytes(m.measured_peak) << " ("
         << fmt_pct(static_cast<double>(m.measured_peak) / static_cast<double>(m.budget) - 1) << " on the budget, "
         << fmt_pct(static_cast<double>(m.measured_peak) / static_cast<double>(p.peak_bytes) - 1)
         << " on the prediction), " << fmt_ms(m.measured_ms) << " ("
         << fmt_pct(m.measured_ms / std::max(1e-9, p.time_ms) - 1) << " on the prediction)\n";
    }
  }
  size_t width = 4, owidth = 6;
  for (const auto& u : units()) {
    width = std::max(width, u.name.size());
    owidth = std::max(owidth, u.options[u.choice].size());
  }
  const int ow = static_cast<int>(owidth) + 2;
  os << std::left << std::setw(static_cast<int>(width) + 2) << "unit" << std::setw(7) << "calls" << std::setw(ow)
     << "option" << std::setw(14) << "kept/step"
     << "time added\n";
  for (const auto& u : units()) {
    os << std::left << std::setw(static_cast<int>(width) + 2) << u.name << std::setw(7) << u.calls;
    if (!u.runs_in.empty()) {
      os << "part of " << u.runs_in << "\n";
      continue;
    }
    char added[32];
    std::snprintf(added, sizeof added, "%+.1f ms", u.time_added_ms);
    os << std::setw(ow) << u.options[u.choice] << std::setw(14) << plan::format_bytes(u.kept_bytes) << added << "\n";
  }
  for (const Unit& u : m.units) {
    if (u.calls.empty())
      os << shown(u.name) << ": not called with grad enabled in the profiled step"
         << (m.options.inner_units() ? "" : " outside another unit") << ": off\n";
  }
  return os.str();
}

void AutoCheckpoint::write_trace(const std::string& path) const {
  const Impl& m = *impl_;
  std::ofstream f(path);
  if (!f) throw Error("[remat::auto] cannot write the trace to '" + path + "'; give a writable path.");
  f << "{\"traceEvents\":[\n";
  bool first = true;
  auto sep = [&] {
    if (!first) f << ",\n";
    first = false;
  };
  for (const auto& s : m.samples) {
    sep();
    f << "{\"name\":\"profiled bytes\",\"ph\":\"C\",\"pid\":1,\"ts\":" << s.time_us
      << ",\"args\":{\"bytes\":" << s.bytes << "}}";
  }
  if (m.planned) {
    const auto& seg = m.step_plan.prediction.segment_bytes;
    for (size_t i = 0; i < seg.size() && i < m.points_us.size(); ++i) {
      sep();
      f << "{\"name\":\"planned peak per segment\",\"ph\":\"C\",\"pid\":1,\"ts\":" << m.points_us[i]
        << ",\"args\":{\"bytes\":" << seg[i] << "}}";
    }
  }
  for (const auto& c : m.calls) {
    const std::string name = shown(m.units[c->unit].name);
    sep();
    f << "{\"name\":\"forward " << name << "\",\"ph\":\"X\",\"pid\":1,\"tid\":1,\"ts\":" << c->forward_begin_us
      << ",\"dur\":" << c->forward_end_us - c->forward_begin_us << "}";
    sep();
    f << "{\"name\":\"backward " << name << "\",\"ph\":\"X\",\"pid\":1,\"tid\":2,\"ts\":" << c->first_unpack_us
      << ",\"dur\":" << c->last_unpack_us - c->first_unpack_us << "}";
  }
  for (const auto& [a, b] : m.trial_windows) {
    sep();
    f << "{\"name\":\"isolated runs (cut out)\",\"ph\":\"X\",\"pid\":1,\"tid\":3,\"ts\":" << a << ",\"dur\":" << b - a
      << "}";
  }
  f << "\n],\"displayTimeUnit\":\"ms\"}\n";
  if (!f) throw Error("[remat::auto] writing the trace to '" + path + "' failed; check the disk.");
}

AutoCheckpoint auto_checkpoint(torch::nn::Module& model, AutoOptions options) {
  ensure_engine_installed();
  return AutoCheckpoint(model, std::move(options));
}

}  // namespace remat
