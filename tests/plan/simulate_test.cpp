// Tests of the chain model, byte parsing, JSON and the exact simulator:
// hand-checked peaks and times, and every invalid-schedule error pinned by its
// text. Leaves out the algorithms (solve_test.cpp) and the tool (cli_test.cpp).
#include <gtest/gtest.h>

#include <cmath>

#include "remat/plan/plan.h"

namespace rp = remat::plan;
using rp::Op;
using rp::OpKind;

namespace {

// 3 stages; a_0 = 100. Sizes chosen so every term is visible in the peak.
rp::Chain small_chain() {
  rp::Chain c;
  c.input_bytes = 100;
  c.stages = {{"s0", 1.0, 2.0, 10, 30, 5, 7}, {"s1", 3.0, 4.0, 20, 50, 0, 0}, {"s2", 5.0, 6.0, 40, 60, 1, 2}};
  return c;
}

constexpr Op F(int i) { return {OpKind::kForward, i}; }
constexpr Op FS(int i) { return {OpKind::kForwardSave, i}; }
constexpr Op B(int i) { return {OpKind::kBackward, i}; }
constexpr Op D(int j) { return {OpKind::kDrop, j}; }

std::string error_of(const rp::Chain& c, std::vector<Op> ops) {
  try {
    rp::simulate(c, rp::Schedule{std::move(ops)});
  } catch (const rp::Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST(Simulate, StoreAllHandChecked) {
  const rp::Chain c = small_chain();
  const auto p = rp::simulate(c, rp::Schedule{{FS(0), FS(1), FS(2), B(2), B(1), B(0)}});
  // FS0: 100+30+5=135 -> 130; FS1: 130+50=180; FS2: 180+60+1=241 -> 240;
  // B2: +grad_3 (40) = 280, during +grad_2 (20) +2 = 302, after 280+20-60-40 = 200;
  // B1: 200+10 = 210, after 200+10-50-20 = 140; B0: 140+100+7 = 247, after 140+100-30-10 = 200.
  EXPECT_EQ(p.op_bytes, (std::vector<int64_t>{135, 180, 241, 302, 210, 247}));
  EXPECT_EQ(p.peak_bytes, 302);
  EXPECT_DOUBLE_EQ(p.time_ms, 1 + 3 + 5 + 2 + 4 + 6);
  EXPECT_EQ(p.forward_executions, 3);
  EXPECT_EQ(p.forwards_per_stage, (std::vector<int>{1, 1, 1}));
}

TEST(Simulate, BackwardFreedBytesLowerOnlyTheBackwardsPeak) {
  rp::Chain c = small_chain();
  c.stages[2].backward_freed_bytes = 50;  // e.g. grad_3 (40) and part of s_2 gone before B2 peaks
  const auto p = rp::simulate(c, rp::Schedule{{FS(0), FS(1), FS(2), B(2), B(1), B(0)}});
  // As StoreAllHandChecked, B2 during 302 - 50 = 252; what stays after it is unchanged.
  EXPECT_EQ(p.op_bytes, (std::vector<int64_t>{135, 180, 241, 252, 210, 247}));
  EXPECT_EQ(p.peak_bytes, 252);
}

TEST(Simulate, CheckpointedHandChecked) {
  const rp::Chain c = small_chain();
  // Keep only a_2 during the forward phase; recompute stages 0 and 1.
  const auto p = rp::simulate(c, rp::Schedule{{F(0), F(1), D(1), FS(2), B(2), D(2), FS(0), FS(1), B(1), B(0)}});
  // (a drop reports the bytes before it) F0: 100+10+5 = 115 -> 110; F1: 110+20 = 130; D1 -> 120; FS2: 120+60+1 = 181 ->
  // 180; B2: 180+40 = 220, +20+2 = 242, after 220+20-60-40 = 140; D2 -> 120 (grad_2 stays); FS0: 120+30+5 = 155 -> 150;
  // FS1: 150+50 = 200; B1: 200+10 = 210 -> 200+10-50-20 = 140; B0: 140+100+7 = 247.
  EXPECT_EQ(p.op_bytes, (std::vector<int64_t>{115, 130, 130, 181, 242, 140, 155, 200, 210, 247}));
  EXPECT_EQ(p.peak_bytes, 247);
  EXPECT_DOUBLE_EQ(p.time_ms, (1 + 3 + 5 + 1 + 3) + (2 + 4 + 6));
  EXPECT_EQ(p.forward_executions, 5);
  EXPECT_EQ(p.forwards_per_stage, (std::vector<int>{2, 2, 1}));
}

TEST(Simulate, InvalidSchedulesArePinned) {
  const rp::Chain c = small_chain();
  EXPECT_EQ(error_of(c, {FS(0), FS(1), FS(2), B(2), B(0)}),
            "[remat::plan] invalid schedule at op 4, backward(0) (stage \"s0\"): backward out of order; "
            "backwards run from stage 2 down to 0 and the next one is backward(1).");
  EXPECT_EQ(error_of(c, {F(0), FS(1), FS(2), B(2), B(1), B(0)}),
            "[remat::plan] invalid schedule at op 5, backward(0) (stage \"s0\"): no saved set for stage 0; "
            "run forward_save(0) before its backward.");
  EXPECT_EQ(error_of(c, {F(0), D(1), F(1)}),
            "[remat::plan] invalid schedule at op 2, forward(1) (stage \"s1\"): its input a_1 is not live "
            "(dropped or never computed).");
  EXPECT_EQ(error_of(c, {F(0), FS(0)}),
            "[remat::plan] invalid schedule at op 1, forward_save(0) (stage \"s0\"): its output a_1 is already "
            "live; drop it first.");
  EXPECT_EQ(error_of(c, {FS(0), FS(1), FS(2)}),
            "[remat::plan] invalid schedule: stage 2 (\"s2\") was left without backward; the schedule has no "
            "backward at all.");
  EXPECT_EQ(error_of(c, {FS(0), FS(1), FS(2), B(2), B(1)}),
            "[remat::plan] invalid schedule: stage 0 (\"s0\") was left without backward.");
  EXPECT_EQ(error_of(c, {F(0), FS(0)}).substr(0, 40), "[remat::plan] invalid schedule at op 1, ");
  EXPECT_EQ(error_of(c, {D(0)}),
            "[remat::plan] invalid schedule at op 0, drop(0): a_0 is the chain input, owned by the caller; "
            "it cannot be dropped.");
  EXPECT_EQ(error_of(c, {D(2)}), "[remat::plan] invalid schedule at op 0, drop(2): a_2 is not live.");
  EXPECT_EQ(error_of(c, {FS(0), D(1)}),
            "[remat::plan] invalid schedule at op 1, drop(1): a_1 is part of stage 0's saved set; backward(0) "
            "frees it.");
  EXPECT_EQ(error_of(c, {F(0), FS(1), D(1)}),
            "[remat::plan] invalid schedule at op 2, drop(1): a_1 is the input of stage 1, whose saved set is "
            "live; backward(1) needs it.");
  EXPECT_EQ(error_of(c, {FS(0), FS(1), FS(2), F(0)}),
            "[remat::plan] invalid schedule at op 3, forward(0) (stage \"s0\"): forward_save(2) ends the "
            "forward phase; the next op must be backward(2).");
  EXPECT_EQ(error_of(c, {F(0), F(1), FS(2), B(2), F(2)}),
            "[remat::plan] invalid schedule at op 4, forward(2) (stage \"s2\"): stage 2's backward already ran.");
  EXPECT_EQ(error_of(c, {F(0), F(1), FS(2), B(2), D(2), FS(0), FS(1), B(1), B(0)}),
            "[remat::plan] invalid schedule at op 5, forward_save(0) (stage \"s0\"): its output a_1 is already "
            "live; drop it first.");
  EXPECT_EQ(error_of(c, {F(0), D(1), F(0), F(1), D(1), FS(2), B(2), D(2), FS(0), FS(1), B(1), B(0), B(0)}),
            "[remat::plan] invalid schedule at op 12, backward(0) (stage \"s0\"): every stage already had its "
            "backward.");
  EXPECT_EQ(error_of(c, {F(0), F(1), FS(2), B(2), D(2), D(1), FS(0), FS(1), B(1), B(0), F(0)}),
            "[remat::plan] invalid schedule at op 10, forward(0) (stage \"s0\"): stage 0's backward already ran.");
  EXPECT_EQ(error_of(c, {F(0), FS(1), FS(2), B(2), B(1), D(1), FS(0), B(0), F(0)}).substr(0, 52),
            "[remat::plan] invalid schedule at op 8, forward(0) (");
  EXPECT_EQ(error_of(c, {FS(0), FS(1), FS(2), B(2), B(1), B(0), D(2)}),
            "[remat::plan] invalid schedule at op 6, drop(2): a_2 is not live.");
  EXPECT_EQ(error_of(c, {F(0), FS(0)}).find("already live") != std::string::npos, true);
  EXPECT_EQ(error_of(c, {FS(0), F(1), FS(2), B(2), D(2), FS(1), B(1), B(0)}), "(no error)");
  EXPECT_EQ(error_of(c, {F(0), F(1), FS(2), B(2), D(2), D(1), FS(0), FS(1), B(1), B(0)}), "(no error)");
  EXPECT_EQ(error_of(c, {F(0), F(1), F(2), D(3), D(2), FS(1), FS(2), B(2), B(1), D(1), FS(0), B(0)}), "(no error)");
  EXPECT_EQ(error_of(c, {FS(0), F(1), D(2), F(1), FS(2), B(2), D(2), FS(1), B(1), B(0)}), "(no error)");
  EXPECT_EQ(error_of(c, {FS(0), FS(1), F(2), D(3), FS(2), B(2), B(1), B(0), D(1)}),
            "[remat::plan] invalid schedule at op 8, drop(1): a_1 is not live.");
  EXPECT_EQ(error_of(c, {F(0), FS(1), FS(2), B(2), B(1), FS(0), B(0)}).substr(0, 42),
            "[remat::plan] invalid schedule at op 5, fo");
  EXPECT_EQ(error_of(c, {F(0), FS(1), FS(2), B(2), B(1), D(1), FS(0), B(0)}), "(no error)");
  EXPECT_EQ(error_of(c, {F(0), F(1), D(1), FS(2), B(2), D(2), FS(0), FS(1), B(1), B(0), D(1)}),
            "[remat::plan] invalid schedule at op 10, drop(1): a_1 is not live.");
  EXPECT_EQ(error_of(c, {F(0), F(1), FS(2), B(2), D(2), FS(1), B(1), B(0)}),
            "[remat::plan] invalid schedule at op 7, backward(0) (stage \"s0\"): no saved set for stage 0; "
            "run forward_save(0) before its backward.");
  EXPECT_EQ(error_of(c, {F(0), F(1), D(1), FS(2), B(2), D(2), FS(0), FS(1), B(1), B(0), B(1)}).substr(0, 54),
            "[remat::plan] invalid schedule at op 10, backward(1) (");
  EXPECT_EQ(error_of(c, {F(0), F(1), FS(2), B(2), FS(0)}).find("already live") != std::string::npos, true);
  EXPECT_EQ(error_of(c, {F(0), F(1), FS(2), B(2), D(2)}),
            "[remat::plan] invalid schedule: stage 1 (\"s1\") was left without backward.");
  EXPECT_EQ(error_of(c, {F(0), F(1), D(1), FS(2), B(2), D(2), FS(0), FS(1), B(1), B(0), {OpKind::kForward, 7}}),
            "[remat::plan] invalid schedule at op 10, forward(7): no such stage; stages are 0..2.");
}

TEST(Simulate, LeftoverCheckpointIsAnError) {
  const rp::Chain c = small_chain();
  EXPECT_EQ(error_of(c, {F(0), F(1), FS(2), B(2), D(2), FS(1), B(1), D(1), FS(0), B(0)}), "(no error)");
  EXPECT_EQ(error_of(c, {F(0), F(1), FS(2), B(2), D(2), FS(1), B(1), FS(0), B(0)}),
            "[remat::plan] invalid schedule at op 7, forward_save(0) (stage \"s0\"): its output a_1 is already "
            "live; drop it first.");
  EXPECT_EQ(error_of(c, {F(0), F(1), FS(2), B(2), FS(1), B(1), D(1), FS(0), B(0)}),
            "[remat::plan] invalid schedule at op 4, forward_save(1) (stage \"s1\"): its output a_2 is already "
            "live; drop it first.");
  EXPECT_EQ(error_of(c, {F(0), F(1), F(2), D(3), D(2), FS(2), B(2)}),
            "[remat::plan] invalid schedule at op 5, forward_save(2) (stage \"s2\"): its input a_2 is not live "
            "(dropped or never computed).");
  rp::Chain one;
  one.input_bytes = 1;
  one.stages = {{"only", 1, 1, 1, 1, 0, 0}};
  EXPECT_EQ(error_of(one, {F(0), FS(0)}),
            "[remat::plan] invalid schedule at op 1, forward_save(0) (stage \"only\"): its output a_1 is already "
            "live; drop it first.");
  EXPECT_EQ(error_of(one, {F(0), D(1), FS(0), B(0)}), "(no error)");
  EXPECT_EQ(error_of(one, {F(0), D(1), FS(0), B(0), F(0)}),
            "[remat::plan] invalid schedule at op 4, forward(0) (stage \"only\"): stage 0's backward already ran.");
  EXPECT_EQ(error_of(c, {F(0), F(1), F(2), D(2), D(3), D(1), FS(0), FS(1), FS(2), B(2), B(1), B(0)}), "(no error)");
  EXPECT_EQ(error_of(c, {F(0), F(1), FS(2), B(2), B(1)}),
            "[remat::plan] invalid schedule at op 4, backward(1) (stage \"s1\"): no saved set for stage 1; run "
            "forward_save(1) before its backward.");
  EXPECT_EQ(error_of(c, {F(0), FS(1), FS(2), B(2), B(1), D(1), FS(0), B(0), {OpKind::kDrop, 9}}),
            "[remat::plan] invalid schedule at op 8, drop(9): no such value; droppable values are a_1..a_3.");
}

// No value can outlive the backward pass, so simulate() has no end-of-schedule
// leftover check: backward(i) frees a_{i+1} and needs forward_save(i) first,
// which refuses a live a_{i+1}; nothing of stage i may run after backward(i).
// So a value made by a plain forward and never dropped fails at that
// forward_save, and the bytes return to a_0 + grad_0.
TEST(Simulate, NothingOutlivesTheBackwardPass) {
  rp::Chain c;
  c.input_bytes = 4;
  c.stages = {{"x", 1, 1, 2, 2, 0, 0}, {"y", 1, 1, 3, 3, 0, 0}};
  // a_1 recomputed by forward(0) for backward(1), dropped after it.
  // F0 4+2 = 6; D1 6 -> 4; F0 6; FS1 6+3 = 9; B1 9 + grad_2 (3) = 12, during
  // +grad_1 (2) = 14, after 12+2-3-3 = 8; D1 8 -> 6; FS0 6+2 = 8; B0 8+4 = 12,
  // after 8+4-2-2 = 8 = a_0 + grad_0: nothing else is live.
  const auto p = rp::simulate(c, rp::Schedule{{F(0), D(1), F(0), FS(1), B(1), D(1), FS(0), B(0)}});
  EXPECT_EQ(p.op_bytes, (std::vector<int64_t>{6, 6, 6, 9, 14, 8, 8, 12}));
  EXPECT_EQ(error_of(c, {F(0), F(1), D(2), FS(1), B(1), D(1), FS(0), B(0)}), "(no error)");
  // Without the drop after backward(1), a_1 is still live where forward_save(0) would make it again.
  EXPECT_EQ(error_of(c, {F(0), D(1), F(0), FS(1), B(1), FS(0), B(0)}),
            "[remat::plan] invalid schedule at op 5, forward_save(0) (stage \"x\"): its output a_1 is already "
            "live; drop it first.");
  // After the last backward nothing is live to drop, and no forward may run.
  EXPECT_EQ(error_of(c, {F(0), FS(1), B(1), D(1), FS(0), B(0), D(1)}),
            "[remat::plan] invalid schedule at op 6, drop(1): a_1 is not live.");
  EXPECT_EQ(error_of(c, {F(0), FS(1), B(1), D(1), FS(0), B(0), D(2)}),
            "[remat::plan] invalid schedule at op 6, drop(2): a_2 is not live.");
  EXPECT_EQ(error_of(c, {F(0), FS(1), B(1), D(1), FS(0), B(0), F(0)}),
            "[remat::plan] invalid schedule at op 6, forward(0) (stage \"x\"): stage 0's backward already ran.");
}

TEST(Chain, ValidateErrors) {
  rp::Chain c;
  EXPECT_THROW(c.validate(), rp::Error);
  try {
    c.validate();
  } catch (const rp::Error& e) {
    EXPECT_STREQ(e.what(), "[remat::plan] chain: no stages; a chain needs at least one stage.");
  }
  c = small_chain();
  c.stages[1].saved_bytes = 5;
  try {
    c.validate();
    FAIL();
  } catch (const rp::Error& e) {
    EXPECT_STREQ(e.what(),
                 "[remat::plan] chain: stage 1 (\"s1\"): saved_bytes (5) < output_bytes (20); the saved set "
                 "includes the stage's output.");
  }
  c = small_chain();
  c.stages[2].backward_tmp_bytes = -3;
  try {
    c.validate();
    FAIL();
  } catch (const rp::Error& e) {
    EXPECT_STREQ(e.what(),
                 "[remat::plan] chain: stage 2 (\"s2\"): backward_tmp_bytes is negative (-3); sizes are bytes >= 0.");
  }
  c = small_chain();
  c.stages[1].backward_freed_bytes = 71;  // saved 50 + output 20 = 70
  try {
    c.validate();
    FAIL();
  } catch (const rp::Error& e) {
    EXPECT_STREQ(e.what(),
                 "[remat::plan] chain: stage 1 (\"s1\"): backward_freed_bytes (71) > saved_bytes + output_bytes (70); "
                 "a backward can free at most its saved set and the gradient at its output.");
  }
  c = small_chain();
  c.stages[0].forward_ms = -1;
  try {
    c.validate();
    FAIL();
  } catch (const rp::Error& e) {
    EXPECT_STREQ(e.what(), "[remat::plan] chain: stage 0 (\"s0\"): forward_ms is -1; times are finite ms >= 0.");
  }
}

TEST(Bytes, ParseAndFormat) {
  EXPECT_EQ(rp::parse_bytes("536870912"), 536870912);
  EXPECT_EQ(rp::parse_bytes("512MiB"), 536870912);
  EXPECT_EQ(rp::parse_bytes("2GiB"), 2147483648);
  EXPECT_EQ(rp::parse_bytes("1.5GB"), 1500000000);
  EXPECT_EQ(rp::parse_bytes("1.5 GiB"), 1610612736);
  EXPECT_EQ(rp::parse_bytes("64k"), 65536);
  EXPECT_EQ(rp::parse_bytes("7B"), 7);
  EXPECT_THROW(rp::parse_bytes("lots"), rp::Error);
  EXPECT_THROW(rp::parse_bytes("-5"), rp::Error);
  EXPECT_THROW(rp::parse_bytes("5 parsecs"), rp::Error);
  try {
    rp::parse_bytes("12XB");
  } catch (const rp::Error& e) {
    EXPECT_STREQ(e.what(),
                 "[remat::plan] bytes: cannot parse \"12XB\"; expected a size like 536870912, 512MiB, 2GiB or 1.5GB.");
  }
  EXPECT_EQ(rp::format_bytes(512), "512 B");
  EXPECT_EQ(rp::format_bytes(1610612736), "1.50 GiB");
  EXPECT_EQ(rp::format_bytes(3 * 1024 * 1024 + 256 * 1024), "3.25 MiB");
}

TEST(Json, RoundTripAndFieldErrors) {
  rp::Chain c = small_chain();
  c.stages[1].backward_freed_bytes = 30;
  const rp::Chain back = rp::chain_from_json(rp::chain_to_json(c));
  ASSERT_EQ(back.size(), 3);
  EXPECT_EQ(back.stages[1].backward_freed_bytes, 30);
  EXPECT_EQ(back.stages[2].backward_freed_bytes, 0);
  EXPECT_EQ(back.stages[2].backward_tmp_bytes, 2);
  EXPECT_EQ(back.stages[1].saved_bytes, 50);
  EXPECT_EQ(back.input_bytes, 100);
  auto err = [](const char* text) -> std::string {
    try {
      rp::chain_from_json(text);
    } catch (const rp::Error& e) {
      return e.what();
    }
    return "(no error)";
  };
  EXPECT_EQ(err(R"({"input_bytes": 1, "stages": [{"forward_ms": 1, "backward_ms": 1, "output_bytes": 1}]})"),
            "[remat::plan] chain JSON: stages[0].saved_bytes: missing.");
  EXPECT_EQ(err(R"({"stages": []})"), "[remat::plan] chain JSON: input_bytes: missing.");
  EXPECT_EQ(err(R"({"input_bytes": 1, "stages": [{"forward_ms": 1, "backward_ms": 1, "output_bytes": -4,
                    "saved_bytes": 1}]})"),
            "[remat::plan] chain JSON: stages[0].output_bytes: negative (-4); sizes are bytes >= 0.");
  EXPECT_EQ(err(R"({"input_bytes": 1, "stages": [{"forward_ms": "x", "backward_ms": 1, "output_bytes": 1,
                    "saved_bytes": 1}]})"),
            "[remat::plan] chain JSON: stages[0].forward_ms: expected a number of ms, got string.");
  EXPECT_EQ(err(R"({"input_bytes": 1, "stages": []})"),
            "[remat::plan] chain JSON: stages: empty; a chain needs at least one stage.");
  EXPECT_EQ(err("{\"input_bytes\": 1,").substr(0, 43), "[remat::plan] chain JSON: malformed: [json.");
}

