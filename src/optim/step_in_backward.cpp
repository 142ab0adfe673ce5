// remat::StepInBackward: the optimizer's update of each parameter inside
// backward (include/remat/optim.h). Leaves out: LBFGS, global-norm clipping,
// create_graph (refused), an optimizer whose step() does not skip parameters
// without a gradient (documented requirement, not checkable).
//
// NOTE [one parameter's update]: each parameter gets a post-accumulate-grad
// hook (AccumulateGrad runs it once per backward, after the engine summed
// every use of the parameter: tied weights, modules called twice, the
// recomputed regions, whose parameter gradients reach the same accumulator).
// The hook leaves the optimizer's param_groups() holding that one parameter
// (in its own group, so its group's options apply), calls step() and puts
// the groups back: the optimizer's own math, state and options, one
// parameter at a time, which is bitwise the plain step for optimizers whose
// update of a parameter reads only its own gradient and state. Then the
// gradient is freed. Hooks of several devices may run on several engine
// threads at once: one mutex serialises the updates.
//
// NOTE [state between updates]: with state_offload, each state tensor goes
// to an isolated store (offload_internal.h) after its parameter's update and
// comes back before the next; the order of the updates of the last backward
// says which states to read ahead. A backward that sent states waits for
// their writes at its end (an engine callback), so that none is in flight
// in the next forward (auto's plan counts on it). A failed write keeps that state in
// memory (the update was applied; stats() says so). A failed read throws
// from that parameter's hook before its update: the parameters before it in
// this backward were updated with their states, it and those after were not,
// and every state is where it was (the file stays for another try).
//
// NOTE [unreached parameters]: a parameter that a backward which updates
// does not reach (a branch not taken this step) keeps no gradient here. In
// plain training with zero_grad(false), a parameter that any backward
// reached keeps a zeroed gradient for good, and step() updates it with it
// (momentum, Adam's moments, weight decay move it). So with
// zero_grad_set_to_none(false), such a backward ends (an engine callback)
// by giving every parameter that was reached before and not now a zero
// gradient (its state back from the store) for the optimizer's step()
// after backward: that is the plain step's update, and the gradient stays,
// as zero_grad(false) keeps it. Frozen parameters too (step() reads only
// whether a gradient is defined). An updating backward ends the step's
// backward passes (earlier ones run under accumulate(), as docs/training.md
// asks of a step with several): a second updating backward in one step
// would find the first one's parameters unreached and give them a second,
// zero-gradient update. "This backward" is the outermost one: a nested
// graph task's end (a chain's early delivery through Engine::execute inside
// a node) does nothing, and its hooks count for the backward around it;
// the delivery queues the end on that outer backward first
// (queue_end_of_updates), since its hooks may all run in nested tasks.
// Unset, the first such parameter warns.
//
// NOTE [updates at the backward's end]: with update_at_backward_end(true),
// a final gradient is not stepped in its hook: the parameter joins a list,
// and the end of the outermost backward (the same engine callback as above,
// before the unreached parameters are looked at) updates the listed ones in
// order, each as a hook would, and frees each gradient after its update.
// The math is the same; what moves is when memory is held: every gradient
// lives until the backward's end, and the updates' temporaries come after
// the activations are gone. auto_checkpoint switches it per plan.
//
// NOTE [saving stored state]: while a parameter's state is in the store,
// the optimizer's slot for it is empty, and torch::save(optimizer) wrote
// the moments as None without a word (a checkpoint that cannot resume). For
// LibTorch's five optimizers the state object is swapped, while stored,
// for Stored<T>, a T whose serialize() writes the state as read back from
// the store (it stays there; the archive holds the copies until it is
// written). A read that fails throws from torch::save before the file is
// written. A user's own state type is not swapped: fetch_state() first.
// The read back takes the updates' mutex: a save from inside an update
// (an optimizer's step(), an on_update listener) is not supported.
#include <remat/optim.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <sstream>
#include <typeinfo>
#include <unordered_map>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <remat/error.h>

#include "../offload/offload_internal.h"
#include "state_layout.h"

