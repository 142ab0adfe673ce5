// The module-level switch: the C++ counterpart of Hugging Face's
// model.gradient_checkpointing_enable().
//
//   struct BlockImpl : torch::nn::Module, remat::Checkpointable {
//     torch::Tensor forward(const torch::Tensor& x) {
//       return checkpointed([this](const torch::Tensor& h) { return body(h); }, x);
//     }
//     ...
//   };
//   remat::enable_checkpointing(*model, remat::select::every_n(2, remat::select::type<BlockImpl>()),
//                               remat::CheckpointOptions().policy(remat::policy::save_matmuls()));
//   std::cout << remat::describe_checkpointing(*model);
//
// NOTE [module switch: a mixin, not a wrapper]: in C++ a parent calls its
// children through typed members (`attn->forward(x)`), so nothing can be
// patched in from outside the way Python swaps `forward`. A wrapper module
// would have to be put in by the parent's author at construction, would
// rename every parameter under it (`blocks.0.weight` -> `blocks.0.inner.weight`,
// which breaks loading saved weights) and could not be switched off at run
// time. A mixin keeps the module, its type and its parameter names; the
// block author writes one line (forward through checkpointed()), and
// enable/disable_checkpointing switch any subset of the tree between steps.
// Modules remat does not own and cannot derive from can still go through
// remat::checkpoint at their call site.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <remat/checkpoint.h>
#include <remat/hooks.h>
#include <remat/offload.h>

namespace remat {

class Checkpointable;

namespace detail {
/** Runs one call of a unit again, for the whole-step profiler (auto.h):
 *  the unit's function on `inputs` (the call's tensors, in argument order)
 *  with the switch as given (nullopt: plain), returning its output tensors
 *  flattened. Valid only while UnitObserver::begin() runs. */
using UnitRun =
    std::function<std::vector<at::Tensor>(const std::optional<CheckpointOptions>&, const std::vector<at::Tensor>&)>;

/** Sees every call of a Checkpointable on this thread while installed (the
 *  whole-step profiler). */
class UnitObserver {
 public:
  /** One observed call: finish() gets its outputs; destroyed after the call
   *  (also when it throws). */
  class Call {
   public:
    virtual ~Call() = default;
    /** The call's output tensors, flattened. */
    virtual void finish(const std::vector<at::Tensor>& outputs) = 0;
  };
  virtual ~UnitObserver() = default;
  /** Before `unit`'s call runs, with its tensor inputs and a way to run it
   *  again; nullptr to let it run unobserved. */
  virtual std::unique_ptr<Call> begin(Checkpointable& unit, const std::vector<at::Tensor>& inputs,
                                      const UnitRun& run) = 0;
};
/** RAII: while alive, the tensors autograd saves on this thread go to the
 *  process's one offload store for these options (the store that
 *  CheckpointOptions::offload uses for equal options). Nothing is pushed
 *  while a checkpointed region recomputes (its saves are the region's) or
 *  with grad mode off (nothing is saved). */
class OffloadCall {
 public:
  explicit OffloadCall(const OffloadOptions& options);
  ~OffloadCall();
  OffloadCall(const OffloadCall&) = delete;
  OffloadCall& operator=(const OffloadCall&) = delete;