// A forward_save after the first backward whose output nothing reads before
// the stage's backward is a recompute the runtime cuts short: counted at
// recompute_ms (when measured, >= 0); any other forward at forward_ms.
TEST(Simulate, CutRecomputesCountAtRecomputeMs) {
  rp::Chain c = small_chain();
  for (auto& s : c.stages) s.recompute_ms = 0.25;
  // F0 F1 FS2 B2 | FS1 B1 (cut) | FS0 B0 (cut)
  auto p = rp::simulate(c, rp::Schedule{{F(0), F(1), FS(2), B(2), D(2), FS(1), B(1), D(1), FS(0), B(0)}});
  EXPECT_DOUBLE_EQ(p.time_ms, 1 + 3 + 5 + 6 + 0.25 + 4 + 0.25 + 2);
  // After B2, F0 then FS1 B1: F0's output is read (full time), FS1 is cut.
  p = rp::simulate(c, rp::Schedule{{F(0), F(1), D(1), FS(2), B(2), D(2), F(0), FS(1), B(1), D(1), FS(0), B(0)}});
  EXPECT_DOUBLE_EQ(p.time_ms, 1 + 3 + 5 + 6 + 1 + 0.25 + 4 + 0.25 + 2);
  // A forward_save whose output feeds the next stage's forward_save (both
  // kept for later backwards) runs in full.
  rp::Chain c4 = c;
  c4.stages.push_back({"s3", 7.0, 8.0, 10, 10, 0, 0});
  c4.stages[3].recompute_ms = 0.25;
  p = rp::simulate(
      c4, rp::Schedule{{F(0), F(1), F(2), FS(3), B(3), D(3), D(2), FS(1), FS(2), B(2), B(1), D(1), FS(0), B(0)}});
  EXPECT_DOUBLE_EQ(p.time_ms, 1 + 3 + 5 + 7 + 8 + 3 + 0.25 + 6 + 4 + 0.25 + 2);
  EXPECT_FALSE(rp::output_unread_until_backward(rp::Schedule{{FS(1), FS(2), B(2), B(1)}}, 0));
  EXPECT_TRUE(rp::output_unread_until_backward(rp::Schedule{{FS(1), FS(2), B(2), B(1)}}, 1));
  // Unmeasured (< 0, the default): forward_ms everywhere, as before.
  p = rp::simulate(small_chain(), rp::Schedule{{F(0), F(1), FS(2), B(2), D(2), FS(1), B(1), D(1), FS(0), B(0)}});
  EXPECT_DOUBLE_EQ(p.time_ms, 1 + 3 + 5 + 6 + 3 + 4 + 1 + 2);
}

