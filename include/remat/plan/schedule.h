// Schedules (the op sequence a runtime executes one by one) and the exact
// simulator that replays them against a Chain. Leaves out: what a runtime
// does with tensors; here only liveness, bytes and time are tracked.
//
// NOTE [Op semantics] (the contract with the runtime; docs/planner.md has more)
// State: live boundary values a_0..a_L, live saved sets s_0..s_{L-1}, one live
// gradient. a_0 is live throughout. s_i covers a_{i+1}: while s_i is live,
// a_{i+1} is live and counted inside saved_bytes, not again.
//  - kForward(i):     needs a_i live and a_{i+1} not live; makes a_{i+1} live.
//  - kForwardSave(i): same needs; makes a_{i+1} and s_i live. Under option
//                     k >= 1 (Op::option), s_i and the backward(i) that frees
//                     it take Stage::options[k - 1]'s bytes and times.
//  - kBackward(i):    needs i == next stage to backward (L-1 down to 0), s_i and
//                     a_i live; makes grad_i live; frees s_i, a_{i+1}, grad_{i+1}.
//  - kDrop(j):        1 <= j <= L; needs a_j live, s_{j-1} not live (a_j is part
//                     of it) and s_j not live (backward(j) needs its input); frees a_j.
// Also: no forward of a stage whose backward already ran; the forward phase
// (ops before the first backward) ends with kForwardSave(L-1), immediately
// followed by kBackward(L-1); the loss gradient grad_L (|a_L| bytes) is live
// from the first backward on. At the end exactly a_0 and grad_0 are live.
// Bytes during an op = bytes before it + what it allocates (|a_{i+1}| for a
// forward, saved_bytes for a forward_save, |a_i| for grad_i in a backward) +
// the op's temporaries. Peak = max over ops (and the initial |a_0|).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "remat/plan/chain.h"

namespace remat::plan {

/** What a schedule op does; the rules are in NOTE [Op semantics] above. */
enum class OpKind {
  kForward,      ///< forward without saving; the output may be kept as a checkpoint
  kForwardSave,  ///< forward saving everything the stage's backward needs
  kBackward,     ///< backward of the stage
  kDrop,         ///< free boundary value a_j (a checkpoint); stage = j
};

/** One op of a schedule: a kind applied to a stage (or boundary). */
struct Op {
  OpKind kind;  ///< what the op does
  /** Stage index i for forwards and backward; boundary index j for kDrop. */
  int stage;
  /** kForwardSave only: 0 keeps everything, k >= 1 runs the stage under
   *  Stage::options[k - 1] (its backward follows the same option). Other
   *  ops: 0. */
  int option = 0;
  friend bool operator==(const Op&, const Op&) = default;
};

/** "forward", "forward_save", "backward", "drop" (the JSON names). */
const char* op_kind_name(OpKind kind);
/** "forward_save(3)"; with an option "forward_save(3, option 1)". */
std::string to_string(const Op& op);

/** The op sequence a runtime executes one by one (NOTE [Op semantics]). */
struct Schedule {
  std::vector<Op> ops;  ///< in execution order
  friend bool operator==(const Schedule&, const Schedule&) = default;
};

/** What simulate() finds for a schedule on a chain: peak bytes and time. */
struct Prediction {
  /** Maximum bytes live at any moment, including a_0. */
  int64_t peak_bytes = 0;
  /** Sum of forward_ms over forward ops (both kinds) and backward_ms over backwards. */
  double time_ms = 0;
  /** Forward executions of all stages, both kinds. */
  int64_t forward_executions = 0;
  /** Forward executions per stage (size L). */
  std::vector<int> forwards_per_stage;
  /** Peak bytes live during each op, at least those live as it begins
   *  (same length as the schedule's ops). */
  std::vector<int64_t> op_bytes;
};

/** Replays the schedule exactly; throws Error naming op index, op and stage for
 *  an invalid schedule (see NOTE [Op semantics]). Validates the chain. */
Prediction simulate(const Chain& chain, const Schedule& schedule);

/** schedule.ops[k] is forward_save(i) and no op between it and backward(i)
 *  runs stage i + 1, so nothing reads a_{i+1}: after the first backward,
 *  the runtime cuts such a recompute short and simulate counts it at
 *  Stage::recompute_ms. */
bool output_unread_until_backward(const Schedule& schedule, size_t k);

}  // namespace remat::plan
