// The model's state in the whole-step plan (AutoOptions::optimizers and
// optimizer_state_store): each optimizer updates its parameters inside
// backward (remat::StepInBackward, made with the planner), and each of its
// param groups keeps its state or sends it to the store, as the plan says.
// Leaves out: placement per parameter (a param group is the unit).
//
// NOTE [model state in the plan]: every step the planner sees, the profiled
// one included, runs with the updates in backward, so the gradients it
// measures are the ones that live then. The profiled step keeps every
// state with its optimizer: its timeline holds every group's state at every
// point, and it notes when each parameter is updated (on_update), so each
// update has its segment. A group whose state is in the store holds, at a
// segment, only what its optimizer's store may have in flight then
// (state_inflight): the states written since the step began and not yet
// on disk plus the one read ahead, never more than the store's
// max_inflight_bytes (state_cap: (read-ahead + 1) x the second largest
// parameter's state; one larger entry goes alone), and the states of the
// parameters updated in that segment. The
// writes of one backward end with it (StepInBackward waits for them), so a
// forward holds only the state read ahead for the next backward's first
// update. So a placement shifts each segment by its own bytes: - the
// groups' state x what the store takes off (all of it on disk, half of
// float32 state in bfloat16, none on the host from a CPU) + what is in
// flight there; and costs the time to write the state and read it back
// once per step (NOTE [state priced by the step]). solve() asks the step solver for
// the fastest plan over every placement (every subset of the groups, up to
// 6 groups; else none or all) and every offload tier: plan::StepVariant.
//
// NOTE [state priced by the step]: the profile prices the store by one
// parameter's state written and read back with nothing else running, as
// if backward waited for every byte. In a planned step the writes go on
// behind the updates after them and the states read ahead arrive before
// their update, so backward waits for a part of it only
// (StepInBackwardStats::state_wait_ms: reads not back in time, a store at
// its cap, the writes drained as backward ends); but the store's threads
// share the disk and the cores with the compute and with the activations'
// stores, which slows the step by more than its waits (at the reference
// GPT with activations on disk too: waits of ~40 ms a step, steps 100-270
// ms over their predictions). So each planned step with state in the
// store, from its placement's second step on (the first sends every state
// and reads none back), prices the store at what the step took over its
// plan's prediction without the store, or what backward waited if that is
// more, per byte written and read back; the price is the mean of the last
// two steps' (of one placement), and when it is more than 1% of the plain
// step off the price the plan in force was solved with, the plan is solved
// again (an overrun or a plan that no longer fits leaves that to the next
// step). A step's noise (a few percent of a step on a shared machine)
// moves the price as much; the store is charged for it, not the units.

// NOTE [updates placed]: the updates run inside backward as each gradient
// is final, or all at the backward's end (StepInBackward::
// update_at_backward_end), as a variant of the plan with every state kept.
// The profiled step runs them inside backward and notes each one's window
// on its timeline and the gradient it freed; the variant's segments are
// the profiled samples with each window held at the level it began with
// (no temporaries there) and every gradient freed so far added back, and
// the segment where the last update ended also holds, after it, what the
// step held then plus every gradient plus the largest update's
// temporaries (the end's updates run one at a time, each freeing its
// gradient). It costs no time: the same updates run. Listed last, so a
// plan that is as fast either way keeps the updates inside backward, which
// holds less wherever the activations are not tiny.

// NOTE [state writes in flight]: of what a store holds in flight, the
// states read ahead and being updated are there whatever the disk's pace;
// the writes not yet on disk are there only while the disk is behind (a
// page cache takes a block's state in milliseconds, between updates tens of
// milliseconds apart). The plan must fit with them (the shift above), but
// its prediction leaves them out: they join the room it keeps in flight
// (inflight_bytes(), as an activation store's do), so that a step peaks
// between the prediction and the prediction plus that room.
#include <algorithm>
#include <sstream>

#include <remat/error.h>
#include <remat/plan/error.h>

#include "../optim/state_layout.h"
#include "internal.h"

