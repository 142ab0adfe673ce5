// Selective checkpointing: the op cache of NOTE [selective op cache]
// (selective_state.h), the built-in policies, checkpoint_name and
// saved_residuals.
#include <remat/selective.h>

#include "../core/replay.h"
#include "../core/write_guard.h"
#include "selective_state.h"

#include <ATen/core/ivalue.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <c10/core/TensorImpl.h>

#include <algorithm>
#include <atomic>
#include <iomanip>
#include <set>
#include <sstream>
#include <unordered_set>

namespace remat {
namespace detail {
namespace {

std::mutex g_stats_mu;
std::map<std::string, OpCounts> g_op_stats;

std::string sizes_str(at::IntArrayRef s) {
  std::ostringstream os;
  os << s;
  return os.str();
}

const std::string& op_name(const c10::OperatorHandle& op) { return op.operator_name().name; }

OpCall call_of(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> inputs, const std::string& tag) {
  return OpCall(&op, op_name(op), op.operator_name().overload_name, inputs, tag);
}

/** v with f applied to each defined tensor (a tensor, or each of a list);
 *  other values as they are. */
template <class F>
c10::IValue map_tensors(const c10::IValue& v, F f) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    return t.defined() ? c10::IValue(f(t)) : v;
  }
  if (v.isTensorList()) {
    std::vector<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorVector()) out.push_back(t.defined() ? f(t) : t);
    return c10::IValue(out);
  }
  return v;
}

/** Aliases that share storage and version counter but not the TensorImpl
 *  (autograd attaches history to what an op returns). */
c10::IValue alias_of(const c10::IValue& v) {
  return map_tensors(v, [](const at::Tensor& t) { return t.tensor_data(); });
}

/** Copies of v's tensors. */
c10::IValue copy_of(const c10::IValue& v) {
  return map_tensors(v, [](const at::Tensor& t) { return t.clone(); });
}

/** Inference tensors have no version counter (InferenceMode inside a region). */
bool versioned(const at::Tensor& t) { return t.defined() && !t.is_inference(); }

bool storable(const c10::IValue& v) {
  return v.isTensor() || v.isTensorList() || v.isInt() || v.isDouble() || v.isBool() || v.isNone() || v.isSymInt() ||
         v.isSymFloat();
}

}  // namespace

void count_op(const std::string& key, int which) {
  std::lock_guard<std::mutex> lock(g_stats_mu);
  OpCounts& c = g_op_stats[key];
  (which == 0 ? c.saved : which == 1 ? c.replayed : c.recomputed) += 1;
}

std::atomic<int64_t> g_ops_saved{0}, g_ops_replayed{0}, g_ops_recomputed{0};

void reset_op_stats() {
  std::lock_guard<std::mutex> lock(g_stats_mu);
  g_op_stats.clear();
  g_ops_saved = 0;
  g_ops_replayed = 0;
  g_ops_recomputed = 0;
}

std::string uncacheable_reason(const c10::OperatorHandle& op) {
  const auto& schema = op.schema();
  if (schema.is_mutable()) return "it modifies a tensor in place";
  for (const auto& r : schema.returns()) {
    if (r.alias_info() != nullptr) return "it returns a view";
  }
  if (is_view_like(op)) return "it returns a view";
  if (op.hasTag(at::Tag::nondeterministic_seeded)) {
    return "it draws random numbers (skipping it would shift the RNG stream the recompute replays)";
  }
  return "";
}

OutputRef::OutputRef(const at::Tensor& t)
    : impl(t.getIntrusivePtr()),
      storage(t.has_storage() ? c10::weak_intrusive_ptr<c10::StorageImpl>(t.storage().getWeakStorageImpl())
                              : c10::weak_intrusive_ptr<c10::StorageImpl>(c10::intrusive_ptr<c10::StorageImpl>())),
      sizes(t.sizes().vec()),
      strides(t.strides().vec()),
      offset(t.storage_offset()),
      options(t.options()) {}

at::Tensor OutputRef::get() const {
  if (auto strong = impl.lock()) return at::Tensor(std::move(strong));
  auto st = storage.lock();
  if (!st) return {};
  at::Tensor t = at::empty({0}, options);
  t.set_(c10::Storage(std::move(st)), offset, sizes, strides);
  return t;
}

