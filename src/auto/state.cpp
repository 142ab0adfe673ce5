// The model's state in the whole-step plan (AutoOptions::optimizers and
// optimizer_state_store): each optimizer updates its parameters inside
// backward (remat::StepInBackward, made with the planner), and each of its
// param groups keeps its state or sends it to the store, as the plan says.
// Leaves out: placement per parameter (a param group is the unit), the loss
// head as a unit, repricing the store from planned steps' times.
//
// NOTE [model state in the plan]: every step the planner sees, the profiled
// one included, runs with the updates in backward, so the gradients it
// measures are the ones that live then. The profiled step keeps every
// state with its optimizer: its timeline holds every group's state at every
// point. A group whose state is in the store holds at most what the store
// has in flight: the states written but not yet on disk and those read
// ahead (the store's max_inflight_bytes, set to (read-ahead + 1) x the
// largest state of one parameter of the groups in the store), plus the
// state of the parameter being updated. So a placement lowers every point
// of the step by the same bytes, saved = the groups' state x what the store
// takes off (all of it on disk, half in bfloat16, none on the host from a
// CPU) - that margin, and costs the time to write the state and read it
// back once per step (measured on one parameter's state after the profiled
// step; no overlap with compute assumed). solve() asks the step model for
// the fastest plan under target + saved for every placement (every subset
// of the groups, up to 6 groups; else none or all) and keeps the fastest.
#include <algorithm>
#include <sstream>

#include <remat/error.h>
#include <remat/plan/error.h>

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
      return 1.0;  // lossless codecs: what the data compresses to is not known ahead
  }
  return 1.0;
}

OffloadOptions store_options(OffloadOptions o, int64_t largest) {
  o.min_bytes(0);  // every state tensor goes, or the saving would be less than counted
  o.prefetch_depth(0);
  o.max_inflight_bytes(std::max<int64_t>(1, (kStatePrefetch + 1) * largest));
  return o;
}

}  // namespace

void AutoCheckpoint::Impl::start_in_backward() {
  for (size_t k = 0; k < options.optimizers().size(); ++k) {
    torch::optim::Optimizer* o = options.optimizers()[k];
    if (o == nullptr) throw Error("[remat::auto] optimizers()[" + std::to_string(k) + "] is null.");
    in_backward.push_back(std::make_unique<StepInBackward>(*o));
  }
}

int64_t AutoCheckpoint::Impl::state_inflight_bytes(const std::vector<bool>& in_store) const {
  int64_t largest = 0;
  for (size_t g = 0; g < state_groups.size(); ++g) {
    if (in_store[g]) largest = std::max(largest, state_groups[g].largest);
  }
  return (kStatePrefetch + 2) * largest;
}

void AutoCheckpoint::Impl::measure_state() {
  state_groups.clear();
  state_ms_per_byte = 0;
  if (!options.optimizer_state_store()) return;
  for (size_t k = 0; k < in_backward.size(); ++k) {
    const auto bytes = in_backward[k]->state_bytes_per_group();
    const auto largest = in_backward[k]->largest_state_bytes_per_group();
    for (size_t g = 0; g < bytes.size(); ++g) {
      if (bytes[g] > 0) state_groups.push_back({k, g, bytes[g], largest[g]});
    }
  }
  if (state_groups.empty()) return;
  // The price: one parameter's state (the largest) written and read back
  // through a store like the plan's.
  const auto it = std::max_element(state_groups.begin(), state_groups.end(),
                                   [](const StateGroup& a, const StateGroup& b) { return a.largest < b.largest; });
  const int64_t bytes = it->largest;
  // Not random: drawing would move the generator the step's dropout uses.
  std::vector<at::Tensor> tensors{at::full({std::max<int64_t>(1, bytes / 4)}, 0.5, at::kFloat)};
  auto store = detail::OffloadStore::create_isolated(store_options(*options.optimizer_state_store(), it->largest));
  memory::DeviceTimer t0(mem->device());
  std::vector<detail::OffloadStore::Handle> handles;
  for (const auto& t : tensors) handles.push_back(store->pack(t));
  store->wait();
  for (auto& h : handles) (void)store->unpack(h);
  state_ms_per_byte = t0.elapsed_ms() / static_cast<double>(bytes);
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
      p.saved_bytes =
          static_cast<int64_t>((1.0 - share) * static_cast<double>(state)) - state_inflight_bytes(p.in_store);
      if (p.saved_bytes <= 0) return;  // the store would hold more than it takes off
    }
    out.push_back(std::move(p));
  };
  add(std::vector<bool>(n, false));
  if (n == 0) return out;
  if (n > kMaxEnumeratedGroups) {
    add(std::vector<bool>(n, true));
    return out;
  }
  for (uint64_t mask = 1; mask < (uint64_t{1} << n); ++mask) {
    std::vector<bool> in_store(n);
    for (size_t g = 0; g < n; ++g) in_store[g] = (mask >> g) & 1;
    add(std::move(in_store));
  }
  return out;
}

void AutoCheckpoint::Impl::apply_state() {
  std::vector<bool> want = placement.in_store;
  want.resize(state_groups.size(), false);
  if (want == state_in_force) return;
  int64_t largest = 0;
  for (size_t g = 0; g < state_groups.size(); ++g) {
    if (want[g]) largest = std::max(largest, state_groups[g].largest);
  }
  for (size_t k = 0; k < in_backward.size(); ++k) {
    torch::optim::Optimizer& opt = *options.optimizers()[k];
    std::vector<bool> groups(opt.param_groups().size(), false);
    bool any = false;
    for (size_t g = 0; g < state_groups.size(); ++g) {
      if (state_groups[g].opt == k && want[g]) groups[state_groups[g].group] = any = true;
    }
    // A new StepInBackward: the old one gives its state back first, and the
    // store's in-flight bound follows the groups it now takes.
    in_backward[k].reset();
    StepInBackwardOptions so;
    if (any) so.state_offload(store_options(*options.optimizer_state_store(), largest)).state_prefetch(kStatePrefetch);
    in_backward[k] = std::make_unique<StepInBackward>(opt, so);
    if (any) in_backward[k]->offload_groups(groups);
  }
  state_in_force = want;
}

std::string AutoCheckpoint::Impl::explain_state() const {
  if (in_backward.empty()) return "";
  std::ostringstream os;
  os << "model state: " << in_backward.size() << (in_backward.size() == 1 ? " optimizer" : " optimizers")
     << " updating each parameter inside backward (its gradient freed then)";
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
  if (placement.saved_bytes > 0) {
    os << "  the store takes " << plan::format_bytes(placement.saved_bytes) << " off every point of the step ("
       << plan::format_bytes(state_inflight_bytes(placement.in_store)) << " in flight counted) for +"
       << static_cast<double>(static_cast<int64_t>(placement.ms * 10 + 0.5)) / 10 << " ms per step ("
       << to_string(options.optimizer_state_store()->target()) << ", measured "
       << (state_ms_per_byte > 0 ? plan::format_bytes(static_cast<int64_t>(1.0 / (state_ms_per_byte * 1e-3))) : "?")
       << "/s written and read back)\n";
  }
  return os.str();
}

}  // namespace remat
