// The thread-local hook stack and the autograd engine that serves it.
// NOTE [saved-tensor hooks in C++]: SavedVariable asks the default engine
// (Engine::get_default_engine().get_default_saved_variable_hooks()) for hooks
// each time autograd saves a tensor; the base engine answers nullptr (the
// Python engine overrides it). We install a subclass, with
// torch::autograd::set_default_engine_stub(), whose answer is the top of this
// thread's stack. Consequences: it is installed once, before the first
// backward, and refuses loudly when another engine (libtorch_python's) is the
// default, since whichever installs last wins; a hook object is made per saved
// tensor and lives as long as the graph node that saved it; backward may run
// on an engine worker thread, so hooks carry their state and never read
// thread-locals at unpack time. The empty-stack path is one thread-local load.
#include <remat/hooks.h>

#include <algorithm>
#include <mutex>
#include <typeinfo>
#include <unordered_set>
#include <vector>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <remat/error.h>

#include "node_ptr.h"
#include "rng_lock.h"

namespace remat {
namespace {

thread_local std::vector<std::shared_ptr<HookFactory>> t_stack;
// Hooks below this depth are suspended by DisableHooks.
thread_local size_t t_disabled_below = 0;

// > 0 while a detail::KeepLeafGrads lives on this thread.
thread_local int t_keep_leaf_grads = 0;

namespace ta = torch::autograd;
using NodePtr = detail::AnyNodePtr;  // shared_ptr or intrusive_ptr (node_ptr.h)

/** The AccumulateGrad nodes reachable from roots, each with its leaf's
 *  current .grad (undefined included). */
std::vector<std::pair<NodePtr, at::Tensor>> leaf_grads(const ta::edge_list& roots) {
  std::vector<std::pair<NodePtr, at::Tensor>> out;
  std::unordered_set<const ta::Node*> seen;
  std::vector<NodePtr> todo;
  for (const auto& e : roots) {
    if (e.function && seen.insert(e.function.get()).second) todo.push_back(e.function);
  }
  while (!todo.empty()) {
    NodePtr n = std::move(todo.back());
    todo.pop_back();
    if (auto* acc = dynamic_cast<ta::AccumulateGrad*>(n.get())) {
      out.emplace_back(n, acc->variable.grad());
      continue;
    }
    for (const auto& e : n->next_edges()) {
      if (e.function && seen.insert(e.function.get()).second) todo.push_back(e.function);
    }
  }
  return out;
}

struct RematEngine final : ta::Engine {
  std::unique_ptr<ta::SavedVariableHooks> get_default_saved_variable_hooks() override {
    if (t_stack.size() <= t_disabled_below) return nullptr;
    return t_stack.back()->make_hook();
  }
  ta::variable_list execute(const ta::edge_list& roots, const ta::variable_list& inputs, bool keep_graph,
                            bool create_graph, bool accumulate_grad, const ta::edge_list& outputs) override {
    ensure_device_threads();
    // A backward started inside a region that holds the RNG lock may run on
    // a device thread that needs it (NOTE [RNG lock lent to device threads]).
    detail::RngLockLend lend;
    if (t_keep_leaf_grads == 0 || !accumulate_grad) {
      return Engine::execute(roots, inputs, keep_graph, create_graph, accumulate_grad, outputs);
    }
    struct Restore {
      std::vector<std::pair<NodePtr, at::Tensor>> grads;
      ~Restore() {
        for (auto& [node, grad] : grads) static_cast<ta::AccumulateGrad*>(node.get())->variable.mutable_grad() = grad;
      }
    } restore{leaf_grads(roots)};
    return Engine::execute(roots, inputs, keep_graph, create_graph, accumulate_grad, outputs);
  }
  void thread_init(int device, const std::shared_ptr<ta::ReadyQueue>& ready_queue, bool should_increment) override {
    detail::mark_autograd_device_thread();
    Engine::thread_init(device, ready_queue, should_increment);
  }
  // Device worker threads must stop before the base destructor runs.
  ~RematEngine() override { stop(); }

