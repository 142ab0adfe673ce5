// See NOTE [recompute side effects] in write_guard.h.
#include "write_guard.h"

#include <ATen/core/ivalue.h>
#include <c10/core/GradMode.h>

namespace remat::detail {
namespace {
/** The defined tensors of an IValue, optional-tensor lists included. */
template <class F>
void tensors_of(const c10::IValue& v, F&& f) {
  if (v.isOptionalTensorList()) {
    for (const std::optional<at::Tensor> t : v.toOptionalTensorList()) {
      if (t.has_value() && t->defined()) f(*t);
    }
    return;
  }
  for_each_tensor(v, [&](const at::Tensor& t) {
    if (t.defined()) f(t);
  });
}
}  // namespace

/** Batch-norm kernels (native_batch_norm, cudnn_batch_norm, ...) update the
 *  running statistics without declaring it in their schemas. */
bool writes_undeclared(const c10::OperatorHandle& op, const c10::Argument& formal) {
  return (formal.name() == "running_mean" || formal.name() == "running_var") &&
         op.operator_name().name.find("batch_norm") != std::string::npos;
}

void WriteGuard::before(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args) {
  const auto& schema = op.schema();
  const auto& formals = schema.arguments();
  for (size_t a = 0; a < args.size() && a < formals.size(); ++a) {
    const auto* alias = formals[a].alias_info();
    if ((alias == nullptr || !alias->isWrite()) && !writes_undeclared(op, formals[a])) continue;
    tensors_of(args[a], [&](const at::Tensor& t) {
      if (!t.has_storage() || made_.count(t.storage().unsafeGetStorageImpl()) != 0) return;
      if (!copied_.insert(t.unsafeGetTensorImpl()).second) return;
      at::NoGradGuard no_grad;
      copies_.emplace_back(t, t.clone());
    });
  }
}

void WriteGuard::made(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> outputs) {
  if (is_view_like(op)) return;
  const auto& returns = op.schema().returns();
  const bool mutable_op = op.schema().is_mutable();
  for (size_t r = 0; r < outputs.size(); ++r) {
    // A mutable op's returns that alias an argument (in-place, out=) are
    // not new; its other returns are (batch norm's output beside the
    // running statistics it updates).
    if (mutable_op && (r >= returns.size() || returns[r].alias_info() != nullptr)) continue;
    tensors_of(outputs[r], [&](const at::Tensor& t) {
      if (t.has_storage()) made_.insert(t.storage().unsafeGetStorageImpl());
    });
  }
}

int64_t WriteGuard::restore() {
  at::NoGradGuard no_grad;
  const auto n = static_cast<int64_t>(copies_.size());
  for (auto it = copies_.rbegin(); it != copies_.rend(); ++it) it->first.copy_(it->second);
  copies_.clear();
  copied_.clear();
  return n;
}

bool is_view_like(const c10::OperatorHandle& op) {
  const auto& n = op.operator_name().name;
  if (n == "aten::_unsafe_view" || n == "aten::_reshape_alias" || n == "aten::lift_fresh") return true;
  for (const auto& r : op.schema().returns()) {
    if (r.alias_info() != nullptr && !r.alias_info()->isWrite()) return true;
  }
  return false;
}

void run_guarded(WriteGuard& guard, const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const size_t nin = op.schema().arguments().size();
  guard.before(op, c10::ArrayRef<c10::IValue>(stack->data() + stack->size() - nin, nin));
  dispatch::run_below(op, ks, stack);
  const size_t nout = op.schema().returns().size();
  guard.made(op, c10::ArrayRef<c10::IValue>(stack->data() + stack->size() - nout, nout));
}

namespace {
/** A recompute without a policy: every op runs, under the write guard. */
class GuardOnly final : public dispatch::Interceptor {
 public:
  explicit GuardOnly(WriteGuard* g) : guard_(g) {}
  void on_op(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) override {
    run_guarded(*guard_, op, ks, stack);
  }
  void on_tag(const at::Tensor&, const std::string&) override {}

 private:
  WriteGuard* guard_;
};
}  // namespace

std::unique_ptr<dispatch::Interceptor> make_write_guard_interceptor(WriteGuard* guard) {
  return std::make_unique<GuardOnly>(guard);
}

}  // namespace remat::detail
