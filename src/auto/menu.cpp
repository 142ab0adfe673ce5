// Each unit's menu (the second stage of the whole-step planner): the
// options a unit offers (keep, recompute, nested recompute, selective
// levels, the user's policies, offload; a chain's schedules) and what each
// costs, measured by running the call again in isolation under each
// option: forward peak, bytes kept, backward peak, time, and which inputs
// and outputs it holds. Leaves out when those runs happen (profiled_step.cpp,
// at each call of the profiled step) and how the costs become a step model
// (step_model.cpp).
//
// NOTE [isolated runs write nothing]: a unit's forward may write state it
// does not own: a BatchNorm its model holds and its forward calls (a block
// normalising with `owner->bn`), a user's counter tensor. Its own buffers
// are not enough to put back. Each isolated run runs under the write guard
// that recomputes use (NOTE [recompute side effects], core/write_guard.h):
// every op is intercepted, and a tensor the run did not make is copied
// before its first write and written back when the run ends, wherever its
// module sits. The copies are made inside the run, so they count in its
// bytes (a BatchNorm's statistics: 2 x channels floats), never under.
#include "internal.h"

#include <ATen/Context.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <string>
#include <unordered_map>

#include <remat/checkpoint.h>
#include <remat/error.h>
#include <remat/hooks.h>
#include <remat/policy.h>

#include "../chain/grad_edges.h"
#include "../core/dispatch.h"
#include "../core/node_ptr.h"
#include "../core/replay.h"
#include "../core/write_guard.h"
#include "../region/levels.h"

namespace remat {

using detail::Clock;
using detail::Held;
using detail::kTop;
using detail::ms_since;

namespace detail {

/** Per input, then per output of an isolated run: held by something besides
 *  the run's own references (NOTE [inputs an option keeps]), and bytes. */
struct Held {
  std::vector<char> held;
  std::vector<int64_t> bytes;
};

}  // namespace detail

namespace {

/** Schedules a chain unit offers besides store-all: its optimal schedule at
 *  this many budgets from its leanest feasible peak up (duplicates dropped). */
constexpr int kChainBudgets = 6;

/** While alive, an isolated run: puts back the CPU RNG when destroyed, and
 *  every tensor that existed before it and that an op wrote meanwhile
 *  (NOTE [isolated runs write nothing]). */
class Restore {
 public:
  Restore() : gen_(at::detail::getDefaultCPUGenerator()) {
    {
      std::lock_guard<std::mutex> lock(gen_.mutex());
      state_ = gen_.get_state();
    }
    scope_.emplace(interceptor_.get());
  }
  ~Restore() {
    scope_.reset();  // the copies go back uninterrupted, and after every inner scope
    guard_.restore();
    std::lock_guard<std::mutex> lock(gen_.mutex());
    gen_.set_state(state_);
  }
  Restore(const Restore&) = delete;
  Restore& operator=(const Restore&) = delete;

