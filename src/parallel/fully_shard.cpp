// remat::parallel::FullyShard: see include/remat/parallel/fully_shard.h and
// NOTE [FullyShard and recompute] there.
//
// NOTE [flat buffers]: each unit's parameters are made views of one flat
// buffer (set_data keeps each parameter's TensorImpl, so the module, the
// optimizer-free autograd graph and saved tensors still see it). Freeing
// sets that buffer's StorageImpl to 0 bytes and gathering allocates it
// again in place: every view of it, a saved copy of a parameter included,
// sees the gathered values without a version bump (the collective writes
// through the data pointer, as PyTorch's FSDP resizes storage to 0 and back).
#include <remat/parallel/fully_shard.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <unordered_map>
#include <unordered_set>

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>
#include <torch/serialize.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <remat/optim.h>

#include <remat/error.h>

#include "common.h"

// _allgather_base and _reduce_scatter_base are deprecated from torch 2.13 on
// (all_gather_single, reduce_scatter_single), which older LibTorch lacks.
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace remat::parallel {

using util::Clock;
using util::message_of;
using util::ms_between;

struct FullyShard::Impl : std::enable_shared_from_this<FullyShard::Impl> {
  /** One flat buffer of a unit: its parameters that require grad, or its
   *  frozen ones (NOTE [frozen parameters] in the header). */
  struct Flat {
    std::vector<size_t> members;  // indices into Unit::params
    int64_t numel = 0, padded = 0, shard_numel = 0;
    at::Tensor flat;   // padded elements; its storage is freed while sharded
    at::Tensor shard;  // this rank's slice: a leaf, the optimizer's parameter
    c10::intrusive_ptr<c10d::Work> gather_work;
    uint32_t gathered_version = 0;  // shard._version() that the gathered values come from
    bool outdated = false;          // NOTE [stale gathered values]: found changed by check_gathered
    /** Notes what the gathered values come from. */
    void stamp() {
      gathered_version = shard._version();
      outdated = false;
    }
    /** The shard changed since the gather, as far as known without reading it. */
    bool stale() const { return outdated || shard._version() != gathered_version; }
    bool empty() const { return members.empty(); }
    int64_t bytes() const { return empty() ? 0 : padded * static_cast<int64_t>(flat.element_size()); }
  };
  static constexpr size_t kTrainable = 0, kFrozen = 1;
  struct Unit {
    std::string name;
    Checkpointable* module = nullptr;  // null: the root unit
    std::vector<at::Tensor> params;    // the module's own tensors (views of a flat once sharded)
    std::vector<std::string> param_names;
    std::vector<uint32_t> param_versions;  // NOTE [writes into gathered parameters]: as gathered
    std::vector<size_t> kind;              // per parameter: kTrainable or kFrozen, as at construction
    std::vector<int64_t> offsets;          // per parameter: its first element in its flat
    Flat flats[2];                         // [kTrainable], [kFrozen]
    bool gathered = false;                 // every non-empty flat holds values (maybe stale: fresh())
    Clock::time_point gather_start;
    at::Tensor grad_flat;  // this backward's full gradient, until reduced
    std::vector<char> posted;
    int64_t n_posted = 0, n_grad_params = 0;
    std::vector<std::pair<decltype(torch::autograd::impl::grad_accumulator(at::Tensor())), uintptr_t>> post_hooks;
    int active = 0;                   // forwards of it running now (an isolated run inside one included)
    std::vector<size_t> descendants;  // units inside its module, in tree order: gathered with it for backward
    bool nested = false;              // its module lies inside another checkpointable module
    bool keep_gathered = false;       // not freed between its forward and its backward
    bool reduced = false;             // its gradient was reduced in this backward
    // Frozen parameters (NOTE [FullyShard and recompute]): hooks on the
    // gradients of its calls' inputs not yet run (a graph dropped unrun
    // gives its count back), and whether an input was a leaf (no hook: the
    // unit then stays gathered to the backward's end).
    int64_t pending_inputs = 0;
    bool until_end = false;
    std::vector<std::vector<at::Tensor>> call_inputs;  // of the calls running now, innermost last
    int64_t bytes() const { return flats[0].bytes() + flats[1].bytes(); }
    bool in_flight() const { return flats[0].gather_work || flats[1].gather_work; }
    /** Gathered from the shards as they are now. */
    bool fresh() const {
      if (!gathered) return false;
      for (const auto& f : flats) {
        if (!f.empty() && f.stale()) return false;
      }
      return true;
    }
    /** Gathered from the current shards, or being gathered. */
    bool held() const { return fresh() || in_flight(); }
  };
  /** A hook on the gradient of a frozen unit's input: counted in
   *  pending_inputs until it runs or its graph is dropped. */
  struct InputToken {
    std::weak_ptr<Impl> impl;
    size_t unit = 0;
    bool fired = false;
    ~InputToken() {
      if (fired) return;
      if (auto self = impl.lock()) --self->units[unit].pending_inputs;
    }
  };
  struct PendingReduce {
    size_t unit;
    c10::intrusive_ptr<c10d::Work> work;
    at::Tensor grad_flat, out;
    Clock::time_point start;
    bool zeros_here = false;  // this rank's part was zeros (NOTE [units no rank used])
  };
  /** Reduced units whose part here was zeros, their shard's sum held until
   *  the ranks know whether any of them used the unit. */
  std::vector<std::pair<size_t, at::Tensor>> held_zero;

  std::shared_ptr<torch::nn::Module> module;
  ProcessGroup group;
  FullyShardOptions options;
  int rank = 0, world = 1;
  std::vector<Unit> units;    // [0] is the root
  std::vector<size_t> order;  // units in first-forward order (root excluded)
  bool order_known = false;
  bool in_backward = false;
  bool graph_pending = false;            // a forward with gradient ran since the last backward ended
  bool graph_pending_before = false;     // graph_pending when the running forward() began
  bool ending = false;                   // end_backward runs
  std::unordered_set<int> queued_tasks;  // graph tasks of this backward that have our callback
  int64_t grad_units = 0;                // units with a parameter that requires grad
  int64_t reduced_units = 0;             // of those, reduced in this backward
  std::vector<PendingReduce> pending;
  ShardStats stats;

  std::string where() const { return "rank " + std::to_string(rank) + " of " + std::to_string(world); }

  // NOTE [writes into gathered parameters]: a module's parameters are views
  // of its unit's gathered buffer, which is freed again; an in-place write
  // into one (Embedding's max_norm renormalising rows in forward, a write
  // between steps while the root is gathered) never reaches the shard the
  // optimizer holds, and was lost without a word. Each parameter's version
  // is noted as its unit is gathered; a write is refused after the forward
  // that made it, or at the next forward when the unit was freed first.
  std::string lost_write;  // the error for a write found as a unit was freed

  /** The error for a write into unit u's gathered parameters since its
   *  gather; "" when none. */
  std::string written(const Unit& u) const {
    for (size_t k = 0; k < u.params.size() && k < u.param_versions.size(); ++k) {
      if (u.params[k]._version() == u.param_versions[k]) continue;
      return "[remat::parallel] FullyShard: parameter '" + u.param_names[k] + "' of unit '" + u.name +
             "' was written in place while gathered (a module that changes its own weights in forward, as "
             "Embedding's max_norm does, or a write between steps); the write went to the gathered copy, "
             "which FullyShard frees, not to the shard the optimizer holds, so it would be lost. Drop the "
             "in-place write (e.g. Embedding without max_norm), or write into the shards of "
             "FullyShard::parameters().";
    }
    return "";
  }

  void note_versions(Unit& u) {
    u.param_versions.clear();
    for (const auto& p : u.params) u.param_versions.push_back(p._version());
  }

  /** NOTE [stale gathered values]: units still gathered as a forward begins
   *  (reshard_after_forward(false), keep_gathered, or left by a forward
   *  with gradient whose graph was dropped) may predate an optimizer's
   *  step. The shard's version does not always tell: LibTorch's SGD writes
   *  through p.data(), whose version counter is not the shard's. So each
   *  rank compares its slice of the gathered values with its shard, and
   *  one all-reduce (the ranks' gathered units are the same) makes a unit
   *  changed on any rank outdated on all: the next use gathers it again. */
  void check_gathered() {
    std::vector<size_t> kept;
    for (size_t i = 0; i < units.size(); ++i) {
      const Unit& u = units[i];
      if (u.gathered && !u.in_flight() && u.active == 0) kept.push_back(i);
    }
    if (kept.empty()) return;
    at::Tensor changed = at::zeros({static_cast<int64_t>(kept.size())}, at::kFloat);
    c10::Device device = at::kCPU;
    for (size_t k = 0; k < kept.size(); ++k) {
      bool c = false;
      for (const Flat& f : units[kept[k]].flats) {
        if (f.empty()) continue;
        device = f.flat.device();
        c = c || f.stale() ||
            !at::equal(f.flat.narrow(0, static_cast<int64_t>(rank) * f.shard_numel, f.shard_numel), f.shard.detach());
      }
      changed[static_cast<int64_t>(k)] = c ? 1.0f : 0.0f;
    }
    if (world > 1) {
      at::Tensor flags = changed.to(device);  // the backend's device (NCCL: CUDA)
      const std::string what = "all-reduce of the gathered units' freshness";
      wait(start_allreduce(flags, c10d::ReduceOp::MAX, what), what);
      changed = flags.cpu();
    }
    for (size_t k = 0; k < kept.size(); ++k) {
      if (changed[static_cast<int64_t>(k)].item<float>() == 0.0f) continue;
      for (Flat& f : units[kept[k]].flats) f.outdated = !f.empty();
    }
  }

  /** Throws the first write into gathered parameters found; the writes are
   *  taken as seen (the next check looks for new ones). */
  void check_writes() {
    std::string e;
    e.swap(lost_write);
    for (auto& u : units) {
      if (e.empty() && (u.gathered || u.in_flight())) e = written(u);
      note_versions(u);
    }
    if (!e.empty()) throw Error(e);
  }

  [[noreturn]] void collective_failed(const std::string& what, const std::exception& e) const {
    throw Error("[remat::parallel] " + where() + ": the " + what + " failed: " + message_of(e) +
                ". A peer process probably exited or stopped answering (timeout " +
                std::to_string(group.timeout().count() / 1000) +
                " s); every rank must run the same units in the same order.");
  }

  /** Starts an all-reduce of t in place (op over the ranks). */
  c10::intrusive_ptr<c10d::Work> start_allreduce(at::Tensor& t, c10d::ReduceOp::RedOpType op, const std::string& what) {
    std::vector<at::Tensor> ts{t};
    c10d::AllreduceOptions o;
    o.reduceOp = op;
    o.timeout = group.timeout();
    try {
      return group.c10d()->allreduce(ts, o);
    } catch (const std::exception& e) {
      collective_failed(what, e);
    }
  }

  void wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what) {
    const auto t0 = Clock::now();
    try {
      work->wait(group.timeout());
    } catch (const std::exception& e) {
      collective_failed(what, e);
    }
    stats.exposed_ms += ms_between(t0, Clock::now());
  }

  // --- flat buffers (NOTE [flat buffers]) ---------------------------------

  static void allocate(Unit& u) {
    for (auto& f : u.flats) {
      if (f.empty()) continue;
      c10::StorageImpl* s = f.flat.storage().unsafeGetStorageImpl();
      const auto nbytes = static_cast<size_t>(f.bytes());
      if (s->nbytes() == nbytes) continue;
      s->set_data_ptr_noswap(s->allocator()->allocate(nbytes));
      s->set_nbytes(nbytes);
    }
  }

  static void release(Unit& u) {
    for (auto& f : u.flats) {
      if (f.empty()) continue;
      c10::StorageImpl* s = f.flat.storage().unsafeGetStorageImpl();
      s->set_data_ptr_noswap(at::DataPtr(nullptr, f.flat.device()));
      s->set_nbytes(0);
    }
  }

  /** Starts gathering unit i, unless it holds the current shards' values or
   *  is being gathered. A stale gathered unit (the optimizer stepped since)
   *  is gathered again in place: every view of it sees the new values. */
  void start_gather(size_t i, bool backward) {
    Unit& u = units[i];
    if (u.held()) return;
    allocate(u);
    note_versions(u);
    for (auto& f : u.flats) {
      if (f.empty()) continue;
      c10d::AllgatherOptions o;
      o.timeout = group.timeout();
      at::Tensor out = f.flat;
      at::Tensor in = f.shard.detach();
      f.stamp();
      try {
        f.gather_work = group.c10d()->_allgather_base(out, in, o);
      } catch (const std::exception& e) {
        release(u);
        u.gathered = false;
        collective_failed("all-gather of unit '" + u.name + "'", e);
      }
      (backward ? stats.backward_allgathers : stats.forward_allgathers) += 1;
    }
    u.gather_start = Clock::now();
    int64_t now = 0;
    for (const auto& v : units) {
      if (v.gathered || v.in_flight()) now += v.bytes();
    }
    stats.max_gathered_bytes = std::max(stats.max_gathered_bytes, now);
    stats.allgather_bytes += u.bytes();
  }

  void finish_gather(size_t i) {
    Unit& u = units[i];
    if (!u.in_flight()) return;
    for (auto& f : u.flats) {
      if (!f.gather_work) continue;
      auto work = std::move(f.gather_work);
      wait(work, "all-gather of unit '" + u.name + "'");
    }
    stats.allgather_ms += ms_between(u.gather_start, Clock::now());
    u.gathered = true;
  }

  void gather(size_t i, bool backward) {
    start_gather(i, backward);
    finish_gather(i);
  }

  void reshard(size_t i) {
    Unit& u = units[i];
    finish_gather(i);
    if (!u.gathered) return;
    if (lost_write.empty()) lost_write = written(u);  // NOTE [writes into gathered parameters]
    release(u);
    u.gathered = false;
  }

  /** Starts gathering the unit after (forward) or before (backward) unit i
   *  in forward order, within options.prefetch_bytes of idle gathered bytes. */
  void prefetch(size_t i, bool backward) {
    if (!order_known || options.prefetch_bytes() <= 0) return;
    const auto at = std::find(order.begin(), order.end(), i);
    if (at == order.end()) return;
    size_t next;
    if (backward) {
      if (at == order.begin()) return;
      next = *(at - 1);
    } else {
      if (at + 1 == order.end()) return;
      next = *(at + 1);
    }
    Unit& n = units[next];
    if (n.held()) return;
    int64_t idle = 0;  // gathered or in flight, not the one running now
    for (size_t k = 1; k < units.size(); ++k) {
      if (k != i && (units[k].gathered || units[k].in_flight())) idle += units[k].bytes();
    }
    if (idle + n.bytes() > options.prefetch_bytes()) return;
    start_gather(next, backward);
  }

  // --- backward ------------------------------------------------------------

  /** Marks the backward and gives the running graph task our callback
   *  (NOTE [the end of a backward]). */
  void begin_backward() {
    in_backward = true;
    queue_end(/*all_reduced=*/false);
  }

  // NOTE [the end of a backward]: the engine's final callback of a graph
  // task completes the reductions and frees every unit. A backward may run
  // nested graph tasks (CheckpointedSequential's stage backwards run inside a
  // node of the outer one), whose end is not the backward's: a callback that
  // runs inside a node (get_current_node) only ends the backward once every
  // unit's gradient is reduced, so the last reduction queues one on its own
  // task. Otherwise the callback of the outermost task ends it, reducing
  // what got no gradient as zeros.
  void queue_end(bool all_reduced) {
    const int task = torch::autograd::get_current_graph_task_id();
    if (!all_reduced && !queued_tasks.insert(task).second) return;
    std::weak_ptr<Impl> weak = weak_from_this();
    torch::autograd::Engine::get_default_engine().queue_callback([weak, all_reduced] {
      if (auto self = weak.lock()) self->end_backward(all_reduced);
    });
  }

  /** Gathers unit i and the units inside it, in a fixed order, so that
   *  every rank issues the same collectives whatever each recomputes. */
  void pre_backward(size_t i) {
    begin_backward();
    Unit& u = units[i];
    start_gather(i, /*backward=*/true);
    for (size_t d : u.descendants) start_gather(d, /*backward=*/true);
    finish_gather(i);
    for (size_t d : u.descendants) finish_gather(d);
    prefetch(i, /*backward=*/true);
  }

  void post_accumulate(size_t i, size_t p) {
    begin_backward();
    Unit& u = units[i];
    at::Tensor& g = u.params[p].mutable_grad();
    if (!g.defined()) return;
    const Flat& f = u.flats[kTrainable];
    if (!u.grad_flat.defined()) u.grad_flat = at::zeros({f.padded}, f.flat.options());
    u.grad_flat.narrow(0, u.offsets[p], u.params[p].numel()).add_(g.reshape({-1}));
    g = at::Tensor();  // the full gradient lives in grad_flat until reduced
    if (!u.posted[p]) {
      u.posted[p] = 1;
      ++u.n_posted;
    }
    if (u.n_posted == u.n_grad_params) reduce(i);
  }

  /** Frees unit i in a backward once nothing will read its parameters:
   *  its gradient is reduced (or it has none) and, with frozen parameters,
   *  its inputs' gradients are complete (NOTE [FullyShard and recompute]). */
  void maybe_free_after_backward(size_t i) {
    Unit& u = units[i];
    if (!in_backward || u.active > 0 || u.until_end || u.pending_inputs > 0) return;
    if (u.n_grad_params > 0 && !u.reduced) return;
    // The root's frozen parameters have no hook that says when backward is
    // done with them (a frozen final norm after the blocks, read after the
    // head's gradient reduced the root): it stays to the backward's end.
    if (i == 0 && !u.flats[kFrozen].empty()) return;
    reshard(i);
  }

  /** A hook on the gradient of one input of a unit with frozen parameters ran. */
  void input_done(InputToken& token) {
    token.fired = true;
    --units[token.unit].pending_inputs;
    maybe_free_after_backward(token.unit);
  }

  /** Reduce-scatters unit i's gradient (async; at most one in flight) and
   *  frees its parameters once nothing reads them. */
  void reduce(size_t i, bool zeros_here = false) {
    Unit& u = units[i];
    const Flat& f = u.flats[kTrainable];
    complete_reductions();
    PendingReduce r;
    r.unit = i;
    r.zeros_here = zeros_here;
    r.grad_flat = std::move(u.grad_flat);
    r.grad_flat.div_(world);
    r.start = Clock::now();
    if (!stats.reduce_scatter_by_allreduce) {
      r.out = at::empty({f.shard_numel}, r.grad_flat.options());
      c10d::ReduceScatterOptions o;
      o.reduceOp = c10d::ReduceOp::SUM;
      o.timeout = group.timeout();
      try {
        r.work = group.c10d()->_reduce_scatter_base(r.out, r.grad_flat, o);
      } catch (const c10::NotImplementedError&) {
        stats.reduce_scatter_by_allreduce = true;
      } catch (const std::exception& e) {
        if (std::string(e.what()).find("does not support") == std::string::npos) {
          collective_failed("reduce-scatter of unit '" + u.name + "'", e);
        }
        stats.reduce_scatter_by_allreduce = true;
      }
    }
    if (stats.reduce_scatter_by_allreduce) {
      std::vector<at::Tensor> ts{r.grad_flat};
      c10d::AllreduceOptions o;
      o.timeout = group.timeout();
      try {
        r.work = group.c10d()->allreduce(ts, o);
      } catch (const std::exception& e) {
        collective_failed("all-reduce of unit '" + u.name + "' gradients", e);
      }
    }
    stats.reduce_scatters += 1;
    u.reduced = true;
    stats.reduce_scatter_bytes += f.bytes();
    pending.push_back(std::move(r));
    std::fill(u.posted.begin(), u.posted.end(), 0);
    u.n_posted = 0;
    maybe_free_after_backward(i);
    // From end_backward itself (what was left), the backward is ending already.
    if (u.n_grad_params > 0 && ++reduced_units == grad_units && !ending) queue_end(/*all_reduced=*/true);
  }

  void complete_reductions() {
    for (auto& r : pending) {
      Unit& u = units[r.unit];
      Flat& f = u.flats[kTrainable];
      wait(r.work, std::string(stats.reduce_scatter_by_allreduce ? "all-reduce" : "reduce-scatter") + " of unit '" +
                       u.name + "' gradients");
      stats.reduce_scatter_ms += ms_between(r.start, Clock::now());
      at::Tensor mine = r.out.defined() ? r.out : r.grad_flat.narrow(0, rank * f.shard_numel, f.shard_numel);
      if (r.zeros_here) {
        held_zero.emplace_back(r.unit, mine);
      } else {
        give_shard(r.unit, mine);
      }
    }
    pending.clear();
  }

  /** Adds `mine`, unit i's reduced gradient of this rank's shard, to the
   *  shard's gradient. */
  void give_shard(size_t i, const at::Tensor& mine) {
    Flat& f = units[i].flats[kTrainable];
    torch::NoGradGuard no_grad;
    at::Tensor& g = f.shard.mutable_grad();
    if (g.defined()) {
      g.add_(mine);
    } else {
      g = mine.clone();
    }
    // The shard's gradient is final: a StepInBackward updates it now and
    // frees it (no AccumulateGrad ever sees a shard).
    remat::detail::step_in_backward_now(f.shard);
  }

  /** A graph task's final callback (NOTE [the end of a backward]): reduces
   *  what is left (parameters that got no gradient count as zero), waits for
   *  every reduction, frees every unit no forward is running. */
  void end_backward(bool all_reduced) {
    if (!in_backward) return;  // ended already
    if (!all_reduced && torch::autograd::get_current_node() != nullptr) {
      queued_tasks.erase(torch::autograd::get_current_graph_task_id());  // a nested task: the backward goes on
      return;
    }
    ending = true;
    for (size_t i = 0; i < units.size(); ++i) {
      if (units[i].grad_flat.defined()) reduce(i);
    }
    // In the step's backward, a unit that got no gradient on this rank is
    // reduced as zeros: another rank's may have got one, and the ranks' lists
    // of collectives must match (which units get a gradient must not depend
    // on the rank, but for the last ones reduced). NOTE [units no rank used]:
    // one that no rank used is left without a gradient, as a plain step
    // leaves a parameter its backward did not reach (a zero gradient would
    // move it: momentum, Adam's moments, weight decay). The ranks learn which
    // from one small all-reduce of flags, after every reduction, each step's
    // backward; the sums of the units reduced as zeros wait for it.
    if (reduced_units > 0) {
      held_zero.clear();  // a backward that failed after reducing left some
      at::Tensor used = at::zeros({static_cast<int64_t>(units.size())}, at::kFloat);
      for (size_t i = 0; i < units.size(); ++i) used[static_cast<int64_t>(i)] = units[i].reduced ? 1.0f : 0.0f;
      for (size_t i = 0; i < units.size(); ++i) {
        Unit& u = units[i];
        if (u.n_grad_params == 0 || u.reduced) continue;
        u.grad_flat = at::zeros({u.flats[kTrainable].padded}, u.flats[kTrainable].flat.options());
        reduce(i, /*zeros_here=*/true);
      }
      for (const Unit& u : units) {
        if (u.n_grad_params > 0) {
          used = used.to(u.flats[kTrainable].flat.device());  // the backend's device (NCCL: CUDA)
          break;
        }
      }
      const std::string what = "all-reduce of the units each rank used";
      auto work = start_allreduce(used, c10d::ReduceOp::SUM, what);
      complete_reductions();
      wait(work, what);
      const at::Tensor any = used.cpu();
      std::vector<std::pair<size_t, at::Tensor>> held;
      held.swap(held_zero);
      for (const auto& [i, mine] : held) {
        if (any[static_cast<int64_t>(i)].item<float>() > 0.0f) give_shard(i, mine);
      }
    }
    ending = false;
    complete_reductions();
    bool forward_running = false;  // this backward ran inside a unit's forward (auto's isolated runs)
    for (const auto& u : units) forward_running |= u.active > 0;
    // A backward that reduced nothing ran inside the step's forward (a
    // profiler's isolated run through autograd::grad): the forward still
    // needs the root, gathered by forward(), and the units running.
    const bool step_backward = reduced_units > 0;
    for (size_t i = 0; i < units.size(); ++i) {
      Unit& u = units[i];
      std::fill(u.posted.begin(), u.posted.end(), 0);
      u.n_posted = 0;
      u.reduced = false;
      u.until_end = false;
      if (u.active == 0 && (i != 0 || step_backward)) reshard(i);
    }
    in_backward = false;
    if (step_backward) graph_pending = false;
    queued_tasks.clear();
    reduced_units = 0;
    // An isolated run's backward inside a forward (auto's profile) does not
    // end the step's forward.
    if (!order.empty() && !forward_running) order_known = true;
  }

  // --- forward -------------------------------------------------------------

  void before_forward(size_t i, const std::vector<at::Tensor>& inputs) {
    Unit& u = units[i];
    if (u.nested && detail::unit_observer() != nullptr) {
      // auto's isolated runs of the module around it would gather it a
      // number of times that depends on each rank's measurements.
      throw Error("[remat::parallel] FullyShard: unit '" + u.name +
                  "' lies inside another checkpointable module, and auto_checkpoint is profiling the step; under "
                  "auto_checkpoint, shard by the outermost checkpointable modules (FullyShardOptions::units, e.g. "
                  "select::type<Block>()).");
    }
    // A forward inside a graph task is a recompute (a checkpoint's, a
    // chain's re-run), even before any hook of ours marked the backward.
    if (!in_backward && torch::autograd::get_current_graph_task_id() != -1) begin_backward();
    if (in_backward) {  // a recompute: gathered once for this backward
      gather(i, /*backward=*/true);
      ++u.active;
      u.call_inputs.emplace_back();
      return;
    }
    if (!order_known && std::find(order.begin(), order.end(), i) == order.end()) order.push_back(i);
    gather(i, /*backward=*/false);
    ++u.active;
    u.call_inputs.push_back(u.flats[kFrozen].empty() ? std::vector<at::Tensor>() : inputs);
    prefetch(i, /*backward=*/false);
  }

  /** The unit's forward threw: it no longer runs, and outside a backward
   *  nothing will need it gathered. */
  void forward_failed(size_t i) {
    --units[i].active;
    if (!units[i].call_inputs.empty()) units[i].call_inputs.pop_back();
    if (!in_backward) reshard(i);
  }

  /** With frozen parameters: a hook on the gradient of each input of this
   *  call, counted until it runs (NOTE [FullyShard and recompute]). */
  void watch_inputs(size_t i, const std::vector<at::Tensor>& inputs) {
    Unit& u = units[i];
    std::weak_ptr<Impl> weak = weak_from_this();
    for (const auto& t : inputs) {
      if (!t.defined() || !t.requires_grad()) continue;
      if (!t.grad_fn()) {  // a leaf: a hook would stay on it for good
        u.until_end = true;
        continue;
      }
      auto token = std::make_shared<InputToken>();
      token->impl = weak;
      token->unit = i;
      ++u.pending_inputs;
      const_cast<at::Tensor&>(t).register_hook([weak, token](const at::Tensor&) {
        if (token->fired) return;
        if (auto self = weak.lock()) self->input_done(*token);
      });
    }
  }

  void after_forward(size_t i, const std::vector<at::Tensor>& outputs) {
    Unit& u = units[i];
    --u.active;
    std::vector<at::Tensor> inputs;
    if (!u.call_inputs.empty()) {
      inputs = std::move(u.call_inputs.back());
      u.call_inputs.pop_back();
    }
    if (in_backward) return;
    bool armed = false;
    if (torch::autograd::GradMode::is_enabled()) {
      std::weak_ptr<Impl> weak = weak_from_this();
      for (const auto& t : outputs) {
        if (!t.defined() || !t.requires_grad() || !t.grad_fn()) continue;
        const_cast<at::Tensor&>(t).register_hook([weak, i](const at::Tensor&) {
          if (auto self = weak.lock()) self->pre_backward(i);
        });
        armed = true;
      }
    }
    if (armed) {
      graph_pending = true;
      if (!u.flats[kFrozen].empty()) watch_inputs(i, inputs);
    }
    if ((options.reshard_after_forward() && !u.keep_gathered) || !armed) reshard(i);
  }
};

