// The whole-step model's memory rule (remat/plan/step.h), written again from
// its text and evaluated over every choice: the oracle of the step solver's
// tests and of its fuzz harness. Torch-free; header-only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "remat/plan/step.h"

namespace remat_test::step {

namespace rp = remat::plan;

/** Memory of segment s under `choice`, from the rule in step.h. */
inline int64_t brute_segment(const rp::StepModel& m, const std::vector<int>& choice, int64_t s) {
  int64_t bytes = m.segment_peak_bytes[s];
  for (size_t u = 0; u < m.units.size(); ++u) {
    for (const rp::StepCall& c : m.units[u].calls) {
      const rp::StepCost& a = c.costs[choice[u]];
      const rp::StepCost& b = c.costs[0];
      if (c.forward_begin <= s && s < c.forward_end) bytes += a.forward_peak_bytes - b.forward_peak_bytes;
      if (c.forward_end <= s && s < c.backward_begin) bytes += a.kept_bytes - b.kept_bytes;
      if (c.backward_begin <= s && s < c.backward_end) bytes += a.backward_peak_bytes - b.backward_peak_bytes;
      // Released inputs: credited from the release point to the backward's end.
      const int64_t credit_end = c.release_end >= 0 ? c.release_end : c.backward_end;
      if (c.release_begin >= 0 && c.release_begin <= s && s < credit_end) {
        bytes -= a.released_bytes - b.released_bytes;
      }
      // Inputs shared with an earlier call: credited while both let go.
      if (c.pair_unit >= 0 && c.pair_begin <= s && s < c.backward_begin && c.pair_lets_go[choice[u]] &&
          c.pair_other_lets_go[choice[c.pair_unit]]) {
        bytes -= c.pair_bytes;
      }
    }
  }
  return bytes;
}

/** True when no unit takes an option other than 0 inside an ancestor that
 *  runs one (step.h's rule for units inside units). */
inline bool nesting_ok(const rp::StepModel& m, const std::vector<int>& choice) {
  for (size_t u = 0; u < m.units.size(); ++u) {
    for (int64_t a = m.units[u].parent; a >= 0 && choice[u] != 0; a = m.units[a].parent) {
      if (choice[a] != 0) return false;
    }
  }
  return true;
}

/** One valid choice and what the rule says it costs. */
struct Evaluated {
  std::vector<int> choice;
  int64_t peak = 0;  // max over segments (0 with none; below 0 where the deltas say so)
  double time_ms = 0;
};

/** Peak and time of one choice. */
inline Evaluated evaluate(const rp::StepModel& m, const std::vector<int>& choice) {
  Evaluated e{choice, 0, m.step_time_ms};
  for (int64_t s = 0; s < static_cast<int64_t>(m.segment_peak_bytes.size()); ++s) {
    const int64_t bytes = brute_segment(m, choice, s);
    e.peak = s == 0 ? bytes : std::max(e.peak, bytes);
  }
  for (size_t u = 0; u < m.units.size(); ++u) {
    for (const rp::StepCall& c : m.units[u].calls) e.time_ms += c.costs[choice[u]].time_ms - c.costs[0].time_ms;
  }
  return e;
}

/** Every choice that respects the nesting, evaluated. */
inline std::vector<Evaluated> every_choice(const rp::StepModel& m) {
  std::vector<Evaluated> out;
  std::vector<int> choice(m.units.size(), 0);
  while (true) {
    if (nesting_ok(m, choice)) out.push_back(evaluate(m, choice));
    size_t u = 0;
    for (; u < choice.size(); ++u) {
      if (++choice[u] < static_cast<int>(m.units[u].options.size())) break;
      choice[u] = 0;
    }
    if (u == choice.size()) break;
  }
  return out;
}

struct Brute {
  double best_time = std::numeric_limits<double>::infinity();  // fastest within the budget
  int64_t min_peak = std::numeric_limits<int64_t>::max();      // over every choice
};

inline Brute best_of(const std::vector<Evaluated>& all, int64_t budget) {
  Brute out;
  for (const Evaluated& e : all) {
    out.min_peak = std::min(out.min_peak, e.peak);
    if (e.peak <= budget) out.best_time = std::min(out.best_time, e.time_ms);
  }
  return out;
}

/** Over every choice: the fastest within budget, and the smallest peak. */
inline Brute brute(const rp::StepModel& m, int64_t budget) { return best_of(every_choice(m), budget); }

}  // namespace remat_test::step
