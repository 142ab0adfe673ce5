// Internal: the value at a boundary of a planned chain. A stage (one module
// of a torch::nn::Sequential) takes and returns one tensor, a
// std::vector<at::Tensor>, or a std::tuple of 2 to 4 tensors (hidden state
// and mask, a skip tensor): whatever the next module's forward accepts.
// The profiler and CheckpointedSequential handle every boundary as the list
// of its tensors plus the C++ type to hand the next module.
#pragma once

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/any.h>

#include <remat/profile.h>

namespace remat::detail {

struct Values {
  enum class Kind { kTensor, kVector, kTuple2, kTuple3, kTuple4 };
  Kind kind = Kind::kTensor;
  std::vector<at::Tensor> ts;  // undefined elements allowed (an absent mask)

  Values() = default;
  explicit Values(at::Tensor t) : ts{std::move(t)} {}
  Values(Kind k, std::vector<at::Tensor> v) : kind(k), ts(std::move(v)) {}

  size_t size() const { return ts.size(); }
  at::Tensor& operator[](size_t k) { return ts[k]; }
  const at::Tensor& operator[](size_t k) const { return ts[k]; }
  /** True when no element is defined (a dropped boundary). */
  bool empty() const;
  void clear() { ts.assign(ts.size(), at::Tensor()); }
  /** Each element detached (same storages, no graph). */
  Values detached() const;
  /** Each defined element cloned (in the current grad mode: a clone of a
   *  leaf that requires grad is a non-leaf whose gradient reaches it). */
  Values cloned() const;
  /** Distinct storages' bytes, minus those in `exclude` (e.g. the chain
   *  input: a mask passed along every stage is counted once, there). */
  int64_t bytes(const Values* exclude = nullptr) const;
  /** "Tensor", "vector of 3 tensors", "tuple of 2 tensors". */
  std::string describe() const;

  /** Unpacks a module's result; throws remat::Error naming `who` and the
   *  type it got when it is none of the accepted ones. */
  static Values from(torch::nn::AnyValue&& v, const std::string& who);
  /** The value as the type it came in. */
  torch::nn::AnyValue to_any() const;
};

/** m's forward on v (v converted to its own C++ type). */
Values run_module(torch::nn::AnyModule& m, const Values& v, const std::string& who);

/** NOTE [stages that write their input]: a block whose first op is an
 *  in-place activation (`ReLU(inplace)`, `LeakyReLU(inplace)`) writes the
 *  stage's input. A planned chain hands a stage a detached leaf (a_i, which
 *  a later recompute reads again): in-place on it is refused by autograd
 *  ("a leaf Variable that requires grad..."), and without grad it would
 *  change the stored boundary value. The profiler runs each stage once on
 *  a copy of its input and compares version counters; such a stage
 *  (`writes_input`) then runs on a copy of its input every time it runs
 *  (profiled that way too, so the copy is counted): the copy is a non-leaf
 *  (a clone, when grad is on) whose gradient reaches the leaf, and a_i
 *  stays as it was. A stage that writes its input on some calls only
 *  cannot be served: run_stage_module throws, naming the stage and module.
 *  Runs m on in (on a copy of it when writes_input); otherwise checks that
 *  m left in unwritten. */
Values run_stage_module(torch::nn::AnyModule& m, const Values& in, bool writes_input, const std::string& who);

struct Levers;

/** remat::profile on a chain whose input is x (any kind); the last stage's
 *  result kind and tensor count into `result` when given (ts left empty,
 *  sized with undefined tensors); each stage's menu (ProfileOptions::
 *  selective_levels, offload), aligned with its plan::Stage::options, into
 *  `levers` when given. */
plan::Chain profile_values(const torch::nn::Sequential& seq, const Values& x, const ProfileOptions& options,
                           Values* result = nullptr, std::vector<char>* writes_input = nullptr,
                           Levers* levers = nullptr);

/** Is the tensor's gradient tracked at a boundary (floating or complex)? */
inline bool differentiable(const at::Tensor& t) { return t.defined() && (t.is_floating_point() || t.is_complex()); }

}  // namespace remat::detail
