// C++ saved-tensor hooks: the counterpart of Python's
// torch.autograd.graph.saved_tensors_hooks, on which checkpoint, offload and
// selective recompute are built. How the engine serves them: docs/runtime.md,
// "Saved-tensor hooks in C++". Leaves out: hooks on autograd's CUDA worker
// threads during double backward (the stack is per thread and not propagated).
#pragma once

#include <any>
#include <functional>
#include <memory>
#include <type_traits>
#include <utility>

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>

namespace remat {

/** One saved tensor's hook: created when autograd saves a tensor, lives as
 *  long as the graph node that saved it (so it can own what it packed). */
using SavedHook = torch::autograd::SavedVariableHooks;

/** Makes a SavedHook for each tensor autograd saves while it is on top of
 *  this thread's hook stack. */
class HookFactory {
 public:
  virtual ~HookFactory() = default;
  /** A new hook for the tensor autograd is saving now (its pack runs next). */
  virtual std::unique_ptr<SavedHook> make_hook() = 0;
};

/** Installs remat's autograd engine (once per process). Every entry point
 *  calls it; throws remat::Error if another engine (e.g. Python's) is the
 *  default, since whichever installs last wins. */
void ensure_engine_installed();

/** Pushes a factory on this thread's stack for the guard's lifetime; the
 *  innermost guard applies. Nestable; not movable. */
class ScopedHooks {
 public:
  /** Pushes factory (not null) until the guard is destroyed. */
  explicit ScopedHooks(std::shared_ptr<HookFactory> factory);
  ~ScopedHooks();
  ScopedHooks(const ScopedHooks&) = delete;
  ScopedHooks& operator=(const ScopedHooks&) = delete;
};

/** The factory on top of this thread's stack, or nullptr (the common,
 *  cheap case: autograd then saves tensors as usual). */
HookFactory* current_hooks();

/** Suspends every remat hook on this thread for its lifetime (tensors saved
 *  meanwhile are kept as usual), like disable_saved_tensors_hooks. */
class DisableHooks {
 public:
  DisableHooks();
  ~DisableHooks();
  DisableHooks(const DisableHooks&) = delete;
  DisableHooks& operator=(const DisableHooks&) = delete;

 private:
  size_t saved_depth_;
};

namespace detail {
/** While one lives on this thread, a backward() (accumulating into .grad)
 *  that remat's engine runs here leaves every leaf it reaches with the
 *  .grad it had before: a checkpoint's re-run of a function that calls
 *  backward() itself must not accumulate a second time (in-place
 *  accumulation into an existing .grad is undone by the re-run's write
 *  guard; this covers a .grad set or replaced). Nestable. */
class KeepLeafGrads {
 public:
  KeepLeafGrads();
  ~KeepLeafGrads();
  KeepLeafGrads(const KeepLeafGrads&) = delete;
  KeepLeafGrads& operator=(const KeepLeafGrads&) = delete;
};

std::shared_ptr<HookFactory> make_function_hooks(std::function<std::any(const at::Tensor&)> pack,
                                                 std::function<at::Tensor(const std::any&)> unpack);
}  // namespace detail

/** RAII pack/unpack pair: pack(tensor) runs when autograd saves a tensor and
 *  returns anything (type P); unpack(const P&) runs when backward needs the
 *  tensor and must return it (same shape and dtype).
 *
 *    remat::SavedTensorsHooks guard(
 *        [](const at::Tensor& t) { return t.to(at::kBFloat16); },
 *        [](const at::Tensor& t) { return t.to(at::kFloat); });
 */
class SavedTensorsHooks {
 public:
  /** Pushes the pair on this thread's hook stack until the guard is
   *  destroyed; both are called on the thread that saves or unpacks. */
  template <class Pack, class Unpack>
  SavedTensorsHooks(Pack pack, Unpack unpack)
      : scope_(
            detail::make_function_hooks([pack = std::move(pack)](const at::Tensor& t) -> std::any { return pack(t); },
                                        [unpack = std::move(unpack)](const std::any& p) -> at::Tensor {
                                          using P = std::decay_t<std::invoke_result_t<Pack&, const at::Tensor&>>;
                                          return unpack(std::any_cast<const P&>(p));
                                        })) {}

 private:
  ScopedHooks scope_;
};

}  // namespace remat
