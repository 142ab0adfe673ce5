// See NOTE [early stop in planned recomputes] in early_stop.h.
#include "early_stop.h"

#include <optional>
#include <string>
#include <typeinfo>
#include <unordered_map>
#include <unordered_set>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/tensor.h>

#include <remat/error.h>
#include <remat/hooks.h>

#include "dispatch.h"

namespace remat::detail {

namespace ta = torch::autograd;

std::shared_ptr<const StopRecord> StopRecords::get(int i) const {
  std::lock_guard<std::mutex> lock(mu_);
  return disabled_[i] ? nullptr : recs_[i];
}

bool StopRecords::wants_record(int i) const {
  std::lock_guard<std::mutex> lock(mu_);
  return !disabled_[i] && !recs_[i];
}

void StopRecords::set(int i, std::shared_ptr<const StopRecord> r) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!recs_[i]) recs_[i] = std::move(r);
}

void StopRecords::disable(int i) {
  std::lock_guard<std::mutex> lock(mu_);
  disabled_[i] = 1;
}

namespace {

const c10::StorageImpl* storage_of(const at::Tensor& t) {
  return t.defined() && t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
}

template <class F>
void for_each_tensor(const c10::IValue& v, F&& f) {
  if (v.isTensor()) {
    f(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList()) f(t);
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) {
      if (e.isTensor()) f(e.toTensor());
    }
  }
}

StopRecord::Out out_of(const at::Tensor& t) {
  StopRecord::Out o;
  if (!t.defined()) return o;
  o.sizes = t.sizes().vec();
  o.strides = t.strides().vec();
  o.options = t.options();
  o.defined = true;
  return o;
}

/** ATen's generated backward nodes (torch::autograd::generated, Itanium
 *  names), CopySlices around them and the error nodes keep every saved
 *  tensor in a SavedVariable, which remat's hooks see. */
bool keeps_saved_in_saved_variables(const ta::Node& node) {
  static const std::string kGenerated = "N5torch8autograd9generated";
  const std::string mangled = typeid(node).name();
  return mangled.compare(0, kGenerated.size(), kGenerated) == 0 || dynamic_cast<const ta::CopySlices*>(&node) ||
         dynamic_cast<const ta::Error*>(&node) || dynamic_cast<const ta::DelayedError*>(&node);
}

/** empty_strided can stand in for it: dense and strided (not sparse,
 *  quantized or nested). */
bool producible(const at::Tensor& t) {
  return !t.defined() || (t.layout() == c10::kStrided && !t.is_quantized() && !t.is_nested());
}

at::Tensor make(const StopRecord::Out& o) {
  return o.defined ? at::empty_strided(o.sizes, o.strides, o.options) : at::Tensor();
}

}  // namespace

struct StopRecorder::Impl final : dispatch::Interceptor {
  StopRecord rec;
  // storage -> the last op that returned it or wrote it (index into rec.ops)
  std::unordered_map<const c10::StorageImpl*, int64_t> writer;
  std::unordered_set<const c10::StorageImpl*> saved;
  int64_t marker = -1;  // the last op returning something other than tensors
  bool foreign = false;
  HookFactory* mine = nullptr;
  uint64_t scopes0 = 0;
  std::optional<SavedTensorsHooks> hooks;
  std::optional<dispatch::Scope> scope;

  void on_op(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) override {
    if (current_hooks() != mine) foreign = true;  // another layer packs what this op saves
    const auto& schema = op.schema();
    const auto& args = schema.arguments();
    const size_t n = args.size();
    const int64_t idx = static_cast<int64_t>(rec.ops.size());
    std::vector<at::Tensor> written;  // through mutable arguments
    for (size_t a = 0; a < n; ++a) {
      const auto* ai = args[a].alias_info();
      if (ai != nullptr && ai->isWrite()) {
        for_each_tensor((*stack)[stack->size() - n + a], [&](const at::Tensor& t) { written.push_back(t); });
      }
    }
    dispatch::run_below(op, ks, stack);
    StopRecord::OpRec r;
    r.name = op.operator_name();
    r.fakeable = true;
    const auto& rets = schema.returns();
    const size_t nr = rets.size();
    for (size_t k = 0; k < nr; ++k) {
      const c10::IValue& v = (*stack)[stack->size() - nr + k];
      StopRecord::Ret ret;
      const auto* ai = rets[k].alias_info();
      if (ai != nullptr) {
        ret.kind = StopRecord::Ret::kAlias;
        for (size_t a = 0; a < n; ++a) {
          const auto* aa = args[a].alias_info();
          if (aa != nullptr && aa->beforeSets() == ai->beforeSets()) {
            ret.alias_arg = static_cast<int>(a);
            break;
          }
        }
        // A view runs (no kernel worth skipping); an alias not found, too.
        if (!ai->isWrite() || ret.alias_arg < 0) r.fakeable = false;
      } else if (v.isTensor()) {
        ret.outs.push_back(out_of(v.toTensor()));
        if (!producible(v.toTensor())) r.fakeable = false;
      } else if (v.isTensorList()) {
        ret.kind = StopRecord::Ret::kList;
        for (const at::Tensor& t : v.toTensorList()) {
          ret.outs.push_back(out_of(t));
          if (!producible(t)) r.fakeable = false;
        }
      } else {
        r.fakeable = false;
        if (!v.isNone()) marker = idx;  // a number or flag: control flow may read it
      }
      for_each_tensor(v, [&](const at::Tensor& t) { written.push_back(t); });
      r.rets.push_back(std::move(ret));
    }
    for (const auto& t : written) {
      if (const auto* s = storage_of(t)) writer[s] = idx;
    }
    rec.ops.push_back(std::move(r));
  }
  void on_tag(const at::Tensor&, const std::string&) override {}
};