TEST(ChainJson, RecomputeMsRoundTripsAndIsOptional) {
  rp::Chain c = small_chain();
  c.stages[1].recompute_ms = 2.5;
  const auto back = rp::chain_from_json(rp::chain_to_json(c));
  EXPECT_DOUBLE_EQ(back.stages[1].recompute_ms, 2.5);
  EXPECT_LT(back.stages[0].recompute_ms, 0);
  EXPECT_EQ(rp::chain_to_json(small_chain()).find("recompute_ms"), std::string::npos);
  c.stages[1].recompute_ms = std::nan("");
  try {
    c.validate();
    ADD_FAILURE() << "no error";
  } catch (const rp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("recompute_ms is nan; times are finite ms >= 0."), std::string::npos)
        << e.what();
  }
}

// A plain forward's temporaries (plain_forward_tmp_bytes, when set) and a
// forward_save's (forward_tmp_bytes) are priced apart; unset, both are
// forward_tmp_bytes. JSON keeps the field optional; -1 is "unset", any other
// negative value an error naming it.
TEST(Simulate, PlainForwardTemporariesApartFromForwardSave) {
  rp::Chain c = small_chain();
  const rp::Schedule s{{F(0), FS(1), FS(2), B(2), B(1), D(1), FS(0), B(0)}};
  const auto before = rp::simulate(c, s);
  EXPECT_EQ(before.op_bytes[0], 100 + 10 + 5);  // a_0 + |a_1| + forward_tmp_bytes
  c.stages[0].plain_forward_tmp_bytes = 20;
  const auto after = rp::simulate(c, s);
  EXPECT_EQ(after.op_bytes[0], 100 + 10 + 20);
  EXPECT_EQ(after.op_bytes[6], before.op_bytes[6]);  // FS(0) still at forward_tmp_bytes
  for (size_t k = 1; k < s.ops.size(); ++k) EXPECT_EQ(after.op_bytes[k], before.op_bytes[k]) << k;
  const auto back = rp::chain_from_json(rp::chain_to_json(c));
  EXPECT_EQ(back.stages[0].plain_forward_tmp_bytes, 20);
  EXPECT_EQ(back.stages[1].plain_forward_tmp_bytes, -1);
  EXPECT_EQ(back.stages[1].plain_tmp_bytes(), back.stages[1].forward_tmp_bytes);
  EXPECT_EQ(rp::chain_to_json(small_chain()).find("plain_forward_tmp_bytes"), std::string::npos);
  c.stages[2].plain_forward_tmp_bytes = -5;
  try {
    c.validate();
    ADD_FAILURE() << "no error";
  } catch (const rp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("plain_forward_tmp_bytes"), std::string::npos) << e.what();
  }
}

