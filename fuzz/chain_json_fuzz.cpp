// libFuzzer harness for remat::plan::chain_from_json (the remat-plan input
// format, include/remat/plan/json.h). Input: arbitrary bytes as JSON text.
// Checks: no crash or sanitizer finding; no exception but remat::Error; an
// accepted chain validates, and chain_to_json of it parses back to the same
// chain (names, times, sizes and stage options exactly); store_all, min_memory and
// plan_to_json take it. Leaves out the other solvers (solve_fuzz).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "common.h"
#include "remat/plan/chain.h"
#include "remat/plan/error.h"
#include "remat/plan/json.h"
#include "remat/plan/solve.h"

namespace rp = remat::plan;

namespace {

bool same(const rp::Chain& a, const rp::Chain& b) {
  if (a.input_bytes != b.input_bytes || a.input_grad_bytes != b.input_grad_bytes || a.size() != b.size()) return false;
  for (int i = 0; i < a.size(); ++i) {
    const rp::Stage& x = a.stages[i];
    const rp::Stage& y = b.stages[i];
    if (x.name != y.name || x.forward_ms != y.forward_ms || x.backward_ms != y.backward_ms ||
        x.output_bytes != y.output_bytes || x.saved_bytes != y.saved_bytes ||
        x.forward_tmp_bytes != y.forward_tmp_bytes || x.backward_tmp_bytes != y.backward_tmp_bytes ||
        x.backward_freed_bytes != y.backward_freed_bytes || x.shared_input_bytes != y.shared_input_bytes ||
        x.output_grad_bytes != y.output_grad_bytes || x.plain_forward_tmp_bytes != y.plain_forward_tmp_bytes ||
        x.options.size() != y.options.size())
      return false;
    for (size_t k = 0; k < x.options.size(); ++k) {
      const rp::StageOption &o = x.options[k], &q = y.options[k];
      if (o.name != q.name || o.saved_bytes != q.saved_bytes || o.forward_ms != q.forward_ms ||
          o.backward_ms != q.backward_ms || o.forward_tmp_bytes != q.forward_tmp_bytes ||
          o.backward_tmp_bytes != q.backward_tmp_bytes || o.backward_freed_bytes != q.backward_freed_bytes)
        return false;
    }
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  rp::Chain chain;
  try {
    chain = rp::chain_from_json(text);
  } catch (const rp::Error&) {
    return 0;  // refused with remat's error: fine
  }
  try {
    chain.validate();
  } catch (const rp::Error& e) {
    remat::fuzz::fail(std::string("chain_from_json accepted a chain that validate() refuses: ") + e.what());
  }
  std::string out;
  rp::Chain back;
  try {
    out = rp::chain_to_json(chain);
    back = rp::chain_from_json(out);
  } catch (const rp::Error& e) {
    remat::fuzz::fail(std::string("chain_to_json output does not parse back: ") + e.what() + "\n" + out);
  }
  if (!same(chain, back)) remat::fuzz::fail("chain_to_json / chain_from_json round trip changed the chain:\n" + out);
  // A chain the reader accepts is one the planner can take: the cheap
  // algorithms run on it (64-bit byte sums, names in the JSON output).
  if (chain.size() > 64) return 0;
  try {
    const rp::Plan all = rp::store_all(chain);
    const rp::Plan least = rp::min_memory(chain);
    if (least.prediction.peak_bytes > all.prediction.peak_bytes)
      remat::fuzz::fail("min_memory peak above store-all's:\n" + out);
    rp::plan_to_json(chain, least);
  } catch (const rp::Error& e) {
    remat::fuzz::fail(std::string("the planner refused a chain the reader accepted: ") + e.what() + "\n" + out);
  }
  return 0;
}
