// The planner's model of a sequential network: a chain of stages with their
// measured (or estimated) times and sizes, and each stage's other options
// for keeping what its backward needs. Torch-free: the runtime fills a
// Chain from profiling; parameters and parameter gradients are not modeled.
// The memory rules built on it are in docs/planner.md and schedule.h.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

/** The torch-free planner: chains, schedules, the simulator and the
 *  checkpointing algorithms (<remat/plan/plan.h>). */
namespace remat::plan {

/** Another way for a forward_save of its stage to keep what the stage's
 *  backward needs: a selective level (keeps some op outputs, recomputes the
 *  rest inside the backward) or offload (sends the saved tensors out and
 *  reads them back in the backward). The fields replace the stage's own for
 *  a forward_save run under the option and for the backward that follows
 *  it; the rest (output_bytes, forward_ms of a plain forward, ...) is the
 *  stage's. Option 0 of a schedule op is the stage itself (keep everything);
 *  option k >= 1 is Stage::options[k - 1]. */
struct StageOption {
  std::string name;  ///< for reports, e.g. "save 2 convolution", "offload disk"
  /** Bytes the forward_save keeps in memory (its output included, its input
   *  not); output_bytes <= saved_bytes. */
  int64_t saved_bytes = 0;
  /** Time of the forward_save under the option, ms; >= the stage's forward_ms. */
  double forward_ms = 0;
  /** Time of the backward that follows it (recompute or reads included), ms;
   *  >= the stage's backward_ms. */
  double backward_ms = 0;
  /** As Stage::forward_tmp_bytes, for a forward_save under the option. */
  int64_t forward_tmp_bytes = 0;
  /** As Stage::backward_tmp_bytes, for its backward. */
  int64_t backward_tmp_bytes = 0;
  /** As Stage::backward_freed_bytes, for its backward. */
  int64_t backward_freed_bytes = 0;
};

/** One stage i of the chain: reads a_i, writes a_{i+1}. */
struct Stage {
  std::string name;  ///< for reports and errors; the profiler writes "<index>:<the module's name()>"
  /** Time of one forward of the stage, ms (with or without saving). */
  double forward_ms = 0;
  /** Time of its backward, ms. */
  double backward_ms = 0;
  /** |a_{i+1}|: bytes of the stage's output (the next stage's input). */
  int64_t output_bytes = 0;
  /** |s_i|: bytes the stage keeps for backward when run with grad, INCLUDING
   *  its output a_{i+1} and EXCLUDING its input a_i; >= output_bytes. */
  int64_t saved_bytes = 0;
  /** Extra bytes live only while the stage's forward_save runs (above its
   *  saved set); also a plain forward's unless plain_forward_tmp_bytes is set. */
  int64_t forward_tmp_bytes = 0;
  /** Extra bytes live only while the stage's backward runs. */
  int64_t backward_tmp_bytes = 0;
  /** Bytes of the stage's saved set and of the gradient at its output that
   *  its backward has already freed when it peaks (a runtime that lets the
   *  graph free them as it goes, as remat's does); at most saved_bytes +
   *  output_bytes. The backward's peak is the bytes before it + |grad_i| +
   *  backward_tmp_bytes - backward_freed_bytes. Default 0. */
  int64_t backward_freed_bytes = 0;
  /** (Last, so that positional initializers keep their meaning.) Time of a forward_save run after the first backward
   * whose output no op reads before the stage's backward (a recompute that the runtime cuts short after the last op
   * whose result backward reads), ms; < 0: forward_ms (the default; no cut measured). */
  double recompute_ms = -1;
  /** (After recompute_ms, for the same reason.) Extra bytes live only while a
   *  plain forward runs (one keeping only a_{i+1}, without autograd: its
   *  intermediates are freed as they die, not saved), above a_{i+1}; < 0:
   *  forward_tmp_bytes (the default). */
  int64_t plain_forward_tmp_bytes = -1;
  /** (Last, as above.) Bytes of a_{i+1} that are a_i's own storage, passed on
   *  unchanged (an identity shortcut: a residual block's head returns
   *  (first(x), x)); also inside saved_bytes. While a_{i+1} and the a_i it
   *  was computed from are both live, these bytes are counted once. A drop
   *  of either leaves them with the other, and a recomputed a_i is new
   *  storage that shares nothing with an older a_{i+1}. Default 0; at most
   *  min(|a_i|, output_bytes). */
  int64_t shared_input_bytes = 0;
  /** (Last, as above.) |grad_{i+1}|, the gradient at the stage's output,
   *  where it differs from output_bytes: a tensor of the chain input passed
   *  on is not in output_bytes (input_bytes counts it) but has a gradient;
   *  one that needs no gradient (a mask) has none. < 0: output_bytes (the
   *  default). */
  int64_t output_grad_bytes = -1;
  /** (Last, as above.) Other ways for a forward_save to keep what backward
   *  needs (StageOption); empty: only keeping everything. Only
   *  OptimalScope::kPersistent plans chains with options (optimal() under
   *  kAuto picks it); the other algorithms use option 0 only. */
  std::vector<StageOption> options = {};
  /** The stage as a forward_save under option k runs it: k == 0 is the
   *  stage itself; k >= 1 takes options[k - 1]'s fields (recompute_ms
   *  unset: a run under an option is never cut short). */
  Stage with_option(int k) const;
  /** |grad_{i+1}|: output_grad_bytes where set. */
  int64_t grad_bytes() const { return output_grad_bytes < 0 ? output_bytes : output_grad_bytes; }