// Stage::shared_input_bytes: a residual head's output (h, x) holds its input
// x. The 8 shared bytes count once while a_2 and the a_1 it came from are
// both live; dropping a_1 leaves them with a_2 (frees nothing), and a
// recomputed a_1 is new storage beside the old a_2. Hand-checked bytes.
TEST(Simulate, SharedInputBytesCountedOnceWhileBothLive) {
  rp::Chain c;
  c.input_bytes = 10;
  c.stages = {{"s0", 1, 2, 8, 8}, {"head", 1, 2, 12, 14}, {"tail", 1, 2, 6, 9}};
  c.stages[1].shared_input_bytes = 8;
  const rp::Schedule s{{F(0), F(1), D(1), FS(2), B(2), F(0), D(2), FS(1), B(1), D(1), FS(0), B(0)}};
  const auto p = rp::simulate(c, s);
  // F(1) adds h only; D(1) frees nothing; B(2) peaks at a0 + a2 + s2 + g3 + g2;
  // F(0) recomputes a_1 in full beside the old a_2, and D(2) then frees all
  // of a_2 (x went with it: the new a_1 is other storage); FS(1) adds s1 net.
  const std::vector<int64_t> want = {18, 22, 22, 31, 49, 42, 42, 36, 44, 26, 26, 36};
  EXPECT_EQ(p.op_bytes, want);
  EXPECT_EQ(p.peak_bytes, 49);
  rp::Chain unshared = c;
  unshared.stages[1].shared_input_bytes = 0;
  EXPECT_EQ(rp::simulate(unshared, s).op_bytes[1], 30);  // x counted twice
  // Store-all keeps a_1 and s_1 together throughout.
  EXPECT_EQ(rp::store_all(c).prediction.peak_bytes + 8, rp::store_all(unshared).prediction.peak_bytes);
  const auto back = rp::chain_from_json(rp::chain_to_json(c));
  EXPECT_EQ(back.stages[1].shared_input_bytes, 8);
  EXPECT_EQ(rp::chain_to_json(unshared).find("shared_input_bytes"), std::string::npos);
}