 private:
  at::Generator gen_;
  at::Tensor state_;
  detail::WriteGuard guard_;
  std::unique_ptr<dispatch::Interceptor> interceptor_ = detail::make_write_guard_interceptor(&guard_);
  std::optional<dispatch::Scope> scope_;
};

/** Inputs for an isolated run: clones (in-place ops on them touch nothing),
 *  with the leaves gradients are taken for. */
struct TrialInputs {
  std::vector<at::Tensor> leaves;  // requires grad, one per input that did
  std::vector<at::Tensor> in;      // what the unit sees
};
TrialInputs trial_inputs(const std::vector<at::Tensor>& inputs) {
  TrialInputs t;
  for (const auto& x : inputs) {
    if (!x.defined()) {
      t.in.push_back(x);
      continue;
    }
    at::Tensor c = x.detach().clone();
    if (x.requires_grad()) {
      c.requires_grad_(true);
      t.leaves.push_back(c);
      at::AutoGradMode on(true);
      t.in.push_back(c.clone());  // not a leaf: in-place ops on it are allowed
    } else {
      t.in.push_back(c);
    }
  }
  return t;
}

/** Which of a run's inputs and outputs are held elsewhere: through one of
 *  these tensors (autograd saves an input as the tensor itself; a policy
 *  keeps an op's output), through another tensor on the same storage (a
 *  detached alias, a view), or through a view's base. A tensor whose
 *  references cannot be told apart reads as held (over-counted, never
 *  under). */
Held held_elsewhere(const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& out) {
  struct Ours {
    std::unordered_map<const c10::TensorImpl*, std::pair<size_t, at::Tensor>> tensors;  // with expected refs
    at::Storage storage;
  };
  std::unordered_map<const c10::StorageImpl*, Ours> ours;
  auto note = [&](const at::Tensor& x) {  // one expected reference to x
    Ours& o = ours[x.storage().unsafeGetStorageImpl()];
    auto& [refs, tensor] = o.tensors[x.unsafeGetTensorImpl()];
    ++refs;
    tensor = x;
    o.storage = x.storage();
  };
  std::vector<const c10::TensorImpl*> views;  // distinct views: each holds its base once
  std::vector<const c10::TensorImpl*> no_base;
  for (const auto* v : {&in, &out}) {
    for (const auto& x : *v) {
      if (!x.defined() || !x.has_storage()) continue;
      note(x);
      if (!x.is_view()) continue;
      if (std::find(views.begin(), views.end(), x.unsafeGetTensorImpl()) != views.end()) continue;
      views.push_back(x.unsafeGetTensorImpl());
      try {
        note(at::Tensor(x._base()));  // a view (an output reshaped from a matmul's) holds its base
      } catch (const c10::Error&) {
        no_base.push_back(x.unsafeGetTensorImpl());
      }
    }
  }
  auto held = [&](const at::Tensor& x) -> bool {
    if (!x.defined()) return false;
    if (!x.has_storage()) return true;
    const Ours& o = ours.at(x.storage().unsafeGetStorageImpl());
    if (o.storage.use_count() > o.tensors.size() + 1) return true;  // use_count counts the copies here too
    for (const auto& [ti, rt] : o.tensors) {
      if (static_cast<size_t>(rt.second.use_count()) > rt.first + 1) return true;
    }
    return std::find(no_base.begin(), no_base.end(), x.unsafeGetTensorImpl()) != no_base.end();
  };
  Held h;
  for (const auto* v : {&in, &out}) {
    for (const auto& x : *v) {
      h.held.push_back(held(x) ? 1 : 0);
      h.bytes.push_back(x.defined() && x.has_storage() ? static_cast<int64_t>(x.storage().nbytes()) : 0);
    }
  }
  return h;
}

}  // namespace

/** Builds u's menu at its first call (the selective levels from this
 *  call's residuals and op times), then measures every option. */
void AutoCheckpoint::Impl::measure(Unit& u, const std::vector<at::Tensor>& inputs, const RunOption& run,
                                   const detail::ChainMenu* menu, CallRecord& rec) {
  if (u.menu.empty()) {
    if (menu != nullptr) {
      build_chain_menu(u, *menu);
    } else if (!u.kind.empty()) {
      build_chunk_menu(u);
    } else {
      build_menu(u, inputs, run);
    }
  }
  // One untimed run first (a call's first run pays for cold caches), then
  // the options in turn, `profile_repeats` times: bytes are exact from the
  // first run, the time is the fastest run's; taking the options in turn
  // spreads any drift of the machine over all of them.
  bool has_backward = true;
  Held retained;
  measure_one(u, inputs, run, Option{}, &has_backward, &retained);
  rec.costs.assign(u.menu.size(), plan::StepCost{});
  rec.transfers.assign(u.menu.size(), plan::TransferRun{});
  std::vector<Held> io_kept(u.menu.size());
  for (int r = 0; r < options.profile_repeats(); ++r) {
    for (size_t k = 0; k < u.menu.size(); ++k) {
      plan::StepCost cost;
      plan::TransferRun transfer;
      try {
        cost = measure_one(u, inputs, run, u.menu[k], &has_backward, &retained, &transfer);
      } catch (const Error&) {
        // A chain called with another shape than its first call's, whose
        // schedules name stage options this call's chain lacks: it keeps.
        if (u.chain == nullptr || k == 0) throw;
        u.plannable = false;
      }
      if (r == 0) {
        rec.costs[k] = cost;
        io_kept[k] = retained;
        rec.transfers[k] = transfer;
      } else if (cost.time_ms < rec.costs[k].time_ms) {
        rec.costs[k].time_ms = cost.time_ms;
        rec.transfers[k] = transfer;  // the time's own run
      }
    }
  }
  // NOTE [no option runs faster than keep]: every option of a module or a
  // chain runs keep's forward and backward and more (a recompute, a
  // transfer). A run measured faster than keep is the machine's noise,
  // which made the whole budget's fastest plan offload (an option at -7 ms
  // on a 3 ms call) or keep room in flight for nothing: priced at keep's
  // time and a nanosecond, so that keep wins where both fit. A chunked
  // call's counts run other kernels and may be faster: as measured.
  if (u.kind.empty()) {
    for (size_t k = 1; k < rec.costs.size(); ++k) {
      rec.costs[k].time_ms = std::max(rec.costs[k].time_ms, rec.costs[0].time_ms + 1e-6);
    }
  }
  // NOTE [inputs an option keeps]: the costs count the call's inputs and
  // outputs as held by its caller. An option that keeps more of them than
  // keep does (a checkpoint keeps its inputs for the recompute, where
  // keep under autocast saves only their low-precision copies; a
  // selective policy keeps an output that keep does not save) is charged
  // the difference until its backward: the caller may let them go after
  // the forward. An option that keeps less is not credited (the caller
  // may hold them).
  // NOTE [released inputs]: which inputs each option lets go where keep holds them.
  rec.lets_go.assign(u.menu.size(), std::vector<char>(inputs.size(), 0));
  for (size_t k = 1; k < u.menu.size(); ++k) {
    for (size_t s = 0; s < inputs.size() && s < io_kept[k].held.size() && s < io_kept[0].held.size(); ++s) {
      rec.lets_go[k][s] = io_kept[0].held[s] && !io_kept[k].held[s] ? 1 : 0;
    }
  }
  // NOTE [inputs two calls hold]: and which outputs.
  const size_t outs = io_kept[0].held.size() > inputs.size() ? io_kept[0].held.size() - inputs.size() : 0;
  rec.out_lets_go.assign(u.menu.size(), std::vector<char>(outs, 0));
  for (size_t k = 1; k < u.menu.size(); ++k) {
    for (size_t o = 0; o < outs && inputs.size() + o < io_kept[k].held.size(); ++o) {
      rec.out_lets_go[k][o] = io_kept[0].held[inputs.size() + o] && !io_kept[k].held[inputs.size() + o] ? 1 : 0;
    }
  }
  for (size_t k = 1; k < u.menu.size(); ++k) {
    // Per input and output, so that keeping one does not offset letting
    // another go; an input is charged its whole storage (a view's base).
    int64_t extra = 0;
    std::vector<const c10::StorageImpl*> charged;
    const Held& h = io_kept[k];
    const Held& h0 = io_kept[0];
    for (size_t s = 0; s < h.held.size() && s < h0.held.size(); ++s) {
      if (!h.held[s] || h0.held[s]) continue;
      if (s < inputs.size()) {
        const at::Tensor& x = inputs[s];
        if (!x.defined() || !x.has_storage()) continue;
        const c10::StorageImpl* st = x.storage().unsafeGetStorageImpl();
        if (std::find(charged.begin(), charged.end(), st) != charged.end()) continue;
        charged.push_back(st);
        extra += static_cast<int64_t>(st->nbytes());
      } else {
        extra += h.bytes[s];
      }
    }
    rec.costs[k].kept_bytes += extra;
    rec.costs[k].backward_peak_bytes += extra;
  }
  if (!has_backward) u.plannable = false;
}

/** A chain's menu: store-all as keep, then its own planner's schedules. */
void AutoCheckpoint::Impl::build_chain_menu(Unit& u, const detail::ChainMenu& menu) {
  for (detail::ChainOption& o : menu(kChainBudgets)) {
    if (!u.menu.empty() && !options.recompute()) break;  // its other schedules run stages again
    Option opt;
    opt.name = u.menu.empty() ? "keep" : o.name;
    if (!u.menu.empty()) opt.schedule = std::move(o.schedule);
    u.menu.push_back(std::move(opt));
  }
  u.plannable = u.menu.size() > 1;
}

void AutoCheckpoint::Impl::build_menu(Unit& u, const std::vector<at::Tensor>& inputs, const RunOption& run) {
  u.menu.push_back({"keep", std::nullopt, std::nullopt});
  const CheckpointOptions& base = options.checkpoint_options();
  if (!options.recompute()) {  // keep, or offload what it saves
    for (size_t i = 0; i < options.offload().size(); ++i) {
      Option o(detail::offload_name(options.offload()[i]), std::nullopt, options.offload()[i]);
      o.store = static_cast<int>(i);
      u.menu.push_back(std::move(o));
    }
    u.plannable = u.menu.size() > 1;
    return;
  }
  u.menu.push_back({"recompute", base, std::nullopt});
  if (options.inner_units() && !u.inner.empty())
    u.menu.push_back({"recompute, inner units too", base, std::nullopt, true});
  u.plannable = true;
  if (options.selective_levels() > 0) {
    // One run under an op timer: every op call's signature, output bytes and time.
    Restore restore;
    TrialInputs t = trial_inputs(inputs);
    detail::OpTimer timer;
    {
      dispatch::Scope scope(&timer);
      std::vector<at::Tensor> out = run(Option{}, t.in);
    }
    for (const Policy& level : detail::level_policies(timer.items(), options.selective_levels())) {
      CheckpointOptions o = base;
      o.policy(base.policy() ? policy::any_of({*base.policy(), level}) : level);
      u.menu.push_back({level.description(), o, std::nullopt});
    }
  }
  for (const Policy& p : options.policies()) {
    CheckpointOptions o = base;
    o.policy(base.policy() ? policy::any_of({*base.policy(), p}) : p);
    u.menu.push_back({p.description(), o, std::nullopt});
  }
  // Options that send to a store end the menu, those sending only inputs
  // first (the margin tiers of solve() drop them from the end).
  // Recompute with the inputs sent to the store: what it keeps is what
  // recompute keeps less its inputs, which it lets go once the caller
  // does (NOTE [released inputs]). Not for a unit inside another: a
  // region nested in another sends nothing (its inputs are the outer's).
  for (size_t i = 0; i < options.offload().size() && u.parent == kTop; ++i) {
    CheckpointOptions co = base;
    co.offload(options.offload()[i]);
    const std::string where = detail::offload_name(options.offload()[i]).substr(std::string("offload ").size());
    Option o("recompute, inputs to " + where, co, std::nullopt);
    o.store = static_cast<int>(i);
    u.menu.push_back(std::move(o));
  }
  for (size_t i = 0; i < options.offload().size(); ++i) {
    Option o(detail::offload_name(options.offload()[i]), std::nullopt, options.offload()[i]);
    o.store = static_cast<int>(i);
    u.menu.push_back(std::move(o));
  }
}

// NOTE [compressed bytes vary]: a lossless codec stores a tensor in as many
// bytes as its values compress to. The isolated runs see the profiled
// step's batch; another batch can compress worse (test_auto's blocks with
// mostly-zero inputs: the zeros of a threshold move with the data, and a
// planned step held 24% more in its lz4 store than the profiled one, 1.2%
// over the budget). Options that keep bytes in a compressing store are
// charged AutoOptions::compression_margin more of what they kept, from
// their forward to their backward's end.

/** One isolated run of a call under option `opt`: forward, then backward
 *  by autograd::grad. An offload option runs with one tensor in flight at
 *  a time (trial_store), so that its bytes do not depend on the disk's
 *  pace; its time includes its waits for the store, which `transfer`
 *  notes with the store's busy time, so that each rung of in-flight bytes
 *  prices them again (NOTE [in flight planned]); what the real store holds
 *  in flight is the margin of solve(). */
plan::StepCost AutoCheckpoint::Impl::measure_one(Unit& u, const std::vector<at::Tensor>& inputs, const RunOption& run,
                                                 const Option& opt, bool* has_backward, Held* io_kept,
                                                 plan::TransferRun* transfer) {
  Restore restore;
  TrialInputs t = trial_inputs(inputs);
  std::vector<at::Tensor> wrt = t.leaves;
  // A chunked call's fn may use any of the model's parameters (an MLP's
  // weights; NOTE [chunked calls as units]): their gradients are part of its backward.
  for (const auto& p : u.module != nullptr ? u.module->parameters() : model.parameters()) {
    if (p.requires_grad()) wrt.push_back(p);
  }
  struct InnerOn {  // the inner units checkpointed for this run (nested recompute)
    Impl& impl;
    const std::vector<size_t>* inner = nullptr;
    ~InnerOn() {
      if (inner == nullptr) return;
      for (size_t i : *inner) impl.units[i].c->set_checkpointing(std::nullopt);
    }
  } inner_on{*this};
  if (opt.inner) {
    inner_on.inner = &u.inner;
    for (size_t i : u.inner) units[i].c->set_checkpointing(options.checkpoint_options());
  }
  plan::StepCost cost;
  // A plain offload option saves to a store of its own, whose counters
  // say what it held in flight (NOTE [offload margin measured]).
  std::shared_ptr<detail::OffloadStore> own_store;
  if (opt.offload && !is_recomputing()) own_store = detail::OffloadStore::create(trial_store(*opt.offload));
  // The disk store the run's transfers go through, and its counters before
  // it (NOTE [in flight planned]): the option's own, or the shared one that
  // a recompute with its inputs sent uses.
  std::shared_ptr<detail::OffloadStore> disk;
  if (opt.store >= 0 && options.offload()[static_cast<size_t>(opt.store)].target() == OffloadTarget::kDisk) {
    if (own_store) {
      disk = own_store;
    } else if (opt.switch_state && opt.switch_state->offload() && !is_recomputing()) {
      disk = detail::OffloadStore::shared(trial_store(*opt.switch_state->offload()));
    }
  }
  const OffloadStats disk_before = disk ? disk->stats() : OffloadStats{};
  detail::forget_rng_captures();  // a capture here is counted, not shared with the previous run's
  memory::Probe probe(mem->device());
  memory::DeviceTimer t0(mem->device());
  std::vector<at::Tensor> out;
  const bool sends = opt.offload || (opt.switch_state && opt.switch_state->offload());
  {
    std::optional<ScopedHooks> to_store;
    if (own_store) to_store.emplace(detail::make_offload_hooks(own_store));
    if (opt.switch_state && opt.switch_state->offload()) {
      Option trial = opt;
      trial.switch_state->offload(trial_store(*opt.switch_state->offload()));
      out = run(trial, t.in);
    } else {
      out = run(opt, t.in);
    }
  }
  const double before_wait_ms = t0.elapsed_ms();
  if (own_store) own_store->wait();
  if (sends) wait_checkpoint_offloads();
  double ms = t0.elapsed_ms();
  const double forward_ms = ms, end_wait_ms = ms - before_wait_ms;
  cost.kept_bytes = std::max<int64_t>(0, probe.delta_bytes());
  cost.forward_peak_bytes = probe.peak_bytes();
  // What a compressing store holds depends on the batch (NOTE
  // [compressed bytes vary]): charged with a margin from its forward on.
  const OffloadOptions* store = opt.offload                                       ? &*opt.offload
                                : opt.switch_state && opt.switch_state->offload() ? &*opt.switch_state->offload()
                                                                                  : nullptr;
  int64_t codec_extra = 0;
  if (store != nullptr && store->codec() != Codec::kNone && store->target() != OffloadTarget::kDisk) {
    codec_extra = static_cast<int64_t>(options.compression_margin() * static_cast<double>(cost.kept_bytes));
    cost.kept_bytes += codec_extra;
    cost.forward_peak_bytes += codec_extra;
  }
  // What the call holds of its inputs and outputs besides the references
  // here (NOTE [inputs an option keeps]).
  *io_kept = held_elsewhere(t.in, out);
  std::vector<at::Tensor> roots, seeds;
  for (const auto& o : out) {
    if (o.defined() && o.requires_grad()) {
      roots.push_back(o);
      seeds.push_back(at::ones_like(o));
    }
  }
  // What the store took and the waits for it, once the run is done.
  auto note_transfer = [&](double backward_ms) {
    if (transfer == nullptr) return;
    *transfer = plan::TransferRun{};
    if (!disk) return;
    const OffloadStats now = disk->stats();
    plan::TransferRun& r = *transfer;
    // Bytes as the cap counts them: the tensors before any encoding, what
    // it sent once and read back once. The busy time of several writer
    // threads is the disk's for one of them.
    const int64_t raw = now.bytes_raw - disk_before.bytes_raw;
    const double writers = static_cast<double>(std::max(1, disk->options().writer_threads()));
    r.forward_ms = forward_ms;
    r.write_wait_ms = std::min(forward_ms, now.write_stall_ms - disk_before.write_stall_ms + end_wait_ms);
    r.write_ms = (now.write_ms - disk_before.write_ms) / writers;
    r.written_bytes = now.bytes_written > disk_before.bytes_written ? raw : 0;
    r.backward_ms = backward_ms;
    r.read_wait_ms = std::min(backward_ms, now.read_stall_ms - disk_before.read_stall_ms);
    r.read_ms = now.read_ms - disk_before.read_ms;
    r.read_bytes = now.bytes_read > disk_before.bytes_read ? raw : 0;
    r.largest_bytes = std::min(raw, now.peak_inflight_bytes);  // one tensor at a time in the run
  };
  if (roots.empty() || wrt.empty()) {
    *has_backward = false;
    cost.backward_peak_bytes = cost.kept_bytes;
    cost.time_ms = ms;
    note_inflight(opt, own_store);
    note_transfer(0);
    return cost;
  }
  const int64_t at_backward = probe.delta_bytes();
  {
    memory::Probe backward(mem->device());
    t0.restart();
    // NOTE [the output's gradient as in the step]: the seeds go in
    // through a node that lets go of each once handed on, so it is freed
    // where its last use in the unit's backward is done, as the gradient a
    // real step passes in. Held here to the end, it counted at the end of
    // every option's backward: keep's peak there (its saved tensors gone,
    // its input's gradient made) came out one output above the step's, and
    // an option that peaks early (a selective level recomputing as its
    // backward starts) was predicted that much low.
    // As torch::autograd::grad with allow_unused: the roots' edges first
    // (an output that is an input leaf gets its accumulator), then wrt's.
    for (const at::Tensor& r : roots) (void)torch::autograd::impl::gradient_edge(r);
    torch::autograd::edge_list to;
    for (const at::Tensor& w : wrt) {
      if (w.grad_fn()) {
        to.push_back(torch::autograd::impl::gradient_edge(w));
      } else if (auto acc = torch::autograd::impl::try_get_grad_accumulator(w)) {
        to.emplace_back(std::move(acc), 0);
      } else {  // not in the graph: an edge the backward never reaches (as autograd's own)
        to.emplace_back(detail::make_node<torch::autograd::Identity>(), 0);
      }
    }
    const torch::autograd::variable_list grads =
        detail::backward_releasing(std::move(roots), std::move(seeds), /*keep_graph=*/false, to);
    ms += t0.elapsed_ms();
    cost.backward_peak_bytes = std::max<int64_t>(0, at_backward + backward.peak_bytes()) + codec_extra;
  }
  cost.time_ms = ms;
  note_inflight(opt, own_store);
  note_transfer(ms - forward_ms);
  return cost;
}

/** NOTE [offload margin measured]: the bytes an offload option's store
 *  held in flight in its isolated run (a tensor at a time: the largest
 *  entry it wrote or read back), per store. */
void AutoCheckpoint::Impl::note_inflight(const Option& opt, const std::shared_ptr<detail::OffloadStore>& store) {
  if (!store || opt.store < 0 || static_cast<size_t>(opt.store) >= inflight_trial.size()) return;
  int64_t& seen = inflight_trial[static_cast<size_t>(opt.store)];
  seen = std::max(seen, store->stats().peak_inflight_bytes);
}

/** The store an offload option's isolated runs use: the option's, with
 *  at most one tensor in flight (the forward waits for each write). */
OffloadOptions AutoCheckpoint::Impl::trial_store(OffloadOptions o) {
  if (o.target() == OffloadTarget::kDisk) o.max_inflight_bytes(1);
  return o;
}

}  // namespace remat