namespace remat {
namespace detail {
namespace {

/** Parameters stepped in backward by any live StepInBackward, by TensorImpl;
 *  and those a DeferredGradients leaves to the optimizer's step(). */
std::mutex g_registry_mu;
std::unordered_map<const void*, int> g_registry;
std::unordered_map<const void*, std::pair<int, std::string>> g_deferred;
std::atomic<int> g_accumulate_everywhere{0};

/** Why p's update is left to step(), or "" (takes the registry lock). */
std::string deferred_why(const at::Tensor& p) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  auto it = g_deferred.find(p.unsafeGetTensorImpl());
  return it == g_deferred.end() ? std::string() : it->second.second;
}

std::string describe_param(int64_t index, const at::Tensor& p) {
  std::ostringstream os;
  os << "parameter #" << index << " (shape " << p.sizes() << ")";
  return os.str();
}

/** The state tensors of LibTorch's optimizers; empty when the type is not
 *  one of them. */
std::vector<at::Tensor*> known_state_tensors(torch::optim::OptimizerParamState& st) {
  using namespace torch::optim;
  if (auto* a = dynamic_cast<AdamParamState*>(&st)) return {&a->exp_avg(), &a->exp_avg_sq(), &a->max_exp_avg_sq()};
  if (auto* a = dynamic_cast<AdamWParamState*>(&st)) return {&a->exp_avg(), &a->exp_avg_sq(), &a->max_exp_avg_sq()};
  if (auto* s = dynamic_cast<SGDParamState*>(&st)) return {&s->momentum_buffer()};
  if (auto* r = dynamic_cast<RMSpropParamState*>(&st)) return {&r->square_avg(), &r->momentum_buffer(), &r->grad_avg()};
  if (auto* g = dynamic_cast<AdagradParamState*>(&st)) return {&g->sum()};
  return {};
}

}  // namespace

int64_t state_tensors_per_parameter(const torch::optim::OptimizerOptions& o) {
  using namespace torch::optim;
  if (const auto* a = dynamic_cast<const AdamWOptions*>(&o)) return a->amsgrad() ? 3 : 2;
  if (const auto* a = dynamic_cast<const AdamOptions*>(&o)) return a->amsgrad() ? 3 : 2;
  if (const auto* s = dynamic_cast<const SGDOptions*>(&o)) return s->momentum() != 0 ? 1 : 0;
  if (const auto* r = dynamic_cast<const RMSpropOptions*>(&o))
    return 1 + (r->momentum() > 0 ? 1 : 0) + (r->centered() ? 1 : 0);
  if (dynamic_cast<const AdagradOptions*>(&o) != nullptr) return 1;
  return 3;
}

namespace {

bool known_optimizer(const torch::optim::Optimizer& o) {
  using namespace torch::optim;
  return dynamic_cast<const Adam*>(&o) || dynamic_cast<const AdamW*>(&o) || dynamic_cast<const SGD*>(&o) ||
         dynamic_cast<const RMSprop*>(&o) || dynamic_cast<const Adagrad*>(&o);
}

}  // namespace

/** Marks a state object swapped in while its tensors are in the store;
 *  rebind() hands it to another StepInBackward (a later one on the same
 *  optimizer: its owner may be gone, and its index is the new one's). */
struct StoredMark {
  virtual ~StoredMark() = default;
  virtual void rebind(std::weak_ptr<StepInBackwardImpl> owner, size_t index) = 0;
};

struct StepInBackwardImpl {
  torch::optim::Optimizer& opt;
  StepInBackwardOptions options;
  struct Param {
    at::Tensor tensor;
    size_t group = 0;
    int64_t index = 0;                        // in the optimizer's order, for messages
    std::vector<OffloadStore::Handle> state;  // one per state tensor (state_offload), in state_tensors() order
    std::vector<char> had;                    // which state tensors were defined when stored
    int64_t state_bytes = 0;                  // of the stored state, the bytes that left memory (state_offloaded_bytes)
    int64_t state_total_bytes = 0;            // of the stored state, all its bytes (as the optimizer held them)
    int64_t state_held_bytes = 0;             // of the stored state, the bytes the store holds in memory
    /** The state object the stored tensors came from: a load() into the
     *  optimizer since then replaced it, and the stored copy is stale. */
    const torch::optim::OptimizerParamState* stored_for = nullptr;
    bool seen_this_pass = false;
    bool pending = false;  // holds a gradient an accumulate() pass kept (or a zero one, NOTE [unreached parameters])
    // The outermost backward (generation) that last reached it; -1: none
    // yet (plain training gives a parameter a gradient for good once reached).
    int64_t reached_gen = -1;
    bool waits_for_end = false;  // in at_end_order (NOTE [updates at the backward's end])
    int updated_task = -1;       // the graph task of its last update in backward
    int nested_task = -1;        // NOTE [backward inside a backward]: a nested task it was updated in
  };
  std::vector<Param> params;
  std::vector<char> group_offloaded;  // per param group: its state goes to the store (state_offload)
  std::unordered_map<const void*, size_t> by_impl;
  std::shared_ptr<OffloadStore> store;
  mutable std::mutex mu;
  int accumulating = 0;
  StepInBackwardStats st;
  std::string deferred_reason;   // the last DeferredGradients' why
  int queued_for = -1;           // the graph task fetch_pending is queued for
  int drained_for = -1;          // the graph task drain is queued for
  std::vector<int> ends_queued;  // graph tasks end_of_updates is queued for
  int64_t generation = 0;        // outermost backward passes that updated, ended (NOTE [unreached parameters])
  // NOTE [after the end]: the outermost graph task whose end_of_updates ran
  // last, and the generation it ended.
  int ended_task = -1;
  int64_t ended_generation = -1;
  bool warned_unreached = false;
  std::weak_ptr<StepInBackwardImpl> self_weak;
  // NOTE [state between updates]: the order of the last backward's updates.
  std::vector<size_t> order, last_order;
  std::vector<int64_t> pos_in_last;         // per parameter, its place in last_order or -1
  StepInBackward::UpdateListener listener;  // on_update()
  // NOTE [updates at the backward's end]: update_at_backward_end(), and the
  // parameters whose update waits for it, in the order they became final.
  bool at_end = false;
  std::vector<size_t> at_end_order;

  /** Inside a backward's updates (on_grad, fetch_pending; with mu held):
   *  the store calls there count as waits. fetch_state(), offload_groups()
   *  and the like run between steps and do not. */
  bool in_updates = false;
  /** Runs fn, adding its time to st.state_wait_ms when in_updates (NOTE
   *  [state between updates]: what the store costs a step is what
   *  backward waits for it). Host wall time. */
  template <typename F>
  auto waited(F&& fn) {
    struct Add {
      StepInBackwardStats& st;
      bool on;
      std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
      ~Add() {
        if (on) {
          st.state_wait_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        }
      }
    } add{st, in_updates};
    return fn();
  }
  /** RAII: in_updates while it lives; call with mu held. */
  struct Updating {
    bool& flag;
    explicit Updating(bool& f) : flag(f) { flag = true; }
    ~Updating() { flag = false; }
  };