 private:
  std::unique_ptr<ScopedHooks> hooks_;
};

/** Hooks around every call of one Checkpointable object, on any thread
 *  (remat::parallel::FullyShard gathers a unit's parameters before its
 *  forward and arms its backward after). A recompute that calls the module
 *  again calls them again. */
class UnitHook {
 public:
  virtual ~UnitHook() = default;
  /** Before the call runs (before a UnitObserver sees it), with the tensors
   *  among its arguments (flattened as outputs are). */
  virtual void before_forward(const std::vector<at::Tensor>& inputs) = 0;
  /** After it returned, with its output tensors flattened (not called when
   *  it throws). */
  virtual void after_forward(const std::vector<at::Tensor>& outputs) = 0;
  /** Instead of after_forward when the call threw (the exception goes on). */
  virtual void forward_failed() {}
};

/** This thread's observer, or nullptr (the common case). */
UnitObserver* unit_observer();
/** Installs `o` on this thread (nullptr removes it); returns the previous one. */
UnitObserver* set_unit_observer(UnitObserver* o);

/** The tensors of a unit's output: a Tensor, a std::vector of them, or a
 *  tuple or pair of those (nested); anything else holds none. */
template <class T>
void flatten_outputs(const T& v, std::vector<at::Tensor>& out) {
  if constexpr (std::is_same_v<T, at::Tensor>) {
    out.push_back(v);
  } else if constexpr (std::is_same_v<T, std::vector<at::Tensor>>) {
    out.insert(out.end(), v.begin(), v.end());
  } else if constexpr (requires { std::tuple_size<T>::value; }) {
    std::apply([&](const auto&... e) { (flatten_outputs(e, out), ...); }, v);
  }
}
}  // namespace detail

/** Mixin for a module whose forward can be checkpointed by the switch. */
class Checkpointable {
 public:
  virtual ~Checkpointable() = default;
  /** On with these options, or off (nullopt). */
  void set_checkpointing(std::optional<CheckpointOptions> options) { options_ = std::move(options); }
  /** True when the switch is on for this module. Default off. */
  bool checkpointing() const { return options_.has_value(); }
  /** The options the switch was turned on with; nullopt when off. */
  const std::optional<CheckpointOptions>& checkpointing_options() const { return options_; }
  /** While the switch is off: what this module's forward saves for
   *  backward goes to an offload store (OffloadScope's, shared by every
   *  module and region offloading with equal options), nothing recomputed.
   *  nullopt (default): kept in memory. With the switch on, the checkpoint
   *  runs and this is ignored (CheckpointOptions::offload offloads a
   *  checkpoint's inputs). Meant for modules outside checkpointed regions,
   *  as the whole-step planner (auto.h) sets it; inside one, the region's
   *  first run sends this module's saves to the store instead of dropping
   *  them, and its recompute runs this module plainly. */
  void set_offloading(std::optional<OffloadOptions> options) { offload_ = std::move(options); }
  /** The options set_offloading() set; nullopt when not offloading. */
  const std::optional<OffloadOptions>& offloading_options() const { return offload_; }
  /** How many times this object's forward has called checkpointed(), on or
   *  off (a recompute of an enclosing region counts again), since the object
   *  was made; a copy (clone()) starts at 0. 0 after a forward that ran the
   *  module means the forward does not route through the switch. */
  int64_t checkpointed_calls() const { return calls_.n.load(std::memory_order_relaxed); }
  /** Installs hooks around this module's calls (nullptr removes them);
   *  one at a time. Not copied by clone(). */
  void set_unit_hook(std::shared_ptr<detail::UnitHook> hook) { hook_.p = std::move(hook); }
  /** The hooks set_unit_hook() installed, or nullptr. */
  detail::UnitHook* unit_hook() const { return hook_.p.get(); }

 protected:
  /** fn(args...) under remat::checkpoint when the switch is on (with this
   *  module's parameters version-checked and buffers restored), a plain call
   *  otherwise. fn must be copyable (capture `this`, not locals by reference). */
  template <class Fn, class... Args>
  auto checkpointed(Fn&& fn, Args&&... args) -> decltype(detail::call(fn, std::forward<Args>(args)...)) {
    calls_.n.fetch_add(1, std::memory_order_relaxed);
    if (hook_.p) return hooked(hook_.p, fn, std::forward<Args>(args)...);
    return switched(std::forward<Fn>(fn), std::forward<Args>(args)...);
  }

