// Chain validation and byte formatting/parsing. Leaves out JSON (json.cpp).
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "remat/plan/chain.h"
#include "remat/plan/error.h"

namespace remat::plan {
namespace {

std::string stage_label(const Chain& chain, int i) {
  return "stage " + std::to_string(i) + " (\"" + chain.stages[i].name + "\")";
}

void check_size(const Chain& chain, int i, const std::string& field, int64_t v) {
  if (v < 0)
    throw Error("[remat::plan] chain: " + stage_label(chain, i) + ": " + field + " is negative (" + std::to_string(v) +
                "); sizes are bytes >= 0.");
}

void check_time(const Chain& chain, int i, const std::string& field, double v) {
  if (!std::isfinite(v) || v < 0) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%g", v);
    throw Error("[remat::plan] chain: " + stage_label(chain, i) + ": " + field + " is " + buf +
                "; times are finite ms >= 0.");
  }
}

}  // namespace

Stage Stage::with_option(int k) const {
  if (k == 0) return *this;
  const StageOption& o = options.at(static_cast<size_t>(k - 1));
  Stage s = *this;
  s.saved_bytes = o.saved_bytes;
  s.forward_ms = o.forward_ms;
  s.backward_ms = o.backward_ms;
  s.forward_tmp_bytes = o.forward_tmp_bytes;
  s.backward_tmp_bytes = o.backward_tmp_bytes;
  s.backward_freed_bytes = o.backward_freed_bytes;
  s.recompute_ms = -1;
  s.options.clear();
  return s;
}

bool Chain::has_options() const {
  return std::any_of(stages.begin(), stages.end(), [](const Stage& s) { return !s.options.empty(); });
}

namespace {
/** An option's fields, in the words of its stage's errors. */
void check_option(const Chain& chain, int i, size_t k) {
  const Stage& s = chain.stages[i];
  const StageOption& o = s.options[k];
  const std::string f = "options[" + std::to_string(k) + "] (\"" + o.name + "\").";
  check_time(chain, i, f + "forward_ms", o.forward_ms);
  check_time(chain, i, f + "backward_ms", o.backward_ms);
  check_size(chain, i, f + "saved_bytes", o.saved_bytes);
  check_size(chain, i, f + "forward_tmp_bytes", o.forward_tmp_bytes);
  check_size(chain, i, f + "backward_tmp_bytes", o.backward_tmp_bytes);
  check_size(chain, i, f + "backward_freed_bytes", o.backward_freed_bytes);
  auto fail = [&](const std::string& why) {
    throw Error("[remat::plan] chain: " + stage_label(chain, i) + ": " + f + why);
  };
  if (o.saved_bytes < s.output_bytes)
    fail("saved_bytes (" + std::to_string(o.saved_bytes) + ") < output_bytes (" + std::to_string(s.output_bytes) +
         "); an option keeps at least the stage's output.");
  if (o.forward_ms < s.forward_ms || o.backward_ms < s.backward_ms)
    fail("forward_ms or backward_ms below the stage's own (" + std::to_string(s.forward_ms) + ", " +
         std::to_string(s.backward_ms) +
         " ms); an option costs at least what keeping everything costs (the "
         "profiler raises a faster measurement to the stage's).");
  if (o.backward_freed_bytes - o.saved_bytes > s.grad_bytes() - s.shared_input_bytes)
    fail("backward_freed_bytes (" + std::to_string(o.backward_freed_bytes) +
         ") exceeds what its backward can free (its saved set and the gradient at the output).");
}
}  // namespace