namespace {

/** Forwards a Checkpointable's calls to its unit. */
class ShardHook : public detail::UnitHook {
 public:
  ShardHook(std::weak_ptr<FullyShard::Impl> impl, size_t unit) : impl_(std::move(impl)), unit_(unit) {}
  void before_forward(const std::vector<at::Tensor>& inputs) override {
    if (auto p = impl_.lock()) p->before_forward(unit_, inputs);
  }
  void after_forward(const std::vector<at::Tensor>& outputs) override {
    if (auto p = impl_.lock()) p->after_forward(unit_, outputs);
  }
  void forward_failed() override {
    if (auto p = impl_.lock()) p->forward_failed(unit_);
  }

 private:
  std::weak_ptr<FullyShard::Impl> impl_;
  size_t unit_;
};

bool under(const std::string& name, const std::string& prefix) {
  return prefix.empty() || name.rfind(prefix + ".", 0) == 0;
}

}  // namespace

FullyShard::FullyShard(std::shared_ptr<torch::nn::Module> module, ProcessGroup group, FullyShardOptions options)
    : impl_(std::make_shared<Impl>()) {
  if (!module) throw Error("[remat::parallel] FullyShard: the module is null.");
  if (!group.defined()) {
    throw Error("[remat::parallel] FullyShard: the ProcessGroup was not joined; use init_process_group().");
  }
  if (options.prefetch_bytes() < 0) {
    throw Error("[remat::parallel] FullyShard: prefetch_bytes " + std::to_string(options.prefetch_bytes()) +
                " is negative; give 0 (no prefetch) or a byte bound (default 64 MiB).");
  }
  Impl& m = *impl_;
  m.module = module;
  m.group = group;
  m.options = options;
  m.rank = group.rank();
  m.world = group.world_size();

  // Units: the selected checkpointable modules that own parameters; each
  // parameter goes to the deepest selected module whose name prefixes its own.
  std::vector<SelectorInput> chosen;
  std::vector<std::string> checkpointable_names;  // every checkpointable module's, units or not
  for (const auto& item : module->named_modules("", true)) {
    if (dynamic_cast<const Checkpointable*>(item.value().get()) != nullptr) checkpointable_names.push_back(item.key());
  }
  const bool any_checkpointable = !checkpointable_names.empty();
  if (any_checkpointable) chosen = selected_checkpointables(*module, options.units(), "parallel::FullyShard");
  m.units.emplace_back();
  m.units[0].name = "(root)";
  std::unordered_map<std::string, size_t> unit_of_name;
  for (const auto& c : chosen) {
    Impl::Unit u;
    u.name = c.name.empty() ? "(root)" : c.name;
    u.module = dynamic_cast<Checkpointable*>(const_cast<torch::nn::Module*>(c.module));
    unit_of_name[c.name] = m.units.size();
    m.units.push_back(std::move(u));
  }
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : module->named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
    size_t owner = 0;
    size_t best = 0;
    for (const auto& c : chosen) {
      if (under(item.key(), c.name) && (owner == 0 || c.name.size() >= best)) {
        owner = unit_of_name[c.name];
        best = c.name.size();
      }
    }
    if (p.is_sparse() || p.device().type() != group.device()) {
      throw Error("[remat::parallel] FullyShard: parameter '" + item.key() + "' is " +
                  (p.is_sparse() ? std::string("sparse") : "on " + p.device().str()) +
                  "; FullyShard shards dense parameters on the group's device (" + c10::DeviceTypeName(group.device()) +
                  ").");
    }
    auto& u = m.units[owner];
    if (!u.params.empty() && u.params[0].scalar_type() != p.scalar_type()) {
      throw Error("[remat::parallel] FullyShard: unit '" + u.name + "' holds parameters of two dtypes ('" +
                  u.param_names[0] + "' " + std::string(c10::toString(u.params[0].scalar_type())) + ", '" + item.key() +
                  "' " + c10::toString(p.scalar_type()) +
                  "); select units (FullyShardOptions::units) whose parameters share one.");
    }
    u.params.push_back(p);
    u.param_names.push_back(item.key());
  }
  // A unit's parameter used by a module outside the unit (a layer shared
  // with another unit or with the root's code) would be read while freed.
  std::unordered_map<const c10::TensorImpl*, std::pair<size_t, size_t>> owner_of;  // unit, parameter
  for (size_t i = 0; i < m.units.size(); ++i) {
    for (size_t k = 0; k < m.units[i].params.size(); ++k) owner_of[m.units[i].params[k].unsafeGetTensorImpl()] = {i, k};
  }
  for (const auto& item : module->named_modules("", true)) {
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false)) {
      const auto at = owner_of.find(p.value().unsafeGetTensorImpl());
      if (at == owner_of.end() || at->second.first == 0) continue;
      const auto& u = m.units[at->second.first];
      const std::string unit_name = u.module == nullptr ? "" : u.name == "(root)" ? "" : u.name;
      if (item.key() == unit_name || under(item.key(), unit_name)) continue;
      throw Error("[remat::parallel] FullyShard: parameter '" + u.param_names[at->second.second] + "' of unit '" +
                  u.name + "' is also used by '" + (item.key().empty() ? "(root)" : item.key()) +
                  "', outside the unit; choose units (FullyShardOptions::units) that hold every module using their "
                  "parameters.");
    }
  }
  // Drop units that own nothing (the root stays, maybe empty).
  std::vector<Impl::Unit> kept;
  for (size_t i = 0; i < m.units.size(); ++i) {
    if (i == 0 || !m.units[i].params.empty()) kept.push_back(std::move(m.units[i]));
  }
  m.units = std::move(kept);
  // Units inside units, by name; and units inside any checkpointable module.
  for (size_t i = 1; i < m.units.size(); ++i) {
    for (size_t j = 1; j < m.units.size(); ++j) {
      if (j != i && m.units[i].name != "(root)" && under(m.units[j].name, m.units[i].name)) {
        m.units[i].descendants.push_back(j);
      }
    }
    for (const auto& n : checkpointable_names) {
      m.units[i].nested |= n != m.units[i].name && m.units[i].name != "(root)" && under(m.units[i].name, n);
    }
  }
  if (options.keep_gathered()) {
    std::vector<SelectorInput> keep;
    if (any_checkpointable) keep = selected_checkpointables(*module, *options.keep_gathered(), "parallel::FullyShard");
    for (const auto& k : keep) {
      bool found = false;
      for (auto& u : m.units) {
        if (u.module != nullptr && dynamic_cast<const torch::nn::Module*>(u.module) == k.module) {
          u.keep_gathered = found = true;
        }
      }
      if (!found) {
        throw Error("[remat::parallel] FullyShard: keep_gathered chose '" + k.name +
                    "', which is not a unit (FullyShardOptions::units did not choose it, or it owns no parameter); "
                    "choose among the units.");
      }
    }
  }
  for (const auto& u : m.units) {  // before anything changes
    if (u.module != nullptr && u.module->unit_hook() != nullptr) {
      throw Error("[remat::parallel] FullyShard: unit '" + u.name +
                  "' already has hooks (another FullyShard on the same module?); shard a model once.");
    }
  }

  torch::NoGradGuard no_grad;
  // Every rank starts from rank 0's buffers (BatchNorm statistics).
  for (auto& b : module->buffers()) {
    if (!b.defined()) continue;
    std::vector<at::Tensor> ts{b};
    try {
      m.group.c10d()->broadcast(ts)->wait(m.group.timeout());
    } catch (const std::exception& e) {
      m.collective_failed("broadcast of rank 0's buffers", e);
    }
  }
  for (size_t i = 0; i < m.units.size(); ++i) {
    auto& u = m.units[i];
    if (u.params.empty()) continue;
    // The parameters that require grad in one flat, the frozen ones in
    // another (NOTE [frozen parameters]).
    for (size_t k = 0; k < u.params.size(); ++k) {
      const size_t kind = u.params[k].requires_grad() ? Impl::kTrainable : Impl::kFrozen;
      Impl::Flat& f = u.flats[kind];
      u.kind.push_back(kind);
      u.offsets.push_back(f.numel);
      f.members.push_back(k);
      f.numel += u.params[k].numel();
    }
    for (size_t kind : {Impl::kTrainable, Impl::kFrozen}) {
      Impl::Flat& f = u.flats[kind];
      if (f.empty()) continue;
      f.shard_numel = (f.numel + m.world - 1) / m.world;
      f.padded = f.shard_numel * m.world;
      f.flat = at::zeros({f.padded}, u.params[0].options().requires_grad(false));
      for (size_t k : f.members) {
        f.flat.narrow(0, u.offsets[k], u.params[k].numel()).copy_(u.params[k].detach().reshape({-1}));
      }
      std::vector<at::Tensor> ts{f.flat};
      try {
        m.group.c10d()->broadcast(ts)->wait(m.group.timeout());
      } catch (const std::exception& e) {
        m.collective_failed("broadcast of rank 0's parameters of unit '" + u.name + "'", e);
      }
      for (size_t k : f.members) {
        at::Tensor& p = u.params[k];
        p.set_data(f.flat.narrow(0, u.offsets[k], p.numel()).view(p.sizes()));
      }
      f.shard = f.flat.narrow(0, static_cast<int64_t>(m.rank) * f.shard_numel, f.shard_numel).clone();
      f.shard.set_requires_grad(kind == Impl::kTrainable);
      f.stamp();
    }
    u.gathered = true;
    m.reshard(i);
    u.posted.assign(u.params.size(), 0);
    std::weak_ptr<Impl> weak = impl_;
    for (size_t k = 0; k < u.params.size(); ++k) {
      if (!u.params[k].requires_grad()) continue;
      if (u.n_grad_params++ == 0) ++m.grad_units;
      auto acc = torch::autograd::impl::grad_accumulator(u.params[k]);
      const uintptr_t key = acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [weak, i, k](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
            if (auto self = weak.lock()) self->post_accumulate(i, k);
            return outputs;
          }));
      u.post_hooks.emplace_back(std::move(acc), key);
    }
    if (u.module != nullptr) u.module->set_unit_hook(std::make_shared<ShardHook>(weak, i));
  }
}