 private:
  /** checkpointed() past its hooks: observed, checkpointed or plain. */
  template <class Fn, class... Args>
  auto switched(Fn&& fn, Args&&... args) -> decltype(detail::call(fn, std::forward<Args>(args)...)) {
    if (detail::UnitObserver* observer = detail::unit_observer()) {
      return observed(*observer, std::forward<Fn>(fn), std::forward<Args>(args)...);
    }
    if (!options_) return off(fn, std::forward<Args>(args)...);
    return detail::checkpoint_impl(*options_, state(), std::forward<Fn>(fn), std::forward<Args>(args)...);
  }
  /** switched() between the hooks' before_forward and after_forward (held
   *  by `hook` for the call, so that removing them mid-call is safe). */
  template <class Fn, class... Args>
  auto hooked(std::shared_ptr<detail::UnitHook> hook, Fn& fn, Args&&... args)
      -> decltype(detail::call(fn, std::forward<Args>(args)...)) {
    using R = decltype(detail::call(fn, std::forward<Args>(args)...));
    std::vector<at::Tensor> inputs;
    (detail::flatten_outputs(std::as_const(args), inputs), ...);
    hook->before_forward(inputs);
    if constexpr (std::is_void_v<R>) {
      try {
        switched(fn, std::forward<Args>(args)...);
      } catch (...) {
        hook->forward_failed();
        throw;
      }
      hook->after_forward({});
    } else {
      auto run = [&]() -> R {
        try {
          return switched(fn, std::forward<Args>(args)...);
        } catch (...) {
          hook->forward_failed();
          throw;
        }
      };
      R r = run();
      std::vector<at::Tensor> outputs;
      detail::flatten_outputs(r, outputs);
      hook->after_forward(outputs);
      return r;
    }
  }
  /** A counter that modules may be copied with (it restarts at 0) and
   *  forwards on several threads may bump. */
  struct Calls {
    std::atomic<int64_t> n{0};
    Calls() = default;
    Calls(const Calls&) {}
    Calls& operator=(const Calls&) { return *this; }
  };
  detail::ModuleState state() const;
  /** fn(args...) with the switch off: plainly, under the offload store when set. */
  template <class Fn, class... Args>
  auto off(Fn& fn, Args&&... args) -> decltype(detail::call(fn, std::forward<Args>(args)...)) {
    if (!offload_) return detail::call(fn, std::forward<Args>(args)...);
    detail::OffloadCall to_store(*offload_);
    return detail::call(fn, std::forward<Args>(args)...);
  }
  /** checkpointed() under a UnitObserver: tells it of the call, with a copy
   *  of fn and args it may run again under other switch states. */
  template <class Fn, class... Args>
  auto observed(detail::UnitObserver& observer, Fn&& fn, Args&&... args)
      -> decltype(detail::call(fn, std::forward<Args>(args)...)) {
    std::vector<at::Tensor> inputs;
    (detail::collect(inputs, args), ...);
    std::unique_ptr<detail::UnitObserver::Call> call;
    {
      auto stored = std::make_shared<std::tuple<std::decay_t<Fn>, std::decay_t<Args>...>>(fn, args...);
      std::apply([](auto&, auto&... a) { (detail::blank(a), ...); }, *stored);
      detail::UnitRun run = [this, stored](const std::optional<CheckpointOptions>& o,
                                           const std::vector<at::Tensor>& in) {
        return std::apply(
            [&](auto& f, auto&... a) {
              size_t k = 0;
              (detail::fill(a, in, k), ...);
              // Holds no tensor between runs: a run's inputs die with it.
              struct Blank {
                std::tuple<std::decay_t<Args>&...> args;
                ~Blank() {
                  std::apply([](auto&... b) { (detail::blank(b), ...); }, args);
                }
              } blank_after{std::tie(a...)};
              std::vector<at::Tensor> out;
              if (o) {
                detail::flatten_outputs(detail::checkpoint_impl(*o, state(), f, a...), out);
              } else {
                detail::flatten_outputs(detail::call(f, a...), out);
              }
              return out;
            },
            *stored);
      };
      call = observer.begin(*this, inputs, run);
    }
    if (!call) {
      if (!options_) return off(fn, std::forward<Args>(args)...);
      return detail::checkpoint_impl(*options_, state(), std::forward<Fn>(fn), std::forward<Args>(args)...);
    }
    auto out = [&]() -> decltype(detail::call(fn, std::forward<Args>(args)...)) {
      if (!options_) return off(fn, std::forward<Args>(args)...);
      return detail::checkpoint_impl(*options_, state(), std::forward<Fn>(fn), std::forward<Args>(args)...);
    }();
    std::vector<at::Tensor> flat;
    detail::flatten_outputs(out, flat);
    call->finish(flat);
    return out;
  }
  std::optional<CheckpointOptions> options_;
  std::optional<OffloadOptions> offload_;
  Calls calls_;
  /** The hooks, which a copy (clone()) does not take: they are the
   *  original's (its parameters, its sharding). */
  struct Hook {
    std::shared_ptr<detail::UnitHook> p;
    Hook() = default;
    Hook(const Hook&) {}
    Hook& operator=(const Hook&) { return *this; }
  } hook_;
};

/** A checkpointable module as selectors see it. */
struct SelectorInput {
  std::string name;  ///< qualified name in the tree ("blocks.3.attn"; "" for the root): the first one it is reached by
  const torch::nn::Module* module;  ///< the module itself (never null; owned by the tree)
};

/** Chooses modules among the checkpointable ones of a tree, in tree order
 *  (pre-order), each module object once: one registered under two names, or
 *  shared by two parents, is seen at its first name only, as Python's
 *  named_modules() lists it (LibTorch's lists it at every name). So
 *  positional selectors count it once, and enable_checkpointing,
 *  disable_checkpointing and describe_checkpointing agree on it. */
class Selector {
 public:
  /** Given the checkpointable modules in tree order, one flag per module:
   *  true selects it. */
  using Fn = std::function<std::vector<bool>(const std::vector<SelectorInput>&)>;
  /** A selector from a function; description names it in
   *  describe_checkpointing() and in errors. */
  Selector(std::string description, Fn fn) : description_(std::move(description)), fn_(std::move(fn)) {}
  /** Applies the selector: one flag per entry of in, true = selected. */
  std::vector<bool> operator()(const std::vector<SelectorInput>& in) const { return fn_(in); }
  /** What it selects, in words (e.g. "every 2nd of type GptBlockImpl"). */
  const std::string& description() const { return description_; }