void Chain::validate() const {
  if (stages.empty()) throw Error("[remat::plan] chain: no stages; a chain needs at least one stage.");
  if (input_bytes < 0)
    throw Error("[remat::plan] chain: input_bytes is negative (" + std::to_string(input_bytes) +
                "); sizes are bytes >= 0.");
  if (input_grad_bytes < -1)
    throw Error("[remat::plan] chain: input_grad_bytes is " + std::to_string(input_grad_bytes) +
                "; sizes are bytes >= 0 (-1: input_bytes).");
  for (int i = 0; i < size(); ++i) {
    const Stage& s = stages[i];
    check_time(*this, i, "forward_ms", s.forward_ms);
    check_time(*this, i, "backward_ms", s.backward_ms);
    if (!(s.recompute_ms < 0)) check_time(*this, i, "recompute_ms", s.recompute_ms);
    check_size(*this, i, "output_bytes", s.output_bytes);
    check_size(*this, i, "saved_bytes", s.saved_bytes);
    check_size(*this, i, "forward_tmp_bytes", s.forward_tmp_bytes);
    if (s.plain_forward_tmp_bytes != -1) check_size(*this, i, "plain_forward_tmp_bytes", s.plain_forward_tmp_bytes);
    check_size(*this, i, "backward_tmp_bytes", s.backward_tmp_bytes);
    check_size(*this, i, "backward_freed_bytes", s.backward_freed_bytes);
    check_size(*this, i, "shared_input_bytes", s.shared_input_bytes);
    if (s.output_grad_bytes != -1) check_size(*this, i, "output_grad_bytes", s.output_grad_bytes);
    if (s.shared_input_bytes > std::min(value_bytes(i), s.output_bytes))
      throw Error("[remat::plan] chain: " + stage_label(*this, i) + ": shared_input_bytes (" +
                  std::to_string(s.shared_input_bytes) + ") > " +
                  (s.shared_input_bytes > s.output_bytes
                       ? "output_bytes (" + std::to_string(s.output_bytes)
                       : "the stage's input bytes (" + std::to_string(value_bytes(i))) +
                  "); an output shares at most what both the input and the output hold.");
    // All >= 0 here: the differences cannot overflow where the sum could.
    const char* grad = s.output_grad_bytes < 0 ? "output_bytes" : "output_grad_bytes";
    if (s.backward_freed_bytes - s.saved_bytes > s.grad_bytes() - s.shared_input_bytes)
      throw Error("[remat::plan] chain: " + stage_label(*this, i) + ": backward_freed_bytes (" +
                  std::to_string(s.backward_freed_bytes) + ") > saved_bytes + " + grad +
                  (s.shared_input_bytes ? " - shared_input_bytes (" : " (") +
                  std::to_string(s.saved_bytes + s.grad_bytes() - s.shared_input_bytes) +
                  "); a backward can free at most its saved set and the gradient at its output" +
                  (s.shared_input_bytes ? ", less what its input still holds." : "."));
    if (s.saved_bytes < s.output_bytes)
      throw Error("[remat::plan] chain: " + stage_label(*this, i) + ": saved_bytes (" + std::to_string(s.saved_bytes) +
                  ") < output_bytes (" + std::to_string(s.output_bytes) +
                  "); the saved set includes the stage's output.");
    for (size_t k = 0; k < s.options.size(); ++k) check_option(*this, i, k);
  }
  // Live bytes in simulate() and the solvers are sums of these fields (at most
  // about four times their total): bounding the total keeps them in int64_t.
  constexpr int64_t kMaxTotalBytes = int64_t{1} << 60;
  int64_t total = 0;
  auto add = [&](int64_t v) {
    if (v > kMaxTotalBytes - total)
      throw Error(
          "[remat::plan] chain: input_bytes and every stage's output, saved and temporary bytes add up to "
          "more than 2^60 bytes (1 EiB); the planner's byte counts must fit in 64 bits.");
    total += v;
  };
  add(input_bytes);
  add(std::max<int64_t>(0, input_grad_bytes));
  for (const Stage& s : stages) {
    add(s.output_bytes);
    add(s.saved_bytes);
    add(s.forward_tmp_bytes);
    add(std::max<int64_t>(0, s.plain_forward_tmp_bytes));
    add(s.backward_tmp_bytes);
    add(s.backward_freed_bytes);
    add(std::max<int64_t>(0, s.output_grad_bytes));
    for (const StageOption& o : s.options) {
      add(o.saved_bytes);
      add(o.forward_tmp_bytes);
      add(o.backward_tmp_bytes);
      add(o.backward_freed_bytes);
    }
  }
}

std::string format_bytes(int64_t bytes) {
  static const char* units[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  if (bytes > -1024 && bytes < 1024) return std::to_string(bytes) + " B";
  double v = static_cast<double>(bytes);
  int u = -1;
  while ((v >= 1024 || v <= -1024) && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f %s", v, units[u]);
  return buf;
}

int64_t parse_bytes(std::string_view text) {
  auto fail = [&]() -> int64_t {
    throw Error("[remat::plan] bytes: cannot parse \"" + std::string(text) +
                "\"; expected a size like 536870912, 512MiB, 2GiB or 1.5GB.");
  };
  std::string s(text);
  size_t pos = 0;
  while (pos < s.size() && std::isspace(static_cast<unsigned char>(s[pos]))) ++pos;
  size_t num_begin = pos;
  while (pos < s.size() && (std::isdigit(static_cast<unsigned char>(s[pos])) || s[pos] == '.')) ++pos;
  if (pos == num_begin) return fail();
  std::string num = s.substr(num_begin, pos - num_begin);
  if (num.find('.') != num.rfind('.') || num == ".") return fail();
  while (pos < s.size() && std::isspace(static_cast<unsigned char>(s[pos]))) ++pos;
  std::string unit;
  for (; pos < s.size(); ++pos) {
    if (std::isspace(static_cast<unsigned char>(s[pos]))) break;
    unit += static_cast<char>(std::tolower(static_cast<unsigned char>(s[pos])));
  }
  while (pos < s.size() && std::isspace(static_cast<unsigned char>(s[pos]))) ++pos;
  if (pos != s.size()) return fail();
  double mult = 1;
  if (unit.empty() || unit == "b") mult = 1;
  else if (unit == "k" || unit == "kib") mult = 1024.0;
  else if (unit == "m" || unit == "mib") mult = 1024.0 * 1024;
  else if (unit == "g" || unit == "gib") mult = 1024.0 * 1024 * 1024;
  else if (unit == "t" || unit == "tib") mult = 1024.0 * 1024 * 1024 * 1024;
  else if (unit == "kb") mult = 1e3;
  else if (unit == "mb") mult = 1e6;
  else if (unit == "gb") mult = 1e9;
  else if (unit == "tb") mult = 1e12;
  else return fail();
  if (num.find('.') == std::string::npos && mult == 1) {
    if (num.size() > 18) return fail();
    return std::stoll(num);
  }
  // strtod, not stod: stod throws std::out_of_range past 1.8e308 (400 digits).
  double v = std::strtod(num.c_str(), nullptr) * mult;
  if (!(v < 9.2e18)) return fail();
  return static_cast<int64_t>(std::floor(v));
}

}  // namespace remat::plan
