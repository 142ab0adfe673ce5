// Internal: the op cache of a checkpointed region with a selective policy
// (CheckpointOptions::policy). NOTE [selective op cache]: in the region's
// first run every op is shown to the policy; the outputs of saved ops are
// kept (as tensor_data() aliases, which share the first run's version
// counters) under the key (op, occurrence of that op in the region). When
// backward recomputes the region, an op whose key is cached is not run: its
// outputs are handed back (after checking they were not modified in place
// and that the op got inputs of the same shapes); every other op runs.
// Keys count occurrences per operator and parameters: the op's tensor
// arguments that are leaves requiring grad (parameters, the same tensors in
// every run) are part of the key. So a call that appears in one run only
// does not shift the others: autocast's cast cache serves a parameter's
// cast in one run and not in the other (its first use in the forward
// casts, the re-run in backward finds the cast cached), and the casts of
// computed tensors, counted apart, keep their numbers. A key that shifts
// all the same (control flow on other state) is caught at hand-back by the
// inputs' shapes and dtypes.
// An in-place op of the region that writes to a cached output's storage
// (Linear's bias `add_` on a view of its mm, a dropout's bernoulli_ into
// a saved empty_like) would make the cache hold the written values, not the
// op's result; version counters do not see writes through _unsafe_view
// aliases, so the first run compares storages before each in-place op and
// copies the affected entries first. A write the first run cannot see (to
// a returned output, after the region) is caught by the version check at
// hand-back, which throws naming the op.
// An entry is dropped when handed back unless backward keeps the graph
// (retain_graph), and everything when the region's graph is freed.
#pragma once

#include "../core/dispatch.h"
#include "../core/write_guard.h"
#include "../offload/offload_internal.h"

#include <ATen/core/ivalue.h>

#include <remat/policy.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace remat::detail {

using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

/** An op output seen in a first run, kept weakly: the tensor while it
 *  lives, else (a view such as _unsafe_view replaced it) rebuilt from its
 *  storage and geometry while that lives. */
struct OutputRef {
  explicit OutputRef(const at::Tensor& t);
  WeakImpl impl;
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
  at::TensorOptions options;
  /** The tensor, or an undefined one when its storage is gone too. */
  at::Tensor get() const;
};

struct InputMeta {
  std::vector<int64_t> sizes;
  at::ScalarType dtype = at::ScalarType::Undefined;
};

/** Why an op's outputs cannot be saved ("" when they can): in-place, view,
 *  random or returning something other than tensors and scalars. */
std::string uncacheable_reason(const c10::OperatorHandle& op);
std::vector<InputMeta> tensor_inputs_meta(c10::ArrayRef<c10::IValue> args);

/** Per-op counters (remat::op_stats), and their totals (CheckpointStats). */
void count_op(const std::string& key, int which);  // 0 saved, 1 replayed, 2 recomputed
extern std::atomic<int64_t> g_ops_saved, g_ops_replayed, g_ops_recomputed;
void reset_op_stats();

class SelectiveCache {
 public:
  explicit SelectiveCache(Policy policy) : policy_(std::move(policy)) {}
  /** The interceptor of the region's first run (the region owns it). */
  std::unique_ptr<dispatch::Interceptor> first_run();
  /** The interceptor of one recompute; keep_graph keeps handed-back entries;
   *  ops that run go through guard (NOTE [recompute side effects]). */
  std::unique_ptr<dispatch::Interceptor> recompute(bool keep_graph, WriteGuard* guard);
  /** Drops what only the first run needs (producers of tagged tensors). */
  void end_first_run();
  /** Drops every cached output. */
  void clear();
  /** Where kOffload outputs go when the first run ends (CheckpointOptions::offload). */
  void set_offload(std::shared_ptr<OffloadStore> store) { store_ = std::move(store); }
  /** saved_residuals: kOffload outputs are recorded as saved, with no target. */
  void inspect_only() { inspect_only_ = true; }
  const Policy& policy() const { return policy_; }

 private:
  friend class FirstRun;
  friend class Recompute;
  friend class ResidualRecorder;
  /** An op call of the region (NOTE [selective op cache]). */
  struct Key {
    std::string op;                                  // "aten::mm"
    std::vector<const c10::TensorImpl*> parameters;  // per tensor argument: the parameter, or nullptr
    int64_t n = 0;                                   // occurrence of (op, parameters) in the region
    bool operator<(const Key& o) const { return std::tie(op, parameters, n) < std::tie(o.op, o.parameters, o.n); }
    /** Counts the call of op on args in counts and returns its key. */
    static Key of(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args,
                  std::map<std::pair<std::string, std::vector<const c10::TensorImpl*>>, int64_t>& counts);
  };
  using Counts = std::map<std::pair<std::string, std::vector<const c10::TensorImpl*>>, int64_t>;
  struct Entry {
    std::vector<c10::IValue> outputs;
    std::vector<std::pair<size_t, uint32_t>> versions;  // tensor output index, version at save
    std::vector<InputMeta> inputs;
    OpDecision decision = OpDecision::kPreferSave;
    bool snapshot = false;  // values copied before an in-place op in the region wrote to them
    // kOffload, once the first run ended: one handle per output (outputs
    // then hold undefined placeholders; the store checks in-place writes).
    std::vector<OffloadStore::Handle> offloaded;
  };
  struct Record {  // one op of the first run
    std::optional<c10::OperatorHandle> op;
    Key key;
    std::vector<OutputRef> outputs;
    std::optional<WeakImpl> base;  // view-like ops: their first input
    bool view_like = false;
    std::string uncacheable;
    std::vector<InputMeta> inputs;
    std::string tag;  // its checkpoint_name
  };
  void save(const Key& key, Entry e);
  /** Before an in-place op writes to `written`: copies the cached outputs
   *  that share its storage (NOTE [selective op cache]). */
  void snapshot_before_write(const at::Tensor& written);
  void on_tag(const at::Tensor& t, const std::string& name);

  std::shared_ptr<OffloadStore> store_;
  bool inspect_only_ = false;
  Policy policy_;
  std::mutex mu_;
  std::map<Key, Entry> cache_;
  std::vector<Record> records_;
  std::unordered_map<const c10::TensorImpl*, size_t> producer_;
  // Storage -> the first in-place op that wrote it after its producer ran
  // (a name cannot then save the producer: it no longer holds the result).
  std::unordered_map<const c10::StorageImpl*, std::string> written_;
};

}  // namespace remat::detail
