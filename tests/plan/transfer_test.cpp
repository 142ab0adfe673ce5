// Tests of the offload price that measured steps set (remat/plan/transfer.h):
// when a charge comes, how much, when it is given back, and the bounds of a
// give-back, step by step; and what an offloading call waits for its disk
// store at a cap on the bytes in flight (transfer_wait_ms).
#include <gtest/gtest.h>

#include <string>

#include "remat/plan/error.h"
#include "remat/plan/transfer.h"

namespace rp = remat::plan;

namespace {

constexpr double kSent = 1000;  // bytes a plan sends per step

TEST(TransferPrice, OneSlowStepChargesItsExcessPerByte) {
  rp::TransferPrice price(1);
  EXPECT_EQ(price.observe(105, 100, kSent, 0), 0) << "5% over is noise";
  EXPECT_DOUBLE_EQ(price.observe(150, 100, kSent, 0), 50 / kSent);
  EXPECT_DOUBLE_EQ(price.observe(130, 100, kSent, 0), 30 / kSent) << "every slow step charges again";
}

TEST(TransferPrice, TwoSlowStepsInARowChargeTheSecondOnesExcess) {
  rp::TransferPrice price(2);
  EXPECT_EQ(price.observe(150, 100, kSent, 0), 0);
  EXPECT_EQ(price.observe(100, 100, kSent, 0), 0) << "a step on time ends the streak";
  EXPECT_EQ(price.observe(150, 100, kSent, 0), 0);
  EXPECT_DOUBLE_EQ(price.observe(140, 100, kSent, 0), 40 / kSent);
  EXPECT_EQ(price.observe(140, 100, kSent, 0), 0) << "the streak starts again after a charge";
  EXPECT_DOUBLE_EQ(price.observe(160, 100, kSent, 0), 60 / kSent);
}

TEST(TransferPrice, AStepThatSendsNothingNeitherChargesNorCounts) {
  rp::TransferPrice price(2);
  EXPECT_EQ(price.observe(150, 100, kSent, 0), 0);
  EXPECT_EQ(price.observe(200, 100, 0, 0), 0);
  EXPECT_EQ(price.observe(150, 100, kSent, 0), 0) << "the step that sent nothing ended the streak";
  EXPECT_GT(price.observe(150, 100, kSent, 0), 0);
}

TEST(TransferPrice, TwoFastStepsGiveBackTheSecondOnesShortfallWithinTheSurcharge) {
  rp::TransferPrice price(1);
  const double charged = price.observe(200, 100, kSent, 0);  // 0.1 ms per byte
  ASSERT_DOUBLE_EQ(charged, 100 / kSent);
  EXPECT_EQ(price.observe(50, 100, kSent, charged), 0) << "one fast step (a warm page cache) undoes nothing";
  EXPECT_DOUBLE_EQ(price.observe(80, 100, kSent, charged), -20 / kSent);
  // A shortfall larger than the surcharge left gives back what is left only.
  const double left = charged / 4;
  EXPECT_EQ(price.observe(10, 100, kSent, left), 0);
  EXPECT_DOUBLE_EQ(price.observe(10, 100, kSent, left), -left);
}

TEST(TransferPrice, NoSurchargeNothingToGiveBack) {
  rp::TransferPrice price(1);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(price.observe(10, 100, kSent, 0), 0);
}

TEST(TransferPrice, ALighterPlanGivesBackInProportionToTheChargedBytes) {
  rp::TransferPrice price(1);
  const double charged = price.observe(200, 100, 4 * kSent, 0);  // spread over 4000 bytes
  ASSERT_DOUBLE_EQ(charged, 100 / (4 * kSent));
  // The plan the charge moved to sends a quarter as much: its shortfall
  // is spread over the 4000 bytes charged, not its own 1000.
  EXPECT_EQ(price.observe(60, 100, kSent, charged), 0);
  EXPECT_DOUBLE_EQ(price.observe(80, 100, kSent, charged), -20 / (4 * kSent));
  price.reset();
  EXPECT_EQ(price.observe(60, 100, kSent, charged), 0);
  EXPECT_DOUBLE_EQ(price.observe(80, 100, kSent, charged), -20 / kSent) << "reset forgets the charged bytes";
}

TEST(TransferPrice, RestartEndsTheStreaksAndKeepsTheCharge) {
  rp::TransferPrice price(2);
  EXPECT_EQ(price.observe(150, 100, kSent, 0), 0);
  price.restart();
  EXPECT_EQ(price.observe(150, 100, kSent, 0), 0) << "the slow streak started again";
  const double charged = price.observe(150, 100, 2 * kSent, 0);
  ASSERT_DOUBLE_EQ(charged, 50 / (2 * kSent));
  EXPECT_EQ(price.observe(80, 100, kSent, charged), 0);
  price.restart();
  EXPECT_EQ(price.observe(80, 100, kSent, charged), 0) << "the fast streak started again";
  EXPECT_DOUBLE_EQ(price.observe(80, 100, kSent, charged), -20 / (2 * kSent)) << "over the charged bytes still";
}

TEST(TransferPrice, ZeroStepsToChargeIsRefused) {
  try {
    rp::TransferPrice price(0);
    FAIL() << "no error";
  } catch (const rp::Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "[remat::plan] TransferPrice: slow_steps_to_charge is 0; give 1 or more (the steps in a row over the "
              "prediction before a charge)");
  }
}