  StepInBackwardImpl(torch::optim::Optimizer& o, StepInBackwardOptions opts) : opt(o), options(std::move(opts)) {}

  std::vector<at::Tensor*> state_tensors_of(torch::optim::OptimizerParamState& s) const {
    if (options.state_tensors()) return options.state_tensors()(s);
    return known_state_tensors(s);
  }

  torch::optim::OptimizerParamState* state_of(const Param& p) {
    auto it = opt.state().find(p.tensor.unsafeGetTensorImpl());
    return it == opt.state().end() ? nullptr : it->second.get();
  }

  /** Brings p's state back from the store (NOTE [state between updates]).
   *  Call with mu held. Throws naming the parameter; nothing changes then. */
  void fetch(Param& p, bool count_miss) {
    if (p.state.empty()) return;
    auto* s = state_of(p);
    if (s != p.stored_for) {
      // The optimizer's state was replaced (load(), or cleared) since it was
      // stored: what it holds now wins, and the stored copy goes.
      forget(p);
      return;
    }
    auto slots = state_tensors_of(*s);
    std::vector<at::Tensor> back(p.state.size());
    for (size_t k = 0; k < p.state.size(); ++k) {
      if (!p.had[k]) continue;
      if (count_miss && !store->resident(p.state[k])) st.state_misses++;
      try {
        back[k] = waited([&] { return store->unpack(p.state[k]); });
      } catch (const std::exception& e) {
        throw Error(std::string("[remat::StepInBackward] the optimizer state of ") + describe_param(p.index, p.tensor) +
                    " cannot be read back from its store: " + e.what() +
                    " Its stored state stays where it is (a file that still exists is kept for another try); " +
                    std::to_string(st.updates) + " parameter updates were applied so far, each with its own state.");
      }
    }
    for (size_t k = 0; k < p.state.size() && k < slots.size(); ++k) {
      if (p.had[k]) *slots[k] = std::move(back[k]);
    }
    forget(p);
  }

  /** Drops p's handles to the store (what they held came back, or is stale). */
  void forget(Param& p) {
    p.state.clear();
    p.had.clear();
    st.state_offloaded_bytes -= p.state_bytes;
    st.state_held_in_store_bytes -= p.state_held_bytes;
    p.state_bytes = 0;
    p.state_held_bytes = 0;
    p.state_total_bytes = 0;
  }

  /** Bytes of p's optimizer state wherever it lives: with the optimizer now,
   *  or in the store. */
  int64_t state_bytes(Param& p) {
    int64_t b = p.state_total_bytes;
    auto* s = state_of(p);
    if (!s) return b;
    for (at::Tensor* t : state_tensors_of(*s)) {
      if (t->defined()) b += static_cast<int64_t>(t->nbytes());
    }
    return b;
  }

  /** NOTE [saving stored state]: a copy of the state object `held` of
   *  parameter `index` with its stored tensors read back (they stay in the
   *  store). Takes mu. Throws naming the parameter when a read fails. */
  template <class T>
  T copy_for_save(size_t index, const T& held) {
    std::lock_guard<std::mutex> lock(mu);
    T copy(held);
    Param& p = params[index];
    if (p.state.empty() || p.stored_for != &held) return copy;
    auto slots = state_tensors_of(copy);
    for (size_t k = 0; k < p.state.size() && k < slots.size(); ++k) {
      if (!p.had[k]) continue;
      try {
        *slots[k] = store->unpack(p.state[k]);
      } catch (const std::exception& e) {
        throw Error("[remat::StepInBackward] saving the optimizer: the state of " + describe_param(p.index, p.tensor) +
                    " cannot be read back from its store: " + e.what() +
                    " Nothing was written, and the state is left where it was.");
      }
    }
    return copy;
  }

  /** The optimizer's state object for p, swapped for a Stored<T> when it is
   *  one of LibTorch's (NOTE [saving stored state]). Call with mu held. */
  torch::optim::OptimizerParamState* wrap_for_save(Param& p);

  /** Sends p's state to the store; call with mu held. */
  void put(Param& p) {
    auto* s = state_of(p);
    if (!s || !p.state.empty()) return;  // no state yet, or in the store already
    s = wrap_for_save(p);
    p.stored_for = s;
    auto slots = state_tensors_of(*s);
    for (at::Tensor* t : slots) {
      // A tensor sharing its storage (a slice of a flat buffer of your own
      // optimizer) stays where it is: storing it would part it from the
      // memory it shares. Not a test of is_view(): a state read back from
      // the store is a view (as_strided) of a buffer it fills alone.
      const bool own = t->defined() && t->storage_offset() == 0 &&
                       t->storage().nbytes() == static_cast<size_t>(t->nbytes()) && t->is_contiguous();
      p.had.push_back(own);
      if (own) {
        const auto& o = store->options();
        const bool in_memory = o.target() == OffloadTarget::kMemory;
        const int64_t stored0 = in_memory ? store->stats().bytes_stored : 0;
        p.state.push_back(waited([&] { return store->pack(*t); }));
        p.state_total_bytes += static_cast<int64_t>(t->nbytes());
        // What the store keeps as it is (below min_bytes; kHost from a CPU
        // tensor) never left memory; a kMemory codec's encoding (encoded at
        // pack) stays, and only the bytes it saved left.
        const bool moved = static_cast<int64_t>(t->nbytes()) >= o.min_bytes() &&
                           !(o.target() == OffloadTarget::kHost && t->device().is_cpu());
        if (moved) {
          const int64_t kept = in_memory ? store->stats().bytes_stored - stored0 : 0;
          p.state_bytes += std::max<int64_t>(0, static_cast<int64_t>(t->nbytes()) - kept);
          p.state_held_bytes += std::min<int64_t>(kept, static_cast<int64_t>(t->nbytes()));
        } else {
          p.state_held_bytes += static_cast<int64_t>(t->nbytes());
        }
        *t = at::Tensor();
      } else {
        p.state.emplace_back();
      }
    }
    st.state_offloaded_bytes += p.state_bytes;
    st.state_held_in_store_bytes += p.state_held_bytes;
    st.peak_state_offloaded_bytes = std::max(st.peak_state_offloaded_bytes, st.state_offloaded_bytes);
  }

