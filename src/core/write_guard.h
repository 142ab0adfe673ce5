// Internal: undoes what a recomputation writes into tensors that outlive it.
// NOTE [recompute side effects]: a re-run of a checkpointed function must
// not change state that existed before it: BatchNorm running statistics
// updated inside a lambda (not a module holder, whose buffers are restored
// anyway), a user's counter tensor, a region input written in place. While
// a region recomputes, every op goes through the interception key (see
// NOTE [op-level interception, as built]); before an op writes into a tensor
// whose storage was not made by the recompute itself, the guard copies that
// tensor once, and when the recompute ends (finished, stopped early, or
// failed) it writes the copies back, last first. Storages made by the
// recompute (op outputs, and outputs a selective policy hands back) are not
// copied: the recompute's own tensors must keep what it computed. Cost:
// one boxed call per op during recomputes, and a copy per written
// pre-existing tensor. A region's first run keeps such copies too (NOTE
// [tensors the first run writes] in region/checkpoint.cpp).
#pragma once

#include "dispatch.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <memory>
#include <unordered_set>
#include <utility>
#include <vector>

namespace remat::detail {

/** Tensors of an IValue (a Tensor or a list of them, undefined ones
 *  included), in order. */
template <class F>
void for_each_tensor(const c10::IValue& v, F&& f) {
  if (v.isTensor()) {
    f(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorVector()) f(t);
  }
}

/** True for ops whose output is (an alias of) their first input's storage. */
bool is_view_like(const c10::OperatorHandle& op);

class WriteGuard {
 public:
  /** Before op runs on args: copies the pre-existing tensors it writes. */
  void before(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args);
  /** After an op (run or handed back): the storages it allocated are the
   *  recompute's own (not those of views and in-place results). */
  void made(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> outputs);
  /** t's storage is the recompute's own (made for it before it started). */
  void adopt(const at::Tensor& t) {
    if (t.defined() && t.has_storage()) made_.insert(t.storage().unsafeGetStorageImpl());
  }
  /** Writes the copies back (last first); returns how many. */
  int64_t restore();
  /** Hands over the copies (tensor, its values before the first write)
   *  instead of writing them back. */
  std::vector<std::pair<at::Tensor, at::Tensor>> take_copies() {
    copied_.clear();
    return std::move(copies_);
  }

 private:
  std::unordered_set<const c10::StorageImpl*> made_;
  std::unordered_set<const c10::TensorImpl*> copied_;
  std::vector<std::pair<at::Tensor, at::Tensor>> copies_;  // tensor, its values before the write
};

/** Runs op under guard (before, run, made). */
void run_guarded(WriteGuard& guard, const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);
/** The interceptor of a recompute without a policy: the guard alone. */
std::unique_ptr<dispatch::Interceptor> make_write_guard_interceptor(WriteGuard* guard);

}  // namespace remat::detail