  /** A plain forward's temporaries: plain_forward_tmp_bytes where set. */
  int64_t plain_tmp_bytes() const { return plain_forward_tmp_bytes < 0 ? forward_tmp_bytes : plain_forward_tmp_bytes; }
};

/** A chain of L >= 1 stages fed by a_0 (the chain input, owned by the caller). */
struct Chain {
  /** |a_0|: bytes of the chain input; always live, and the size of the gradient at boundary 0. */
  int64_t input_bytes = 0;
  std::vector<Stage> stages;  ///< the L stages, in execution order
  /** |grad_0|, the gradient at the chain input, where it differs from
   *  input_bytes (a runtime may charge the parameter gradients its stages'
   *  backwards allocate to the gradients at the boundaries: docs/runtime.md);
   *  < 0: input_bytes (the default). */
  int64_t input_grad_bytes = -1;

  /** Number of stages L. */
  int size() const { return static_cast<int>(stages.size()); }
  /** |a_j| for j in [0, L]: input_bytes for j = 0, else stages[j-1].output_bytes. */
  int64_t value_bytes(int j) const { return j == 0 ? input_bytes : stages[j - 1].output_bytes; }
  /** |grad_j| for j in [0, L]: input_grad_bytes (else input_bytes) for j = 0,
   *  else stages[j-1].grad_bytes(); grad_L is the loss gradient. */
  int64_t grad_bytes(int j) const {
    return j == 0 ? (input_grad_bytes < 0 ? input_bytes : input_grad_bytes) : stages[j - 1].grad_bytes();
  }
  /** |a_{j+1}| net of the bytes it shares with a_j (Stage::shared_input_bytes),
   *  j in [0, L-1]: what a forward of stage j adds while a_j is live. */
  int64_t new_value_bytes(int j) const { return stages[j].output_bytes - stages[j].shared_input_bytes; }
  /** Some stage has options (Stage::options). */
  bool has_options() const;
  /** Throws Error for an empty chain, a negative or non-finite size or time,
   *  saved_bytes < output_bytes, shared_input_bytes above |a_i| or
   *  output_bytes (the message names the stage and the field), or
   *  sizes adding up to more than 2^60 bytes (so that byte sums fit in 64 bits),
   *  and an option keeping less than the output or costing less time than
   *  keeping everything (forward_ms or backward_ms below the stage's). */
  void validate() const;
};

}  // namespace remat::plan