  /** Reads ahead the states of the parameters updated after p in the last
   *  backward (wrapping to its first: the next backward starts there). */
  void read_ahead(const Param& p) {
    if (!store || last_order.empty()) return;
    const int64_t at = pos_in_last[static_cast<size_t>(&p - params.data())];
    const int64_t n = static_cast<int64_t>(last_order.size());
    for (int64_t k = 1; k <= std::min<int64_t>(options.state_prefetch(), n - 1); ++k) {
      const Param& q = params[last_order[static_cast<size_t>(((at < 0 ? -1 : at) + k) % n)]];
      for (const auto& h : q.state) store->prefetch(h);
    }
  }

  void begin_order(Param& p) {
    if (!p.seen_this_pass) return;
    // A parameter updated twice: a new backward began. Its order guides the next.
    last_order = std::move(order);
    order.clear();
    pos_in_last.assign(params.size(), -1);
    for (size_t k = 0; k < last_order.size(); ++k) pos_in_last[last_order[k]] = static_cast<int64_t>(k);
    for (auto& q : params) q.seen_this_pass = false;
  }

  /** A parameter's gradient is final (its hook; now: step_in_backward_now,
   *  which updates at once even with update_at_backward_end). */
  void on_grad(const at::Tensor& t, bool now = false) {
    if (at::GradMode::is_enabled()) {
      // A backward with create_graph runs its nodes with grad mode on. The
      // first hook throws, before any parameter changed.
      throw Error(
          "[remat::StepInBackward] a backward with create_graph (higher-order gradients) reached a parameter "
          "that is updated in backward; its update would not be differentiable and would change the parameter "
          "the second derivative needs. Destroy the StepInBackward for that step (call the optimizer's step() "
          "after backward instead).");
    }
    const std::string why = deferred_why(t);
    std::lock_guard<std::mutex> lock(mu);
    const Updating updating(in_updates);
    auto it = by_impl.find(t.unsafeGetTensorImpl());
    if (it == by_impl.end()) return;
    Param& p = params[it->second];
    const int task = torch::autograd::get_current_graph_task_id();
    // NOTE [after the end]: a gradient handed over by a final callback that
    // runs after this backward's end_of_updates (FullyShard's end of
    // backward, queued after an ordinary parameter's update queued ours)
    // belongs to the backward that ended: it is updated at once, and
    // queues no second end, which would take every parameter updated
    // before it for unreached (zero gradients for step(), a second update).
    const bool after_end = task != -1 && task == ended_task && torch::autograd::get_current_node() == nullptr;
    // NOTE [backward inside a backward]: a backward run inside a node of
    // another (a reentrant checkpoint of the user's own) updated p with its
    // part of the gradient; graph task ids grow, so a task older than that
    // nested one that reaches p now is one around it, and p's gradient was
    // not final then. Refused before a second update (the first one cannot
    // be undone); update_at_backward_end(true) waits for the outermost end.
    if (p.nested_task != -1 && task != -1) {
      if (task < p.nested_task) {
        const int nested = p.nested_task;
        p.nested_task = -1;
        throw Error("[remat::StepInBackward] " + describe_param(p.index, p.tensor) +
                    " was updated in a backward run inside a node of another backward (graph task " +
                    std::to_string(nested) +
                    ": a reentrant checkpoint, or a custom function whose backward calls backward), and the "
                    "backward around it reached it again: that update used only part of its gradient. Call "
                    "update_at_backward_end(true), which updates once the outermost backward ends, or use "
                    "remat::checkpoint (non-reentrant) for that region.");
      }
      p.nested_task = -1;  // a later backward: the mark is stale
    }
    p.reached_gen = after_end ? ended_generation : generation;
    if (!why.empty()) {
      st.deferred++;
      deferred_reason = why;
      if (store) fetch(p, /*count_miss=*/false);  // step() needs it
      return;
    }
    if (accumulating > 0 || g_accumulate_everywhere.load() > 0) {
      // NOTE [state between updates]: the state stays in the store; the
      // backward that updates brings back the states of kept gradients it
      // does not reach (they meet the optimizer's step() after it).
      st.accumulated++;
      p.pending = true;
      return;
    }
    // NOTE [updates at the backward's end]: the update waits for the end
    // of the outermost backward (outside any backward: now).
    if (at_end && !now && task != -1 && !after_end) {
      queue_end(task);
      if (!p.waits_for_end) at_end_order.push_back(it->second);
      p.waits_for_end = true;
      return;
    }
    update(p, task, /*queue_the_end=*/!after_end);
  }

