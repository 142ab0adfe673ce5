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

#include "../core/dispatch.h"

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

bool any_alive(const std::vector<WeakStorage>& storages) {
  for (const auto& w : storages) {
    if (!w.expired()) return true;
  }
  return false;
}

namespace {

const c10::StorageImpl* storage_of(const at::Tensor& t) {
  return t.defined() && t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
}

WeakStorage weak_storage_of(const at::Tensor& t) { return WeakStorage(t.storage().getWeakStorageImpl()); }

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
  // storages this run made (returned by an op, not as an alias of an argument)
  std::unordered_map<const c10::StorageImpl*, WeakStorage> made;
  std::vector<WeakStorage> after_cut;  // filled by finish()
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
        note_made(v.toTensor());
      } else if (v.isTensorList()) {
        ret.kind = StopRecord::Ret::kList;
        for (const at::Tensor& t : v.toTensorList()) {
          ret.outs.push_back(out_of(t));
          if (!producible(t)) r.fakeable = false;
          note_made(t);
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
  void note_made(const at::Tensor& t) {
    if (const auto* s = storage_of(t)) made.insert_or_assign(s, weak_storage_of(t));
  }
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
  // Storages made here and last written after the cut point: what a cut
  // run would leave uninitialized (see "Kept state" in the NOTE).
  for (const auto& [s, weak] : m.made) {
    auto it = m.writer.find(s);
    if (it != m.writer.end() && it->second > stop) m.after_cut.push_back(weak);
  }
  m.made.clear();
  return rec;
}

std::vector<WeakStorage> StopRecorder::after_cut() const { return impl_->after_cut; }

struct StopReplay::Impl final : dispatch::Interceptor {
  std::shared_ptr<const StopRecord> rec;
  size_t k = 0;
  bool diverged = false;
  int64_t skipped = 0;
  std::optional<dispatch::Scope> scope;
  std::unordered_set<const c10::StorageImpl*> made;  // by the ops that ran
  std::vector<WeakStorage> produced;

  void run(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    dispatch::run_below(op, ks, stack);
    const auto& rets = op.schema().returns();
    const size_t nr = rets.size();
    for (size_t j = 0; j < nr; ++j) {
      if (rets[j].alias_info() != nullptr) continue;
      for_each_tensor((*stack)[stack->size() - nr + j], [&](const at::Tensor& t) {
        if (const auto* s = storage_of(t)) made.insert(s);
      });
    }
  }
  at::Tensor produce(const StopRecord::Out& o) {
    at::Tensor t = make(o);
    if (const auto* s = storage_of(t)) {
      made.insert(s);
      produced.push_back(weak_storage_of(t));
    }
    return t;
  }

  void on_op(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) override {
    if (diverged) return dispatch::run_below(op, ks, stack);
    const int64_t idx = static_cast<int64_t>(k++);
    if (k > rec->ops.size() || rec->ops[idx].name != op.operator_name()) {
      if (idx > rec->stop) throw Diverged{};  // ops before it were not run
      diverged = true;
      return dispatch::run_below(op, ks, stack);
    }
    const auto& r = rec->ops[idx];
    if (idx <= rec->stop || !r.fakeable) return run(op, ks, stack);
    const size_t n = op.schema().arguments().size();
    std::vector<c10::IValue> args(stack->end() - static_cast<std::ptrdiff_t>(n), stack->end());
    stack->erase(stack->end() - static_cast<std::ptrdiff_t>(n), stack->end());
    for (const auto& ret : r.rets) {
      switch (ret.kind) {
        case StopRecord::Ret::kAlias: {
          // An in-place write that does not happen: a storage of this run's
          // now holds stale values.
          for_each_tensor(args[ret.alias_arg], [&](const at::Tensor& t) {
            if (const auto* s = storage_of(t); s != nullptr && made.count(s) != 0) {
              produced.push_back(weak_storage_of(t));
            }
          });
          stack->push_back(args[ret.alias_arg]);
          break;
        }
        case StopRecord::Ret::kTensor: stack->push_back(produce(ret.outs.at(0))); break;
        case StopRecord::Ret::kList: {
          c10::List<at::Tensor> l;
          for (const auto& o : ret.outs) l.push_back(produce(o));
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
std::vector<WeakStorage> StopReplay::produced() const { return impl_->produced; }

bool early_stop_available(const dispatch::Interceptor* own) {
  // With stacked interceptors (NOTE [op-level interception, as built]), the
  // runtime's own write guard below the recorder sees every op that runs,
  // as a re-run must; any other interceptor would see a different stream.
  if (current_hooks() != nullptr) return false;
  if (dispatch::current() != nullptr && (own == nullptr || dispatch::current() != own)) return false;
  try {
    dispatch::Scope probe(nullptr);  // installs the fallback; refused beside Python's FakeTensor
  } catch (const Error&) {
    return false;
  }
  return true;
}

}  // namespace remat::detail