std::vector<InputMeta> tensor_inputs_meta(c10::ArrayRef<c10::IValue> args) {
  std::vector<InputMeta> out;
  for (const auto& a : args) {
    for_each_tensor(a, [&](const at::Tensor& t) {
      out.push_back(t.defined() ? InputMeta{t.sizes().vec(), t.scalar_type()} : InputMeta{});
    });
  }
  return out;
}

// ---------------------------------------------------------------------------
// First run: ask the policy, run, keep the outputs of saved ops.

class FirstRun final : public dispatch::Interceptor {
 public:
  explicit FirstRun(SelectiveCache* c) : c_(c) {}

  void on_op(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) override {
    const size_t nin = op.schema().arguments().size();
    c10::ArrayRef<c10::IValue> args(stack->data() + stack->size() - nin, nin);
    SelectiveCache::Record rec;
    rec.op = op;
    rec.key = SelectiveCache::Key::of(op, args, counts_);
    rec.view_like = is_view_like(op);
    rec.uncacheable = uncacheable_reason(op);
    const OpDecision d = c_->policy_(call_of(op, args, ""));
    if (saves(d) && !rec.uncacheable.empty() && d == OpDecision::kMustSave) refuse(rec, d, "");
    rec.inputs = tensor_inputs_meta(args);
    if (op.schema().is_mutable()) {
      const auto& formals = op.schema().arguments();
      for (size_t a = 0; a < nin && a < formals.size(); ++a) {
        if (formals[a].alias_info() != nullptr && formals[a].alias_info()->isWrite()) {
          for_each_tensor(args[a], [&](const at::Tensor& t) { c_->snapshot_before_write(t); });
        }
      }
    }
    if (rec.view_like && !args.empty() && args[0].isTensor() && args[0].toTensor().defined()) {
      rec.base.emplace(args[0].toTensor().getIntrusivePtr());
    }
    dispatch::run_below(op, ks, stack);
    const size_t nout = op.schema().returns().size();
    c10::ArrayRef<c10::IValue> outs(stack->data() + stack->size() - nout, nout);
    for (const auto& o : outs) {
      if (rec.uncacheable.empty() && !storable(o)) rec.uncacheable = "it returns a " + o.tagKind();
      for_each_tensor(o, [&](const at::Tensor& t) {
        if (t.defined()) rec.outputs.emplace_back(t);
      });
    }
    std::lock_guard<std::mutex> lock(c_->mu_);
    const size_t index = c_->records_.size();
    const bool in_place = op.schema().is_mutable();
    for (const auto& w : rec.outputs) {
      const auto* impl = w.impl._unsafe_get_target();
      // An in-place op returns its argument: that tensor keeps its producer.
      if (in_place && c_->producer_.count(impl) != 0) continue;
      c_->producer_[impl] = index;
      if (!in_place && !rec.view_like) c_->written_.erase(w.storage._unsafe_get_target());
    }
    if (in_place) {
      const auto& formals = op.schema().arguments();
      for (size_t a = 0; a < nin && a < formals.size(); ++a) {
        if (formals[a].alias_info() != nullptr && formals[a].alias_info()->isWrite()) {
          for (const auto& o : outs) {
            for_each_tensor(o, [&](const at::Tensor& t) {
              if (t.defined() && t.has_storage()) c_->written_.emplace(t.storage().unsafeGetStorageImpl(), rec.key.op);
            });
          }
        }
      }
    }
    if (saves(d) && rec.uncacheable.empty()) {
      SelectiveCache::Entry e;
      e.decision = d;
      e.outputs.assign(outs.begin(), outs.end());
      e.inputs = rec.inputs;
      c_->save(rec.key, std::move(e));
    }
    c_->records_.push_back(std::move(rec));
  }

  void on_tag(const at::Tensor& t, const std::string& name) override { c_->on_tag(t, name); }

