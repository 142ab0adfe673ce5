// The profiled step (the first stage of the whole-step planner): runs the
// user's step once with every unit call observed (Checkpointable's
// UnitObserver, CheckpointedSequential's ChainObserver), records each call's
// forward and backward windows, which inputs it holds alone and when, and
// the step's memory timeline. Leaves out what each call's options cost
// (menu.cpp, whose isolated runs it starts at each call) and the step model
// built from the record (step_model.cpp).
//
// NOTE [what a profiled step measures]: the step runs plain. Each unit call
// is first run again in isolation under every option of its unit, on clones
// of its inputs (so in-place ops on them touch nothing), with the RNG and
// every tensor the run wrote put back after each run (NOTE [isolated runs
// write nothing], menu.cpp) and gradients taken with autograd::grad
// (nothing accumulates into .grad): the step that follows is the plain
// step, bitwise. Those runs give each option's forward peak, the bytes it
// keeps, its backward peak (a probe each, above the bytes live at the
// call's start) and its time. The real call then runs under a saved-tensor
// hook that only notes the time of the first and last unpack: the call's
// backward window. A memory::Recording records every allocation of the
// step, with the isolated runs' windows cut out; the windows of all calls
// cut it into segments, whose peaks are the model's baseline.
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
#include "internal.h"
#include "measure.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <tuple>

#include <remat/checkpoint.h>
#include <remat/error.h>
#include <remat/hooks.h>