FullyShard::~FullyShard() {
  for (auto& u : impl_->units) {
    if (u.module != nullptr) u.module->set_unit_hook(nullptr);
    for (auto& [node, key] : u.post_hooks) node->del_post_hook(key);
  }
}

std::vector<at::Tensor> FullyShard::parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& u : impl_->units) {
    for (const auto& f : u.flats) {
      if (!f.empty()) out.push_back(f.shard);
    }
  }
  return out;
}

void FullyShard::check_forward_writes() { impl_->check_writes(); }

void FullyShard::begin_forward() {
  Impl& m = *impl_;
  if (!m.in_backward) m.check_writes();  // NOTE [writes into gathered parameters]
  if (m.in_backward) {
    throw Error(
        "[remat::parallel] FullyShard::forward ran before the last backward through it ended (it is still "
        "running, or an error stopped it); finish the backward first. After an error in backward, rebuild the model, "
        "load the last save_sharded() or save_full() into it and shard that: this model's parameters hold no data.");
  }
  // The flats were cut by requires_grad: a parameter frozen or unfrozen
  // since would get no update, or one its shard does not allow.
  for (const auto& u : m.units) {
    for (size_t k = 0; k < u.params.size(); ++k) {
      if (u.params[k].requires_grad() == (u.kind[k] == Impl::kTrainable)) continue;
      throw Error(
          "[remat::parallel] FullyShard: parameter '" + u.param_names[k] + "' of unit '" + u.name + "' " +
          (u.params[k].requires_grad() ? "requires grad now but was frozen" : "is frozen now but required grad") +
          " when the model was sharded; set requires_grad before constructing FullyShard (it cuts each "
          "unit's buffers and the optimizer's shards by it), or shard the model again.");
    }
  }
  m.check_gathered();  // NOTE [stale gathered values]
  m.graph_pending_before = m.graph_pending;
  if (torch::autograd::GradMode::is_enabled()) m.graph_pending = true;
  if (!m.units[0].params.empty()) m.gather(0, /*backward=*/false);
  // The first unit's gather overlaps whatever runs before it (the embedding).
  if (m.order_known && !m.order.empty() && m.units[m.order.front()].bytes() <= m.options.prefetch_bytes()) {
    m.start_gather(m.order.front(), /*backward=*/false);
  }
}