  [[noreturn]] static void refuse(const SelectiveCache::Record& rec, OpDecision d, const std::string& tag) {
    throw Error("[remat::checkpoint] the selective policy returned " + std::string(to_string(d)) + " for " +
                rec.key.op + (tag.empty() ? "" : " (output named '" + tag + "')") +
                ", which cannot be saved: " + rec.uncacheable +
                ". In-place, view and random ops are always recomputed; return kPreferSave (recomputed "
                "silently) or save the op that produces its input.");
  }

 private:
  SelectiveCache* c_;
  SelectiveCache::Counts counts_;
};

// ---------------------------------------------------------------------------
// Recompute: hand back what was saved, run the rest.

class Recompute final : public dispatch::Interceptor {
 public:
  Recompute(SelectiveCache* c, bool keep, WriteGuard* guard) : c_(c), keep_(keep), guard_(guard) {}

  void on_op(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) override {
    const size_t nargs = op.schema().arguments().size();
    const SelectiveCache::Key k =
        SelectiveCache::Key::of(op, c10::ArrayRef<c10::IValue>(stack->data() + stack->size() - nargs, nargs), counts_);
    const std::string& key = k.op;
    std::unique_lock<std::mutex> lock(c_->mu_);
    auto it = c_->cache_.find(k);
    if (it == c_->cache_.end()) {
      lock.unlock();
      run_guarded(*guard_, op, ks, stack);
      g_ops_recomputed.fetch_add(1, std::memory_order_relaxed);
      count_op(key, 2);
      return;
    }
    const size_t nin = op.schema().arguments().size();
    c10::ArrayRef<c10::IValue> args(stack->data() + stack->size() - nin, nin);
    check(k, it->second, args);
    std::vector<c10::IValue> outs;
    // Offloaded: read back (a fresh tensor each time, so retain_graph needs
    // no copy).
    for (auto& h : it->second.offloaded) outs.emplace_back(c_->store_->unpack(h));
    if (it->second.offloaded.empty()) {
      for (const auto& o : it->second.outputs) {
        // A snapshot is written again by the recompute's own in-place op:
        // when the entry must survive (retain_graph), hand out a copy.
        outs.push_back(it->second.snapshot && keep_ ? copy_of(o) : alias_of(o));
      }
    }
    if (!keep_) c_->cache_.erase(it);
    lock.unlock();
    torch::jit::drop(*stack, nin);
    guard_->made(op, outs);
    for (auto& o : outs) stack->push_back(std::move(o));
    g_ops_replayed.fetch_add(1, std::memory_order_relaxed);
    count_op(key, 1);
  }

  void on_tag(const at::Tensor&, const std::string&) override {}

 private:
  void check(const SelectiveCache::Key& k, const SelectiveCache::Entry& e, c10::ArrayRef<c10::IValue> args) const {
    const std::string where = k.op + " (call " + std::to_string(k.n + 1) + " of it in the region)";
    size_t j = 0;
    for (const auto& o : e.outputs) {
      for_each_tensor(o, [&](const at::Tensor& t) {
        for (const auto& [index, version] : e.versions) {
          if (index == j && t._version() != version) {
            throw Error("[remat::checkpoint] the output of " + where + " was saved by the selective policy '" +
                        c_->policy_.description() + "' and then modified in place outside the region (version " +
                        std::to_string(version) + " -> " + std::to_string(t._version()) +
                        "), so it no longer holds the op's result. Use an out-of-place op on it, or let the "
                        "policy recompute " +
                        k.op + " (policy::recompute_ops({\"" + k.op + "\"})).");
          }
        }
        ++j;
      });
    }
    const std::vector<InputMeta> now = tensor_inputs_meta(args);
    bool same = now.size() == e.inputs.size();
    for (size_t i = 0; same && i < now.size(); ++i) {
      same = now[i].sizes == e.inputs[i].sizes && now[i].dtype == e.inputs[i].dtype;
    }
    if (!same) {
      std::string first, again;
      for (const auto& m : e.inputs) first += sizes_str(m.sizes) + " ";
      for (const auto& m : now) again += sizes_str(m.sizes) + " ";
      throw Error("[remat::checkpoint] " + where + " got inputs of shapes " + first + "in the forward but " + again +
                  "in the recomputation; the checkpointed function must run the same ops each time.");
    }
  }

