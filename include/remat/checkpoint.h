// remat::checkpoint: non-reentrant activation checkpointing for any callable
// (saved-tensor hooks, as torch.utils.checkpoint with use_reentrant=False),
// and checkpoint_sequential with torch.utils.checkpoint.checkpoint_sequential's
// segment semantics.
//
// The region's forward runs once with grad enabled under saved-tensor hooks
// that keep a handle instead of each saved tensor; parameters and the
// region's own inputs are referenced, never copied. The first unpack in
// backward re-runs fn (RNG, autocast state and module buffers as in the
// first run) and stops once every still-needed tensor exists.
// Leaves out: the reentrant variant (it cannot run autograd::grad through the
// region and gives no parameter gradients when no input requires grad;
// docs/runtime.md, "What still differs from torch.utils.checkpoint").
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include <remat/error.h>
#include <remat/hooks.h>
#include <remat/offload.h>
#include <remat/policy.h>

namespace torch::nn {
class Sequential;
}  // namespace torch::nn

namespace remat {
namespace dispatch {
class Interceptor;
class Scope;
}  // namespace dispatch

/** What recomputation compares against the first run. */
enum class DeterminismCheck {
  kNone,      ///< nothing
  kMetadata,  ///< shape, dtype and device of every recomputed tensor
  kValues,    ///< metadata and bitwise values (hash taken at forward; slow)
};

/** The process-wide default of CheckpointOptions::early_stop (true unless
 *  set): options built afterwards start from it, a per-call
 *  `.early_stop(...)` overrides it (PyTorch's set_checkpoint_early_stop). */
void set_checkpoint_early_stop(bool enabled);
/** The process-wide default of CheckpointOptions::early_stop. */
bool checkpoint_early_stop();

/** The process-wide default of CheckpointOptions::debug (false unless set),
 *  e.g. turned on once while hunting a determinism error (PyTorch's
 *  set_checkpoint_debug_enabled); a per-call `.debug(...)` overrides it. */
void set_checkpoint_debug(bool enabled);
/** The process-wide default of CheckpointOptions::debug. */
bool checkpoint_debug();

/** Waits until every pending write of the offload stores that
 *  CheckpointOptions().offload(...) made is done (e.g. before measuring
 *  memory); throws the first background error (a failed write). */
void wait_checkpoint_offloads();

/** Options of remat::checkpoint() and checkpoint_sequential(): RNG replay,
 *  determinism checks, early stop, a selective policy, offload of the
 *  region's inputs. All optional, with the defaults below. */
struct CheckpointOptions {
  /** Replay the CPU RNG state (and that of CUDA devices holding inputs) in
   *  recompute, so dropout masks match the first run. Default true. */
  TORCH_ARG(bool, preserve_rng_state) = true;
  /** What recomputation compares against the first run; a mismatch throws
   *  remat::Error naming the saved tensor and what differs. Default kMetadata. */
  TORCH_ARG(DeterminismCheck, determinism_check) = DeterminismCheck::kMetadata;
  /** Stop recomputing as soon as every needed tensor exists. Default
   *  checkpoint_early_stop() (true unless changed). */
  TORCH_ARG(bool, early_stop) = checkpoint_early_stop();
  /** Selective checkpointing (policy.h): which ops' outputs are saved from
   *  the first run instead of recomputed. Default none: everything is
   *  recomputed. */
  TORCH_ARG(std::optional<Policy>, policy);
  /** PyTorch's debug=True: record the ops of the forward and of the
   *  recomputation, and show them side by side, aligned at the first
   *  difference, in a determinism error. Default checkpoint_debug() (false
   *  unless changed: nothing recorded). */
  TORCH_ARG(bool, debug) = checkpoint_debug();
  /** Offload the region's inputs (its checkpoints) to a target while the
   *  rest is recomputed (the Unsloth scheme): the inputs are saved through
   *  an offload store (docs/offload.md), one per distinct OffloadOptions in
   *  the process, reused across regions and steps. Same as calling the
   *  region inside an OffloadScope, without offloading anything else.
   *  Ignored for a region nested in another (its inputs go through the
   *  outer region). Default none. */
  TORCH_ARG(std::optional<OffloadOptions>, offload);
};

/** Process-wide counters, for tests and telemetry. */
struct CheckpointStats {
  int64_t regions = 0;         ///< checkpointed forward calls
  int64_t recomputations = 0;  ///< re-runs of a region's function
  int64_t early_stops = 0;     ///< re-runs cut short by early stop
  int64_t ops_saved = 0;       ///< op outputs kept by a selective policy (first runs)
  int64_t ops_replayed = 0;    ///< saved ops handed back in a recompute instead of running
  int64_t ops_recomputed = 0;  ///< ops run again in recomputes of regions with a policy
  int64_t writes_undone = 0;   ///< tensors that outlive a recompute, written by it and put back
};
/** The counters since the process started or the last reset_checkpoint_stats(). */
CheckpointStats checkpoint_stats();
/** Sets every counter of checkpoint_stats() (and op_stats()) to 0. */
void reset_checkpoint_stats();

/** True on a thread that is re-running a checkpointed function (e.g. to
 *  skip side effects such as logging or counters). */
bool is_recomputing();

namespace detail {

struct Frame;
using RecomputeFn = std::function<void(const std::vector<at::Tensor>&)>;

/** A module whose train/eval flag a recompute replays. The callable's own
 *  module by address (first): the recompute calls it, so it outlives the
 *  graph anyway, and it need not be owned by a shared_ptr. A descendant by
 *  weak_ptr (second; first null): one replaced between forward and
 *  backward (replace_module) is freed and then skipped, and a strong
 *  reference would keep a module that stores its outputs alive in a cycle
 *  with its own graph. (The core's replay takes the same pair.) */
using ModuleRef = std::pair<torch::nn::Module*, std::weak_ptr<torch::nn::Module>>;

/** What a checkpoint knows of a module fn: its parameters (version-checked
 *  before each recompute), buffers (restored after it, so BatchNorm
 *  statistics are updated once per step as in a plain run) and modules,
 *  the module and its descendants in pre-order, whose train/eval flags the
 *  recompute runs with as the forward did (an eval() between forward and
 *  backward would change what it computes). */
struct ModuleState {
  std::vector<at::Tensor> parameters;
  std::vector<at::Tensor> buffers;
  std::vector<ModuleRef> modules;
};
/** m and its descendants in pre-order, for ModuleState::modules. */
std::vector<ModuleRef> module_tree(const torch::nn::Module& m);

/** The process-wide lock of NOTE [RNG regions and threads] (replay.h),
 *  held by a region's first run from RNG capture to the end of its forward. */
void lock_rng_regions();
void unlock_rng_regions();

/** True when a checkpoint would save anything (grad mode on, not inference
 *  mode); otherwise checkpoint() just calls fn. */
bool should_checkpoint();

/** One checkpointed forward: saves the inputs (through any outer hooks, so
 *  nested checkpoints free their inputs too), captures RNG/autocast state and
 *  pushes the checkpoint hooks until destroyed. */
class Region {
 public:
  Region(const CheckpointOptions& options, const std::vector<at::Tensor>& inputs, RecomputeFn recompute,
         ModuleState state);
  ~Region();
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