  /** Updates p in backward: its state back from the store, the
   *  optimizer's update, its gradient freed, the state sent again. Call
   *  with mu held, in_updates set. */
  void update(Param& p, int task, bool queue_the_end = true) {
    if (queue_the_end) queue_end(task);  // NOTE [unreached parameters]
    // Queued once per backward (a backward that threw never ran its
    // callback: the next one queues again).
    if (store && task != -1 && queued_for != task) {
      bool any_pending = false;
      for (const auto& q : params) any_pending |= q.pending && !q.state.empty();
      if (any_pending) {
        queued_for = task;
        torch::autograd::Engine::get_default_engine().queue_callback(
            [self = self_weak.lock()] { self ? self->fetch_pending() : void(); });
      }
    }
    if (store) {
      fetch(p, /*count_miss=*/true);
      begin_order(p);
      // NOTE [state between updates]: the backward ends once its writes are done.
      if (group_offloaded[p.group] && task != -1 && drained_for != task) {
        drained_for = task;
        torch::autograd::Engine::get_default_engine().queue_callback(
            [self = self_weak.lock()] { self ? self->drain() : void(); });
      }
    }
    // Measured for a listener only (auto's profiled step).
    const int64_t param_bytes =
        listener && p.tensor.grad().defined() ? static_cast<int64_t>(p.tensor.grad().nbytes()) : 0;
    const auto t0 = listener ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point();
    step_one(p);
    p.pending = false;
    p.updated_task = task;
    st.updates++;
    if (listener) {
      const double update_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      listener(StepInBackward::UpdateEvent{p.group, state_bytes(p), param_bytes, update_ms});
    }
    if (store) {
      p.seen_this_pass = true;
      order.push_back(static_cast<size_t>(&p - params.data()));
      if (group_offloaded[p.group]) put(p);
      read_ahead(p);
      st.state_write_failures = store->failures(&st.last_state_error);
    }
  }

  /** End of a backward that sent states: their writes finish before the
   *  next forward, which then holds none of them. */
  void drain() {
    const auto t0 = std::chrono::steady_clock::now();
    try {
      store->wait();
    } catch (const std::exception&) {  // a failed write keeps its state in memory; failures() counts it
    }
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    std::lock_guard<std::mutex> lock(mu);
    st.state_wait_ms += ms;
    drained_for = -1;
    st.state_write_failures = store->failures(&st.last_state_error);
  }

  /** End of a backward that updated: the states of gradients kept by
   *  earlier passes that it did not reach come back for the optimizer's
   *  step(). */
  void fetch_pending() {
    std::lock_guard<std::mutex> lock(mu);
    const Updating updating(in_updates);
    queued_for = -1;
    for (auto& q : params) {
      if (!q.pending) continue;
      try {
        fetch(q, /*count_miss=*/false);
      } catch (const std::exception& e) {
        TORCH_WARN("[remat::StepInBackward] ", e.what(), " Call fetch_state() before the optimizer's step().");
      }
    }
  }

  /** NOTE [unreached parameters]: end_of_updates at the end of graph task
   *  `task` (once), unless gradients are being accumulated. Call with mu held. */
  void queue_end(int task) {
    if (task == -1 || accumulating > 0 || g_accumulate_everywhere.load() > 0) return;
    if (std::find(ends_queued.begin(), ends_queued.end(), task) != ends_queued.end()) return;
    ends_queued.push_back(task);
    torch::autograd::Engine::get_default_engine().queue_callback(
        [self = self_weak.lock(), task] { self ? self->end_of_updates(task) : void(); });
  }

  /** NOTE [unreached parameters]: the end of graph task `task`, in a
   *  backward that updates. */
  void end_of_updates(int task) {
    std::lock_guard<std::mutex> lock(mu);
    const Updating updating(in_updates);
    ends_queued.erase(std::remove(ends_queued.begin(), ends_queued.end(), task), ends_queued.end());
    // A nested graph task (a chain's early delivery of a stage's gradient
    // runs its own Engine::execute inside a node): the backward goes on.
    // NOTE [backward inside a backward]: the parameters it updated are marked.
    if (torch::autograd::get_current_node() != nullptr) {
      for (auto& q : params) {
        if (q.updated_task == task) q.nested_task = task;
      }
      return;
    }
    // NOTE [updates at the backward's end]: in the order their gradients
    // became final. A gradient gone since (an optimizer's step() and
    // zero_grad() after a backward that threw) has nothing to update.
    std::vector<size_t> due;
    due.swap(at_end_order);
    for (size_t i : due) params[i].waits_for_end = false;
    bool updated = false;
    for (size_t k = 0; k < due.size(); ++k) {
      Param& p = params[due[k]];
      if (!p.tensor.grad().defined()) continue;
      try {
        update(p, /*task=*/-1);  // queues nothing: this is the backward's end
      } catch (...) {
        // A state that cannot be read back: this one and the ones after it
        // keep their gradients for the optimizer's step(), their states back
        // from the store where they can be, as an accumulated gradient's.
        for (size_t r = k; r < due.size(); ++r) {
          Param& q = params[due[r]];
          q.pending = true;
          try {
            fetch(q, /*count_miss=*/false);
          } catch (const std::exception&) {  // the first failure is the one thrown
          }
        }
        ++generation;
        throw;
      }
      updated = true;
    }
    if (updated && store) {
      // What update() queues inside a backward, done here: the states of
      // gradients kept by accumulate() passes come back for step(), and the
      // writes end before the next forward.
      for (auto& q : params) {
        if (q.pending) fetch(q, /*count_miss=*/false);
      }
      waited([&] {
        try {
          store->wait();
        } catch (const std::exception&) {  // a failed write keeps its state in memory; failures() counts it
        }
      });
      st.state_write_failures = store->failures(&st.last_state_error);
    }
    const int64_t ended = generation++;
    // NOTE [backward inside a backward]: the marks belong to this backward.
    for (auto& q : params) q.nested_task = -1;
    ended_task = task;
    ended_generation = ended;
    const std::optional<bool>& set_to_none = options.zero_grad_set_to_none();
    for (auto& q : params) {
      // Frozen ones too: step() reads only whether a gradient is defined.
      if (q.reached_gen < 0 || q.reached_gen == ended || q.tensor.grad().defined()) continue;
      if (!set_to_none) {
        if (!warned_unreached) {
          warned_unreached = true;
          TORCH_WARN("[remat::StepInBackward] ", describe_param(q.index, q.tensor),
                     " was trained before, and this backward, which updated others, did not reach it: unless an "
                     "earlier backward of this step did, it is not updated, as in a loop that calls zero_grad() "
                     "(set_to_none). A loop that calls zero_grad(false) keeps its zeroed gradient and updates it "
                     "(momentum, weight decay): say which in StepInBackwardOptions::zero_grad_set_to_none(true or "
                     "false) (AutoOptions too), which also silences this.");
        }
        return;
      }
      if (*set_to_none) return;
      q.tensor.mutable_grad() = at::zeros_like(q.tensor);
      q.pending = true;
      if (!store) continue;
      try {
        fetch(q, /*count_miss=*/false);  // step() updates it
      } catch (const std::exception& e) {
        TORCH_WARN("[remat::StepInBackward] ", e.what(), " Call fetch_state() before the optimizer's step().");
      }
    }
  }