 private:
  std::string description_;
  Fn fn_;
};

/** Selectors for enable_checkpointing(): by name, type, position. */
namespace select {
/** Every checkpointable module. */
Selector all();
/** Modules whose qualified name matches a glob (`*`, `?`, `[...]`), e.g. "blocks.*.attn". */
Selector name(std::string glob);
/** Modules for which pred(module) holds; see type<M>(). */
Selector predicate(std::string description, std::function<bool(const torch::nn::Module&)> pred);
/** Modules of type M (the Impl class, e.g. remat::models::GptBlockImpl). */
template <class M>
Selector type() {
  return predicate("type " + c10::demangle(typeid(M).name()),
                   [](const torch::nn::Module& m) { return dynamic_cast<const M*>(&m) != nullptr; });
}
/** Of the modules base selects, the 1st, (n+1)-th, (2n+1)-th...: Megatron's
 *  uniform method, HF's every-n-layers. n >= 1. */
Selector every_n(int64_t n, Selector base = all());
/** The first n of the modules base selects: Megatron's block method. n >= 0. */
Selector first_n(int64_t n, Selector base = all());
}  // namespace select

/** Switches on the checkpointable modules of model that selector chooses,
 *  with options (a policy makes it selective); others keep their state.
 *  Returns how many module objects were switched on (a module reached by
 *  two names counts once). Throws remat::Error when the selector chooses
 *  none, listing the checkpointable modules of the tree. */
int64_t enable_checkpointing(torch::nn::Module& model, const Selector& selector,
                             const CheckpointOptions& options = CheckpointOptions());
/** Sends what the checkpointable modules that selector chooses save for
 *  backward to an offload store while their switch is off
 *  (Checkpointable::set_offloading); others keep their state. Returns how
 *  many module objects were chosen. Throws remat::Error on invalid options
 *  (a missing directory, by name) or when the selector chooses none (as
 *  enable_checkpointing), changing nothing. */
int64_t enable_offloading(torch::nn::Module& model, const Selector& selector, const OffloadOptions& options);
/** Switches every checkpointable module of model off, offloading included;
 *  returns how many were on or offloading. */
int64_t disable_checkpointing(torch::nn::Module& model);
/** A header line ("k of n checkpointable modules on"), then one line per
 *  checkpointable module object, in the order selectors see them: name,
 *  type, on/off and policy, and its other names ("(also as b)").
 *
 *  A module switched on whose forward does not call checkpointed() runs
 *  plain, and nothing in its type says so. It is detected from
 *  checkpointed_calls() once a forward has run: when some module of the
 *  tree has called checkpointed() but no module of this one's type has, a
 *  module of that type that is on is marked ", but no T has run through
 *  checkpointed() while other modules have: its forward must call
 *  checkpointed(), or the switch does nothing", and the header counts it
 *  (", j of them not running through checkpointed()"). By type: a block
 *  that a forward did not call is not marked while another of its type
 *  was called; a type none of whose modules was called is (it cannot be
 *  told from one that bypasses). Before any forward, and in a tree where
 *  no module calls checkpointed() at all, nothing is marked. */
std::string describe_checkpointing(const torch::nn::Module& model);

/** The checkpointable modules of model that selector chooses, in tree order
 *  (each object once, at its first name), for layers that act on the same
 *  modules as enable_checkpointing. Throws remat::Error as it does when the
 *  selector chooses none; `caller` names the function in that message. */
std::vector<SelectorInput> selected_checkpointables(const torch::nn::Module& model, const Selector& selector,
                                                    const std::string& caller);

/** enable_checkpointing() on a module holder (e.g. a TORCH_MODULE Gpt). */
template <class M>
int64_t enable_checkpointing(torch::nn::ModuleHolder<M>& model, const Selector& selector,
                             const CheckpointOptions& options = CheckpointOptions()) {
  return enable_checkpointing(*model, selector, options);
}
/** enable_offloading() on a module holder. */
template <class M>
int64_t enable_offloading(torch::nn::ModuleHolder<M>& model, const Selector& selector, const OffloadOptions& options) {
  return enable_offloading(*model, selector, options);
}
/** disable_checkpointing() on a module holder. */
template <class M>
int64_t disable_checkpointing(torch::nn::ModuleHolder<M>& model) {
  return disable_checkpointing(*model);
}
/** describe_checkpointing() on a module holder. */
template <class M>
std::string describe_checkpointing(const torch::nn::ModuleHolder<M>& model) {
  return describe_checkpointing(*model);
}

}  // namespace remat