// A call whose forward computes 6 ms and waited 4 ms for 8 MiB of writes
// (one tensor in flight), whose backward computes 5 ms and waited 2 ms for
// its reads.
rp::TransferRun fast_disk() {
  rp::TransferRun r;
  r.forward_ms = 10, r.write_wait_ms = 4, r.write_ms = 3, r.written_bytes = 8 << 20;
  r.backward_ms = 7, r.read_wait_ms = 2, r.read_ms = 2.5, r.read_bytes = 8 << 20;
  r.largest_bytes = 1 << 20;  // the run held one such tensor in flight
  return r;
}

TEST(TransferWait, WithNoRoomTheCallWaitsAsItsRunDid) {
  EXPECT_DOUBLE_EQ(rp::transfer_wait_ms(fast_disk(), 0), 6);
  EXPECT_DOUBLE_EQ(rp::transfer_wait_ms(fast_disk(), 1 << 20), 6) << "one tensor in flight, as in the run";
  rp::TransferRun none = fast_disk();
  none.written_bytes = 0, none.read_bytes = 0;  // nothing sent: its waits as measured
  EXPECT_DOUBLE_EQ(rp::transfer_wait_ms(none, int64_t{1} << 40), 6);
}

TEST(TransferWait, WithRoomForEveryByteAFastDiskCostsNothing) {
  // Writes 3 ms beside 6 ms of compute, reads 2.5 ms beside 5 ms.
  EXPECT_DOUBLE_EQ(rp::transfer_wait_ms(fast_disk(), 9 << 20), 0);
  EXPECT_DOUBLE_EQ(rp::transfer_wait_ms(fast_disk(), int64_t{1} << 40), 0) << "more room changes nothing";
}

TEST(TransferWait, ASlowDiskIsWaitedForBeyondTheCompute) {
  rp::TransferRun r = fast_disk();
  r.forward_ms = 10, r.write_wait_ms = 8, r.write_ms = 9;  // 2 ms of compute, 9 ms of writing
  r.read_bytes = 0, r.read_wait_ms = 0, r.read_ms = 0;
  EXPECT_DOUBLE_EQ(rp::transfer_wait_ms(r, 9 << 20), 7);
  EXPECT_DOUBLE_EQ(rp::transfer_wait_ms(r, 5 << 20), 7.5) << "half the bytes beside the compute";
  r.write_ms = 20;  // a busy time above what the run took: never more than the run's wait
  EXPECT_DOUBLE_EQ(rp::transfer_wait_ms(r, 9 << 20), 8);
}

TEST(TransferWait, LessRoomNeverCostsLess) {
  double last = rp::transfer_wait_ms(fast_disk(), 0);
  for (int64_t cap = 0; cap <= (16 << 20); cap += 1 << 20) {
    const double w = rp::transfer_wait_ms(fast_disk(), cap);
    EXPECT_LE(w, last) << cap;
    last = w;
  }
  EXPECT_DOUBLE_EQ(rp::transfer_wait_ms(fast_disk(), 3 << 20), 4.5) << "a quarter of each phase beside";
}

TEST(TransferWait, FiguresThatAreNoMeasurementAreRefused) {
  rp::TransferRun r = fast_disk();
  r.read_wait_ms = 9;  // above the backward's 7 ms
  try {
    rp::transfer_wait_ms(r, 0);
    FAIL() << "no error";
  } catch (const rp::Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "[remat::plan] transfer_wait_ms: the read figures (phase 7.000000 ms, waited 9.000000 ms, busy "
              "2.500000 ms, 8388608 bytes) are not a measurement; give finite figures >= 0 with the wait within "
              "the phase");
  }
  r = fast_disk();
  r.largest_bytes = -1;
  try {
    rp::transfer_wait_ms(r, 0);
    FAIL() << "no error";
  } catch (const rp::Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "[remat::plan] transfer_wait_ms: largest_bytes is -1; give the largest tensor the call sends, >= 0");
  }
}

}  // namespace