void FullyShard::end_forward(bool failed) noexcept {
  Impl& m = *impl_;
  if (m.in_backward) return;
  if (failed) {
    // What this forward gathered or prefetched goes (the units kept from an
    // earlier forward are gathered again by their backward); the root stays
    // only for an earlier forward's backward.
    m.graph_pending = m.graph_pending_before;
    for (size_t i = 1; i < m.units.size(); ++i) {
      if (m.units[i].active > 0) continue;
      try {
        m.reshard(i);  // waits for an in-flight prefetch first
      } catch (...) {  // a failed collective: the step is lost anyway
      }
    }
  } else if (torch::autograd::GradMode::is_enabled()) {
    return;
  }
  // A forward without gradient (an evaluation) leaves nothing for a
  // backward, unless one of an earlier forward is still to come.
  if (m.graph_pending) return;
  try {
    m.reshard(0);
  } catch (...) {
  }
}

void FullyShard::explain_failed_forward(const c10::Error& e) const {
  // c10's words for a read of a storage of 0 bytes: of its data, or a view of it.
  const std::string what = e.what_without_backtrace();
  if (what.find("data is not allocated yet") == std::string::npos &&
      what.find("out of bounds for storage of size 0") == std::string::npos)
    return;
  const Impl& m = *impl_;
  std::string sharded;
  int64_t n = 0;
  for (const auto& u : m.units) {
    if (u.params.empty() || u.gathered || u.in_flight()) continue;
    if (n++ < 8) sharded += std::string(sharded.empty() ? "" : ", ") + "'" + u.name + "'";
  }
  if (n == 0) return;
  if (n > 8) sharded += " and " + std::to_string(n - 8) + " more";
  throw Error(
      "[remat::parallel] FullyShard: the forward read a parameter of a unit while the unit was sharded "
      "(sharded then: " +
      sharded +
      "). A unit's parameters hold data only while its own forward runs: a module of a unit was called "
      "from outside the unit (by the model's own code, or by another unit). Call it only from inside the "
      "unit's forward, or choose units (FullyShardOptions::units) that hold every module the model calls "
      "directly.");
}

