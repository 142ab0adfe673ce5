// The planner's input readers on hostile input: chain_from_json, parse_bytes
// and Chain::validate. Regression tests for what fuzz/ found (fuzz/FINDINGS.md):
// every refusal is a remat::Error naming the field, never another exception.
#include <gtest/gtest.h>

#include <string>

#include "remat/plan/plan.h"

namespace rp = remat::plan;

namespace {

std::string error_of(const std::string& json) {
  try {
    rp::chain_from_json(json);
  } catch (const rp::Error& e) {
    return e.what();
  }
  return "(no error)";
}

std::string one_stage(const std::string& input_bytes, const std::string& saved_bytes = "1") {
  return R"({"input_bytes": )" + input_bytes +
         R"(, "stages": [{"forward_ms": 1, "backward_ms": 1, "output_bytes": 1, "saved_bytes": )" + saved_bytes + "}]}";
}

}  // namespace

// fuzz: chain_json_fuzz, "number overflow parsing '1.0e73709551615'": nlohmann
// throws out_of_range (not parse_error) for a number beyond double.
TEST(Reader, NumberBeyondDoubleIsAnError) {
  const std::string e = error_of(one_stage("1e400"));
  EXPECT_EQ(e.rfind("[remat::plan] chain JSON: malformed: ", 0), 0u) << e;
  EXPECT_NE(e.find("number overflow"), std::string::npos) << e;
}

// An integer above 2^63 - 1 was read as negative ("negative (-1)").
TEST(Reader, IntegerAboveInt64IsTooLargeNotNegative) {
  EXPECT_EQ(error_of(one_stage("18446744073709551615")),
            "[remat::plan] chain JSON: input_bytes: too large (18446744073709551615); at most 2^63 - 1 bytes.");
  EXPECT_EQ(error_of(one_stage("-1")), "[remat::plan] chain JSON: input_bytes: negative (-1); sizes are bytes >= 0.");
  EXPECT_EQ(rp::chain_from_json(one_stage("1152921504606846973")).input_bytes, 1152921504606846973);  // 2^60 - 3
}

// Sizes each valid but adding up past int64_t made simulate() overflow
// (UBSan: signed integer overflow in simulate.cpp); validate() now refuses them.
TEST(Reader, SizesWhoseSumOverflowsAreRefused) {
  const std::string e = error_of(one_stage("5000000000000000000", "5000000000000000000"));
  EXPECT_EQ(e,
            "[remat::plan] chain: input_bytes and every stage's output, saved and temporary bytes add up to more "
            "than 2^60 bytes (1 EiB); the planner's byte counts must fit in 64 bits.");
  rp::Chain c = rp::chain_from_json(one_stage("1"));
  c.stages[0].backward_tmp_bytes = int64_t{1} << 60;
  EXPECT_THROW(c.validate(), rp::Error);
  c.stages[0].backward_tmp_bytes = (int64_t{1} << 60) - 3;  // 1 + 1 + 1 + this: exactly 2^60
  EXPECT_NO_THROW(c.validate());
  EXPECT_GT(rp::store_all(c).prediction.peak_bytes, int64_t{1} << 59);  // no overflow
}

// std::stod threw std::out_of_range for a number past 1.8e308 with a unit.
TEST(Reader, ParseBytesOfAHugeNumberIsAnError) {
  EXPECT_THROW(rp::parse_bytes(std::string(400, '9') + "k"), rp::Error);
  EXPECT_THROW(rp::parse_bytes(std::string(400, '9') + ".5"), rp::Error);
  EXPECT_EQ(rp::parse_bytes("1.5k"), 1536);
}