  SelectiveCache* c_;
  bool keep_;
  WriteGuard* guard_;
  SelectiveCache::Counts counts_;
};

}  // namespace detail

// ---------------------------------------------------------------------------
// SelectiveCache

namespace detail {

SelectiveCache::Key SelectiveCache::Key::of(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args,
                                            Counts& counts) {
  Key k;
  k.op = dispatch::op_key(op);
  for (const auto& a : args) {
    for_each_tensor(a, [&](const at::Tensor& t) {
      k.parameters.push_back(t.defined() && t.is_leaf() && t.requires_grad() ? t.unsafeGetTensorImpl() : nullptr);
    });
  }
  k.n = counts[{k.op, k.parameters}]++;
  return k;
}

std::unique_ptr<dispatch::Interceptor> SelectiveCache::first_run() { return std::make_unique<FirstRun>(this); }

std::unique_ptr<dispatch::Interceptor> SelectiveCache::recompute(bool keep_graph, WriteGuard* guard) {
  return std::make_unique<Recompute>(this, keep_graph, guard);
}

void SelectiveCache::save(const Key& key, Entry e) {
  if (e.decision == OpDecision::kOffload && !store_ && !inspect_only_) {
    throw Error("[remat::checkpoint] the selective policy '" + policy_.description() + "' returned kOffload for " +
                key.op +
                ", but the region has no offload target; set one with CheckpointOptions().offload(OffloadOptions(...)) "
                "or return kPreferSave.");
  }
  e.versions.clear();
  size_t j = 0;
  for (auto& o : e.outputs) {
    o = alias_of(o);
    for_each_tensor(o, [&](const at::Tensor& t) {
      if (versioned(t)) e.versions.emplace_back(j, t._version());
      ++j;
    });
  }
  if (cache_.emplace(key, std::move(e)).second) {
    g_ops_saved.fetch_add(1, std::memory_order_relaxed);
    count_op(key.op, 0);
  }
}

void SelectiveCache::on_tag(const at::Tensor& t, const std::string& name) {
  if (!t.defined()) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto find = [&](const c10::TensorImpl* impl) -> Record* {
    auto it = producer_.find(impl);
    return it == producer_.end() ? nullptr : &records_[it->second];
  };
  Record* rec = find(t.unsafeGetTensorImpl());
  // Through views to the op that made the storage: saving a view would pin
  // its base anyway, and the view itself is cheap to recompute.
  while (rec != nullptr && rec->view_like && rec->base) {
    Record* up = find(rec->base->_unsafe_get_target());
    if (up == nullptr) break;
    rec = up;
  }
  if (rec == nullptr || rec->view_like) {
    const OpDecision d = policy_(OpCall(nullptr, "", "", {}, name));
    if (saves(d)) {
      throw Error("[remat::checkpoint_name] the policy '" + policy_.description() + "' saves '" + name +
                  "', but that tensor was not produced by an op inside this region (it is a region input, "
                  "or made outside the region): it cannot be saved as an op output. Name a tensor the region "
                  "computes.");
    }
    return;
  }
  rec->tag = name;
  const OpDecision d = policy_(call_of(*rec->op, {}, name));
  if (!saves(d)) {
    cache_.erase(rec->key);
    return;
  }
  if (!rec->uncacheable.empty()) {
    if (d == OpDecision::kMustSave) FirstRun::refuse(*rec, d, name);
    return;
  }
  if (cache_.count(rec->key) != 0) return;
  for (const OutputRef& w : rec->outputs) {
    auto it = written_.find(w.storage._unsafe_get_target());
    if (it != written_.end()) {
      throw Error("[remat::checkpoint_name] the policy '" + policy_.description() + "' saves '" + name + "', but " +
                  it->second + " wrote in place into the output of " + rec->key.op +
                  " before it was named, so no op's result holds those values (C++ torch::nn::Linear adds its "
                  "bias in place on 3-d inputs). Name a tensor no in-place op has written (e.g. call "
                  "torch::linear(x, weight, bias)), or save " +
                  rec->key.op + " by operator (policy::save_ops), which copies it before the write.");
    }
  }
  Entry e;
  bool single_tensors = rec->outputs.size() == rec->op->schema().returns().size();
  for (const auto& ret : rec->op->schema().returns()) single_tensors &= ret.type()->kind() == c10::TypeKind::TensorType;
  for (const OutputRef& w : rec->outputs) {
    at::Tensor strong = w.get();
    if (!strong.defined() || !single_tensors) {
      throw Error("[remat::checkpoint_name] the policy '" + policy_.description() + "' saves '" + name +
                  "', an output of " + rec->key.op +
                  ", but that op's outputs can no longer be kept together (another output is already freed, "
                  "or it returns a list), so it cannot be handed back in the recompute. Name the result of a "
                  "single-output op, or save " +
                  rec->key.op + " by operator (policy::save_ops).");
    }
    e.outputs.emplace_back(std::move(strong));
  }
  e.inputs = rec->inputs;
  e.decision = d;
  save(rec->key, std::move(e));
}

void SelectiveCache::snapshot_before_write(const at::Tensor& written) {
  if (!written.defined() || !written.has_storage()) return;
  const c10::StorageImpl* st = written.storage().unsafeGetStorageImpl();
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [key, e] : cache_) {
    if (e.snapshot) continue;
    bool hit = false;
    for (const auto& o : e.outputs) {
      for_each_tensor(o, [&](const at::Tensor& t) {
        hit |= t.defined() && t.has_storage() && t.storage().unsafeGetStorageImpl() == st;
      });
    }
    if (!hit) continue;
    for (auto& o : e.outputs) o = copy_of(o);
    e.versions.clear();
    size_t j = 0;
    for (const auto& o : e.outputs) {
      for_each_tensor(o, [&](const at::Tensor& t) {
        if (versioned(t)) e.versions.emplace_back(j, t._version());
        ++j;
      });
    }
    e.snapshot = true;
  }
}