  /** NOTE [one parameter's update]. */
  void step_one(Param& p) {
    auto& groups = opt.param_groups();
    std::vector<std::vector<at::Tensor>> held(groups.size());
    for (size_t g = 0; g < groups.size(); ++g) held[g].swap(groups[g].params());
    struct PutBack {
      std::vector<torch::optim::OptimizerParamGroup>& groups;
      std::vector<std::vector<at::Tensor>>& held;
      ~PutBack() {
        for (size_t g = 0; g < groups.size() && g < held.size(); ++g) groups[g].params().swap(held[g]);
      }
    } put_back{groups, held};
    groups[p.group].params().push_back(p.tensor);
    opt.step();
    p.tensor.mutable_grad() = at::Tensor();  // freed: the point of stepping here
  }
};

namespace {

/** NOTE [saving stored state]: a T (one of LibTorch's param states) that
 *  the optimizer holds while its tensors are in the store. */
template <class T>
struct Stored final : T, StoredMark {
  Stored(T&& state, std::weak_ptr<StepInBackwardImpl> owner, size_t index)
      : T(std::move(state)), owner_(std::move(owner)), index_(index) {}
  void serialize(torch::serialize::OutputArchive& archive) const override {
    if (auto impl = owner_.lock()) {
      impl->copy_for_save<T>(index_, *this).serialize(archive);
    } else {
      T::serialize(archive);  // its StepInBackward brought every state back as it went
    }
  }
  using T::serialize;  // the InputArchive overload
  void rebind(std::weak_ptr<StepInBackwardImpl> owner, size_t index) override {
    owner_ = std::move(owner);
    index_ = index;
  }
  std::unique_ptr<torch::optim::OptimizerParamState> clone() const override {
    if (auto impl = owner_.lock()) return std::make_unique<T>(impl->copy_for_save<T>(index_, *this));
    return std::make_unique<T>(static_cast<const T&>(*this));
  }

 private:
  std::weak_ptr<StepInBackwardImpl> owner_;
  size_t index_;
};

template <class T>
bool swap_in(std::unique_ptr<torch::optim::OptimizerParamState>& slot, const std::weak_ptr<StepInBackwardImpl>& owner,
             size_t index) {
  if (typeid(*slot) != typeid(T)) return false;
  slot = std::make_unique<Stored<T>>(std::move(static_cast<T&>(*slot)), owner, index);
  return true;
}

}  // namespace

torch::optim::OptimizerParamState* StepInBackwardImpl::wrap_for_save(Param& p) {
  using namespace torch::optim;
  auto& slot = opt.state()[p.tensor.unsafeGetTensorImpl()];
  const size_t index = static_cast<size_t>(&p - params.data());
  if (auto* mark = dynamic_cast<StoredMark*>(slot.get())) {
    mark->rebind(self_weak, index);  // swapped in by an earlier StepInBackward on this optimizer
  } else {
    (void)(swap_in<AdamParamState>(slot, self_weak, index) || swap_in<AdamWParamState>(slot, self_weak, index) ||
           swap_in<SGDParamState>(slot, self_weak, index) || swap_in<RMSpropParamState>(slot, self_weak, index) ||
           swap_in<AdagradParamState>(slot, self_weak, index));
  }
  return slot.get();
}

namespace {

struct Hook final : torch::autograd::PostAccumulateGradHook {
  std::shared_ptr<StepInBackwardImpl> impl;
  explicit Hook(std::shared_ptr<StepInBackwardImpl> i) : impl(std::move(i)) {}
  void operator()(const torch::autograd::Variable& tensor) override { impl->on_grad(tensor); }
};

}  // namespace

DeferredGradients::DeferredGradients(std::vector<at::Tensor> params, std::string why) : params_(std::move(params)) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  for (const auto& p : params_) {
    auto& d = g_deferred[p.unsafeGetTensorImpl()];
    d.first++;
    d.second = why;
  }
}