namespace remat {

namespace {

/** Parameters whose state is read ahead of their update, in the store the
 *  planner makes. */
constexpr int64_t kStatePrefetch = 1;
constexpr size_t kMaxEnumeratedGroups = 6;

/** What share of a state the store keeps in this process's memory (1: no
 *  saving). */
double kept_share(const OffloadOptions& o, const c10::Device& device) {
  switch (o.target()) {
    case OffloadTarget::kDisk: return 0.0;
    case OffloadTarget::kHost: return device.is_cpu() ? 1.0 : 0.0;
    case OffloadTarget::kMemory:
      if (o.codec() == Codec::kBFloat16) return 0.5;
      if (o.codec() == Codec::kFloat8) return 0.25;
      if (o.codec() == Codec::kInt8Block) return 65.0 / 256;  // a byte per value and a float32 per 256
      return 1.0;  // lossless codecs: what the data compresses to is not known ahead
  }
  return 1.0;
}

/** What one optimizer's store may hold in flight (its max_inflight_bytes):
 *  (read-ahead + 1) parameters' states, each bounded by the second largest
 *  parameter's (its tensors, state_layout.h, times its bytes). The largest
 *  one (a GPT's tied embedding, four times a block's largest) goes alone: a
 *  store lets an entry past its cap when nothing else is in flight. So the
 *  blocks' updates hold two of their own states in flight, not two of the
 *  embedding's. Known before the state exists (the store is made with the
 *  planner). */
int64_t state_cap(const torch::optim::Optimizer& opt) {
  int64_t first = 0, second = 0;
  for (const auto& g : opt.param_groups()) {
    const int64_t n = g.has_options() ? detail::state_tensors_per_parameter(g.options()) : 3;
    for (const auto& p : g.params()) {
      const int64_t b = n * static_cast<int64_t>(p.nbytes());
      second = std::max(second, std::min(first, b));
      first = std::max(first, b);
    }
  }
  return std::max<int64_t>(1, (kStatePrefetch + 1) * (second > 0 ? second : first));
}

/** The most one entry of the store holds: the largest parameter's bytes
 *  (each state tensor is the size of its parameter). */
int64_t largest_entry(const torch::optim::Optimizer& opt) {
  int64_t b = 0;
  for (const auto& g : opt.param_groups()) {
    for (const auto& p : g.params()) b = std::max<int64_t>(b, static_cast<int64_t>(p.nbytes()));
  }
  return b;
}

/** The store of one optimizer: every state tensor goes (else the saving
 *  would be less than counted), read ahead by the StepInBackward, at most
 *  `cap` bytes in flight. */
OffloadOptions store_options(OffloadOptions o, int64_t cap) {
  o.min_bytes(0);
  o.prefetch_depth(0);
  o.max_inflight_bytes(cap);
  return o;
}

}  // namespace

void AutoCheckpoint::Impl::start_in_backward() {
  for (size_t k = 0; k < options.optimizers().size(); ++k) {
    torch::optim::Optimizer* o = options.optimizers()[k];
    if (o == nullptr) throw Error("[remat::auto] optimizers()[" + std::to_string(k) + "] is null.");
    // One StepInBackward per optimizer for the planner's life: a plan only
    // changes which groups send their state (accumulate()'s guards stay
    // valid through replans).
    StepInBackwardOptions so;
    if (options.zero_grad_set_to_none()) so.zero_grad_set_to_none(*options.zero_grad_set_to_none());
    if (options.optimizer_state_store()) {
      so.state_offload(store_options(*options.optimizer_state_store(), state_cap(*o))).state_prefetch(kStatePrefetch);
    }
    in_backward.push_back(std::make_unique<StepInBackward>(*o, so));
    if (options.optimizer_state_store())
      in_backward.back()->offload_groups(std::vector<bool>(o->param_groups().size()));
  }
}

void AutoCheckpoint::Impl::listen_to_updates(bool on) {
  // Only while the profiled step runs: planned steps' backward does no work for it.
  for (size_t k = 0; k < in_backward.size(); ++k) {
    in_backward[k]->on_update(
        on ? StepInBackward::UpdateListener([this, k](const StepInBackward::UpdateEvent& e) { note_update(k, e); })
           : StepInBackward::UpdateListener());
  }
}

void AutoCheckpoint::Impl::note_update(size_t opt, const StepInBackward::UpdateEvent& e) {
  if (timeline == nullptr || in_trial) return;  // only the profiled step's own updates
  const double end = timeline->now_us();
  std::lock_guard<std::mutex> lock(updates_mu);
  updates_trial.push_back({opt, e.group, e.state_bytes, end, end - 1000.0 * e.update_ms, e.param_bytes, 0});
}

AutoCheckpoint::Impl::StateInflight AutoCheckpoint::Impl::state_inflight(const std::vector<bool>& in_store) const {
  const size_t segments = step_model.segment_peak_bytes.size();
  StateInflight out{std::vector<int64_t>(segments, 0), std::vector<int64_t>(segments, 0)};
  if (segments == 0) return out;
  for (size_t k = 0; k < in_backward.size(); ++k) {
    // Which of optimizer k's groups send their state, and the most one of
    // their parameters has.
    std::vector<bool> sends(options.optimizers()[k]->param_groups().size(), false);
    std::vector<int64_t> state_of(sends.size(), 0), seen_of(sends.size(), 0);
    int64_t largest = 0;
    for (size_t g = 0; g < state_groups.size(); ++g) {
      if (state_groups[g].opt != k || !in_store[g]) continue;
      sends[state_groups[g].group] = true;
      state_of[state_groups[g].group] = state_groups[g].bytes;
      largest = std::max(largest, state_groups[g].largest);
    }
    if (largest == 0) continue;
    // An entry past the cap goes alone (state_cap).
    const int64_t cap = std::max(state_cap(*options.optimizers()[k]), largest_entry(*options.optimizers()[k]));
    std::vector<const StateUpdate*> seq;
    for (const StateUpdate& u : state_updates) {
      if (u.opt != k) continue;
      seq.push_back(&u);
      if (sends[u.group]) seen_of[u.group] += u.bytes;
    }
    // A parameter with state that the profiled step did not update (it may
    // be in a later one, at a point not known): the store's whole bound at
    // every point.
    bool all_seen = true;
    for (size_t g = 0; g < sends.size(); ++g) all_seen &= !sends[g] || seen_of[g] >= state_of[g];
    // A kMemory store encodes at pack and reads nothing ahead: only the
    // state being updated is out of it.
    const bool pending = options.optimizer_state_store()->target() != OffloadTarget::kMemory;
    if (!all_seen) {
      // The state being updated and one read ahead are there; the rest of
      // the cap is writes.
      for (size_t s = 0; s < segments; ++s) {
        out.held[s] += cap + largest;
        out.writes[s] += pending ? cap - std::min(cap, largest) : 0;
      }
      continue;
    }
    auto in = [&](const StateUpdate* u) { return sends[u->group] ? u->bytes : int64_t{0}; };
    std::vector<int64_t> written(segments, 0), ahead(segments, 0), in_use(segments, 0);
    for (const StateUpdate* u : seq) {
      const auto s = static_cast<size_t>(u->segment);
      written[s] += in(u);
      in_use[s] = std::max(in_use[s], in(u));
    }
    for (size_t s = 1; s < segments; ++s) written[s] += written[s - 1];
    // The state read ahead after each update (the next one's; after the
    // last, the first's, for the next backward), from that update's segment
    // to the next update's; before the first update, the first's.
    const size_t n = seq.size();
    for (size_t i = 0; i <= n && n > 0; ++i) {
      const StateUpdate* next = seq[i % n];
      const size_t from = i == 0 ? 0 : static_cast<size_t>(seq[i - 1]->segment);
      const size_t to = i < n ? static_cast<size_t>(next->segment) : segments - 1;
      for (size_t s = from; s <= to && s < segments; ++s) ahead[s] = std::max(ahead[s], in(next));
    }
    for (size_t s = 0; s < segments; ++s) {
      // The writes not yet on disk are there only while the disk is behind:
      // the plan's room in flight, not its prediction (NOTE [state writes
      // in flight]).
      const int64_t with_writes = pending ? std::min(cap, written[s] + ahead[s]) : 0;
      out.held[s] += with_writes + in_use[s];
      out.writes[s] += with_writes - (pending ? std::min(cap, ahead[s]) : 0);
    }
  }
  return out;
}

void AutoCheckpoint::Impl::measure_state() {
  state_groups.clear();
  {
    std::lock_guard<std::mutex> lock(updates_mu);
    state_updates = std::move(updates_trial);
    updates_trial.clear();
  }
  // Each update's segment: the one whose span holds its time.
  const auto last = static_cast<int64_t>(step_model.segment_peak_bytes.size()) - 1;
  for (StateUpdate& u : state_updates) {
    const auto at = std::upper_bound(points_us.begin(), points_us.end(), u.time_us) - points_us.begin() - 1;
    u.segment = std::clamp<int64_t>(at, 0, std::max<int64_t>(0, last));
  }
  if (!options.optimizer_state_store()) return;
  for (size_t k = 0; k < in_backward.size(); ++k) {
    const auto bytes = in_backward[k]->state_bytes_per_group();
    const auto largest = in_backward[k]->largest_state_bytes_per_group();
    const auto& groups = options.optimizers()[k]->param_groups();
    for (size_t g = 0; g < bytes.size(); ++g) {
      if (bytes[g] <= 0) continue;
      bool float32 = true;  // a lossy codec shrinks float32 state only
      for (const auto& p : groups[g].params()) float32 &= p.scalar_type() == at::kFloat;
      state_groups.push_back({k, g, bytes[g], largest[g], float32});
    }
  }
  if (state_groups.empty()) return;
  // The price: one parameter's state (the largest) written and read back
  // through a store like the plan's.
  const auto it = std::max_element(state_groups.begin(), state_groups.end(),
                                   [](const StateGroup& a, const StateGroup& b) { return a.largest < b.largest; });
  const int64_t bytes = it->largest;
  // Not random: drawing would move the generator the step's dropout uses.
  const at::Tensor probe = at::full({std::max<int64_t>(1, bytes / 4)}, 0.5, at::kFloat);
  auto store = detail::OffloadStore::create_isolated(
      store_options(*options.optimizer_state_store(), state_cap(*options.optimizers()[it->opt])));
  memory::DeviceTimer t0(mem->device());
  detail::OffloadStore::Handle h = store->pack(probe);
  store->wait();
  (void)store->unpack(h);
  // A price planned steps measured stays (NOTE [state priced by the step]).
  if (state_reprices == 0) state_ms_per_byte = t0.elapsed_ms() / static_cast<double>(bytes);
}

double AutoCheckpoint::Impl::state_waited_ms() const {
  double ms = 0;
  for (const auto& sib : in_backward) ms += sib->stats().state_wait_ms;
  return ms;
}

/** NOTE [state priced by the step]. Returns true when the plan in force
 *  should be solved again. */
bool AutoCheckpoint::Impl::reprice_state(double waited_ms, double step_ms) {
  if (placement.state_bytes <= 0 || state_groups.empty()) return false;
  if (state_steps++ == 0) return false;  // the placement's first step
  int64_t sent = 0;
  for (size_t g = 0; g < state_groups.size() && g < placement.in_store.size(); ++g) {
    if (placement.in_store[g]) sent += state_groups[g].bytes;
  }
  if (sent <= 0) return false;
  // What the step took over its plan's prediction without the store, or
  // what backward waited for it if that is more.
  const double over = step_ms - (step_plan.prediction.time_ms - placement.ms);
  const double observed = std::max({0.0, waited_ms, over}) / (2.0 * static_cast<double>(sent));
  const double price = state_last >= 0 ? 0.5 * (state_last + observed) : observed;
  state_last = observed;
  const double moved = std::abs(price - state_price_planned) * 2.0 * static_cast<double>(sent);
  state_ms_per_byte = price;
  ++state_reprices;
  return moved > 0.01 * step_model.step_time_ms;
}

std::vector<AutoCheckpoint::Impl::Placement> AutoCheckpoint::Impl::placements() const {
  const size_t n = state_groups.size();
  std::vector<Placement> out;
  auto add = [&](std::vector<bool> in_store) {
    Placement p;
    p.in_store = std::move(in_store);
    const double share =
        options.optimizer_state_store() ? kept_share(*options.optimizer_state_store(), mem->device()) : 1.0;
    int64_t state = 0;
    for (size_t g = 0; g < n; ++g) {
      if (!p.in_store[g]) continue;
      state += state_groups[g].bytes;
      p.ms += 2.0 * state_ms_per_byte * static_cast<double>(state_groups[g].bytes);
    }
    if (state > 0) {
      p.state_bytes = static_cast<int64_t>((1.0 - share) * static_cast<double>(state));
      StateInflight held = state_inflight(p.in_store);
      p.shift = std::move(held.held);
      p.writes = std::move(held.writes);
      bool saves = false;  // somewhere the store takes off more than it holds
      for (int64_t& b : p.shift) {
        b -= p.state_bytes;
        saves |= b < 0;
      }
      if (!saves) return;
    }
    out.push_back(std::move(p));
  };
  add(std::vector<bool>(n, false));
  if (n > kMaxEnumeratedGroups) {
    add(std::vector<bool>(n, true));
  } else if (n > 0) {
    for (uint64_t mask = 1; mask < (uint64_t{1} << n); ++mask) {
      std::vector<bool> in_store(n);
      for (size_t g = 0; g < n; ++g) in_store[g] = (mask >> g) & 1;
      add(std::move(in_store));
    }
  }
  // Last: among equally fast plans the updates stay inside backward.
  if (!in_backward.empty() && !state_updates.empty() && !step_model.segment_peak_bytes.empty()) {
    out.push_back(at_end_placement());
  }
  return out;
}

/** NOTE [updates placed]. */
AutoCheckpoint::Impl::Placement AutoCheckpoint::Impl::at_end_placement() const {
  Placement pl;
  pl.in_store.assign(state_groups.size(), false);
  pl.at_end = true;
  const size_t segments = step_model.segment_peak_bytes.size();
  std::vector<const StateUpdate*> ups;
  for (const StateUpdate& u : state_updates) ups.push_back(&u);
  std::stable_sort(ups.begin(), ups.end(),
                   [](const StateUpdate* a, const StateUpdate* b) { return a->begin_us < b->begin_us; });
  // Per segment, its peak as profiled (as build_model reads the samples)
  // and with the updates at the end.
  std::vector<int64_t> on(segments, 0), off(segments, 0);
  int64_t level = profile_start_bytes, level_off = profile_start_bytes;
  int64_t done = 0;                         // gradients the updates ended so far freed
  int64_t base = -1;                        // the level as the update under way began (-1: none seen yet)
  int64_t window_peak = 0;                  // the most its window held
  int64_t temps = 0;                        // the most one update held above its start
  int64_t end_level = profile_start_bytes;  // the level as the last update ended
  size_t next = 0;                          // the first update not ended
  auto close = [&] {
    if (base < 0) base = level;  // no sample in its window
    temps = std::max(temps, window_peak - base);
    done += ups[next]->grad_bytes;
    end_level = level;
    base = -1;
    window_peak = 0;
    ++next;
  };
  size_t k = 0;
  for (size_t s = 0; s < segments; ++s) {
    int64_t peak = level, peak_off = level_off;
    while (k < samples.size() && samples[k].time_us < points_us[s + 1]) {
      const memory::Sample& x = samples[k];
      while (next < ups.size() && x.time_us >= ups[next]->time_us) close();
      int64_t v_off = x.bytes + done;
      if (next < ups.size() && x.time_us >= ups[next]->begin_us) {  // inside an update: what it began with
        if (base < 0) base = level;
        window_peak = std::max(window_peak, x.bytes);
        v_off = base + done;
      }
      if (x.time_us >= points_us[s]) {
        peak = std::max(peak, x.bytes);
        peak_off = std::max(peak_off, v_off);
      }
      level = x.bytes;
      level_off = v_off;
      ++k;
    }
    on[s] = peak;
    off[s] = peak_off;
  }
  while (next < ups.size()) close();
  // The updates at the backward's end: every gradient, and one update's
  // temporaries at a time, over what the step held as the last one ended;
  // in the segment after every unit's backward (no option of a unit moves
  // what lives then).
  double last_end = ups.empty() ? points_us.back() : ups.back()->time_us;
  for (const auto& c : calls) last_end = std::max(last_end, c->backward_end_us);
  const auto at = std::upper_bound(points_us.begin(), points_us.end(), last_end) - points_us.begin() - 1;
  const auto s_end = static_cast<size_t>(std::clamp<int64_t>(at, 0, static_cast<int64_t>(segments) - 1));
  off[s_end] = std::max(off[s_end], end_level + done + temps);
  pl.shift.resize(segments);
  for (size_t s = 0; s < segments; ++s) pl.shift[s] = off[s] - on[s];
  return pl;
}

void AutoCheckpoint::Impl::apply_state() {
  for (auto& sib : in_backward) sib->update_at_backward_end(placement.at_end);  // NOTE [updates placed]
  std::vector<bool> want = placement.in_store;
  want.resize(state_groups.size(), false);
  if (!options.optimizer_state_store() || want == state_in_force) return;
  for (size_t k = 0; k < in_backward.size(); ++k) {
    std::vector<bool> groups(options.optimizers()[k]->param_groups().size(), false);
    for (size_t g = 0; g < state_groups.size(); ++g) {
      if (state_groups[g].opt == k && want[g]) groups[state_groups[g].group] = true;
    }
    in_backward[k]->offload_groups(groups);  // a group that goes sends its state now
  }
  state_in_force = want;
  state_steps = 0;
  state_last = -1;  // a new placement's price starts from its own steps
}

std::string AutoCheckpoint::Impl::explain_state() const {
  if (in_backward.empty()) return "";
  std::ostringstream os;
  os << "model state: " << in_backward.size() << (in_backward.size() == 1 ? " optimizer" : " optimizers");
  // NOTE [updates placed]: the plan's own options under the other place
  // of the updates (every state kept there), as predicted.
  const std::vector<int>& choice = step_plan.prediction.choice;
  auto peak_with = [&](const Placement& pl) {
    plan::StepVariant x;
    x.segment_shift_bytes = pl.shift;
    return plan::simulate_step(plan::apply_variant(step_model, x), choice).peak_bytes;
  };
  const bool other =
      !state_updates.empty() && !step_model.segment_peak_bytes.empty() && choice.size() == step_model.units.size();
  // Both with every state kept: a store's saving is not the updates' place.
  auto compared = [&](const Placement& alt, const Placement& here, const char* where) {
    const int64_t d = peak_with(alt) - peak_with(here);
    os << "; " << where << ", this plan's options would peak " << plan::format_bytes(std::abs(d))
       << (d >= 0 ? " higher" : " lower");
  };
  if (placement.at_end) {
    os << " updating every parameter at the end of backward, one after another (each gradient freed then)";
    if (other) {
      compared(Placement{}, placement, "updating inside backward, the updates' temporaries meet the activations");
    }
  } else {
    os << " updating each parameter inside backward (its gradient freed then)";
    if (other) {
      compared(at_end_placement(), Placement{},
               placement.state_bytes > 0
                   ? "with every state kept, updating at the end of backward, every gradient lives until then"
                   : "updating at the end of backward, every gradient lives until then");
    }
  }
  if (!options.optimizer_state_store()) {
    os << "; state kept with the optimizer (no optimizer_state_store)\n";
    return os.str();
  }
  if (state_groups.empty()) {
    os << "; no optimizer state yet\n";
    return os.str();
  }
  os << "\n";
  for (size_t g = 0; g < state_groups.size(); ++g) {
    const StateGroup& s = state_groups[g];
    const bool in = g < placement.in_store.size() && placement.in_store[g];
    os << "  optimizer " << s.opt << " group " << s.group << ": " << plan::format_bytes(s.bytes) << " of state "
       << (in ? "in the store" : "kept") << "\n";
  }
  const int64_t at = step_plan.prediction.peak_segment;
  if (placement.state_bytes > 0 && at >= 0 && static_cast<size_t>(at) < placement.shift.size()) {
    const int64_t writes =
        static_cast<size_t>(at) < placement.writes.size() ? placement.writes[static_cast<size_t>(at)] : 0;
    const int64_t held = placement.shift[static_cast<size_t>(at)] + placement.state_bytes - writes;
    os << "  the store takes " << plan::format_bytes(placement.state_bytes) << " off every point of the step, less "
       << plan::format_bytes(held) << " read ahead or being updated where the plan peaks (and up to "
       << plan::format_bytes(writes) << " being written, in the room kept in flight), for +"
       << static_cast<double>(static_cast<int64_t>(placement.ms * 10 + 0.5)) / 10 << " ms per step ("
       << to_string(options.optimizer_state_store()->target());
    if (state_reprices > 0) {
      os << ", priced by its last planned steps (" << state_reprices << " so far; the last one's backward waited "
         << static_cast<double>(static_cast<int64_t>(state_wait_last_ms * 10 + 0.5)) / 10 << " ms for it): "
         << static_cast<double>(static_cast<int64_t>(state_ms_per_byte * double(int64_t{1} << 30) * 2 + 0.5))
         << " ms per GiB of state)\n";
    } else {
      os << ", measured "
         << (state_ms_per_byte > 0 ? plan::format_bytes(static_cast<int64_t>(1.0 / (state_ms_per_byte * 1e-3))) : "?")
         << "/s written and read back, until planned steps measure what it costs them)\n";
    }
  }
  return os.str();
}

}  // namespace remat
