// The non-DP algorithms: store-all, uniform (checkpoint_sequential), sqrt,
// Chen et al.'s greedy segmentation and Revolve's binomial schedule. Leaves out
// the optimal DP (optimal.cpp) and dispatch (solve.cpp).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "internal.h"
#include "remat/plan/error.h"
#include "remat/plan/solve.h"

namespace remat::plan {
namespace internal {

Plan make_plan(const Chain& chain, std::string algorithm, Schedule schedule) {
  Plan plan;
  plan.algorithm = std::move(algorithm);
  plan.prediction = simulate(chain, schedule);
  plan.schedule = std::move(schedule);
  return plan;
}

void emit_sweep(std::vector<Op>& ops, int from, int to) {
  // a_from live -> a_to live, intermediates dropped right after use.
  for (int k = from; k < to; ++k) {
    ops.push_back({OpKind::kForward, k});
    if (k > from) ops.push_back({OpKind::kDrop, k});
  }
}

Schedule segmented(int L, const std::vector<int>& starts) {
  // starts: 0 = starts[0] < starts[1] < ... < L. All but the last segment run
  // without saving (their input stays as a checkpoint); the last runs plain.
  Schedule s;
  auto& ops = s.ops;
  const int n = static_cast<int>(starts.size());
  auto end_of = [&](int j) { return j + 1 < n ? starts[j + 1] : L; };  // exclusive
  for (int j = 0; j + 1 < n; ++j) emit_sweep(ops, starts[j], end_of(j));
  for (int k = starts[n - 1]; k < L; ++k) ops.push_back({OpKind::kForwardSave, k});
  for (int k = L - 1; k >= starts[n - 1]; --k) ops.push_back({OpKind::kBackward, k});
  for (int j = n - 2; j >= 0; --j) {
    ops.push_back({OpKind::kDrop, end_of(j)});
    for (int k = starts[j]; k < end_of(j); ++k) ops.push_back({OpKind::kForwardSave, k});
    for (int k = end_of(j) - 1; k >= starts[j]; --k) ops.push_back({OpKind::kBackward, k});
  }
  return s;
}

}  // namespace internal

using internal::make_plan;
using internal::segmented;

Plan store_all(const Chain& chain) {
  chain.validate();
  return make_plan(chain, "store-all", segmented(chain.size(), {0}));
}

Plan uniform(const Chain& chain, int segments) {
  chain.validate();
  if (segments < 1)
    throw Error("[remat::plan] uniform: segments is " + std::to_string(segments) + "; it must be >= 1.");
  const int L = chain.size();
  const int k = std::min(segments, L);
  const int size = L / k;
  std::vector<int> starts;
  for (int j = 0; j < k; ++j) starts.push_back(j * size);
  return make_plan(chain, "uniform:" + std::to_string(segments), segmented(L, starts));
}

Plan sqrt_schedule(const Chain& chain) {
  chain.validate();
  const int k = std::max(1, static_cast<int>(std::lround(std::sqrt(static_cast<double>(chain.size())))));
  Plan p = uniform(chain, k);
  p.algorithm = "sqrt";
  return p;
}

namespace {

std::vector<int> greedy_starts(const Chain& chain, int64_t threshold_bytes) {
  // Chen et al. 2016, Alg. 2: temp accumulates saved bytes; once it exceeds the
  // threshold, the current stage's output becomes a checkpoint.
  std::vector<int> starts{0};
  int64_t temp = 0;
  const int L = chain.size();
  for (int i = 0; i + 1 < L; ++i) {
    temp += chain.stages[i].saved_bytes;
    if (temp > threshold_bytes) {
      starts.push_back(i + 1);
      temp = 0;
    }
  }
  return starts;
}

}  // namespace

Plan greedy(const Chain& chain, int64_t budget_bytes) {
  chain.validate();
  const int L = chain.size();
  // Thresholds at which the segmentation can change: sums of saved bytes over ranges.
  std::vector<int64_t> thresholds{0};
  for (int i = 0; i < L; ++i) {
    int64_t sum = 0;
    for (int j = i; j < L; ++j) thresholds.push_back(sum += chain.stages[j].saved_bytes);
  }
  std::sort(thresholds.begin(), thresholds.end());
  thresholds.erase(std::unique(thresholds.begin(), thresholds.end()), thresholds.end());
  if (thresholds.size() > 4096) {  // long chains: an even sample keeps it O(4096 L)
    std::vector<int64_t> sample;
    for (size_t k = 0; k < 4096; ++k) sample.push_back(thresholds[k * (thresholds.size() - 1) / 4095]);
    thresholds.swap(sample);
  }
  bool found = false;
  Plan best;
  int64_t min_peak = std::numeric_limits<int64_t>::max();
  std::vector<int> last;
  for (int64_t th : thresholds) {
    std::vector<int> starts = greedy_starts(chain, th);
    if (starts == last) continue;
    last = starts;
    Plan p = make_plan(chain, "greedy", segmented(L, starts));
    min_peak = std::min(min_peak, p.prediction.peak_bytes);
    if (p.prediction.peak_bytes > budget_bytes) continue;
    if (!found || p.prediction.time_ms < best.prediction.time_ms ||
        (p.prediction.time_ms == best.prediction.time_ms && p.prediction.peak_bytes < best.prediction.peak_bytes)) {
      best = std::move(p);
      found = true;
    }
  }
  if (!found)
    throw Error("[remat::plan] greedy: no segmentation fits in " + format_bytes(budget_bytes) +
                "; greedy's smallest peak is " + format_bytes(min_peak) + " and the smallest feasible peak is " +
                format_bytes(min_feasible_peak_bytes(chain)) +
                ". Raise memory_budget_bytes or use the optimal algorithm.");
  return best;
}

namespace {

/** Revolve's advance for `steps` steps with `snaps` checkpoints, the current
 *  one included (revolve.c, Griewank & Walther 2000): how many steps to advance
 *  before taking the next checkpoint. steps >= 2, snaps >= 1. */
int revolve_advance(int64_t steps, int64_t snaps) {
  int64_t reps = 0, range = 1;
  while (range < steps) {
    ++reps;
    range = range * (reps + snaps) / reps;  // beta(snaps, reps)
  }
  const int64_t bino1 = range * reps / (snaps + reps);
  const int64_t bino2 = snaps > 1 ? bino1 * snaps / (snaps + reps - 1) : 1;
  const int64_t bino3 = snaps == 1 ? 0 : (snaps > 2 ? bino2 * (snaps - 1) / (snaps + reps - 2) : 1);
  const int64_t bino4 = bino2 * (reps - 1) / snaps;
  const int64_t bino5 = snaps < 3 ? 0 : (snaps > 3 ? bino3 * (snaps - 2) / reps : 1);
  int64_t advance;
  if (steps <= bino1 + bino3) advance = bino4;
  else if (steps >= range - bino5) advance = bino1;
  else advance = steps - bino2 - bino3;
  return static_cast<int>(std::clamp<int64_t>(advance, 1, steps - 1));
}

void revolve_rec(std::vector<Op>& ops, int s, int t, int snaps) {
  // Reverse stages s..t with a_s checkpointed and `snaps` checkpoints (a_s's included).
  while (s < t) {
    const int advance = snaps == 1 ? t - s : revolve_advance(t - s + 1, snaps);
    const int mid = s + advance;
    internal::emit_sweep(ops, s, mid);
    revolve_rec(ops, mid, t, snaps - 1);
    ops.push_back({OpKind::kDrop, mid});
    t = mid - 1;
  }
  ops.push_back({OpKind::kForwardSave, s});
  ops.push_back({OpKind::kBackward, s});
}

}  // namespace

Plan revolve(const Chain& chain, int slots) {
  chain.validate();
  if (slots < 1)
    throw Error("[remat::plan] revolve: slots is " + std::to_string(slots) + "; it must be >= 1 (a_0 occupies one).");
  Schedule s;
  revolve_rec(s.ops, 0, chain.size() - 1, slots);
  return make_plan(chain, "revolve:" + std::to_string(slots), std::move(s));
}

}  // namespace remat::plan