DeferredGradients::~DeferredGradients() {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  for (const auto& p : params_) {
    auto it = g_deferred.find(p.unsafeGetTensorImpl());
    if (it != g_deferred.end() && --it->second.first == 0) g_deferred.erase(it);
  }
}

bool is_deferred(const at::Tensor& p) { return p.defined() && !deferred_why(p).empty(); }

AccumulateEverywhere::AccumulateEverywhere() { g_accumulate_everywhere++; }
AccumulateEverywhere::~AccumulateEverywhere() { g_accumulate_everywhere--; }

void queue_end_of_updates(const at::Tensor& p) {
  if (!p.defined() || torch::autograd::impl::get_autograd_meta(p) == nullptr) return;
  auto* hook = dynamic_cast<Hook*>(torch::autograd::impl::post_acc_grad_hooks(p).get());
  if (hook == nullptr) return;
  std::lock_guard<std::mutex> lock(hook->impl->mu);
  hook->impl->queue_end(torch::autograd::get_current_graph_task_id());
}

bool step_in_backward_now(const at::Tensor& p) {
  if (!p.defined() || torch::autograd::impl::get_autograd_meta(p) == nullptr || !p.grad().defined()) return false;
  auto& slot = torch::autograd::impl::post_acc_grad_hooks(p);
  auto* hook = dynamic_cast<Hook*>(slot.get());
  if (!hook) return false;
  // Now, in any mode: FullyShard calls this as its backward ends, maybe in a
  // nested graph task's callback whose own end is not the backward's.
  hook->impl->on_grad(p, /*now=*/true);
  return true;
}

}  // namespace detail

StepInBackward::StepInBackward(torch::optim::Optimizer& optimizer, const StepInBackwardOptions& options)
    : impl_(std::make_shared<detail::StepInBackwardImpl>(optimizer, options)) {
  auto& impl = *impl_;
  impl.self_weak = impl_;
  if (dynamic_cast<torch::optim::LBFGS*>(&optimizer)) {
    throw Error(
        "[remat::StepInBackward] LBFGS cannot step inside backward: its step re-evaluates the whole loss through "
        "a closure. Call its step(closure) after backward.");
  }
  if (options.state_prefetch() < 0) {
    throw Error("[remat::StepInBackward] StepInBackwardOptions::state_prefetch is " +
                std::to_string(options.state_prefetch()) + "; it must be >= 0 (0 reads each state when needed).");
  }
  if (options.state_offload() && options.state_offload()->codec() == Codec::kFloat8) {
    throw Error(
        "[remat::StepInBackward] state_offload with Codec::kFloat8: one scale per tensor flushes the small values "
        "of Adam's second moment to zero and the updates blow up. Use Codec::kInt8Block (a scale per 256 values), "
        "Codec::kBFloat16, or a lossless store.");
  }
  if (options.state_offload() && options.state_offload()->target() == OffloadTarget::kMemory &&
      options.state_offload()->codec() == Codec::kNone) {
    throw Error(
        "[remat::StepInBackward] state_offload to OffloadTarget::kMemory without a codec keeps every byte where "
        "it was. Give a codec (Codec::kBFloat16 halves the state), or OffloadTarget::kDisk.");
  }
  if (options.state_offload() && !options.state_tensors() && !detail::known_optimizer(optimizer)) {
    throw Error(
        "[remat::StepInBackward] state_offload: remat knows the state of LibTorch's SGD, Adam, AdamW, RMSprop and "
        "Adagrad, not of this optimizer. Pass StepInBackwardOptions::state_tensors(fn) returning the tensors of "
        "its per-parameter state.");
  }
  int64_t index = 0;
  for (size_t g = 0; g < optimizer.param_groups().size(); ++g) {
    for (const auto& t : optimizer.param_groups()[g].params()) {
      const void* key = t.unsafeGetTensorImpl();
      if (impl.by_impl.count(key)) {
        throw Error("[remat::StepInBackward] " + detail::describe_param(index, t) +
                    " is listed twice in the optimizer's param groups (model->parameters() lists a parameter "
                    "that two modules register, such as a tied weight, once per module); give each parameter "
                    "to the optimizer once.");
      }
      // A tensor made without requires_grad (FullyShard's frozen flat shard)
      // has no autograd metadata to hold a hook (LibTorch asserts): made.
      torch::autograd::impl::materialize_autograd_meta(t);
      if (torch::autograd::impl::post_acc_grad_hooks(t) != nullptr) {
        throw Error("[remat::StepInBackward] " + detail::describe_param(index, t) +
                    " already has a post-accumulate-grad hook (another StepInBackward on the same parameters?); "
                    "one StepInBackward per parameter.");
      }
      impl.by_impl.emplace(key, impl.params.size());
      detail::StepInBackwardImpl::Param p;
      p.tensor = t;
      p.group = g;
      p.index = index++;
      impl.params.push_back(std::move(p));
    }
  }
  if (options.state_offload()) {
    // Reads ahead are ours, in update order (NOTE [state between updates]),
    // not the store's reverse save order.
    OffloadOptions store_options = *options.state_offload();
    store_options.prefetch_depth(0);
    impl.store = detail::OffloadStore::create_isolated(store_options);
  }
  impl.pos_in_last.assign(impl.params.size(), -1);
  impl.group_offloaded.assign(optimizer.param_groups().size(), 1);
  {
    std::lock_guard<std::mutex> lock(detail::g_registry_mu);
    for (const auto& p : impl.params) detail::g_registry[p.tensor.unsafeGetTensorImpl()]++;
  }
  for (const auto& p : impl.params) {
    torch::autograd::impl::set_post_acc_grad_hooks(p.tensor, std::make_unique<detail::Hook>(impl_));
  }
}

