// Random step models for the step solver's tests (step_test.cpp,
// step_variants_test.cpp): chains, GAN-like steps (a unit called twice
// before its backward), blocks with units inside, shared inputs. Torch-free;
// header-only.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "remat/plan/step.h"

namespace remat_test::step {

namespace rp = remat::plan;

// Gives call `c` of unit u a shared input with call 0 of unit `other`, from
// a random segment in [forward_end, min(hi, backward_begin)], each
// non-profiled option of both letting go of it at random.
inline void add_pair(std::mt19937& rng, rp::StepModel& m, size_t u, size_t c, size_t other, int64_t hi) {
  std::uniform_int_distribution<int> coin(0, 1);
  rp::StepCall& call = m.units[u].calls[c];
  call.pair_unit = static_cast<int64_t>(other);
  call.pair_call = 0;
  call.pair_bytes = std::uniform_int_distribution<int64_t>(1, 48)(rng) << 20;
  call.pair_begin = std::uniform_int_distribution<int64_t>(call.forward_end, std::min(hi, call.backward_begin))(rng);
  call.pair_lets_go.assign(m.units[u].options.size(), false);
  call.pair_other_lets_go.assign(m.units[other].options.size(), false);
  for (size_t k = 1; k < call.pair_lets_go.size(); ++k) call.pair_lets_go[k] = coin(rng);
  for (size_t k = 1; k < call.pair_other_lets_go.size(); ++k) call.pair_other_lets_go[k] = coin(rng);
  // The profiled step held the shared input in both: it is in the peaks.
  for (int64_t s = call.pair_begin; s < call.backward_begin; ++s) m.segment_peak_bytes[s] += call.pair_bytes;
}

// Adds each unit's profiled (keep) bytes to the segments its windows cover.
inline void add_keep_peaks(rp::StepModel& m) {
  for (const auto& unit : m.units) {
    const rp::StepCall& c = unit.calls[0];
    for (int64_t s = c.forward_begin; s < c.backward_end; ++s) {
      if (s < c.forward_end) m.segment_peak_bytes[s] += c.costs[0].forward_peak_bytes;
      else if (s < c.backward_begin) m.segment_peak_bytes[s] += c.costs[0].kept_bytes;
      else m.segment_peak_bytes[s] += c.costs[0].backward_peak_bytes;
    }
  }
}

// A random option menu per call: keep first (most memory, least time), the
// others trade kept bytes for time, like recompute, selective and offload.
// With release_hi >= fe, half the calls get a release point in [fe,
// min(release_hi, bb)] and their options release 0-3 MiB of inputs.
inline rp::StepCall random_call(std::mt19937& rng, int options, int64_t fb, int64_t fe, int64_t bb, int64_t be,
                                int64_t release_hi = -1) {
  std::uniform_int_distribution<int> mib(1, 64);
  std::uniform_real_distribution<double> ms(0.5, 20);
  rp::StepCall c{fb, fe, bb, be, {}};
  const int64_t MiB = 1 << 20;
  rp::StepCost keep{ms(rng), mib(rng) * MiB, 0, 0};
  keep.kept_bytes = keep.forward_peak_bytes - mib(rng) % 8 * MiB / 8;
  if (keep.kept_bytes < 0) keep.kept_bytes = 0;
  keep.backward_peak_bytes = keep.kept_bytes + mib(rng) * MiB / 4;
  c.costs.push_back(keep);
  for (int k = 1; k < options; ++k) {
    rp::StepCost o = keep;
    o.kept_bytes = keep.kept_bytes * (mib(rng) % 10) / 10;
    o.forward_peak_bytes = std::max(o.kept_bytes, keep.forward_peak_bytes - mib(rng) * MiB / 16);
    o.backward_peak_bytes = keep.backward_peak_bytes + mib(rng) * MiB / 8;
    o.time_ms = keep.time_ms + ms(rng) * (10 - o.kept_bytes * 10 / std::max<int64_t>(1, keep.kept_bytes)) / 10;
    c.costs.push_back(o);
  }
  if (release_hi >= fe && mib(rng) % 2 == 0) {
    c.release_begin = std::uniform_int_distribution<int64_t>(fe, std::min(release_hi, bb))(rng);
    if (mib(rng) % 2 == 0) c.release_end = std::uniform_int_distribution<int64_t>(bb, be)(rng);
    for (size_t k = 1; k < c.costs.size(); ++k) c.costs[k].released_bytes = mib(rng) % 4 * MiB;
  }
  return c;
}

// A chain: forwards in order, backwards in reverse, with `gap` segments of
// other work (a head, a loss) between; segment peaks grow with what is live.
// With late_releases, a release may come after the next unit's forward
// (the chain DP then hands the step to GLPK).
inline rp::StepModel random_chain(std::mt19937& rng, int units, int max_options, bool late_releases = false) {
  std::uniform_int_distribution<int> opts(1, max_options);
  rp::StepModel m;
  m.step_time_ms = 100;
  const int64_t n = 4 * units + 2;
  for (int u = 0; u < units; ++u) {
    rp::StepUnit unit{"u" + std::to_string(u), {}, {}};
    const int o = opts(rng);
    for (int k = 0; k < o; ++k) unit.options.push_back(k == 0 ? "keep" : "opt" + std::to_string(k));
    unit.calls.push_back(
        random_call(rng, o, 2 * u, 2 * u + 1, n - 2 * u - 2, n - 2 * u - 1, late_releases ? n : 2 * u + 2));
    m.units.push_back(unit);
  }
  // The profiled step's memory: what each unit keeps, plus its windows' peaks.
  m.segment_peak_bytes.assign(n, 10 << 20);
  add_keep_peaks(m);
  return m;
}

// A GAN-like step: a generator unit, then a discriminator unit called on
// fake and real before any backward, with skip-like overlapping windows.
// With `nest`, D.head is an inner unit of D (a unit called twice: GLPK).
inline rp::StepModel random_gan(std::mt19937& rng, int max_options, bool nest = false) {
  std::uniform_int_distribution<int> opts(2, max_options);
  rp::StepModel m;
  m.step_time_ms = 50;
  m.segment_peak_bytes.assign(12, 0);
  std::uniform_int_distribution<int> mib(1, 32);
  for (auto& p : m.segment_peak_bytes) p = mib(rng) * (int64_t{1} << 20);
  auto add = [&](const std::string& name, std::vector<std::array<int64_t, 4>> windows) {
    rp::StepUnit u{name, {}, {}};
    const int o = opts(rng);
    for (int k = 0; k < o; ++k) u.options.push_back(k == 0 ? "keep" : "opt" + std::to_string(k));
    for (const auto& w : windows) u.calls.push_back(random_call(rng, o, w[0], w[1], w[2], w[3], w[2]));
    m.units.push_back(u);
  };
  add("G", {{0, 1, 10, 11}});
  add("D", {{1, 2, 8, 9}, {2, 4, 6, 8}});
  add("D.head", {{3, 4, 6, 7}});
  if (nest) m.units.back().parent = 1;
  add("E", {{4, 5, 5, 6}});
  return m;
}

// Blocks in a chain, each with units inside (a GPT block's attention and
// MLP): the inner units' forwards lie in the block's forward, their
// backwards in its backward, in reverse. Every unit gets 1..max_options
// options; the profiled peaks add what each window holds.
inline rp::StepModel random_nested(std::mt19937& rng, int blocks, int inner, int max_options) {
  std::uniform_int_distribution<int> opts(1, max_options);
  rp::StepModel m;
  m.step_time_ms = 100;
  const int64_t per = inner + 1;  // segments per block forward (inner forwards, then its own tail)
  const int64_t n = 2 * blocks * per + 2;
  auto add = [&](const std::string& name, int64_t parent, int64_t fb, int64_t fe, int64_t bb, int64_t be,
                 int64_t release_hi) {
    rp::StepUnit u{name, {}, {}, parent};
    const int o = opts(rng);
    for (int k = 0; k < o; ++k) u.options.push_back(k == 0 ? "keep" : "opt" + std::to_string(k));
    u.calls.push_back(random_call(rng, o, fb, fe, bb, be, release_hi));
    m.units.push_back(u);
  };
  for (int b = 0; b < blocks; ++b) {
    const int64_t f0 = b * per, b0 = n - 2 - (b + 1) * per;  // its forward's and backward's first segment
    const int64_t parent = static_cast<int64_t>(m.units.size());
    add("b" + std::to_string(b), -1, f0, f0 + per, b0, b0 + per, f0 + per);
    for (int i = 0; i < inner; ++i) {
      add("b" + std::to_string(b) + ".i" + std::to_string(i), parent, f0 + i, f0 + i + 1, b0 + per - 1 - i,
          b0 + per - i, f0 + per);
    }
  }
  m.segment_peak_bytes.assign(n, 10 << 20);
  add_keep_peaks(m);
  return m;
}

}  // namespace remat_test::step