double FullyShard::clip_grad_norm(double max_norm) {
  Impl& m = *impl_;
  if (!(max_norm > 0.0) || !std::isfinite(max_norm)) {
    throw Error("[remat::parallel] FullyShard::clip_grad_norm: max_norm " + std::to_string(max_norm) +
                " must be a positive finite number.");
  }
  for (const auto& u : m.units) {
    if (StepInBackward::steps_in_backward(u.flats[Impl::kTrainable].shard)) {
      throw Error(
          "[remat::parallel] FullyShard::clip_grad_norm: unit '" + u.name +
          "' is updated inside backward (remat::StepInBackward), so no gradient is left to clip: the global norm "
          "needs every gradient before any update. Destroy the StepInBackward to clip, or train without clipping.");
    }
  }
  torch::NoGradGuard no_grad;
  at::Tensor sq =
      at::zeros({1}, at::TensorOptions()
                         .dtype(at::kDouble)
                         .device(m.group.device() == c10::kCUDA ? c10::Device(c10::kCUDA) : c10::Device(c10::kCPU)));
  for (const auto& u : m.units) {
    const at::Tensor& shard = u.flats[Impl::kTrainable].shard;
    if (shard.defined() && shard.grad().defined()) sq += shard.grad().to(at::kDouble).square().sum();
  }
  std::vector<at::Tensor> ts{sq};
  c10d::AllreduceOptions o;
  o.timeout = m.group.timeout();
  try {
    m.group.c10d()->allreduce(ts, o)->wait(m.group.timeout());
  } catch (const std::exception& e) {
    m.collective_failed("all-reduce of the gradient norm", e);
  }
  const double norm = std::sqrt(sq.item<double>());
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    for (auto& u : m.units) {
      at::Tensor& shard = u.flats[Impl::kTrainable].shard;
      if (shard.defined() && shard.grad().defined()) shard.mutable_grad().mul_(coef);
    }
  }
  return norm;
}