StepInBackward::~StepInBackward() {
  auto& impl = *impl_;
  for (const auto& p : impl.params) {
    auto& slot = torch::autograd::impl::post_acc_grad_hooks(p.tensor);
    auto* mine = dynamic_cast<detail::Hook*>(slot.get());
    if (mine && mine->impl == impl_) slot.reset();
  }
  {
    std::lock_guard<std::mutex> lock(detail::g_registry_mu);
    for (const auto& p : impl.params) {
      auto it = detail::g_registry.find(p.tensor.unsafeGetTensorImpl());
      if (it != detail::g_registry.end() && --it->second == 0) detail::g_registry.erase(it);
    }
  }
  try {
    fetch_state();
  } catch (const std::exception& e) {
    TORCH_WARN("[remat::StepInBackward] destroyed with optimizer state it could not read back: ", e.what());
  }
}

StepInBackward::Accumulating::Accumulating(std::shared_ptr<detail::StepInBackwardImpl> impl) : impl_(std::move(impl)) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->accumulating++;
}
StepInBackward::Accumulating::Accumulating(Accumulating&& other) noexcept : impl_(std::move(other.impl_)) {}
StepInBackward::Accumulating::~Accumulating() {
  if (!impl_) return;
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->accumulating--;
}

StepInBackward::Accumulating StepInBackward::accumulate() { return Accumulating(impl_); }

void StepInBackward::fetch_state() {
  auto& impl = *impl_;
  std::lock_guard<std::mutex> lock(impl.mu);
  if (!impl.store) return;
  std::string first;
  for (auto& p : impl.params) {
    try {
      impl.fetch(p, /*count_miss=*/false);
    } catch (const std::exception& e) {
      if (first.empty()) first = e.what();
    }
  }
  if (!first.empty()) throw Error(first);
}

void StepInBackward::update_at_backward_end(bool on) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->at_end = on;
}

bool StepInBackward::updates_at_backward_end() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->at_end;
}

void StepInBackward::on_update(UpdateListener fn) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->listener = std::move(fn);
}

void StepInBackward::wait() {
  if (!impl_->store) return;
  try {
    impl_->store->wait();
  } catch (const std::exception&) {  // an isolated store has no store-wide error; nothing to report
  }
}

void StepInBackward::offload_groups(const std::vector<bool>& groups) {
  auto& impl = *impl_;
  std::lock_guard<std::mutex> lock(impl.mu);
  if (!impl.store) {
    throw Error(
        "[remat::StepInBackward] offload_groups: there is no state store; give StepInBackwardOptions::"
        "state_offload to choose where the state goes.");
  }
  if (groups.size() != impl.group_offloaded.size()) {
    throw Error("[remat::StepInBackward] offload_groups: " + std::to_string(groups.size()) +
                " flags for an optimizer of " + std::to_string(impl.group_offloaded.size()) +
                " param groups; give one per group.");
  }
  for (size_t g = 0; g < groups.size(); ++g) impl.group_offloaded[g] = groups[g];
  for (auto& p : impl.params) {
    if (impl.group_offloaded[p.group]) {
      impl.put(p);  // now, not at its next update: the step before that update holds less
    } else {
      impl.fetch(p, /*count_miss=*/false);
    }
  }
}

std::vector<int64_t> StepInBackward::state_bytes_per_group() const {
  auto& impl = *impl_;
  std::lock_guard<std::mutex> lock(impl.mu);
  std::vector<int64_t> out(impl.group_offloaded.size(), 0);
  for (auto& p : impl.params) out[p.group] += impl.state_bytes(p);
  return out;
}

std::vector<int64_t> StepInBackward::largest_state_bytes_per_group() const {
  auto& impl = *impl_;
  std::lock_guard<std::mutex> lock(impl.mu);
  std::vector<int64_t> out(impl.group_offloaded.size(), 0);
  for (auto& p : impl.params) out[p.group] = std::max(out[p.group], impl.state_bytes(p));
  return out;
}

StepInBackwardStats StepInBackward::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  StepInBackwardStats s = impl_->st;
  if (impl_->store) s.state_write_failures = impl_->store->failures(&s.last_state_error);
  return s;
}

std::string StepInBackward::describe() const {
  const StepInBackwardStats s = stats();
  std::ostringstream os;
  os << "StepInBackward: " << impl_->params.size() << " parameters in " << impl_->opt.param_groups().size()
     << " group(s) updated in backward; " << s.updates << " updates";
  if (s.accumulated > 0) os << ", " << s.accumulated << " gradients kept for accumulation";
  if (s.deferred > 0) {
    std::lock_guard<std::mutex> lock(impl_->mu);
    os << ", " << s.deferred << " left to the optimizer's step(): " << impl_->deferred_reason;
  }
  if (impl_->store) {
    os << "; state between updates in " << impl_->store->describe() << " (" << s.state_offloaded_bytes
       << " B there now, at most " << s.peak_state_offloaded_bytes << " B; " << s.state_misses
       << " states read when needed";
    if (s.state_write_failures > 0)
      os << "; " << s.state_write_failures << " writes failed, those states kept in memory: " << s.last_state_error;
    os << ")";
  } else {
    os << "; state kept by the optimizer";
  }
  return os.str();
}

bool StepInBackward::steps_in_backward(const at::Tensor& p) {
  std::lock_guard<std::mutex> lock(detail::g_registry_mu);
  return p.defined() && detail::g_registry.count(p.unsafeGetTensorImpl()) > 0;
}

}  // namespace remat