void SelectiveCache::end_first_run() {
  std::lock_guard<std::mutex> lock(mu_);
  records_.clear();
  producer_.clear();
  // kOffload outputs leave memory now: the region's in-place writes into
  // them (snapshots) are done, and backward needs them only in a recompute.
  for (auto& [key, e] : cache_) {
    if (!store_) break;  // inspect_only
    if (e.decision != OpDecision::kOffload || !e.offloaded.empty()) continue;
    bool tensors = !e.outputs.empty();
    for (const auto& o : e.outputs) tensors = tensors && o.isTensor() && o.toTensor().defined();
    if (!tensors) continue;  // a list or an undefined output stays in memory
    for (auto& o : e.outputs) {
      e.offloaded.push_back(store_->pack(o.toTensor()));
      o = c10::IValue(at::Tensor());
    }
    e.versions.clear();
  }
}

void SelectiveCache::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  cache_.clear();
}

}  // namespace detail

// ---------------------------------------------------------------------------
// Policies

const char* to_string(OpDecision d) {
  switch (d) {
    case OpDecision::kMustSave: return "kMustSave";
    case OpDecision::kPreferSave: return "kPreferSave";
    case OpDecision::kPreferRecompute: return "kPreferRecompute";
    case OpDecision::kMustRecompute: return "kMustRecompute";
    case OpDecision::kOffload: return "kOffload";
  }
  return "?";
}