void FullyShard::save_full(const std::string& path) {
  Impl& m = *impl_;
  if (m.in_backward)
    throw Error("[remat::parallel] FullyShard::save_full ran during a backward; call it between steps.");
  m.check_gathered();  // NOTE [stale gathered values]: gathered before an optimizer's step
  // Units gathered already (the root between forward() and backward, kept
  // ones) stay so: a backward may still need them.
  std::vector<char> was_gathered;
  for (auto& u : m.units) was_gathered.push_back(u.gathered || u.in_flight());
  for (size_t i = 0; i < m.units.size(); ++i) {
    if (!m.units[i].params.empty()) m.gather(i, /*backward=*/false);
  }
  std::string error;
  if (m.rank == 0) {
    const std::string tmp = path + ".tmp." + std::to_string(::getpid());
    try {
      torch::save(m.module, tmp);
      std::filesystem::rename(tmp, path);
    } catch (const std::exception& e) {
      std::error_code ec;
      std::filesystem::remove(tmp, ec);
      error = "[remat::parallel] FullyShard::save_full could not write '" + path + "': " + message_of(e) +
              ". Give a path in a writable folder.";
    }
  }
  for (size_t i = 0; i < m.units.size(); ++i) {
    if (!was_gathered[i]) m.reshard(i);
  }
  // Every rank learns whether rank 0 wrote the file, and throws alike.
  std::vector<at::Tensor> failed{at::full({1}, error.empty() ? 0.0 : 1.0, at::TensorOptions().dtype(at::kFloat))};
  try {
    m.group.c10d()->allreduce(failed)->wait(m.group.timeout());
  } catch (const std::exception& e) {
    m.collective_failed("all-reduce after save_full", e);
  }
  if (!error.empty()) throw Error(error);
  if (failed[0].item<float>() > 0) {
    throw Error("[remat::parallel] FullyShard::save_full: rank 0 could not write '" + path +
                "' (its error says why); nothing was saved.");
  }
}

