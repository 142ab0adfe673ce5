// The exact simulator: replays a Schedule against a Chain under the rules of
// NOTE [Op semantics] (schedule.h). Leaves out everything but liveness, bytes
// and time.
#include <algorithm>
#include <string>
#include <vector>

#include "remat/plan/error.h"
#include "remat/plan/schedule.h"

namespace remat::plan {

const char* op_kind_name(OpKind kind) {
  switch (kind) {
    case OpKind::kForward: return "forward";
    case OpKind::kForwardSave: return "forward_save";
    case OpKind::kBackward: return "backward";
    case OpKind::kDrop: return "drop";
  }
  return "?";
}

std::string to_string(const Op& op) {
  return std::string(op_kind_name(op.kind)) + "(" + std::to_string(op.stage) +
         (op.option != 0 ? ", option " + std::to_string(op.option) : std::string()) + ")";
}

bool output_unread_until_backward(const Schedule& schedule, size_t k) {
  const int i = schedule.ops[k].stage;
  for (size_t n = k + 1; n < schedule.ops.size(); ++n) {
    const Op& op = schedule.ops[n];
    if (op.kind == OpKind::kBackward && op.stage == i) return true;
    if (op.stage == i + 1 && (op.kind == OpKind::kForward || op.kind == OpKind::kForwardSave)) return false;
  }
  return false;
}

namespace {
/** The fields an option replaces (Stage::with_option without copying the stage). */
struct Costs {
  int64_t saved, forward_tmp, backward_tmp, backward_freed;
  double forward_ms, backward_ms, recompute_ms;
};
Costs costs(const Stage& s, int k) {
  if (k == 0)
    return {s.saved_bytes, s.forward_tmp_bytes, s.backward_tmp_bytes, s.backward_freed_bytes,
            s.forward_ms,  s.backward_ms,       s.recompute_ms};
  const StageOption& o = s.options[static_cast<size_t>(k - 1)];
  return {o.saved_bytes,
          o.forward_tmp_bytes,
          o.backward_tmp_bytes,
          o.backward_freed_bytes,
          o.forward_ms,
          o.backward_ms,
          -1};
}
}  // namespace

Prediction simulate(const Chain& chain, const Schedule& schedule) {
  chain.validate();
  const int L = chain.size();
  std::vector<char> live_a(L + 1, 0), live_s(L, 0);
  // shares[i]: a_{i+1} holds Stage::shared_input_bytes of the live a_i it
  // was computed from, counted once (in a_i) while both live.
  std::vector<char> shares(L, 0);
  std::vector<int> option_of(L, 0);  // the option of stage i's live saved set
  live_a[0] = 1;
  Prediction p;
  p.forwards_per_stage.assign(L, 0);
  p.op_bytes.reserve(schedule.ops.size());
  int64_t cur = chain.input_bytes;
  p.peak_bytes = cur;
  int next_backward = L - 1;  // stages above it have had their backward
  bool backward_started = false;
  auto A = [&](int j) { return chain.value_bytes(j); };
  auto G = [&](int j) { return chain.grad_bytes(j); };

  for (size_t k = 0; k < schedule.ops.size(); ++k) {
    const Op op = schedule.ops[k];
    auto fail = [&](const std::string& why) {
      std::string where = "[remat::plan] invalid schedule at op " + std::to_string(k) + ", " + to_string(op);
      if (op.kind != OpKind::kDrop && op.stage >= 0 && op.stage < L)
        where += " (stage \"" + chain.stages[op.stage].name + "\")";
      throw Error(where + ": " + why);
    };
    const int i = op.stage;
    if (!backward_started && live_s[L - 1] && op.kind != OpKind::kBackward)
      fail("forward_save(" + std::to_string(L - 1) + ") ends the forward phase; the next op must be backward(" +
           std::to_string(L - 1) + ").");
    if (op.option != 0) {
      if (op.kind != OpKind::kForwardSave)
        fail("only a forward_save takes an option (a backward follows its forward_save's).");
      if (op.stage >= 0 && op.stage < L &&
          (op.option < 0 || op.option > static_cast<int>(chain.stages[op.stage].options.size())))
        fail("no option " + std::to_string(op.option) + "; the stage has " +
             std::to_string(chain.stages[op.stage].options.size()) + " (1.." +
             std::to_string(chain.stages[op.stage].options.size()) + "; 0 keeps everything).");
    }
    const int64_t before = cur;
    int64_t during = cur;
    switch (op.kind) {
      case OpKind::kForward:
      case OpKind::kForwardSave: {
        if (i < 0 || i >= L) fail("no such stage; stages are 0.." + std::to_string(L - 1) + ".");
        if (i > next_backward) fail("stage " + std::to_string(i) + "'s backward already ran.");
        if (!live_a[i]) fail("its input a_" + std::to_string(i) + " is not live (dropped or never computed).");
        if (live_a[i + 1]) fail("its output a_" + std::to_string(i + 1) + " is already live; drop it first.");
        const Stage& st = chain.stages[i];
        const Costs c = costs(st, op.option);
        const int64_t add = (op.kind == OpKind::kForward ? st.output_bytes : c.saved) - st.shared_input_bytes;
        during = cur + add + (op.kind == OpKind::kForward ? st.plain_tmp_bytes() : c.forward_tmp);
        cur += add;
        live_a[i + 1] = 1;
        shares[i] = 1;
        if (op.kind == OpKind::kForwardSave) {
          live_s[i] = 1;
          option_of[i] = op.option;
        }
        p.time_ms += op.kind == OpKind::kForwardSave && c.recompute_ms >= 0 && backward_started &&
                             output_unread_until_backward(schedule, k)
                         ? c.recompute_ms
                     : op.kind == OpKind::kForwardSave ? c.forward_ms
                                                       : st.forward_ms;
        ++p.forward_executions;
        ++p.forwards_per_stage[i];
        break;
      }
      case OpKind::kBackward: {
        if (i < 0 || i >= L) fail("no such stage; stages are 0.." + std::to_string(L - 1) + ".");
        if (next_backward < 0) fail("every stage already had its backward.");
        if (i != next_backward)
          fail("backward out of order; backwards run from stage " + std::to_string(L - 1) +
               " down to 0 and the next one is backward(" + std::to_string(next_backward) + ").");
        if (!live_s[i])
          fail("no saved set for stage " + std::to_string(i) + "; run forward_save(" + std::to_string(i) +
               ") before its backward.");
        if (!live_a[i]) fail("its input a_" + std::to_string(i) + " is not live (dropped or never computed).");
        if (!backward_started) {
          backward_started = true;
          cur += G(L);  // the loss gradient
        }
        const Stage& st = chain.stages[i];
        const Costs c = costs(st, option_of[i]);
        during = cur + G(i) + c.backward_tmp - c.backward_freed;
        cur += G(i) - c.saved - G(i + 1) + (shares[i] ? st.shared_input_bytes : 0);
        live_s[i] = 0;
        live_a[i + 1] = 0;
        shares[i] = 0;
        p.time_ms += c.backward_ms;
        --next_backward;
        break;
      }
      case OpKind::kDrop: {
        if (i < 1 || i > L)
          fail(i == 0 ? "a_0 is the chain input, owned by the caller; it cannot be dropped."
                      : "no such value; droppable values are a_1..a_" + std::to_string(L) + ".");
        if (!live_a[i]) fail("a_" + std::to_string(i) + " is not live.");
        if (live_s[i - 1])
          fail("a_" + std::to_string(i) + " is part of stage " + std::to_string(i - 1) + "'s saved set; backward(" +
               std::to_string(i - 1) + ") frees it.");
        if (i < L && live_s[i])
          fail("a_" + std::to_string(i) + " is the input of stage " + std::to_string(i) +
               ", whose saved set is live; backward(" + std::to_string(i) + ") needs it.");
        live_a[i] = 0;
        cur -= A(i);
        // What a_i shares with a neighbour stays live with it.
        if (shares[i - 1]) cur += chain.stages[i - 1].shared_input_bytes;
        if (i < L && shares[i]) cur += chain.stages[i].shared_input_bytes;
        shares[i - 1] = 0;
        if (i < L) shares[i] = 0;
        break;
      }
      default: fail("unknown op kind.");
    }
    // What was live when the op began is live during it: a backward that
    // frees more than it allocates peaks at its start, not below it.
    during = std::max(during, before);
    p.op_bytes.push_back(during);
    if (during > p.peak_bytes) p.peak_bytes = during;
  }
  if (next_backward >= 0)
    throw Error("[remat::plan] invalid schedule: stage " + std::to_string(next_backward) + " (\"" +
                chain.stages[next_backward].name + "\") was left without backward" +
                (backward_started ? "." : "; the schedule has no backward at all."));
  // Every backward ran, so only a_0 and grad_0 are live: backward(i) frees
  // a_{i+1} (with s_i) and no forward of stage i may run after it. A value made
  // by a plain forward and never dropped fails earlier, at the forward_save
  // that backward(i) needs ("already live"); tests/plan/simulate_test.cpp,
  // NothingOutlivesTheBackwardPass.
  return p;
}

}  // namespace remat::plan