namespace policy {
namespace {

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

/** Matches "ns::op" against a call's name, "ns::op.overload" against both. */
std::function<bool(const OpCall&)> op_matcher(std::vector<std::string> ops, const char* who) {
  for (const auto& o : ops) {
    if (o.find("::") == std::string::npos) {
      throw Error(std::string("[remat::policy::") + who + "] operator '" + o +
                  "' has no namespace; write it as the dispatcher names it, e.g. 'aten::" + o + "'.");
    }
  }
  std::set<std::string> set(ops.begin(), ops.end());
  return [set = std::move(set)](const OpCall& c) {
    return set.count(c.name()) != 0 || (!c.overload().empty() && set.count(c.name() + "." + c.overload()) != 0);
  };
}

}  // namespace

const std::vector<std::string>& matmul_ops() {
  static const std::vector<std::string> ops = {
      "aten::mm",
      "aten::addmm",
      "aten::bmm",
      "aten::baddbmm",
      "aten::matmul",
      "aten::linear",
      "aten::convolution",
      "aten::_convolution",
      "aten::mkldnn_convolution",
      "aten::cudnn_convolution",
      "aten::_scaled_dot_product_flash_attention",
      "aten::_scaled_dot_product_flash_attention_for_cpu",
      "aten::_scaled_dot_product_efficient_attention",
      "aten::_scaled_dot_product_cudnn_attention",
      "aten::_scaled_dot_product_attention_math",
      "aten::scaled_dot_product_attention",
  };
  return ops;
}

Policy save_ops(std::vector<std::string> ops) {
  const std::string d = "save_ops(" + joined(ops) + ")";
  auto match = op_matcher(std::move(ops), "save_ops");
  return Policy(d,
                [match](const OpCall& c) { return match(c) ? OpDecision::kPreferSave : OpDecision::kPreferRecompute; });
}

Policy offload_ops(std::vector<std::string> ops) {
  const std::string d = "offload_ops(" + joined(ops) + ")";
  auto match = op_matcher(std::move(ops), "offload_ops");
  return Policy(d, [match](const OpCall& c) { return match(c) ? OpDecision::kOffload : OpDecision::kPreferRecompute; });
}

Policy save_matmuls() {
  auto match = op_matcher(matmul_ops(), "save_matmuls");
  return Policy("save_matmuls",
                [match](const OpCall& c) { return match(c) ? OpDecision::kPreferSave : OpDecision::kPreferRecompute; });
}

Policy save_nothing() {
  return Policy("save_nothing", [](const OpCall&) { return OpDecision::kPreferRecompute; });
}

Policy recompute_ops(std::vector<std::string> ops) {
  const std::string d = "recompute_ops(" + joined(ops) + ")";
  auto match = op_matcher(std::move(ops), "recompute_ops");
  return Policy(
      d, [match](const OpCall& c) { return match(c) ? OpDecision::kMustRecompute : OpDecision::kPreferRecompute; });
}

Policy save_names(std::vector<std::string> names) {
  const std::string d = "save_names(" + joined(names) + ")";
  std::set<std::string> set(names.begin(), names.end());
  return Policy(d, [set](const OpCall& c) {
    return !c.tag().empty() && set.count(c.tag()) != 0 ? OpDecision::kPreferSave : OpDecision::kPreferRecompute;
  });
}

Policy save_names_except(std::vector<std::string> names) {
  const std::string d = "save_names_except(" + joined(names) + ")";
  std::set<std::string> set(names.begin(), names.end());
  return Policy(d, [set](const OpCall& c) {
    return !c.tag().empty() && set.count(c.tag()) == 0 ? OpDecision::kPreferSave : OpDecision::kPreferRecompute;
  });
}

Policy recompute_names(std::vector<std::string> names) {
  const std::string d = "recompute_names(" + joined(names) + ")";
  std::set<std::string> set(names.begin(), names.end());
  return Policy(d, [set](const OpCall& c) {
    return !c.tag().empty() && set.count(c.tag()) != 0 ? OpDecision::kMustRecompute : OpDecision::kPreferRecompute;
  });
}

Policy any_of(std::vector<Policy> policies) {
  if (policies.empty()) throw Error("[remat::policy::any_of] needs at least one policy.");
  std::string d;
  for (const auto& p : policies) d += (d.empty() ? "" : ", ") + p.description();
  return Policy("any_of(" + d + ")", [policies = std::move(policies)](const OpCall& c) {
    bool must_save = false, prefer_save = false, offload = false;
    for (const auto& p : policies) {
      switch (p(c)) {
        case OpDecision::kMustRecompute: return OpDecision::kMustRecompute;
        case OpDecision::kMustSave: must_save = true; break;
        case OpDecision::kPreferSave: prefer_save = true; break;
        case OpDecision::kOffload: offload = true; break;
        case OpDecision::kPreferRecompute: break;
      }
    }
    // Kept in memory beats offloaded: a policy that keeps an output wins.
    if (must_save) return OpDecision::kMustSave;
    if (prefer_save) return OpDecision::kPreferSave;
    return offload ? OpDecision::kOffload : OpDecision::kPreferRecompute;
  });
}

}  // namespace policy

