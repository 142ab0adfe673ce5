// Tests of the offload price that measured steps set (remat/plan/transfer.h):
// when a charge comes, how much, when it is given back, and the bounds of a
// give-back, step by step.
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

}  // namespace
