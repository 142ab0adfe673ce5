// Internal: op-level interception through the c10 dispatcher, the mechanism
// under selective checkpointing (policies, names, residual inspection).
// NOTE [op-level interception, as built]: remat registers one boxed fallback
// on DispatchKey::Fake. Fake sits below ADInplaceOrView and Autograd and
// above BackendSelect and the backends, so the fallback sees each ATen op
// after autograd has recorded it (its saved tensors go through the hooks as
// usual) and after CompositeImplicitAutograd ops (linear, matmul, dropout)
// have decomposed; what it sees are the ops that run kernels (addmm, bmm,
// _softmax, bernoulli_). Autocast sits above autograd, so its casts reach
// the fallback as ordinary `_to_copy` ops; inference mode excludes autograd,
// not Fake. In a C++-only process nothing else registers a fallback on Fake
// (checked at install: hasBackendFallbackForDispatchKey); Python's
// FakeTensor uses the Python key, and a process with Python's fallback on
// Fake is refused loudly. The key is in this thread's TLS include set only
// while an Interceptor is pushed (a Scope lives), so outside regions
// no op pays anything: the dispatcher never computes Fake into a key set.
// With one active, each op pays one boxed call (~1-2 us on this machine),
// negligible next to the kernels at the reference sizes. The fallback runs
// the interceptor with Fake excluded (Suspend), so the kernel's own nested
// ops and anything the interceptor does are not intercepted again.
// NOTE [stacked interceptors]: Scopes stack per thread, outermost first. An
// op goes to the innermost interceptor; its run_below() hands the op to the
// next one out, and the outermost's runs the kernel. So an inner region
// (a nested checkpoint with a policy, the debug log) never hides an op from
// an outer one (an outer re-run's write guard sees the writes of the inner
// region's ops), and an op an inner interceptor hands back without running
// (a selective cache hit) reaches no outer one: nothing ran. A Scope with
// no interceptor only logs and passes ops on.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <string>
#include <vector>

namespace remat::dispatch {

/** Sees every op that runs on this thread while it is on top of the stack. */
class Interceptor {
 public:
  virtual ~Interceptor() = default;
  /** stack holds the op's arguments; on return it must hold its results.
   *  run_below() executes the op. Runs with interception suspended. */
  virtual void on_op(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) = 0;
  /** remat::checkpoint_name(t, name) on this thread. */
  virtual void on_tag(const at::Tensor& t, const std::string& name) = 0;
};

/** Runs op below the calling interceptor: on the next interceptor out, or
 *  on the kernels below the interception key. */
void run_below(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);

/** The innermost interceptor of this thread, or nullptr. */
Interceptor* current();

/** checkpoint_name(t, name): every interceptor of this thread sees it,
 *  innermost first. */
void tag(const at::Tensor& t, const std::string& name);

/** How many Scopes this thread has opened so far (a layer that must see
 *  every op tells from it whether another interceptor took over meanwhile). */
uint64_t scopes_opened();

/** Pushes an interceptor on this thread's stack (nullptr: none, ops pass
 *  through to the outer ones) and turns interception on for this thread;
 *  pops and restores both when destroyed. With a log, the key of every op
 *  that reaches this level is appended to it (the debug mode). */
class Scope {
 public:
  explicit Scope(Interceptor* i, std::vector<std::string>* log = nullptr);
  ~Scope();
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  size_t depth_;  // levels below this one
  c10::impl::ForceDispatchKeyGuard keys_;
};

/** Turns interception off on this thread for its lifetime (remat's own
 *  tensor work inside a region: hashing, saving, policy calls). */
class Suspend {
 public:
  Suspend();
  ~Suspend();
  Suspend(const Suspend&) = delete;
  Suspend& operator=(const Suspend&) = delete;

 private:
  c10::impl::ForceDispatchKeyGuard keys_;
};

/** "aten::mm" or "aten::add.Tensor" (name, then overload when it has one). */
std::string op_key(const c10::OperatorHandle& op);

}  // namespace remat::dispatch