TEST(Simulate, SharedInputBytesOutOfRangeArePinned) {
  rp::Chain c;
  c.input_bytes = 10;
  c.stages = {{"s0", 1, 2, 8, 8}, {"head", 1, 2, 12, 14}};
  auto message = [&] {
    try {
      c.validate();
    } catch (const rp::Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  c.stages[1].shared_input_bytes = 9;  // a_1 has 8
  EXPECT_EQ(message(),
            "[remat::plan] chain: stage 1 (\"head\"): shared_input_bytes (9) > the stage's input bytes (8); an "
            "output shares at most what both the input and the output hold.");
  c.stages[0].shared_input_bytes = 9;  // a_1 has 8, a_0 10
  EXPECT_EQ(message(),
            "[remat::plan] chain: stage 0 (\"s0\"): shared_input_bytes (9) > output_bytes (8); an output shares "
            "at most what both the input and the output hold.");
  c.stages[0].shared_input_bytes = -1;
  EXPECT_EQ(message(),
            "[remat::plan] chain: stage 0 (\"s0\"): shared_input_bytes is negative (-1); sizes are bytes >= 0.");
  c.stages[0].shared_input_bytes = 0;
  c.stages[1].shared_input_bytes = 8;
  c.stages[1].backward_freed_bytes = 19;  // s1 14 + g2 12 - the 8 that a_1 keeps = 18
  EXPECT_EQ(message(),
            "[remat::plan] chain: stage 1 (\"head\"): backward_freed_bytes (19) > saved_bytes + output_bytes - "
            "shared_input_bytes (18); a backward can free at most its saved set and the gradient at its output, "
            "less what its input still holds.");
  c.stages[1].backward_freed_bytes = 18;
  EXPECT_EQ(message(), "(no error)");
  try {  // the JSON reader validates the field too
    rp::chain_from_json(R"({"input_bytes": 10, "stages": [{"forward_ms": 1, "backward_ms": 1,
        "output_bytes": 8, "saved_bytes": 8, "shared_input_bytes": 9}]})");
    ADD_FAILURE() << "no error";
  } catch (const rp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("shared_input_bytes (9) > output_bytes (8)"), std::string::npos) << e.what();
  }
}

