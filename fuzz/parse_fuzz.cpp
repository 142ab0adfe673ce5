// libFuzzer harness for the planner's text inputs (the remat-plan flags):
// parse_bytes (--budget), parse_algorithm (--algorithm), parse_optimal_scope
// (--scope), include/remat/plan/error.h and solve.h. Input: arbitrary bytes as
// one string. Checks: no crash or sanitizer finding, no exception but
// remat::Error; an accepted size is >= 0 and its decimal form parses back to
// it; format_bytes of it works; an accepted algorithm has a positive param
// where it takes one. Leaves out chains (chain_json_fuzz, solve_fuzz).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "common.h"
#include "remat/plan/error.h"
#include "remat/plan/solve.h"

namespace rp = remat::plan;
using remat::fuzz::fail;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const int64_t v = rp::parse_bytes(text);
    if (v < 0) fail("parse_bytes(\"" + std::string(text) + "\") = " + std::to_string(v) + " < 0");
    if (rp::parse_bytes(std::to_string(v)) != v) fail("parse_bytes does not read back " + std::to_string(v));
    if (rp::format_bytes(v).empty()) fail("format_bytes(" + std::to_string(v) + ") is empty");
  } catch (const rp::Error&) {
  }
  try {
    const rp::SolveOptions o = rp::parse_algorithm(text);
    if ((o.algorithm == rp::Algorithm::kUniform || o.algorithm == rp::Algorithm::kRevolve) && o.param < 1)
      fail("parse_algorithm(\"" + std::string(text) + "\") gave param " + std::to_string(o.param));
    if (o.budget_bytes != -1) fail("parse_algorithm set a budget");
  } catch (const rp::Error&) {
  }
  try {
    rp::optimal_scope_name(rp::parse_optimal_scope(text));
  } catch (const rp::Error&) {
  }
  return 0;
}