StopRecorder::StopRecorder() : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.scopes0 = dispatch::scopes_opened();
  m.hooks.emplace(
      [&m](const at::Tensor& t) {
        if (const auto* s = storage_of(t)) m.saved.insert(s);
        // Detached (an op's output kept as is would hold its own grad_fn),
        // unseen by the record: later runs have no hooks.
        dispatch::Suspend own_op;
        return t.detach();
      },
      [](const at::Tensor& t) { return t; });
  m.mine = current_hooks();
  m.scope.emplace(&m);
}

StopRecorder::~StopRecorder() = default;

std::shared_ptr<const StopRecord> StopRecorder::finish(const std::vector<at::Tensor>& outs, uint64_t seq0) {
  Impl& m = *impl_;
  m.scope.reset();
  m.hooks.reset();
  auto rec = std::make_shared<StopRecord>(std::move(m.rec));
  // Interceptors opened inside (selective regions) saw ops this one did not.
  if (m.foreign || dispatch::scopes_opened() != m.scopes0 + 1) return rec;
  // Only ATen's generated nodes (and CopySlices around them) keep what
  // they save in SavedVariables, which the hooks saw.
  std::vector<ta::Node*> stack;
  std::unordered_set<ta::Node*> visited;
  for (const auto& t : outs) {
    if (t.defined() && t.grad_fn() && visited.insert(t.grad_fn().get()).second) stack.push_back(t.grad_fn().get());
  }
  while (!stack.empty()) {
    ta::Node* node = stack.back();
    stack.pop_back();
    if (dynamic_cast<ta::AccumulateGrad*>(node) != nullptr || node->sequence_nr() < seq0) continue;
    if (!keeps_saved_in_saved_variables(*node)) {
      return rec;
    }
    for (const auto& e : node->next_edges()) {
      if (e.is_valid() && visited.insert(e.function.get()).second) stack.push_back(e.function.get());
    }
  }
  int64_t stop = m.marker;
  for (const auto* s : m.saved) {
    auto it = m.writer.find(s);
    if (it != m.writer.end()) stop = std::max(stop, it->second);
  }
  rec->stop = stop;
  rec->usable = true;
  return rec;
}

struct StopReplay::Impl final : dispatch::Interceptor {
  std::shared_ptr<const StopRecord> rec;
  size_t k = 0;
  bool diverged = false;
  int64_t skipped = 0;
  std::optional<dispatch::Scope> scope;

  void on_op(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) override {
    if (diverged) return dispatch::run_below(op, ks, stack);
    const int64_t idx = static_cast<int64_t>(k++);
    if (k > rec->ops.size() || rec->ops[idx].name != op.operator_name()) {
      if (idx > rec->stop) throw Diverged{};  // ops before it were not run
      diverged = true;
      return dispatch::run_below(op, ks, stack);
    }
    const auto& r = rec->ops[idx];
    if (idx <= rec->stop || !r.fakeable) return dispatch::run_below(op, ks, stack);
    const size_t n = op.schema().arguments().size();
    std::vector<c10::IValue> args(stack->end() - static_cast<std::ptrdiff_t>(n), stack->end());
    stack->erase(stack->end() - static_cast<std::ptrdiff_t>(n), stack->end());
    for (const auto& ret : r.rets) {
      switch (ret.kind) {
        case StopRecord::Ret::kAlias: stack->push_back(args[ret.alias_arg]); break;
        case StopRecord::Ret::kTensor: stack->push_back(make(ret.outs.at(0))); break;
        case StopRecord::Ret::kList: {
          c10::List<at::Tensor> l;
          for (const auto& o : ret.outs) l.push_back(make(o));
          stack->push_back(std::move(l));
          break;
        }
      }
    }
    ++skipped;
  }
  void on_tag(const at::Tensor&, const std::string&) override {}
};

StopReplay::StopReplay(std::shared_ptr<const StopRecord> rec) : impl_(std::make_unique<Impl>()) {
  impl_->rec = std::move(rec);
  impl_->scope.emplace(impl_.get());
}

StopReplay::~StopReplay() = default;
bool StopReplay::diverged() const { return impl_->diverged; }
int64_t StopReplay::skipped() const { return impl_->skipped; }

bool early_stop_available() {
  if (current_hooks() != nullptr || dispatch::current() != nullptr) return false;
  try {
    dispatch::Scope probe(nullptr);  // installs the fallback; refused beside Python's FakeTensor
  } catch (const Error&) {
    return false;
  }
  return true;
}

}  // namespace remat::detail