// Stage::output_grad_bytes: grad_1 of 25 bytes instead of |a_1| = 10 (the
// head of a chain passing its input on: the input's part of the output is in
// input_bytes, not output_bytes, but has a gradient). Only the ops during
// which grad_1 is live move, by the 15 bytes.
TEST(Simulate, OutputGradBytesPriceTheGradientApart) {
  rp::Chain c = small_chain();
  const rp::Schedule s = rp::store_all(c).schedule;
  const auto before = rp::simulate(c, s);
  c.stages[0].output_grad_bytes = 25;
  const auto after = rp::simulate(c, s);
  ASSERT_EQ(s.ops.size(), 6u);  // FS(0) FS(1) FS(2) B(2) B(1) B(0)
  for (size_t k = 0; k < 4; ++k) EXPECT_EQ(after.op_bytes[k], before.op_bytes[k]) << k;
  EXPECT_EQ(after.op_bytes[4], before.op_bytes[4] + 15);  // B(1) writes grad_1
  EXPECT_EQ(after.op_bytes[5], before.op_bytes[5] + 15);  // B(0) reads it
  EXPECT_EQ(rp::chain_from_json(rp::chain_to_json(c)).stages[0].output_grad_bytes, 25);
  EXPECT_EQ(rp::chain_to_json(small_chain()).find("output_grad_bytes"), std::string::npos);
  c.stages[0].output_grad_bytes = -2;
  try {
    c.validate();
    ADD_FAILURE() << "no error";
  } catch (const rp::Error& e) {
    EXPECT_STREQ(e.what(),
                 "[remat::plan] chain: stage 0 (\"s0\"): output_grad_bytes is negative (-2); sizes are bytes >= 0.");
  }
}
