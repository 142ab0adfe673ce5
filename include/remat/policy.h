// Selective checkpointing policies: for each ATen op run inside a
// checkpointed region, a Policy decides whether its outputs are saved from
// the first run (and handed back, without running the op, when backward
// recomputes the region) or recomputed. The counterpart of PyTorch's
// create_selective_checkpoint_contexts and of JAX's checkpoint policies:
//
//   auto y = remat::checkpoint(
//       remat::CheckpointOptions().policy(remat::policy::save_matmuls()), block, x);
//
// The policy sees the ops that run kernels (autograd's decompositions are
// done: `linear` arrives as addmm or mm, `matmul` as mm or bmm). In-place,
// view and random ops are always recomputed: a saved view would pin its base
// and go stale, and a skipped random op would shift the RNG stream that the
// recompute replays. Saved outputs that are later modified in place make the
// recompute throw, naming the op. See NOTE [op-level interception, as built]
// (src/core/dispatch.h) for the mechanism and its cost.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <c10/util/ArrayRef.h>

namespace c10 {
class IValue;
class OperatorHandle;
}  // namespace c10

namespace remat {

/** What a policy decides for one op. kMust* are binding; kPrefer* say the
 *  same in eager execution but leave room for an automatic memory budget to
 *  override them. kOffload saves the output like kPreferSave, but when the
 *  region's forward ends it moves to the region's offload target
 *  (CheckpointOptions().offload(...), required) and comes back when backward
 *  recomputes the region. */
enum class OpDecision { kMustSave, kPreferSave, kPreferRecompute, kMustRecompute, kOffload };

/** True for kMustSave, kPreferSave and kOffload. */
constexpr bool saves(OpDecision d) {
  return d == OpDecision::kMustSave || d == OpDecision::kPreferSave || d == OpDecision::kOffload;
}

/** "kMustSave" ... "kMustRecompute". */
const char* to_string(OpDecision d);

/** One op call, as a policy sees it. */
class OpCall {
 public:
  /** Built by remat for each op (tests may build one with op == nullptr);
   *  inputs must outlive the OpCall. */
  OpCall(const c10::OperatorHandle* op, std::string name, std::string overload, c10::ArrayRef<c10::IValue> inputs,
         std::string tag)
      : op_(op), name_(std::move(name)), overload_(std::move(overload)), inputs_(inputs), tag_(std::move(tag)) {}
  /** The operator, e.g. "aten::mm" (no overload). */
  const std::string& name() const { return name_; }
  /** The overload, e.g. "Tensor" for aten::add.Tensor; "" for the default. */
  const std::string& overload() const { return overload_; }
  /** The arguments as the dispatcher holds them. Empty when the policy is
   *  asked again because an output got a name (tag() is then set). */
  c10::ArrayRef<c10::IValue> inputs() const { return inputs_; }
  /** The remat::checkpoint_name given to an output of this op, or "". */
  const std::string& tag() const { return tag_; }
  /** The operator handle; nullptr only in tests that build an OpCall. */
  const c10::OperatorHandle* op() const { return op_; }

 private:
  const c10::OperatorHandle* op_;
  std::string name_, overload_;
  c10::ArrayRef<c10::IValue> inputs_;
  std::string tag_;
};

/** A named decision function. Called once per op in a region's first run,
 *  and again for an op whose output is given a name (with tag() set; the
 *  second answer wins). Must not depend on anything but its argument. */
class Policy {
 public:
  /** The decision function: one OpDecision per op call. */
  using Fn = std::function<OpDecision(const OpCall&)>;
  /** A policy from a function; description names it in messages. */
  Policy(std::string description, Fn fn) : description_(std::move(description)), fn_(std::move(fn)) {}
  /** The decision for call. */
  OpDecision operator()(const OpCall& call) const { return fn_(call); }
  /** For describe_checkpointing() and error messages, e.g. "save_matmuls". */
  const std::string& description() const { return description_; }

 private:
  std::string description_;
  Fn fn_;
};

/** Ready-made policies for CheckpointOptions::policy and their combination. */
namespace policy {

/** The operators save_matmuls() saves: aten::mm, addmm, bmm, baddbmm,
 *  matmul, linear, convolution (and _convolution, cudnn/mkldnn variants)
 *  and the scaled-dot-product-attention kernels. */
const std::vector<std::string>& matmul_ops();

/** kPreferSave for the ops of matmul_ops(), kPreferRecompute otherwise: the
 *  expensive outputs stay, the cheap memory-heavy ones are recomputed. */
Policy save_matmuls();
/** kPreferRecompute for every op: like a checkpoint without a policy, but
 *  through the interception path (for comparisons). */
Policy save_nothing();
/** kPreferSave for the named operators ("aten::mm", or "aten::add.Tensor"
 *  for one overload), kPreferRecompute otherwise. Throws remat::Error on a
 *  name without a namespace ("mm" instead of "aten::mm"). */
Policy save_ops(std::vector<std::string> ops);
/** kOffload for the named operators, kPreferRecompute otherwise: their
 *  outputs go to the region's offload target instead of staying in memory. */
Policy offload_ops(std::vector<std::string> ops);
/** kMustRecompute for the named operators, kPreferRecompute otherwise; in
 *  any_of() it overrides other policies' saves. */
Policy recompute_ops(std::vector<std::string> ops);
/** JAX's save_only_these_names: kPreferSave for ops whose output carries
 *  one of the names (remat::checkpoint_name), kPreferRecompute otherwise. */
Policy save_names(std::vector<std::string> names);
/** JAX's save_any_names_but_these: kPreferSave for every named output
 *  except the given names, kPreferRecompute otherwise. */
Policy save_names_except(std::vector<std::string> names);
/** kMustRecompute for ops whose output carries one of the names. */
Policy recompute_names(std::vector<std::string> names);
/** Combination: a kMust* answer of any policy decides (kMustRecompute over
 *  kMustSave); otherwise the op is saved if any policy prefers saving. */
Policy any_of(std::vector<Policy> policies);

}  // namespace policy
}  // namespace remat
