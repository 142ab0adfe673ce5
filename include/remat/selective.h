// Selective checkpointing beyond policies (policy.h): names for tensors
// inside a region (JAX's checkpoint_name), per-op counters, and inspection
// of what autograd keeps (JAX's print_saved_residuals).
//
//   auto s = remat::checkpoint_name(q_k, "attn_scores");      // inside a region
//   std::cout << remat::saved_residuals(block, x).to_string();  // what backward keeps
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <ATen/core/Tensor.h>

#include <remat/checkpoint.h>
#include <remat/policy.h>

namespace remat {

/** Names t for the policies of the region it is in (policy::save_names and
 *  the like): the op that produced t (through views of it) is asked again
 *  with OpCall::tag() == name. Returns t itself; outside a region with a
 *  policy it does nothing else. Throws remat::Error when a policy then saves
 *  a tensor that cannot be saved (a region input, or an output of an op
 *  whose other outputs are gone), naming it. */
at::Tensor checkpoint_name(const at::Tensor& t, const std::string& name);

/** What happened to one operator in regions with a policy. */
struct OpCounts {
  int64_t saved = 0;       ///< outputs kept in a first run
  int64_t replayed = 0;    ///< handed back in a recompute instead of running
  int64_t recomputed = 0;  ///< run again in a recompute
};
/** Per operator ("aten::addmm"), since the last reset_checkpoint_stats(). */
std::map<std::string, OpCounts> op_stats();

/** Where a saved tensor comes from. */
enum class ResidualKind {
  kInput,         ///< an argument of the function
  kParameter,     ///< a leaf that requires grad (a parameter), or a view of one
  kRecomputable,  ///< made inside the function: checkpointing can drop it
  kExternal,      ///< made before the call and captured (a constant, a mask)
};
/** "input", "parameter", "recomputable" or "external". */
const char* to_string(ResidualKind k);

/** One tensor autograd saves for backward. */
struct SavedResidual {
  std::string op;   ///< producing operator ("aten::addmm"); "" when not made inside
  std::string tag;  ///< its checkpoint_name, or ""
  /** Its shape. */
  std::vector<int64_t> sizes;
  /** Its dtype. */
  at::ScalarType dtype = at::ScalarType::Undefined;
  int64_t bytes = 0;    ///< bytes of its storage
  bool shared = false;  ///< its storage was listed before (counted once)
  int64_t saves = 1;    ///< how many backward nodes save this tensor
  /** Where it comes from. */
  ResidualKind kind = ResidualKind::kRecomputable;
  bool kept_by_policy = false;  ///< with a policy: the policy saves its producer
};

/** Every tensor autograd keeps for a function, in save order. Byte totals
 *  count each storage once. */
struct SavedResiduals {
  /** One per saved tensor, in save order. */
  std::vector<SavedResidual> residuals;
  int64_t total_bytes = 0;         ///< every kind
  int64_t recomputable_bytes = 0;  ///< kRecomputable: what plain backward keeps beyond inputs and parameters
  /** Bytes of kInput, kParameter and kExternal residuals. */
  ///@{
  int64_t input_bytes = 0, parameter_bytes = 0, external_bytes = 0;
  ///@}
  /** With a policy: bytes of the outputs it saves (what a checkpoint with
   *  it keeps beyond inputs and parameters); -1 without one. */
  int64_t policy_bytes = -1;
  std::string policy;  ///< its description, or ""
  /** A table, one line per residual, then the totals. */
  std::string to_string() const;
};

namespace detail {
/** Records what autograd saves (through a hook that keeps the tensors) and
 *  which op made each tensor (through an interceptor) while it lives. */
class ResidualRecorder {
 public:
  ResidualRecorder(std::optional<Policy> policy, std::vector<at::Tensor> inputs);
  ~ResidualRecorder();
  ResidualRecorder(const ResidualRecorder&) = delete;
  ResidualRecorder& operator=(const ResidualRecorder&) = delete;
  /** Stops recording and lists what was saved. */
  SavedResiduals finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

template <class Fn, class... Args>
SavedResiduals saved_residuals_impl(std::optional<Policy> policy, Fn&& fn, Args&&... args) {
  std::vector<at::Tensor> inputs;
  (collect(inputs, args), ...);
  ResidualRecorder rec(std::move(policy), std::move(inputs));
  auto out = call(fn, std::forward<Args>(args)...);  // keeps the graph alive until finish()
  return rec.finish();
}
}  // namespace detail

/** Runs fn(args...) once with grad enabled and lists every tensor autograd
 *  would keep for its backward (fn is called as remat::checkpoint calls it).
 *  Nothing is checkpointed and the graph is freed before returning. */
template <class Fn, class... Args>
requires(!std::is_same_v<std::decay_t<Fn>, Policy>) SavedResiduals saved_residuals(Fn&& fn, Args&&... args) {
  return detail::saved_residuals_impl(std::nullopt, std::forward<Fn>(fn), std::forward<Args>(args)...);
}

/** As above, and marks the residuals whose producer `policy` would save. */
template <class Fn, class... Args>
SavedResiduals saved_residuals(const Policy& policy, Fn&& fn, Args&&... args) {
  return detail::saved_residuals_impl(policy, std::forward<Fn>(fn), std::forward<Args>(args)...);
}

}  // namespace remat