void FullyShard::save_sharded(const std::string& prefix) const {
  const Impl& m = *impl_;
  const std::string path = prefix + ".rank" + std::to_string(m.rank) + "-of-" + std::to_string(m.world);
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  std::vector<at::Tensor> shards;  // the shards, then the module's buffers (BatchNorm statistics)
  for (const auto& u : m.units) {
    for (const auto& f : u.flats) {
      if (!f.empty()) shards.push_back(f.shard.detach());
    }
  }
  for (const auto& b : m.module->buffers()) {
    if (b.defined()) shards.push_back(b.detach());
  }
  try {
    torch::save(shards, tmp);
    std::filesystem::rename(tmp, path);
  } catch (const std::exception& e) {
    std::error_code ec;
    std::filesystem::remove(tmp, ec);
    throw Error("[remat::parallel] FullyShard::save_sharded could not write '" + path + "': " + message_of(e) +
                ". Give a prefix in a writable folder.");
  }
  m.group.barrier();  // every rank's file of this step exists when any returns
}

void FullyShard::load_sharded(const std::string& prefix) {
  Impl& m = *impl_;
  const std::string path = prefix + ".rank" + std::to_string(m.rank) + "-of-" + std::to_string(m.world);
  std::vector<Impl::Flat*> mine;  // every shard, in save_sharded's order
  std::vector<const std::string*> unit_of;
  for (auto& u : m.units) {
    for (auto& f : u.flats) {
      if (f.empty()) continue;
      mine.push_back(&f);
      unit_of.push_back(&u.name);
    }
  }
  std::vector<at::Tensor> buffers;
  for (const auto& b : m.module->buffers()) {
    if (b.defined()) buffers.push_back(b);
  }
  // Read and check this rank's file; nothing changes until every rank has.
  std::vector<at::Tensor> shards;
  std::string error;
  if (!std::filesystem::exists(path)) {
    error = "[remat::parallel] FullyShard::load_sharded: '" + path + "' does not exist (" + m.where() +
            " reads <prefix>.rank<r>-of-<world>, one file per rank, as save_sharded wrote them); put each rank's "
            "file where that rank reads it, or give the prefix and world size they were saved with.";
  } else {
    try {
      torch::load(shards, path);
    } catch (const std::exception& e) {
      error = "[remat::parallel] FullyShard::load_sharded could not read '" + path + "': " + message_of(e) + ".";
    }
  }
  if (error.empty() && shards.size() != mine.size() + buffers.size()) {
    error = "[remat::parallel] FullyShard::load_sharded: '" + path + "' holds " + std::to_string(shards.size()) +
            " tensors, this model has " + std::to_string(mine.size()) + " shards and " +
            std::to_string(buffers.size()) + " buffers; load into the model and units it was saved from.";
  }
  for (size_t k = 0; error.empty() && k < buffers.size(); ++k) {
    const at::Tensor& saved = shards[mine.size() + k];
    if (!saved.sizes().equals(buffers[k].sizes()) || saved.scalar_type() != buffers[k].scalar_type()) {
      error = "[remat::parallel] FullyShard::load_sharded: buffer " + std::to_string(k) + " of '" + path +
              "' does not match this model's; load into the model and units it was saved from.";
    }
  }
  for (size_t k = 0; error.empty() && k < mine.size(); ++k) {
    if (shards[k].numel() != mine[k]->shard_numel || shards[k].scalar_type() != mine[k]->shard.scalar_type()) {
      error = "[remat::parallel] FullyShard::load_sharded: shard " + std::to_string(k) + " of '" + path + "' has " +
              std::to_string(shards[k].numel()) + " elements, unit '" + *unit_of[k] + "' " +
              std::to_string(mine[k]->shard_numel) + "; load into the model and units it was saved from.";
    }
  }
  // All or nothing: every rank learns whether every rank can load (the
  // lowest failing rank + 1, or 0).
  std::vector<at::Tensor> failed{at::full({1}, error.empty() ? 0.0 : static_cast<double>(m.world - m.rank),
                                          at::TensorOptions().dtype(at::kFloat))};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::MAX;
  o.timeout = m.group.timeout();
  try {
    m.group.c10d()->allreduce(failed, o)->wait(m.group.timeout());
  } catch (const std::exception& e) {
    m.collective_failed("all-reduce before load_sharded", e);
  }
  if (!error.empty()) throw Error(error);
  if (failed[0].item<float>() > 0) {
    throw Error("[remat::parallel] FullyShard::load_sharded: rank " +
                std::to_string(m.world - static_cast<int>(failed[0].item<float>())) + " of " + std::to_string(m.world) +
                " could not load its file of '" + prefix + "' (its error says why); no rank changed anything.");
  }
  torch::NoGradGuard no_grad;
  for (size_t k = 0; k < mine.size(); ++k) mine[k]->shard.copy_(shards[k]);
  for (size_t k = 0; k < buffers.size(); ++k) buffers[k].copy_(shards[mine.size() + k]);
}