 private:
  void init(const CheckpointOptions& options, const std::vector<at::Tensor>& inputs, RecomputeFn recompute,
            ModuleState state);
  bool rng_locked_ = false;
  std::shared_ptr<Frame> frame_;
  std::unique_ptr<ScopedHooks> scope_;
  std::unique_ptr<dispatch::Interceptor> interceptor_;  // with a policy: the first run's
  std::unique_ptr<dispatch::Scope> dispatch_scope_;
};

template <class T>
void collect(std::vector<at::Tensor>& out, const T& v) {
  if constexpr (std::is_same_v<T, at::Tensor>) {
    out.push_back(v);
  } else if constexpr (std::is_same_v<T, std::vector<at::Tensor>>) {
    out.insert(out.end(), v.begin(), v.end());
  }
}

template <class T>
void blank(T& v) {
  if constexpr (std::is_same_v<T, at::Tensor>) {
    v = at::Tensor();
  } else if constexpr (std::is_same_v<T, std::vector<at::Tensor>>) {
    for (auto& t : v) t = at::Tensor();
  }
}

template <class T>
void fill(T& v, const std::vector<at::Tensor>& in, size_t& k) {
  if constexpr (std::is_same_v<T, at::Tensor>) {
    v = in[k++];
  } else if constexpr (std::is_same_v<T, std::vector<at::Tensor>>) {
    for (auto& t : v) t = in[k++];
  }
}

/** Calls a module holder's (or module pointer's) forward(), or a callable. */
template <class F, class... A>
decltype(auto) call(F& f, A&&... a) {
  if constexpr (requires { f->forward(std::forward<A>(a)...); }) {
    return f->forward(std::forward<A>(a)...);
  } else {
    return std::invoke(f, std::forward<A>(a)...);
  }
}

/** A module holder's parameters, buffers and module tree; nothing for
 *  plain callables. */
template <class F>
ModuleState module_state_of(F& f) {
  if constexpr (requires {
                  f->buffers();
                  f->parameters();
                }) {
    ModuleState s{f->parameters(), f->buffers(), {}};
    // A wrapper with operator-> only (no module to reach) keeps the rest.
    if constexpr (requires { module_tree(*f); }) s.modules = module_tree(*f);
    return s;
  } else {
    return {};
  }
}

/** checkpoint() with the module state given explicitly. */
template <class Fn, class... Args>
auto checkpoint_impl(const CheckpointOptions& options, ModuleState state, Fn&& fn, Args&&... args) {
  static_assert(std::is_copy_constructible_v<std::decay_t<Fn>>,
                "remat::checkpoint keeps a copy of fn for the recompute: fn must be copyable");
  if (!should_checkpoint()) return call(fn, std::forward<Args>(args)...);
  std::vector<at::Tensor> inputs;
  (collect(inputs, args), ...);
  using Stored = std::tuple<std::decay_t<Fn>, std::decay_t<Args>...>;
  auto stored = std::make_shared<Stored>(fn, args...);
  // The stored copy holds no tensors between runs: inputs live in the frame.
  std::apply([](auto&, auto&... a) { (blank(a), ...); }, *stored);
  RecomputeFn recompute = [stored](const std::vector<at::Tensor>& in) {
    std::apply(
        [&](auto& f, auto&... a) {
          size_t k = 0;
          (fill(a, in, k), ...);
          struct Reblank {
            Stored* s;
            ~Reblank() {
              std::apply([](auto&, auto&... b) { (blank(b), ...); }, *s);
            }
          } reblank{stored.get()};
          call(f, a...);
        },
        *stored);
  };
  Region region(options, inputs, std::move(recompute), std::move(state));
  return call(fn, std::forward<Args>(args)...);
}

}  // namespace detail

/** Checkpoints fn(args...): see the file comment. Tensors among args (also
 *  inside std::vector<at::Tensor>) are the region's inputs; other args are
 *  copied and passed again to the recompute. fn must be copyable; a module
 *  holder is called through forward() and its buffers are restored after
 *  each recompute. Returns what fn returns (Tensor, tuple, vector...).
 *  A lambda that captures a module holder by value must be `mutable`
 *  (`[lstm](const at::Tensor& x) mutable { return lstm->forward(x); }`):
 *  forward() is non-const and a plain lambda's captures are const, so it
 *  does not compile with or without remat; or capture by reference. */
template <class Fn, class... Args>
auto checkpoint(const CheckpointOptions& options, Fn&& fn, Args&&... args) {
  return detail::checkpoint_impl(options, detail::module_state_of(fn), std::forward<Fn>(fn),
                                 std::forward<Args>(args)...);
}

/** checkpoint() with default CheckpointOptions. */
template <class Fn, class... Args>
requires(!std::is_same_v<std::decay_t<Fn>, CheckpointOptions>) auto checkpoint(Fn&& fn, Args&&... args) {
  return checkpoint(CheckpointOptions(), std::forward<Fn>(fn), std::forward<Args>(args)...);
}

/** PyTorch's checkpoint_sequential: splits seq into `segments` segments of
 *  size(seq)/segments modules, checkpoints all but the last, which runs
 *  plain. segments must be in [1, size(seq)]. Each module takes and returns
 *  one Tensor. */
at::Tensor checkpoint_sequential(const torch::nn::Sequential& seq, int64_t segments, const at::Tensor& x,
                                 const CheckpointOptions& options = CheckpointOptions());

namespace detail {
struct SequentialStage {
  std::function<at::Tensor(const at::Tensor&)> fn;
  ModuleState state;
};
at::Tensor checkpoint_stages(std::vector<SequentialStage> stages, int64_t segments, const at::Tensor& x,
                             const CheckpointOptions& options, const char* what);
}  // namespace detail

/** checkpoint_sequential over any list of callables, Tensor -> Tensor. */
at::Tensor checkpoint_sequential(const std::vector<std::function<at::Tensor(const at::Tensor&)>>& fns, int64_t segments,
                                 const at::Tensor& x, const CheckpointOptions& options = CheckpointOptions());

/** checkpoint_sequential over a vector of module holders (their parameters
 *  are version-checked and buffers restored, as for a Sequential). */
template <class H>
requires requires(H h, const at::Tensor& t) {
  h->forward(t);
  h->parameters();
  h->buffers();
}
at::Tensor checkpoint_sequential(const std::vector<H>& modules, int64_t segments, const at::Tensor& x,
                                 const CheckpointOptions& options = CheckpointOptions()) {
  std::vector<detail::SequentialStage> stages;
  for (H m : modules) {
    stages.push_back({[m](const at::Tensor& h) mutable { return m->forward(h); },
                      {m->parameters(), m->buffers(), detail::module_tree(*m)}});
  }
  return detail::checkpoint_stages(std::move(stages), segments, x, options, "modules");
}

/** checkpoint_sequential over a ModuleList whose modules are all of type M
 *  (the Impl class, e.g. `checkpoint_sequential<GptBlockImpl>(list, 4, x)`);
 *  throws remat::Error naming the first module that is not. */
template <class M>
at::Tensor checkpoint_sequential(const torch::nn::ModuleList& list, int64_t segments, const at::Tensor& x,
                                 const CheckpointOptions& options = CheckpointOptions()) {
  std::vector<detail::SequentialStage> stages;
  for (size_t i = 0; i < list->size(); ++i) {
    std::shared_ptr<M> m = std::dynamic_pointer_cast<M>(list->ptr(i));
    if (!m) {
      throw Error("[remat::checkpoint_sequential] module " + std::to_string(i) + " of the ModuleList is a " +
                  list->ptr(i)->name() + ", not a " + c10::demangle(typeid(M).name()) +
                  "; pass the modules' common type, or a std::vector of callables.");
    }
    stages.push_back(
        {[m](const at::Tensor& h) { return m->forward(h); }, {m->parameters(), m->buffers(), detail::module_tree(*m)}});
  }
  return detail::checkpoint_stages(std::move(stages), segments, x, options, "modules");
}

}  // namespace remat