namespace remat {

using detail::kDisagree;
using detail::kNotSeen;
using detail::kTop;
using detail::shown;

namespace detail {

/** Live tensors packed (per `list`) on storage `st`. */
size_t CallRecord::live_on(
    const std::vector<std::pair<const c10::StorageImpl*, c10::weak_intrusive_ptr<c10::TensorImpl>>>& list,
    const c10::StorageImpl* st) {
  size_t live = 0;
  for (const auto& [impl, weak] : list) live += impl == st && !weak.expired() ? 1 : 0;
  return live;
}

/** A tensor this call's saves (or an inner call's) packed: noted where
 *  it shares an input's storage. */
void CallRecord::packed(const at::Tensor& t) {
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
void CallRecord::note_exclusive(double now) {
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
void CallRecord::unpacked(double t) {
  for (CallRecord* r = this; r != nullptr; r = r->enclosing.get()) {
    std::lock_guard<std::mutex> lock(r->mu);
    // An unpack while the call's forward runs is its forward's own (a unit
    // whose forward calls autograd::grad, a gradient penalty): its backward
    // comes after its forward.
    if (r->forward_end_us < 0) continue;
    if (r->first_unpack_us < 0) {
      r->note_exclusive(t);
      r->first_unpack_us = t;
    }
    r->backward_end_us = std::max(r->backward_end_us, t);
    // Keep may let an input go inside its backward: credit it no longer
    // than it is seen live (NOTE [released inputs]).
    for (size_t i = 0; i < r->inputs.size(); ++i) {
      if (r->exclusive_us[i] >= 0 && !r->inputs[i].expired()) r->alive_us[i] = t;
    }
  }
}

/** NOTE [a backward ends with its last node]: a backward node that
 *  unpacked this call's saves has returned. */
void CallRecord::node_done(double t) {
  for (CallRecord* r = this; r != nullptr; r = r->enclosing.get()) {
    std::lock_guard<std::mutex> lock(r->mu);
    r->backward_end_us = std::max(r->backward_end_us, t);
  }
}

}  // namespace detail

namespace {

// NOTE [a backward ends with its last node]: a call's backward goes on
// after its last unpack, until the node that unpacked returns. The node's
// incoming gradient lives until then: the unchunked loss's mm backward
// holds the (tokens x vocabulary) gradient of the logits while it makes
// the hidden state's and the weight's, after it unpacked them. A window
// that ended at the last unpack left that at the head's option 0's size
// outside it, for every other option to carry (the predictions of chunked
// plans ran a logits' gradient high). The profiled step notes, per
// backward node on each thread, the calls whose saves it unpacked; their
// backward ends where the next node on that thread starts (the engine
// frees a node's inputs a few microseconds after its RecordFunction scope
// ends, so that end is too early), or where the step ends.
struct NodeFrame : at::ObserverContext {
  NodeFrame* prev = nullptr;
  std::vector<std::shared_ptr<detail::CallRecord>> unpacked;
  std::weak_ptr<memory::Recording> timeline;
};
thread_local NodeFrame* t_node = nullptr;
struct NodeReturned {  // the calls whose last node so far returned last on this thread
  std::vector<std::weak_ptr<detail::CallRecord>> calls;
  std::weak_ptr<memory::Recording> timeline;
};
thread_local NodeReturned t_returned;

/** The calls of the node that returned last on this thread: their
 *  backward goes on to now. */
void note_node_returned() {
  if (t_returned.calls.empty()) return;
  if (auto tl = t_returned.timeline.lock()) {
    const double now = tl->now_us();
    for (const auto& w : t_returned.calls) {
      if (auto rec = w.lock()) rec->node_done(now);
    }
  }
  t_returned.calls.clear();
}

/** A backward node starts on this thread: the node before it has freed
 *  its inputs; the unpacks from here on are this node's. */
std::unique_ptr<at::ObserverContext> node_starts() {
  note_node_returned();
  auto frame = std::make_unique<NodeFrame>();
  frame->prev = t_node;
  t_node = frame.get();
  return frame;
}

/** A backward node returned: the calls it unpacked for end their backward
 *  here for now, and again where the next node on this thread starts or
 *  the step ends (note_node_returned), whichever comes. */
void node_returns(const at::RecordFunction&, at::ObserverContext* ctx) {
  auto* frame = static_cast<NodeFrame*>(ctx);
  if (frame == nullptr) return;
  t_node = frame->prev;
  auto tl = frame->timeline.lock();
  if (!tl || frame->unpacked.empty()) return;
  const double now = tl->now_us();
  t_returned.calls.clear();
  for (const auto& rec : frame->unpacked) {
    rec->node_done(now);
    t_returned.calls.push_back(rec);
  }
  t_returned.timeline = frame->timeline;
}

using CallPtr = std::unique_ptr<detail::UnitObserver::Call>;

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

}  // namespace

class AutoCheckpoint::Impl::ObservedCall : public Call {
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
              if (auto tl = weak.lock()) {
                rec->unpacked(tl->now_us());
                if (t_node != nullptr) {  // NOTE [a backward ends with its last node]
                  auto& u = t_node->unpacked;
                  if (std::find(u.begin(), u.end(), rec) == u.end()) u.push_back(rec);
                  t_node->timeline = weak;
                }
              }
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
void AutoCheckpoint::Impl::find_pair(CallRecord& rec) {
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
void AutoCheckpoint::Impl::note_exclusive(double now) {
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
void AutoCheckpoint::Impl::note_backward_op() {
  if (timeline == nullptr || in_trial || outside_noted == unit_events) return;
  note_exclusive(timeline->now_us());
  outside_noted = unit_events;
}

/** True when a call starting now is observed: the profiled step is
 *  running, outside the isolated runs and recomputes, and not inside a
 *  chain (its stages run as its schedule says) or, without inner units,
 *  inside another unit. */
bool AutoCheckpoint::Impl::observing() const {
  if (timeline == nullptr || in_trial || is_recomputing() || !at::GradMode::is_enabled()) return false;
  if (!active.empty() && !options.inner_units()) return false;  // runs as part of the enclosing unit
  for (const auto& a : active) {
    if (units[a->unit].chain != nullptr) return false;
  }
  return true;
}

CallPtr AutoCheckpoint::Impl::begin(Checkpointable& c, const std::vector<at::Tensor>& inputs,
                                    const detail::UnitRun& run) {
  if (!observing()) return nullptr;
  auto it = index.find(&c);
  if (it == index.end()) return nullptr;  // not a module of this model
  RunOption again = [&run](const Option& o, const std::vector<at::Tensor>& in) { return run(o.switch_state, in); };
  return begin_call(it->second, inputs, again, nullptr);
}

CallPtr AutoCheckpoint::Impl::begin(CheckpointedSequentialImpl& chain, const std::vector<at::Tensor>& inputs,
                                    const detail::ChainRun& run, const detail::ChainMenu& menu) {
  if (!observing()) return nullptr;
  auto it = chain_index.find(&chain);
  if (it == chain_index.end()) return nullptr;  // not a module of this model
  RunOption again = [&run](const Option& o, const std::vector<at::Tensor>& in) { return run(o.schedule, in); };
  return begin_call(it->second, inputs, again, &menu);
}

namespace {
/** Under autocast, the recomputes inside the isolated runs of a unit's
 *  options do not clear the step's cache of casts as they end (a re-run's
 *  autocast region clears it when the nesting falls to 0, and a C++ step's
 *  autocast does not nest): a unit called twice then uses the same casts
 *  of its weights in both calls, as plainly (their gradients are summed in
 *  one cast's backward). It cleared the cache between the calls, and the
 *  profiled step's gradients differed from plain's in the last bits (a
 *  bias, 2.4e-4 in bfloat16). The runs use the cache as the step does, so
 *  that they measure what it holds. */
struct TrialAutocast {
  bool on = at::autocast::is_autocast_enabled(at::kCPU) || at::autocast::is_autocast_enabled(at::kCUDA);
  TrialAutocast() {
    if (on) at::autocast::increment_nesting();
  }
  ~TrialAutocast() {
    if (on) at::autocast::decrement_nesting();
  }
  TrialAutocast(const TrialAutocast&) = delete;
  TrialAutocast& operator=(const TrialAutocast&) = delete;
};
}  // namespace

CallPtr AutoCheckpoint::Impl::begin_call(size_t unit, const std::vector<at::Tensor>& inputs, const RunOption& run,
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
    const TrialAutocast autocast;
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

void AutoCheckpoint::Impl::profile(const std::function<void()>& fn) {
  calls.clear();
  trial_windows.clear();
  // NOTE [menus rebuilt]: a unit's menu is built at its first call of the
  // profiled step, from that call: its selective levels name the ops at
  // its shapes, and whether it has a backward depends on which parameters
  // train. A later profile (another batch size, parameters unfrozen)
  // builds every menu again; the menus in force come back if it throws,
  // so that they keep matching step_model.
  std::vector<std::pair<std::vector<Option>, bool>> menus_before;
  // NOTE [chunked calls as units]: the profile may add units; one that
  // throws drops them again.
  const size_t units_before = units.size();
  const std::vector<int64_t> sites_before = site_units;
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
    units.resize(units_before);
    before.resize(std::min(before.size(), units_before));
    site_units = sites_before;
    for (size_t i = 0; i < units.size(); ++i) std::tie(units[i].menu, units[i].plannable) = std::move(menus_before[i]);
    throw;
  }
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
void AutoCheckpoint::Impl::profile_fresh(const std::function<void()>& fn) {
  inflight_trial.assign(options.offload().size(), 0);
  {
    std::lock_guard<std::mutex> lock(updates_mu);
    updates_trial.clear();  // NOTE [model state in the plan]: this step's updates
  }
  mem = memory::source_for(memory::measured_device(model.parameters()));
  mem->enable();
  const int64_t start_bytes = mem->current_bytes();
  const Grads grads_start = grads_now();
  try {
    timeline_owner = mem->record();
  } catch (const Error& e) {
    const std::string what = e.what();
    // The CPU's counter and a CUDA device's recording say it in their words.
    if (what.find("already recording") == std::string::npos && what.find("already under way") == std::string::npos)
      throw;
    throw Error(
        "[remat::auto] the profiled step cannot start: the process's memory is being recorded already (another "
        "auto_checkpoint planner profiling its step, on this thread or another, or a remat::memory::Timeline of "
        "yours). A planner counts every tensor of the process, so planners profiling at once would measure each "
        "other: let one planner reach planned() before another profiles (the steps of planners on one thread "
        "take turns), or train the models in separate processes. The step did not run.");
  }
  memory::Recording& tl = *timeline_owner;
  timeline = &tl;
  detail::UnitObserver* previous = detail::set_unit_observer(this);
  detail::ChainObserver* previous_chain = detail::set_chain_observer(this);
  listen_to_updates(true);  // NOTE [model state in the plan]
  struct Reset {
    Impl* self;
    detail::UnitObserver* previous;
    detail::ChainObserver* previous_chain;
    ~Reset() {
      detail::set_unit_observer(previous);
      detail::set_chain_observer(previous_chain);
      self->listen_to_updates(false);
      self->timeline = nullptr;
      self->timeline_owner.reset();
    }
  } reset{this, previous, previous_chain};
  // NOTE [released inputs]: the backward ops of the step (on this
  // thread: CPU graphs run backward on the caller's thread) are events too.
  t_profiling = this;
  const at::CallbackHandle backward_ops =
      at::addThreadLocalCallback(at::RecordFunctionCallback(
                                     [](const at::RecordFunction&) -> std::unique_ptr<at::ObserverContext> {
                                       if (t_profiling != nullptr) t_profiling->note_backward_op();
                                       return node_starts();  // NOTE [a backward ends with its last node]
                                     },
                                     node_returns)
                                     .scopes({at::RecordScope::BACKWARD_FUNCTION})
                                     .needsInputs(false));
  struct Unhook {
    at::CallbackHandle handle;
    ~Unhook() {
      at::removeCallback(handle);
      t_profiling = nullptr;
      t_returned.calls.clear();
    }
  } unhook{backward_ops};
  const double begin_us = tl.now_us();
  fn();
  note_node_returned();  // NOTE [a backward ends with its last node]: the step's last node
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

/** The model's parameters' gradients now: their bytes, and their storages. */
AutoCheckpoint::Impl::Grads AutoCheckpoint::Impl::grads_now() const {
  Grads g;
  for (const auto& p : model.parameters()) {
    const at::Tensor& grad = p.grad();
    if (!grad.defined() || !grad.has_storage()) continue;
    g.bytes += static_cast<int64_t>(grad.storage().nbytes());
    g.storages.push_back(grad.storage().getWeakStorageImpl());
  }
  return g;
}

}  // namespace remat