  // NOTE [device threads of remat's engine]: Engine starts its device
  // threads (one per accelerator, with their ready queues) under one
  // process-wide once flag in engine.cpp, not one per engine. remat's engine
  // becomes the default at the first checkpoint; when a backward ran on the
  // stock engine before (a plain warm-up step on a GPU), the flag is spent
  // and this engine has no device queue: its first backward on a device
  // failed an INTERNAL ASSERT in Engine::ready_queue (seen on an H200). So
  // once, before the first backward: start them the usual way, and where
  // that did nothing although there are devices, start them directly.
  void ensure_device_threads() {
    std::call_once(threads_once_, [this] {
      initialize_device_threads_pool();
      c10::DeviceIndex devices = 0;
      for (const auto& impl_atomic : c10::impl::device_guard_impl_registry) {
        const auto* impl = impl_atomic.load();
        if (impl == nullptr) continue;
        const auto type = impl->type();  // these run on the CPU ready queue (as in engine.cpp)
        if (type == c10::DeviceType::CPU || type == c10::DeviceType::Meta || type == c10::DeviceType::Lazy) continue;
        devices = std::max(devices, impl->deviceCount());
      }
      if (devices > 0 && device_ready_queues_.empty()) {
        start_device_threads();
      } else if (!thread_pool_shared_) {
        // No device, but the pool of threads for deeply nested (reentrant)
        // backwards is made by start_device_threads too.
        thread_pool_shared_ = std::make_shared<ThreadPoolShared>();
      }
    });
  }

 private:
  std::once_flag threads_once_;
};

RematEngine& remat_engine() {
  static RematEngine engine;
  return engine;
}

torch::autograd::Engine& remat_engine_stub() { return remat_engine(); }

std::once_flag g_install_once;

}  // namespace

void ensure_engine_installed() {
  std::call_once(g_install_once, [] {
    auto& current = torch::autograd::Engine::get_default_engine();
    if (typeid(current) != typeid(torch::autograd::Engine)) {
      throw Error(std::string("[remat::hooks] another autograd engine (") + typeid(current).name() +
                  ") is already the default, e.g. Python's from libtorch_python; remat's "
                  "saved-tensor hooks cannot work beside it. Use remat from a C++ process "
                  "without the Python bindings loaded.");
    }
    torch::autograd::set_default_engine_stub(&remat_engine_stub);
  });
  // Cheap re-check: someone may have installed an engine after us.
  if (&torch::autograd::Engine::get_default_engine() != &remat_engine()) {
    throw Error(
        "[remat::hooks] remat's autograd engine was replaced by another one (e.g. Python's); "
        "saved-tensor hooks would be ignored and checkpoints would keep everything. Use remat "
        "from a C++ process without the Python bindings loaded.");
  }
}

ScopedHooks::ScopedHooks(std::shared_ptr<HookFactory> factory) {
  ensure_engine_installed();
  t_stack.push_back(std::move(factory));
}

ScopedHooks::~ScopedHooks() { t_stack.pop_back(); }

HookFactory* current_hooks() { return t_stack.size() <= t_disabled_below ? nullptr : t_stack.back().get(); }

DisableHooks::DisableHooks() : saved_depth_(t_disabled_below) { t_disabled_below = t_stack.size(); }
DisableHooks::~DisableHooks() { t_disabled_below = saved_depth_; }

namespace detail {
namespace {

struct Functions {
  std::function<std::any(const at::Tensor&)> pack;
  std::function<at::Tensor(const std::any&)> unpack;
};

class FunctionHook final : public SavedHook {
 public:
  explicit FunctionHook(std::shared_ptr<Functions> fns) : fns_(std::move(fns)) {}
  void call_pack_hook(const at::Tensor& tensor) override { packed_ = fns_->pack(tensor); }
  at::Tensor call_unpack_hook() override { return fns_->unpack(packed_); }

 private:
  std::shared_ptr<Functions> fns_;  // outlives the guard that pushed it
  std::any packed_;
};

class FunctionHookFactory final : public HookFactory {
 public:
  explicit FunctionHookFactory(std::shared_ptr<Functions> fns) : fns_(std::move(fns)) {}
  std::unique_ptr<SavedHook> make_hook() override { return std::make_unique<FunctionHook>(fns_); }

 private:
  std::shared_ptr<Functions> fns_;
};

}  // namespace

KeepLeafGrads::KeepLeafGrads() { ++t_keep_leaf_grads; }
KeepLeafGrads::~KeepLeafGrads() { --t_keep_leaf_grads; }

std::shared_ptr<HookFactory> make_function_hooks(std::function<std::any(const at::Tensor&)> pack,
                                                 std::function<at::Tensor(const std::any&)> unpack) {
  return std::make_shared<FunctionHookFactory>(
      std::make_shared<Functions>(Functions{std::move(pack), std::move(unpack)}));
}

}  // namespace detail

}  // namespace remat
