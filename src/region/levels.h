// Selective levels: which op outputs a region keeps, chosen on measured op
// output bytes and times (a knapsack), and the policies that keep exactly
// those op calls. Shared by the whole-step planner (auto) and the chain's
// per-stage menu (CheckpointedSequential); not installed.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <remat/offload.h>
#include <remat/policy.h>

#include "../core/dispatch.h"

namespace remat::detail {

/** An op call as the selective levels tell calls apart: the operator with
 *  its overload and the shapes of its tensor arguments ("aten::addmm
 *  [512] [2048,512] [512,1536]"). Stateless: a policy computes it from its
 *  OpCall, the profiler from the dispatcher's stack. */
std::string op_signature(const std::string& key, c10::ArrayRef<c10::IValue> args);

/** What keeping one kind of op call costs and saves, per unit call. */
struct OpItem {
  std::string key;       // op_key, e.g. "aten::addmm"
  int64_t bytes = 0;     // its outputs' bytes (new storage only), summed over its calls
  double ms = 0;         // its time, summed
  bool saveable = true;  // a policy can keep it (not a view, not in place, not random)
};

/** Times every op of a run and measures its outputs, by op_signature(). */
class OpTimer : public dispatch::Interceptor {
 public:
  void on_op(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) override {
    const std::string key = dispatch::op_key(op);
    const size_t nargs = op.schema().arguments().size();
    const std::string sig = op_signature(key, c10::ArrayRef<c10::IValue>(*stack).slice(stack->size() - nargs));
    std::vector<const void*> in_storages;
    for (size_t i = stack->size() - nargs; i < stack->size(); ++i) {
      const auto& a = (*stack)[i];
      if (a.isTensor() && a.toTensor().defined() && a.toTensor().has_storage()) {
        in_storages.push_back(a.toTensor().storage().unsafeGetStorageImpl());
      }
    }
    const auto t0 = std::chrono::steady_clock::now();
    dispatch::run_below(op, ks, stack);
    OpItem& item = items_[sig];
    item.key = key;
    item.ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const size_t nout = op.schema().returns().size();
    for (size_t i = stack->size() - nout; i < stack->size(); ++i) {
      const auto& r = (*stack)[i];
      if (!r.isTensor() || !r.toTensor().defined() || !r.toTensor().has_storage()) continue;
      const void* st = r.toTensor().storage().unsafeGetStorageImpl();
      if (std::find(in_storages.begin(), in_storages.end(), st) != in_storages.end()) {
        item.saveable = false;  // a view of, or a write into, an input
        continue;
      }
      item.bytes += static_cast<int64_t>(r.toTensor().storage().nbytes());
    }
  }
  void on_tag(const at::Tensor&, const std::string&) override {}
  const std::map<std::string, OpItem>& items() const { return items_; }

 private:
  std::map<std::string, OpItem> items_;
};

/** The sets of op calls to keep at `levels` byte caps (j/(levels+1) of all
 *  saveable bytes, j = 1..levels): per cap, the set with the most recompute
 *  time whose bytes fit. Exact: a DP over the items keeping the Pareto
 *  front of (bytes, time). Sets equal to none or all of the items are left
 *  out (recompute and keep are on the menus already). */
std::vector<std::vector<std::string>> knapsack_levels(const std::map<std::string, OpItem>& items, int levels);

/** A policy keeping exactly the op calls of `set` (op_signature()s). */
Policy keep_calls(std::string description, std::vector<std::string> set);

/** "save 3 addmm, _softmax": the operators of a level, counted. */
std::string level_name(const std::vector<std::string>& set);

/** knapsack_levels(items, levels) as policies named by level_name(). */
std::vector<Policy> level_policies(const std::map<std::string, OpItem>& items, int levels);

/** "offload disk", "offload memory zstd": an offload option's menu name. */
std::string offload_name(const OffloadOptions& o);

/** Throws Error (prefixed by `which`) for an offload option that cannot
 *  save anything on a menu: kHost for CPU tensors (on_cpu), kMemory without
 *  a codec, a missing or read-only directory. */
void check_menu_offload(const std::string& which, const OffloadOptions& off, bool on_cpu);

}  // namespace remat::detail