// ---------------------------------------------------------------------------
// Names, counters

at::Tensor checkpoint_name(const at::Tensor& t, const std::string& name) {
  dispatch::tag(t, name);
  return t;
}

std::map<std::string, OpCounts> op_stats() {
  std::lock_guard<std::mutex> lock(detail::g_stats_mu);
  return detail::g_op_stats;
}

// ---------------------------------------------------------------------------
// saved_residuals

const char* to_string(ResidualKind k) {
  switch (k) {
    case ResidualKind::kInput: return "input";
    case ResidualKind::kParameter: return "parameter";
    case ResidualKind::kRecomputable: return "recomputable";
    case ResidualKind::kExternal: return "external";
  }
  return "?";
}

namespace detail {

struct ResidualRecorder::Impl {
  std::optional<Policy> policy;
  std::vector<at::Tensor> inputs;
  std::vector<at::Tensor> saved;  // in save order; kept alive until finish()
  SelectiveCache cache;
  // Inspection changes nothing: what fn writes into tensors that existed
  // before it (BatchNorm statistics, its inputs) is put back at the end.
  WriteGuard writes;
  std::unique_ptr<dispatch::Interceptor> guard;
  std::optional<dispatch::Scope> guard_scope;
  std::unique_ptr<dispatch::Interceptor> interceptor;
  std::optional<dispatch::Scope> scope;
  std::optional<SavedTensorsHooks> hooks;
  std::optional<at::AutoGradMode> grad;
  std::unordered_set<const c10::TensorImpl*> before;  // live inputs: not made inside

  Impl(std::optional<Policy> p, std::vector<at::Tensor> in)
      : policy(std::move(p)), inputs(std::move(in)), cache(policy ? *policy : policy::save_nothing()) {}
  /** Stops interception and puts back what fn wrote (once). */
  void stop() {
    scope.reset();
    if (guard_scope) {
      guard_scope.reset();
      writes.restore();
    }
  }
  ~Impl() { stop(); }
};

ResidualRecorder::ResidualRecorder(std::optional<Policy> policy, std::vector<at::Tensor> inputs)
    : impl_(std::make_unique<Impl>(std::move(policy), std::move(inputs))) {
  ensure_engine_installed();
  Impl& m = *impl_;
  m.grad.emplace(true);
  m.cache.inspect_only();
  m.interceptor = m.cache.first_run();
  m.hooks.emplace(
      [&m](const at::Tensor& t) {
        m.saved.push_back(t);
        // Detached: a packed output holding its own grad_fn would be a
        // reference cycle (node -> saved variable -> tensor -> node).
        return t.detach();
      },
      [](const at::Tensor& t) { return t; });
  m.guard = make_write_guard_interceptor(&m.writes);
  m.guard_scope.emplace(m.guard.get());
  m.scope.emplace(m.interceptor.get());
}

ResidualRecorder::~ResidualRecorder() = default;

SavedResiduals ResidualRecorder::finish() {
  Impl& m = *impl_;
  m.stop();
  m.hooks.reset();
  m.grad.reset();
  SavedResiduals r;
  if (m.policy) {
    r.policy = m.policy->description();
    r.policy_bytes = 0;
  }
  std::unordered_set<const c10::StorageImpl*> seen, seen_policy;
  std::unordered_map<const c10::TensorImpl*, size_t> first_index;
  {
    std::lock_guard<std::mutex> lock(m.cache.mu_);
    if (m.policy) {
      for (const auto& [key, e] : m.cache.cache_) {
        for (const auto& o : e.outputs) {
          for_each_tensor(o, [&](const at::Tensor& t) {
            if (t.defined() && t.has_storage() && seen_policy.insert(t.storage().unsafeGetStorageImpl()).second) {
              r.policy_bytes += static_cast<int64_t>(t.storage().nbytes());
            }
          });
        }
      }
    }
    for (const at::Tensor& t : m.saved) {
      if (!t.defined()) continue;
      auto known = first_index.find(t.unsafeGetTensorImpl());
      if (known != first_index.end()) {
        r.residuals[known->second].saves += 1;
        continue;
      }
      SavedResidual s;
      s.sizes = t.sizes().vec();
      s.dtype = t.scalar_type();
      s.bytes = t.has_storage() ? static_cast<int64_t>(t.storage().nbytes()) : 0;
      s.shared = t.has_storage() && !seen.insert(t.storage().unsafeGetStorageImpl()).second;
      bool is_input = false;
      for (const auto& in : m.inputs) is_input |= in.defined() && in.is_same(t);
      auto it = m.cache.producer_.find(t.unsafeGetTensorImpl());
      if (is_input) {
        s.kind = ResidualKind::kInput;
      } else if (is_parameter_like(t)) {
        s.kind = ResidualKind::kParameter;
      } else if (it != m.cache.producer_.end()) {
        const auto& rec = m.cache.records_[it->second];
        s.kind = ResidualKind::kRecomputable;
        s.op = rec.key.op;
        s.tag = rec.tag;
        // Kept if its own producer, or the one its view chain leads to, is cached.
        const SelectiveCache::Record* p = &rec;
        while (p->view_like && p->base && m.cache.cache_.count(p->key) == 0) {
          auto up = m.cache.producer_.find(p->base->_unsafe_get_target());
          if (up == m.cache.producer_.end()) break;
          p = &m.cache.records_[up->second];
        }
        s.kept_by_policy = m.policy.has_value() && m.cache.cache_.count(p->key) != 0;
        if (s.tag.empty()) s.tag = p->tag;
      } else {
        s.kind = ResidualKind::kExternal;
      }
      if (!s.shared) {
        r.total_bytes += s.bytes;
        switch (s.kind) {
          case ResidualKind::kInput: r.input_bytes += s.bytes; break;
          case ResidualKind::kParameter: r.parameter_bytes += s.bytes; break;
          case ResidualKind::kRecomputable: r.recomputable_bytes += s.bytes; break;
          case ResidualKind::kExternal: r.external_bytes += s.bytes; break;
        }
      }
      first_index[t.unsafeGetTensorImpl()] = r.residuals.size();
      r.residuals.push_back(std::move(s));
    }
  }
  m.saved.clear();
  m.cache.end_first_run();
  m.cache.clear();
  return r;
}

}  // namespace detail

