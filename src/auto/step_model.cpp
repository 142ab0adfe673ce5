// The step model (the third stage of the whole-step planner): turns the
// profiled step's record (calls, windows, the memory timeline, each
// option's costs) into the torch-free plan::StepModel, solves it under a
// budget with plan's step solver (with the offload stores' in-flight margin
// in tiers), and reprices offload from measured steps. Leaves out how the
// record is made (profiled_step.cpp, menu.cpp), how a plan is put in force
// (apply.cpp) and the text of its errors (explain.cpp).
#include "internal.h"

#include "../offload/offload_codec.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include <remat/error.h>

namespace remat {

using detail::kDisagree;
using detail::shown;

/** The profiled step as a plan::StepModel (profile_fresh() calls it at the
 *  step's end): the timeline cut into segments at the calls' windows, the
 *  segments' peaks, and per call its options' costs, the inputs it lets go
 *  and the earlier call it shares one with. */
void AutoCheckpoint::Impl::build_model(const memory::Recording& tl, int64_t start_bytes, double begin_us,
                                       double end_us) {
  profile_start_bytes = start_bytes;
  // Samples outside the isolated runs.
  samples.clear();
  size_t w = 0;
  for (const memory::Sample& s : tl.samples()) {
    while (w < trial_windows.size() && s.time_us > trial_windows[w].second) ++w;
    if (w < trial_windows.size() && s.time_us >= trial_windows[w].first) continue;
    samples.push_back(s);
  }
  double trials_ms = 0;
  for (const auto& [a, b] : trial_windows) trials_ms += (b - a) / 1000.0;
  // The isolated runs slow the step around them (caches): a plain
  // warm-up step, when one ran, times the plain step better.
  profiled_ms = (end_us - begin_us) / 1000.0 - trials_ms;
  if (warmup_ms > 0) profiled_ms = std::min(profiled_ms, warmup_ms);

  // Segment boundaries: the step's ends and every window's ends.
  points_us = {begin_us, end_us};
  largest_input_sent = 0;
  for (const auto& c : calls) {
    if (c->forward_end_us < 0) c->forward_end_us = c->forward_begin_us;  // threw: never here
    if (c->first_unpack_us < 0) c->first_unpack_us = c->backward_end_us = c->forward_end_us;
    c->backward_end_us = std::min(c->backward_end_us, end_us);  // a node on another thread may return late
    for (double t : {c->forward_begin_us, c->forward_end_us, c->first_unpack_us, c->backward_end_us}) {
      points_us.push_back(t);
    }
    // NOTE [released inputs]: from when every input that some option
    // lets go (and that the step saw held only by this call) is free to go.
    // The credit ends at the earliest last sighting of such an input
    // alive in the call's backward (keep may free it there).
    c->release_us = c->release_end_us = -1;
    for (size_t i = 0; i < c->exclusive_us.size(); ++i) {
      bool let_go = false;
      for (const auto& k : c->lets_go) let_go |= i < k.size() && k[i];
      if (!let_go || c->exclusive_us[i] < 0) continue;
      c->release_us = std::max(c->release_us, c->exclusive_us[i]);
      const double alive = std::max(c->alive_us[i], c->first_unpack_us);
      c->release_end_us = c->release_end_us < 0 ? alive : std::min(c->release_end_us, alive);
    }
    if (c->release_us >= 0 && c->forward_end_us <= c->first_unpack_us) {
      c->release_us = std::clamp(c->release_us, c->forward_end_us, c->first_unpack_us);
      c->release_end_us = std::clamp(c->release_end_us, c->first_unpack_us, c->backward_end_us);
      points_us.push_back(c->release_us);
      points_us.push_back(c->release_end_us);
    } else {
      c->release_us = c->release_end_us = -1;
    }
    // NOTE [inputs two calls hold]: from when only the two hold it.
    if (c->pair && c->pair_us >= 0 && c->exclusive_us[c->pair_slot] < 0 && c->forward_end_us <= c->first_unpack_us) {
      c->pair_us = std::clamp(c->pair_us, c->forward_end_us, c->first_unpack_us);
      points_us.push_back(c->pair_us);
    } else {
      c->pair_us = -1;
    }
    c->packs.clear();  // the weak references are needed no more
    c->out_packs.clear();
    // The largest input of a unit that may send its inputs to a store.
    bool sends_inputs = false;
    for (const Option& o : units[c->unit].menu) sends_inputs |= o.store >= 0 && o.switch_state.has_value();
    if (sends_inputs) {
      for (int64_t b : c->input_bytes) largest_input_sent = std::max(largest_input_sent, b);
    }
  }
  std::sort(points_us.begin(), points_us.end());
  points_us.erase(std::unique(points_us.begin(), points_us.end()), points_us.end());
  auto at = [&](double t) {
    return static_cast<int64_t>(std::lower_bound(points_us.begin(), points_us.end(), t) - points_us.begin());
  };
  const size_t segments = points_us.size() - 1;
  plan::StepModel m;
  m.step_time_ms = profiled_ms;
  m.segment_peak_bytes.assign(segments, 0);
  int64_t level = start_bytes;
  size_t k = 0;
  for (size_t s = 0; s < segments; ++s) {
    int64_t peak = level;
    while (k < samples.size() && samples[k].time_us < points_us[s + 1]) {
      if (samples[k].time_us >= points_us[s]) peak = std::max(peak, samples[k].bytes);
      level = samples[k].bytes;
      ++k;
    }
    m.segment_peak_bytes[s] = peak;
  }
  // NOTE [what the profiled step leaves behind]
  for (size_t s = 0; s < segments; ++s) {
    m.segment_peak_bytes[s] += s == 0 ? grown : grown_everywhere;
  }
  profiled_peak = 0;
  for (int64_t p : m.segment_peak_bytes) profiled_peak = std::max(profiled_peak, p);

  std::vector<int64_t> model_index(units.size(), -1);
  std::vector<size_t> now_modeled;
  std::vector<std::vector<double>> now_input_bytes;
  std::vector<std::vector<std::vector<plan::TransferRun>>> now_transfers;
  for (size_t i = 0, j = 0; i < units.size(); ++i) {
    if (units[i].calls.empty()) continue;
    model_index[i] = static_cast<int64_t>(j++);
    now_modeled.push_back(i);
    now_input_bytes.emplace_back();
    now_transfers.emplace_back();
    for (size_t ci : units[i].calls) {
      const CallRecord& r = *calls[ci];
      now_transfers.back().push_back(r.transfers);
      double bytes = 0;
      for (size_t x = 0; x < r.input_ids.size(); ++x) {
        const auto first = std::find(r.input_ids.begin(), r.input_ids.end(), r.input_ids[x]);
        if (r.input_ids[x] != nullptr && first == r.input_ids.begin() + static_cast<int64_t>(x)) {
          bytes += static_cast<double>(r.input_bytes[x]);
        }
      }
      now_input_bytes.back().push_back(bytes);
    }
  }
  // NOTE [inputs two calls hold]: the earlier call c shares its input
  // with, and that call's output slot, or null. An inner call's output
  // that the calls around it return as theirs is theirs too: the pair is
  // the outermost plannable one, whose recompute or offload lets go of
  // it (while the inner call's choice is then moot) and which keeps a
  // chain of blocks a chain for the solver.
  auto pair_of = [&](const CallRecord& c) {
    std::pair<const CallRecord*, size_t> found{nullptr, 0};
    if (c.pair_us < 0 || c.pair == nullptr) return found;
    const c10::StorageImpl* st = c.pair->output_ids[c.pair_out];
    size_t out = c.pair_out;
    for (const CallRecord* r = c.pair.get(); r != nullptr; r = r->enclosing.get()) {
      if (r != c.pair.get()) {
        const auto o = std::find(r->output_ids.begin(), r->output_ids.end(), st);
        // Not its output, or a call around c too (its forward goes on).
        if (o == r->output_ids.end() || r->forward_end_us > c.forward_begin_us) break;
        out = static_cast<size_t>(o - r->output_ids.begin());
        if (!units[r->unit].plannable) continue;
      }
      if (model_index[r->unit] >= 0 && r->out_lets_go.size() == units[r->unit].menu.size()) found = {r, out};
    }
    return found;
  };
  for (size_t i = 0; i < units.size(); ++i) {
    Unit& u = units[i];
    if (u.calls.empty()) continue;
    plan::StepUnit su;
    su.name = shown(u.name);
    su.parent = u.parent >= 0 ? model_index[static_cast<size_t>(u.parent)] : -1;
    u.offered.clear();
    for (size_t k = 0; k < u.menu.size(); ++k) {
      // "inner units too" switches them on wherever they run: offered only
      // when each of them runs inside this unit alone.
      if (u.menu[k].inner && !inner_calls_inside(i)) continue;
      u.offered.push_back(k);
      su.options.push_back(u.menu[k].name);
    }
    // Not plannable, or called inside different units (or inside a unit
    // that is, whose options were measured with it plain): kept.
    bool disagrees = u.parent == kDisagree;
    for (int64_t a = u.parent; a >= 0 && !disagrees; a = units[static_cast<size_t>(a)].parent) {
      disagrees = units[static_cast<size_t>(a)].parent == kDisagree;
    }
    if (!u.plannable || disagrees) {
      su.options.resize(1);
      u.offered.resize(1);
    }
    for (size_t ci : u.calls) {
      const CallRecord& c = *calls[ci];
      plan::StepCall sc;
      sc.forward_begin = at(c.forward_begin_us);
      sc.forward_end = at(c.forward_end_us);
      sc.backward_begin = at(c.first_unpack_us);
      sc.backward_end = at(c.backward_end_us);
      for (size_t k : u.offered) {
        plan::StepCost cost = c.costs[k];
        if (c.release_us >= 0) {  // what it lets go of the inputs held only here, each storage once
          std::vector<const c10::StorageImpl*> counted;
          for (size_t i = 0; i < c.exclusive_us.size(); ++i) {
            if (!c.lets_go[k][i] || c.exclusive_us[i] < 0 || c.input_ids[i] == nullptr) continue;
            if (std::find(counted.begin(), counted.end(), c.input_ids[i]) != counted.end()) continue;
            counted.push_back(c.input_ids[i]);
            cost.released_bytes += c.input_bytes[i];
          }
        }
        sc.costs.push_back(cost);
      }
      if (c.release_us >= 0) {
        sc.release_begin = at(c.release_us);
        sc.release_end = at(c.release_end_us);
      }
      const auto [other, other_out] = pair_of(c);
      const Unit& a = units[other != nullptr ? other->unit : 0];
      const auto pos =
          std::find_if(a.calls.begin(), a.calls.end(), [&](size_t ci2) { return calls[ci2].get() == other; });
      // A unit applied to its own output (an RNN cell, b(b(x))) pairs with
      // itself, which the step model does not take (one decision on both
      // sides): without the credit, the prediction counts the input as held
      // until this call's backward (it holds it then at most).
      if (other != nullptr && pos != a.calls.end() && other->unit != c.unit) {
        sc.pair_unit = model_index[other->unit];
        sc.pair_call = pos - a.calls.begin();
        sc.pair_bytes = c.input_bytes[c.pair_slot];
        sc.pair_begin = at(c.pair_us);
        for (size_t k : u.offered) sc.pair_lets_go.push_back(c.lets_go[k][c.pair_slot] != 0);
        // Per option of the earlier unit's menu (its offered ones below).
        for (size_t k = 0; k < a.menu.size(); ++k) {
          sc.pair_other_lets_go.push_back(other_out < other->out_lets_go[k].size() &&
                                          other->out_lets_go[k][other_out] != 0);
        }
      }
      su.calls.push_back(std::move(sc));
    }
    m.units.push_back(std::move(su));
  }
  // The earlier calls' flags, from their unit's menu to its offered options.
  for (auto& su : m.units) {
    for (auto& sc : su.calls) {
      if (sc.pair_unit < 0) continue;
      const Unit& a = units[now_modeled[static_cast<size_t>(sc.pair_unit)]];
      std::vector<bool> flags;
      for (size_t k : a.offered) flags.push_back(sc.pair_other_lets_go[k]);
      sc.pair_other_lets_go = std::move(flags);
    }
  }
  step_model = std::move(m);
  plain_calibrations = 0;  // the new profile's plain time (NOTE [plain time calibrated])
  plain_last = -1;
  surcharge_ms_per_byte.assign(options.offload().size(), 0.0);  // fresh prices: nothing added
  offload_ms_per_gib = 0;
  transfer_price.reset();
  modeled = std::move(now_modeled);
  input_bytes_of = std::move(now_input_bytes);
  transfers_of = std::move(now_transfers);
  inflight_seen = inflight_trial;
}

/** True when every inner unit of units[i] that ran in the profiled step
 *  ran only inside units[i] (at any depth). */
bool AutoCheckpoint::Impl::inner_calls_inside(size_t i) const {
  for (size_t d : units[i].inner) {
    if (units[d].calls.empty()) continue;
    int64_t a = units[d].parent;
    while (a >= 0 && static_cast<size_t>(a) != i) a = units[static_cast<size_t>(a)].parent;
    if (a < 0) return false;
  }
  return true;
}

/** Bytes the offload stores may hold in flight at once (pending writes,
 *  reads ahead), beyond what the isolated runs measured: each kDisk
 *  store's max_inflight_bytes, or the largest entry it held in flight,
 *  which a store lets go alone (NOTE [offload margin measured]); with
 *  inputs_only (plans whose units send only their inputs), of the inputs.
 *  Never more than every call of the step sends to that store: an entry
 *  in flight is a write not yet on disk or a read ahead of one, so a cap
 *  above what a step sends (the default 256 MiB on a small model) holds
 *  no more than that. */
int64_t AutoCheckpoint::Impl::inflight_margin(bool inputs_only, const std::vector<int64_t>& caps) const {
  int64_t m = 0;
  for (size_t i = 0; i < options.offload().size(); ++i) {
    const OffloadOptions& o = options.offload()[i];
    if (o.target() != OffloadTarget::kDisk) continue;
    const int64_t seen = i < inflight_seen.size() ? inflight_seen[i] : 0;
    const int64_t cap = i < caps.size() ? caps[i] : o.max_inflight_bytes();
    const int64_t entry = inputs_only ? largest_input_sent : std::max(largest_input_sent, seen);
    m += std::min(std::max(cap, entry), sent_per_step(i, inputs_only));
    // A codec's buffer beside the entry it encodes or decodes: one per
    // writer thread and one for the reader. The cap counts raw bytes only.
    m += (o.writer_threads() + 1) * detail::codec_buffer_bytes(o.codec(), entry);
  }
  return m;
}

/** The most a step's calls send to store i (of options.offload()): per
 *  call, the most any of its unit's options that send there wrote in its
 *  isolated run (with inputs_only, only the options that send inputs),
 *  plus the storages of the call's inputs (the isolated run sent compact
 *  clones; the real step sends a view's whole base), summed over every
 *  call of every unit (an inner unit's with its parent's, which can only
 *  over-count). As the profiled step's shapes say: another shape needs
 *  profile_step() again, as every figure of the plan does. */
int64_t AutoCheckpoint::Impl::sent_per_step(size_t i, bool inputs_only) const {
  int64_t total = 0;
  const std::vector<size_t> mu = model_units();
  for (size_t j = 0; j < transfers_of.size() && j < mu.size(); ++j) {
    const Unit& u = units[mu[j]];
    for (size_t ci = 0; ci < transfers_of[j].size(); ++ci) {
      const auto& per_option = transfers_of[j][ci];
      int64_t most = 0;
      bool sends = false;
      for (size_t k = 0; k < per_option.size() && k < u.menu.size(); ++k) {
        const Option& o = u.menu[k];
        if (o.store != static_cast<int>(i) || (inputs_only && o.offload)) continue;
        sends = true;
        most = std::max(most, per_option[k].written_bytes);
      }
      if (!sends) continue;
      const double inputs = j < input_bytes_of.size() && ci < input_bytes_of[j].size() ? input_bytes_of[j][ci] : 0;
      total += most + static_cast<int64_t>(inputs);
    }
  }
  return total;
}

// NOTE [in flight planned]: what a disk store may hold in flight (pending
// writes, reads ahead) is the plan's to choose, not a fixed cap. More lets
// an offloading call's writes run beside its compute instead of stalling
// it, and costs its bytes at every point of the step (the margin, never
// more than the step sends to the store). Each disk store's ladder, from
// the bottom: one entry at a time (the largest tensor a call sent, which
// the store holds alone whatever its cap, or the given cap if that is
// less); 4x, 16x, 64x that tensor; max_inflight_bytes as the user gave
// it, and 4x, 16x, 64x the larger of it and that tensor; room beside that
// tensor for all one call sends, the top (with room for all its writes a
// call waits only for what the disk takes beyond its compute: a larger cap
// prices no call lower). At each rung the offload options are priced by
// their isolated runs' transfers (plan::transfer_wait_ms: the store's
// measured pace; a share room / bytes of the writes beside the forward's
// compute and of the reads beside the backward's, the room being what the
// cap holds beyond the one tensor the run held), and the tiers that offer
// them carry that rung's margin. The plan takes the fastest rung whose
// margin fits (the lowest among equals); apply() runs each disk store at
// its rung. What several calls sending at once cost beyond that (a disk
// that does not keep up) is charged by measured steps (NOTE [offload
// priced by the step]).

/** Per rung, per store of options.offload(): the caps solve() compares. */
std::vector<std::vector<int64_t>> AutoCheckpoint::Impl::cap_ladder() const {
  const size_t n = options.offload().size();
  // Per disk store: the largest tensor one call sent (held alone, whatever
  // the cap) and the cap with room beside it for the most one call sends.
  std::vector<int64_t> largest(n, 0), whole(n, 0);
  const std::vector<size_t> mu = model_units();
  for (size_t j = 0; j < transfers_of.size() && j < mu.size(); ++j) {
    const Unit& u = units[mu[j]];
    for (const auto& per_option : transfers_of[j]) {
      for (size_t k = 0; k < per_option.size() && k < u.menu.size(); ++k) {
        const int st = u.menu[k].store;
        if (st < 0 || static_cast<size_t>(st) >= n) continue;
        const plan::TransferRun& r = per_option[k];
        largest[static_cast<size_t>(st)] = std::max(largest[static_cast<size_t>(st)], r.largest_bytes);
        whole[static_cast<size_t>(st)] =
            std::max(whole[static_cast<size_t>(st)], std::max(r.written_bytes, r.read_bytes) + r.largest_bytes);
      }
    }
  }
  std::vector<std::vector<int64_t>> per_store(n);
  size_t rungs = 1;
  for (size_t i = 0; i < n; ++i) {
    const OffloadOptions& o = options.offload()[i];
    const int64_t given = o.max_inflight_bytes();
    std::vector<int64_t>& l = per_store[i];
    if (o.target() != OffloadTarget::kDisk || whole[i] == 0) {
      l.push_back(given);
      continue;
    }
    // NOTE [in flight planned]: one entry at a time (any cap up to the
    // largest tensor: it goes alone), 4x, 16x, 64x that; the given cap,
    // 4x, 16x, 64x the larger of the two; room for all one call sends, the
    // top.
    const int64_t one = std::min(given, largest[i] > 0 ? largest[i] : given);
    std::vector<int64_t> c{one, given, whole[i]};
    for (int64_t base : {std::max<int64_t>(largest[i], 1), std::max(given, largest[i])}) {
      int64_t x = std::min(base, int64_t{1} << 56);
      for (int k = 0; k < 3; ++k) c.push_back(x *= 4);
    }
    std::sort(c.begin(), c.end());
    for (int64_t x : c) {
      if (x > whole[i] || (x != one && x <= largest[i]) || (!l.empty() && x == l.back())) continue;
      l.push_back(x);
    }
    rungs = std::max(rungs, l.size());
  }
  // A store with fewer rungs stays at its last.
  std::vector<std::vector<int64_t>> ladder(rungs, std::vector<int64_t>(n, 0));
  for (size_t r = 0; r < rungs; ++r) {
    for (size_t i = 0; i < n; ++i) ladder[r][i] = per_store[i][std::min(r, per_store[i].size() - 1)];
  }
  return ladder;
}

/** Per unit of the step model, per offered option: what its calls'
 *  transfers cost at these caps less what their isolated runs waited
 *  (NOTE [in flight planned]); empty when nothing is priced. */
std::vector<std::vector<double>> AutoCheckpoint::Impl::priced_at(const std::vector<int64_t>& caps) const {
  std::vector<std::vector<double>> out;
  bool any = false;
  const std::vector<size_t> mu = model_units();
  for (size_t j = 0; j < step_model.units.size() && j < transfers_of.size(); ++j) {
    const Unit& u = units[mu[j]];
    std::vector<double> d(step_model.units[j].options.size(), 0.0);
    for (size_t kk = 0; kk < d.size(); ++kk) {
      const int store = store_of(j, kk);
      if (store < 0 || static_cast<size_t>(store) >= caps.size()) continue;
      for (const auto& per_option : transfers_of[j]) {
        if (u.offered[kk] >= per_option.size()) continue;
        const plan::TransferRun& r = per_option[u.offered[kk]];
        if (r.written_bytes == 0 && r.read_bytes == 0) continue;
        d[kk] += plan::transfer_wait_ms(r, caps[static_cast<size_t>(store)]) - r.write_wait_ms - r.read_wait_ms;
      }
      // NOTE [no option runs faster than keep] (menu.cpp): room in flight
      // takes off at most the option's time above keep's, and a nanosecond
      // less, so that keep wins the tie after rounding.
      double above_keep = 0;
      for (const plan::StepCall& c : step_model.units[j].calls) above_keep += c.costs[kk].time_ms - c.costs[0].time_ms;
      d[kk] = std::max(d[kk], 1e-6 - above_keep);
      any = any || d[kk] != 0;
    }
    out.push_back(std::move(d));
  }
  if (!any) out.clear();
  return out;
}

// NOTE [offload margin measured]: a disk store holds a tensor from its
// save until its file is written, and a read from its prefetch until its
// unpack: at most max_inflight_bytes at once, or one entry alone when it
// is larger. The entries are what the store takes: the saved activations
// (a view's dense base), not the parameters, which it keeps where they
// are. The largest one is measured, not guessed from the largest tensor a
// unit saves (a 4 MiB weight where the largest activation is 8 KiB): each
// plain offload option's isolated runs save to a store of their own with
// one entry in flight at a time, whose counters give the largest entry it
// wrote or read back. Options that send a unit's inputs send those
// storages whole (largest_input_sent).

std::vector<AutoCheckpoint::Impl::Tier> AutoCheckpoint::Impl::tiers() const {
  if (inflight_margin() == 0) return {Tier{}};
  std::vector<Tier> out{{without_offload(/*plain_only=*/false), 0, {}, {}}};
  const std::vector<size_t> inputs_only = without_offload(/*plain_only=*/true);
  bool sends_inputs = false;  // some option sends a unit's inputs (none under recompute(false))
  for (size_t i = 0; i < options.offload().size(); ++i) sends_inputs |= sent_per_step(i, /*inputs_only=*/true) > 0;
  for (const std::vector<int64_t>& caps : cap_ladder()) {
    const std::vector<std::vector<double>> ms = priced_at(caps);
    if (sends_inputs) out.push_back({inputs_only, inflight_margin(/*inputs_only=*/true, caps), caps, ms});
    out.push_back({{}, inflight_margin(/*inputs_only=*/false, caps), caps, ms});
  }
  return out;
}

/** The store an option of step-model unit j sends to (an index in
 *  options.offload()), or -1. */
int AutoCheckpoint::Impl::store_of(size_t j, size_t k) const {
  const Unit& u = units[model_units()[j]];
  return u.menu[u.offered[k]].store;
}

/** Per unit of the step model, its options less those that send to a store
 *  (they end each menu), or with plain_only less those that send what the
 *  unit saves (they end it). */
std::vector<size_t> AutoCheckpoint::Impl::without_offload(bool plain_only) const {
  std::vector<size_t> offered;
  const std::vector<size_t> mu = model_units();
  for (size_t j = 0; j < step_model.units.size(); ++j) {
    const Unit& unit = units[mu[j]];
    size_t n = step_model.units[j].options.size();
    while (n > 1 && (plain_only ? unit.menu[unit.offered[n - 1]].offload.has_value() : store_of(j, n - 1) >= 0)) --n;
    offered.push_back(n);
  }
  return offered;
}

/** NOTE [model state in the plan] (state.cpp): each placement of the
 *  optimizers' state shifts each segment by its own bytes; each tier
 *  withholds options or adds its stores' in-flight bytes everywhere. */
AutoCheckpoint::Impl::Variants AutoCheckpoint::Impl::variants() const {
  Variants v;
  const size_t segments = step_model.segment_peak_bytes.size();
  for (const Placement& pl : placements()) {
    for (const Tier& t : tiers()) {
      plan::StepVariant x;
      x.options_offered = t.offered;
      if (t.margin != 0 || !pl.shift.empty()) {
        x.segment_shift_bytes.assign(segments, t.margin);
        for (size_t s = 0; s < pl.shift.size() && s < segments; ++s) x.segment_shift_bytes[s] += pl.shift[s];
      }
      x.time_ms = pl.ms;
      x.option_time_ms = t.option_ms;
      v.list.push_back(std::move(x));
      v.of.emplace_back(t, pl);
    }
  }
  return v;
}

/** The fastest plan whose predicted peak fits target. Plans that offload
 *  through a disk store must fit with the stores' in-flight bytes added
 *  (inflight_margin), so that bound holds whatever the disk's pace. The
 *  prediction leaves that margin out (explain() shows it apart). */
plan::StepPlan AutoCheckpoint::Impl::solve(int64_t target) {
  const plan::StepSolveOptions so{options.solver_time_limit_s()};
  const Variants v = variants();
  plan::StepPlan p;
  try {
    p = plan::solve_step_variants(step_model, v.list, target, so);
  } catch (const Error&) {
    throw Error(no_plan_fits(target));
  }
  adopt(v, &p);
  return p;
}

/** A plan of its variant as the plan in force counts it: the in-flight
 *  margin and the state writes left out of the prediction, the variant's
 *  caps, option times and state placement noted. */
void AutoCheckpoint::Impl::adopt(const Variants& v, plan::StepPlan* plan) {
  plan::StepPlan& p = *plan;
  const auto& [tier, pl] = v.of[static_cast<size_t>(p.variant)];
  p.prediction.peak_bytes -= tier.margin;
  for (int64_t& b : p.prediction.segment_bytes) b -= tier.margin;
  plan_margin = tier.margin;
  // NOTE [state writes in flight]: the prediction without them.
  plan_state_writes = 0;
  if (!pl.writes.empty() && !p.prediction.segment_bytes.empty()) {
    const int64_t bound = p.prediction.peak_bytes;
    int64_t peak = std::numeric_limits<int64_t>::min();
    for (size_t s = 0; s < p.prediction.segment_bytes.size(); ++s) {
      if (s < pl.writes.size()) p.prediction.segment_bytes[s] -= pl.writes[s];
      if (p.prediction.segment_bytes[s] > peak) {
        peak = p.prediction.segment_bytes[s];
        p.prediction.peak_segment = static_cast<int64_t>(s);
      }
    }
    p.prediction.peak_bytes = peak;
    plan_state_writes = std::max<int64_t>(0, bound - peak);
  }
  plan_caps = tier.caps;
  plan_option_ms = tier.option_ms;
  placement = pl;
}

/** A choice of the user's as a plan (apply_choice): under each variant
 *  that offers its options, the variant fastest within the budget (with
 *  its in-flight margin), else the one that peaks lowest. Throws
 *  remat::Error for a choice the nesting forbids. */
plan::StepPlan AutoCheckpoint::Impl::given(const std::vector<int>& choice) {
  const Variants v = variants();
  std::optional<plan::StepPlan> best;
  bool best_fits = false;
  for (size_t i = 0; i < v.list.size(); ++i) {
    bool offered = true;
    const std::vector<size_t>& n = v.list[i].options_offered;
    for (size_t j = 0; j < choice.size() && j < n.size(); ++j) {
      offered = offered && (n[j] == 0 || static_cast<size_t>(choice[j]) < n[j]);
    }
    if (!offered) continue;
    plan::StepPlan p;
    p.prediction = plan::simulate_step(plan::apply_variant(step_model, v.list[i]), choice);
    p.variant = static_cast<int64_t>(i);
    const bool fits = p.prediction.peak_bytes <= budget;
    if (!best || (fits && !best_fits) ||
        (fits == best_fits && (fits ? p.prediction.time_ms < best->prediction.time_ms
                                    : p.prediction.peak_bytes < best->prediction.peak_bytes))) {
      best = std::move(p);
      best_fits = fits;
    }
  }
  if (!best) {  // every variant withholds one of its options: never for a choice within the menus
    throw Error("[remat::auto] internal: no variant offers the given choice; please report it with explain().");
  }
  best->budget_bytes = budget;
  best->solver = detail::kGivenSolver;
  best->optimal = false;
  best->relative_gap = std::numeric_limits<double>::infinity();
  adopt(v, &*best);
  return *best;
}

/** The smallest peak a plan reaches, its in-flight margin included. */
AutoCheckpoint::Impl::Leanest AutoCheckpoint::Impl::leanest() const {
  const Variants v = variants();
  const plan::StepPlan lean =
      plan::min_peak_step_variants(step_model, v.list, plan::StepSolveOptions{options.solver_time_limit_s()});
  return Leanest{lean.prediction.peak_bytes, lean.prediction.peak_segment,
                 v.of[static_cast<size_t>(lean.variant)].first.margin, lean.optimal, lean.timed_out};
}

/** NOTE [plain time calibrated]: a predicted time is the plain step's
 *  time plus what the plan's options add. The profile runs in a process's
 *  first steps (the optimizer's state created, fresh pages touched, the
 *  isolated runs around it), which at the reference GPT size on a CPU took
 *  ~20% longer than the plain steps after them. A planned step implies a
 *  plain time (its own less what its plan adds) that is trusted when its
 *  plan sends nothing to a store (no offloading option, no optimizer state
 *  in a store: a transfer's excess is the repricing's, NOTE [offload
 *  priced by the step]) and adds at most 10% to the plain time (what the
 *  options add was measured in the same first steps; on a plan that adds
 *  little, their error is small beside the plain time's). A plan's first
 *  step is left out (it may pay for new allocations); the next two in a row
 *  set the plain time to their mean, and so does every step after with the
 *  one before it. Every plan carries the same plain time, so it moves no
 *  choice by itself; the predictions, explain() and the repricing's 10%
 *  test then measure against the steps the user runs. */
void AutoCheckpoint::Impl::calibrate_plain(double step_ms) {
  plan::StepPrediction& p = step_plan.prediction;
  bool sends = placement.state_bytes > 0;
  for (size_t j = 0; j < step_model.units.size() && j < p.choice.size() && !sends; ++j) {
    sends = store_of(j, static_cast<size_t>(p.choice[j])) >= 0;
  }
  const double added = p.time_ms - step_model.step_time_ms;
  const double implied = step_ms - added;
  const bool first = plain_plan_steps++ == 0;
  if (sends || first || added > 0.1 * step_model.step_time_ms || !(implied > 0)) {
    plain_last = -1;
    return;
  }
  if (plain_last > 0) {
    const double plain = 0.5 * (plain_last + implied);
    p.time_ms += plain - step_model.step_time_ms;
    step_model.step_time_ms = plain;
    ++plain_calibrations;
  }
  plain_last = implied;
}

/** NOTE [offload priced by the step]: an isolated run writes and reads
 *  one call's tensors through a warm page cache; a real step sends every
 *  offloaded unit's at once, and a disk (or a machine whose fresh pages
 *  are slow) can take far longer for that. When two planned steps in a
 *  row that offload run more than 10% over their predicted time, the
 *  second one's excess is charged to the offload options the plan uses,
 *  per byte they send (what
 *  keep would have kept less what the option keeps), on every call of
 *  every unit, and the plan is solved again: the step measures the transfer
 *  bandwidth that the isolated runs could not. One slow step charges
 *  nothing: a plan's first step starts its stores (writer threads, new
 *  files), and a charge from it priced offload out of every later plan,
 *  whose steps then sent nothing that could give it back. Two steps in a row that
 *  offload and run more than 10% under the prediction give the charge
 *  back, down to no surcharge at most (plan::TransferPrice has the rule,
 *  which CheckpointedSequential shares). The isolated runs' own prices
 *  (at each rung of in-flight bytes: NOTE [in flight planned]) are never
 *  lowered by it. Returns true when it repriced. */
bool AutoCheckpoint::Impl::reprice_offload(double step_ms) {
  const plan::StepPrediction& p = step_plan.prediction;
  if (options.offload().empty()) return false;
  const std::vector<size_t> mu = model_units();
  // Bytes option k of unit j sends per call: its inputs when it recomputes
  // (each storage once), else what keep would keep less what it keeps.
  auto sent_by = [&](size_t j, size_t ci, size_t k) -> double {
    const Unit& u = units[mu[j]];
    const plan::StepCall& c = step_model.units[j].calls[ci];
    if (!u.menu[u.offered[k]].switch_state) {
      return static_cast<double>(std::max<int64_t>(0, c.costs[0].kept_bytes - c.costs[k].kept_bytes));
    }
    return input_bytes_of[j][ci];
  };
  double sent = 0;                                          // bytes the plan's offloading calls send
  std::vector<bool> used(options.offload().size(), false);  // which of options.offload() the plan uses
  for (size_t j = 0; j < step_model.units.size(); ++j) {
    const size_t k = static_cast<size_t>(p.choice[j]);
    const int store = store_of(j, k);
    if (store < 0) continue;
    used[static_cast<size_t>(store)] = true;
    for (size_t ci = 0; ci < step_model.units[j].calls.size(); ++ci) sent += sent_by(j, ci, k);
  }
  // The smallest surcharge in force on a store in use: what a give-back
  // may take back at most.
  double room = std::numeric_limits<double>::infinity();
  for (size_t st = 0; st < used.size(); ++st) {
    if (used[st]) room = std::min(room, surcharge_ms_per_byte[st]);
  }
  const double per_byte = transfer_price.observe(step_ms, p.time_ms, sent, std::isfinite(room) ? room : 0.0);
  if (per_byte == 0) return false;
  for (size_t j = 0; j < step_model.units.size(); ++j) {
    plan::StepUnit& su = step_model.units[j];
    for (size_t k = 1; k < su.options.size(); ++k) {
      const int store = store_of(j, k);
      if (store < 0 || !used[static_cast<size_t>(store)]) continue;
      for (size_t ci = 0; ci < su.calls.size(); ++ci) su.calls[ci].costs[k].time_ms += per_byte * sent_by(j, ci, k);
    }
  }
  for (size_t s = 0; s < used.size(); ++s) {
    if (used[s]) surcharge_ms_per_byte[s] = std::max(0.0, surcharge_ms_per_byte[s] + per_byte);
  }
  offload_ms_per_gib = *std::max_element(surcharge_ms_per_byte.begin(), surcharge_ms_per_byte.end()) *
                       static_cast<double>(int64_t{1} << 30);
  ++reprices;
  return true;
}

}  // namespace remat