ShardStats FullyShard::stats() const { return impl_->stats; }

void FullyShard::reset_stats() {
  const bool by_allreduce = impl_->stats.reduce_scatter_by_allreduce;
  impl_->stats = ShardStats();
  impl_->stats.reduce_scatter_by_allreduce = by_allreduce;
}

ShardMemory FullyShard::memory() const {
  ShardMemory out;
  for (const auto& u : impl_->units) {
    if (u.params.empty()) continue;
    for (const auto& f : u.flats) {
      if (f.empty()) continue;
      const int64_t item = static_cast<int64_t>(f.shard.element_size());
      out.shard_parameter_bytes += f.shard_numel * item;
      if (f.shard.grad().defined()) out.shard_gradient_bytes += f.shard_numel * item;
    }
    if (u.gathered || u.in_flight()) out.gathered_bytes += u.bytes();
    out.full_parameter_bytes += u.bytes();
    out.largest_unit_bytes = std::max(out.largest_unit_bytes, u.bytes());
  }
  return out;
}

std::vector<ShardUnit> FullyShard::units() const {
  std::vector<ShardUnit> out;
  for (const auto& u : impl_->units) {
    out.push_back({u.name, static_cast<int64_t>(u.params.size()), u.flats[0].numel + u.flats[1].numel,
                   u.flats[0].shard_numel + u.flats[1].shard_numel});
  }
  return out;
}

const ProcessGroup& FullyShard::group() const { return impl_->group; }

}  // namespace remat::parallel