std::string SavedResiduals::to_string() const {
  auto mib = [](int64_t b) {
    std::ostringstream os;
    os << std::fixed << std::setprecision(2) << static_cast<double>(b) / (1024.0 * 1024.0) << " MiB";
    return os.str();
  };
  std::ostringstream os;
  os << std::left << std::setw(4) << "#" << std::setw(13) << "kind" << std::setw(30) << "op" << std::setw(16) << "name"
     << std::setw(22) << "shape" << std::setw(10) << "dtype" << std::right << std::setw(12) << "bytes"
     << (policy.empty() ? "" : "  policy") << "\n";
  for (size_t i = 0; i < residuals.size(); ++i) {
    const auto& s = residuals[i];
    os << std::left << std::setw(4) << i << std::setw(13) << remat::to_string(s.kind) << std::setw(30)
       << (s.op.empty() ? "-" : s.op) << std::setw(16) << (s.tag.empty() ? "-" : s.tag) << std::setw(22)
       << detail::sizes_str(s.sizes) << std::setw(10) << c10::toString(s.dtype) << std::right << std::setw(12)
       << (s.shared ? "(shared)" : std::to_string(s.bytes));
    if (s.saves > 1) os << " x" << s.saves;
    if (!policy.empty() && s.kind == ResidualKind::kRecomputable)
      os << "  " << (s.kept_by_policy ? "saved" : "recomputed");
    os << "\n";
  }
  os << "total " << mib(total_bytes) << ": recomputable " << mib(recomputable_bytes) << ", inputs " << mib(input_bytes)
     << ", parameters " << mib(parameter_bytes) << ", external " << mib(external_bytes) << "\n";
  if (!policy.empty()) os << "policy " << policy << " keeps " << mib(policy_bytes) << " of op outputs\n";
  return os.str();
}

}  // namespace remat
