// remat::CheckpointedSequential: executes a planner Schedule op by op.
// NOTE [planned execution]: forward runs the ops before the first backward
// (kForward without grad, kForwardSave with grad on a detached input that
// becomes a leaf) and returns a_L attached to a chain of autograd nodes, one
// per stage: node i has an edge to node i-1 per tensor of a_i (node 0: to
// the tensors of x; a boundary may hold a vector or tuple of tensors,
// values.h) and one to each parameter of stage i. Autograd calls node L-1
// with dL/da_L; node i runs the schedule's ops up to and including
// kBackward(i) (the recomputations that precede it too) and returns dL/da_i
// and stage i's parameter gradients as its outputs (or delivers them to
// .grad itself as each is complete, NOTE [early delivery] in grad_edges.h).
// So parameter gradients flow through autograd as in a plain run: each
// parameter's hooks fire once per backward with its whole gradient, as soon
// as it is complete (DDP's Reducer overlaps), and
// autograd::grad or backward(inputs=) compute only what they are asked for
// (a node skips what the engine says is not needed). The inner backward of
// a stage captures its gradients at redirected edges (NOTE [redirected
// gradient edges]), never at the parameters, so nothing fires twice.
// retain_graph: the state after the forward part (kept values, saved stage
// graphs) is kept and restored for each further backward. create_graph
// (higher-order gradients): the chain is recomputed once as a whole with its
// graph (RNG replayed), so the returned gradients are differentiable; that
// backward costs plain memory. Every execution of a stage after its first
// replays the first one's RNG, autocast and buffer state, so BatchNorm
// statistics move once per step and dropout masks match a plain run.
// NOTE [side effects of planned re-runs]: the stage's own registered buffers
// are ReplayGuard's; everything else a re-run writes in place (a BatchNorm
// owned elsewhere and called from a lambda, a counter tensor) goes through
// the write guard remat::checkpoint uses (NOTE [recompute side effects]):
// every re-run pushes its interceptor, which copies each pre-existing tensor
// before its first write. The copies are written back once no re-run's
// graph awaits its backward (after the stage's backward, or at once for a
// re-run without grad): writing back bumps the version counters that the
// re-run's graph saved (BatchNorm saves its running statistics), so earlier
// would fail that backward. One guard serves all re-runs pending at once, so
// each tensor is copied before the first of them and gets that value back.
// The profiler guards each of its runs the same way.
#include <remat/sequential.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <numeric>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include <ATen/SequenceNumber.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <remat/error.h>
#include <remat/hooks.h>
#include <remat/memory.h>
#include <remat/optim.h>

#include "../core/dispatch.h"
#include "../core/replay.h"
#include "../core/write_guard.h"
#include "early_stop.h"
#include "floor.h"
#include "grad_edges.h"
#include "levers.h"
#include "observe.h"
#include "values.h"

namespace remat {
namespace detail {

namespace ta = torch::autograd;

struct Execution : std::enable_shared_from_this<Execution> {
  /** What the forward part leaves; restored for each further backward. */
  struct State {
    std::vector<Values> a;           // boundary values a_0..a_L (detached)
    std::vector<Values> leaf;        // s_i: stage input leaves ...
    std::vector<Values> out;         // ... and outputs with their graph
    std::vector<Redirected> edges;   // ... whose gradient edges lead to a sink
    std::vector<bool> from_forward;  // the graph was made by the forward part
    std::vector<int> runs;
  };
  /** A boundary tensor's metadata for the node that receives its gradient. */
  struct Meta {
    bool defined = false;
    at::TensorOptions options;
    std::vector<int64_t> sizes;
  };

  std::shared_ptr<CheckpointedSequentialImpl> owner;
  torch::nn::Sequential seq;
  plan::Schedule schedule;
  int L = 0;
  size_t pc = 0, forward_end_pc = 0;
  bool in_forward_part = false;
  State st;
  std::optional<State> kept;  // retain_graph: the state after the forward part
  bool backward_started = false;
  std::vector<at::Tensor> grads;                      // gradients at the current boundary's tensors
  std::vector<std::vector<at::Tensor>> params;        // per stage: requires grad, distinct
  std::vector<ta::Node*> nodes;                       // per stage (owned by the graph)
  std::vector<std::vector<Meta>> out_meta;            // a_1..a_L
  std::vector<std::optional<ReplayState>> first_run;  // per stage
  std::vector<char> writes_input;                     // per stage (NOTE [stages that write their input])
  /** Leaves a stage uses without registering them (a tensor its forward
   *  closes over, a weight tied LibTorch-style) get their gradient in parts,
   *  one per delivery (accumulate_into), which a parameter's
   *  post-accumulate-grad hook cannot tell from a final one: while this
   *  execution lives, a StepInBackward leaves them to the optimizer's
   *  step(). */
  std::vector<std::unique_ptr<remat::detail::DeferredGradients>> deferred_leaves;
  void defer_unregistered_leaves(const Redirected& r) {
    if (r.other_leaves.empty()) return;
    std::vector<at::Tensor> leaves;
    for (const auto& [leaf, nr] : r.other_leaves) leaves.push_back(leaf);
    deferred_leaves.push_back(std::make_unique<remat::detail::DeferredGradients>(
        std::move(leaves),
        "used inside a CheckpointedSequential stage without being its parameter, so its "
        "gradient arrives in parts"));
  }
  // NOTE [side effects of planned re-runs]: the guard of the re-runs whose
  // writes are not undone yet, and per stage whether its re-run's graph
  // awaits its backward.
  std::unique_ptr<WriteGuard> rerun_writes;
  std::unique_ptr<dispatch::Interceptor> rerun_interceptor;
  std::vector<char> rerun_graph;
  int rerun_graphs = 0;
  /** Early stop's check for kept state (NOTE [early stop in planned
   *  recomputes]): after the stage's backward, are these storages alive? */
  struct KeptCheck {
    std::shared_ptr<const StopRecord> recorded;  // a recording run's record, set if they are not
    std::vector<WeakStorage> storages;
  };
  std::vector<std::optional<KeptCheck>> kept_check;  // per stage
  Values input;                                      // x as given (attached), for create_graph
  bool preserve_rng = true;
  std::vector<bool> input_requires_grad;  // per tensor of x
  std::vector<int64_t> input_versions;    // per tensor of x, after the forward (-1: none to check)

  /** A backward's re-run of stage 0 reads the chain's input: refused if it
   *  was written in place since the forward (a plain run's saved tensors
   *  raise LibTorch's version error; a re-run would compute other values
   *  and wrong gradients without a word). */
  void check_input_unchanged() const {
    for (size_t k = 0; k < input_versions.size() && k < input.ts.size(); ++k) {
      if (input_versions[k] < 0 || input.ts[k]._version() == input_versions[k]) continue;
      throw Error("[remat::CheckpointedSequential] input " + std::to_string(k) +
                  " of the chain was modified in place after the forward (version " +
                  std::to_string(input_versions[k]) + " -> " + std::to_string(input.ts[k]._version()) +
                  "); recomputing from it would give wrong gradients. Modify a clone instead, or keep the input "
                  "unchanged until backward has run.");
    }
  }
  std::unique_ptr<memory::Probe> probe;
  int64_t input_bytes = 0;
  // The chain's own bytes (StepReport::chain_peak_bytes): summed over the
  // intervals where the chain runs (its forward part, each node's apply),
  // so that what other code allocates in between is left out.
  int64_t own = 0, own_peak = 0;
  std::vector<int64_t> op_peak;  // per schedule op: the chain's own bytes at most while it ran
  int64_t ops_skipped = 0;       // by early stop, this step
  const CheckpointedSequentialImpl::Entry* entry = nullptr;         // the plan this execution runs
  double predicted_ms = 0;                                          // the plan\'s, as this execution runs it
  double own_ms = 0;                                                // StepReport::chain_ms, closed intervals
  std::optional<std::chrono::steady_clock::time_point> open_since;  // the interval running now

  /** Counts one interval where the chain runs (when measuring). */
  struct OwnInterval {
    Execution& e;
    std::optional<memory::Probe> p;
    std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
    explicit OwnInterval(Execution& ex, int64_t received = 0) : e(ex) {
      e.open_since = t0;
      if (!e.probe) return;
      e.own += received;  // gradients handed in by the engine become the chain's
      e.own_peak = std::max(e.own_peak, e.own);
      p.emplace(e.probe->device());
    }
    ~OwnInterval() {
      if (e.open_since) {
        e.own_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        e.open_since.reset();
      }
      if (!p) return;
      e.own_peak = std::max(e.own_peak, e.own + p->peak_bytes());
      e.own += p->delta_bytes();
    }
  };
  // NOTE [early delivery]: per stage and parameter, whether this backward
  // lets the stage's inner backward deliver the gradient itself (set by
  // begin_backward); the outer edges invalidated meanwhile, with their node.
  std::vector<std::vector<char>> deliver;
  std::vector<std::pair<detail::AnyNodePtr, std::vector<std::pair<size_t, ta::Edge>>>> detached_edges;
  ta::Node* running = nullptr;  // the node whose apply runs
  // create_graph: per stage, the node's outputs computed by node L-1.
  bool higher_order = false;
  std::vector<ta::variable_list> higher_order_grads;

  std::string who(int i) const {
    return "[remat::CheckpointedSequential] stage " + std::to_string(i) + " (" + (seq->begin() + i)->ptr()->name() +
           ")";
  }

  ~Execution() { restore_rerun_writes(); }

  /** Stage i on in. Its first execution runs as is; every later one (a
   *  re-run) replays the first one's state under the write guard (NOTE
   *  [side effects of planned re-runs]), cut short by early stop when
   *  `cut` (NOTE [early stop in planned recomputes]; seq0: the sequence
   *  number before the run). */
  Values run_stage(int i, const Values& in, bool cut = false, uint64_t seq0 = 0, const StageLever* lever = nullptr) {
    auto& m = *(seq->begin() + i);
    if (st.runs[i]++ == 0) {
      RngRegionLock rng_lock(preserve_rng);  // NOTE [RNG regions and threads]
      first_run[i] = ReplayState::capture(preserve_rng, {device_of(in)}, m.ptr()->buffers(), module_tree(*m.ptr()));
      Values y = run_stage_under(m, in, writes_input[i], who(i), lever);
      out_meta[i].clear();
      for (const auto& t : y.ts) out_meta[i].push_back(t.defined() ? Meta{true, t.options(), t.sizes().vec()} : Meta{});
      return y;
    }
    const bool graph = at::GradMode::is_enabled();
    for (;;) {
      ReplayGuard replay(*first_run[i], /*enable_grad=*/false);
      if (!rerun_writes) {
        rerun_writes = std::make_unique<WriteGuard>();
        rerun_interceptor = make_write_guard_interceptor(rerun_writes.get());
      }
      for (const auto& b : first_run[i]->buffers) rerun_writes->adopt(b);  // ReplayGuard's
      if (graph && !rerun_graph[i]) {
        rerun_graph[i] = 1;
        ++rerun_graphs;
      }
      // Early stop sees every op only with no other interceptor than ours.
      const bool alone = dispatch::current() == nullptr;
      try {
        Values y;
        {
          dispatch::Scope ops(rerun_interceptor.get());
          y = cut && lever == nullptr && early_stop_available(alone ? rerun_interceptor.get() : nullptr)
                  ? run_cut(i, m, in, seq0)
                  : run_stage_under(m, in, writes_input[i], who(i), lever);
        }
        if (rerun_graphs == 0) restore_rerun_writes();
        return y;
      } catch (const Diverged&) {
        // Outputs were produced from ops that did not run: run it all again
        // (the RNG replayed again), and never cut it again.
        entry->stops->disable(i);
        cut = false;
      }
    }
  }

  /** A re-run cut short after the ops whose results backward reads (once a
   *  full run recorded them); the record is kept only if the stage keeps no
   *  state (checked after its backward: check_kept_state). */
  Values run_cut(int i, torch::nn::AnyModule& m, const Values& in, uint64_t seq0) {
    StopRecords& recs = *entry->stops;
    if (auto rec = recs.get(i); rec && rec->usable) {
      StopReplay replay(rec);
      Values y = run_stage_module(m, in, writes_input[i], who(i));
      ops_skipped += replay.skipped();
      if (replay.diverged()) {
        recs.disable(i);
      } else {
        kept_check[i] = KeptCheck{nullptr, replay.produced()};
      }
      return y;
    }
    if (!recs.wants_record(i)) return run_stage_module(m, in, writes_input[i], who(i));
    StopRecorder recorder;
    Values y = run_stage_module(m, in, writes_input[i], who(i));
    auto rec = recorder.finish(y.ts, seq0);
    if (rec->usable) {
      kept_check[i] = KeptCheck{rec, recorder.after_cut()};
    } else {
      recs.set(i, std::move(rec));
    }
    return y;
  }

  /** After stage i's backward, which let go of its outputs and graph: a
   *  storage of its cut-able ops still alive is kept by the stage (NOTE
   *  [early stop in planned recomputes], "Kept state"). A recording's
   *  record is then dropped; a cut run's produced values are replaced by a
   *  full run's (without grad, from a_i, live until the stage's backward). */
  void check_kept_state(int i) {
    if (!kept_check[i]) return;
    KeptCheck c = std::move(*kept_check[i]);
    kept_check[i].reset();
    StopRecords& recs = *entry->stops;
    const bool kept = any_alive(c.storages);
    c.storages.clear();
    if (c.recorded) {
      if (kept) {
        recs.disable(i);
      } else {
        recs.set(i, std::move(c.recorded));
      }
      return;
    }
    if (!kept) return;
    recs.disable(i);
    if (st.a[i].empty()) return;
    at::NoGradGuard no_grad;
    run_stage(i, st.a[i]);
    --st.runs[i];  // not one of the schedule's executions
  }

  /** Writes back what the pending re-runs wrote (NOTE [side effects of
   *  planned re-runs]). */
  void restore_rerun_writes() {
    if (!rerun_writes) return;
    {
      dispatch::Suspend own;  // remat's own work: no interceptor sees the restore
      rerun_writes->restore();
    }
    rerun_interceptor.reset();
    rerun_writes.reset();
  }

  /** After stage i's backward: its re-run's graph is gone. */
  void rerun_graph_done(int i) {
    if (!rerun_graph[i]) return;
    rerun_graph[i] = 0;
    if (--rerun_graphs == 0) restore_rerun_writes();
  }

  /** NOTE [early stop in planned recomputes]: a recompute in backward
   *  whose output no later op reads (only its graph is needed). */
  bool cut_allowed(int i) const {
    if (in_forward_part || higher_order || !owner->options_.early_stop() || !entry || !entry->stops) return false;
    return schedule.ops[pc].stage == i && plan::output_unread_until_backward(schedule, pc);
  }

  static c10::Device device_of(const Values& v) {
    for (const auto& t : v.ts) {
      if (t.defined()) return t.device();
    }
    return c10::Device(c10::kCPU);
  }

  void need(bool ok, const plan::Op& op, const char* what) const {
    if (!ok) {
      throw Error("[remat::CheckpointedSequential] op #" + std::to_string(pc) + " " + plan::to_string(op) + ": " +
                  what + "; the schedule does not fit this chain (validate it with remat::plan::simulate).");
    }
  }

  /** Stage i's backward: dL/da_i into `grads` (each tensor when wanted) and
   *  the wanted parameter gradients into param_grads (aligned with
   *  params[i]). want: the node's outputs (a_i's tensors, then params[i]). */
  void stage_backward(int i, const std::vector<bool>& want, ta::variable_list& param_grads) {
    Values o = std::move(st.out[i]);
    Values in = std::move(st.leaf[i]);
    Redirected r = std::move(st.edges[i]);
    st.out[i] = Values();
    st.leaf[i] = Values();
    st.edges[i] = Redirected();
    const bool retain = kept.has_value() && st.from_forward[i];
    std::vector<at::Tensor> g = std::move(grads);
    const size_t n_in = in.size();
    grads.assign(n_in, at::Tensor());
    // Tensors passed through unchanged (a mask) take their gradient to the
    // input directly; the rest are the inner backward's roots.
    std::vector<at::Tensor> roots, seeds;
    for (size_t k = 0; k < o.size() && k < g.size(); ++k) {
      if (!o[k].defined() || !o[k].requires_grad() || !g[k].defined()) continue;
      if (o[k].grad_fn() == nullptr) {
        size_t j = 0;
        while (j < n_in && !(in[j].defined() && in[j].unsafeGetTensorImpl() == o[k].unsafeGetTensorImpl())) ++j;
        if (j < n_in) {
          if (want[j]) grads[j] = grads[j].defined() ? grads[j] + g[k] : g[k];
        } else {
          // A leaf returned as is, not this stage's input: a part of its gradient.
          deferred_leaves.push_back(std::make_unique<remat::detail::DeferredGradients>(
              std::vector<at::Tensor>{o[k]}, "returned as is by a CheckpointedSequential stage"));
          accumulate_into(o[k], g[k]);
        }
        continue;
      }
      roots.push_back(std::move(o[k]));
      seeds.push_back(std::move(g[k]));
    }
    g.clear();
    o = Values();
    if (roots.empty()) return;
    // Sink inputs to capture: the inputs (targets 0..n_in-1), wanted
    // parameters, and leaves used but not registered (delivered to them
    // afterwards).
    ta::edge_list outputs;
    std::vector<int> slot;  // k < n_in: input k, n_in + k: parameter k, < 0: other leaf -1-k
    const int ni = static_cast<int>(n_in);
    for (int j = 0; j < ni; ++j) {
      if (want[j] && r.target_input[j] >= 0) {
        outputs.push_back(r.edge(r.target_input[j]));
        slot.push_back(j);
      }
    }
    // Parameters delivered during the inner backward (NOTE [early
    // delivery]): their hooks are armed for this call only.
    struct Disarm {
      std::vector<DeliverHook*> hooks;
      ~Disarm() {
        for (auto* h : hooks) h->target = at::Tensor();
      }
    } armed;
    std::vector<size_t> early;
    for (size_t k = 0; k < params[i].size(); ++k) {
      if (want[n_in + k] && r.target_input[n_in + k] >= 0) {
        // Only onto an existing .grad (added in place): a first gradient
        // becomes .grad as it is, and the engine may take it over only
        // from the node's outputs (here it would be copied: +1 gradient).
        if (deliver[i][k] && params[i][k].grad().defined()) {
          // Its update runs in a nested graph task: its StepInBackward, if
          // any, ends its updates with this (the outer) backward.
          queue_end_of_updates(params[i][k]);
          DeliverHook* h = r.hooks[r.target_input[n_in + k]];
          h->target = params[i][k];
          armed.hooks.push_back(h);
          early.push_back(n_in + k);
        }
        outputs.push_back(r.edge(r.target_input[n_in + k]));
        slot.push_back(ni + static_cast<int>(k));
      }
    }
    for (size_t k = 0; k < r.other_leaves.size(); ++k) {
      outputs.push_back(r.edge(r.other_leaves[k].second));
      slot.push_back(-1 - static_cast<int>(k));
    }
    if (outputs.empty()) return;
    // Only the graph's own references keep the stage's outputs and the
    // gradients at them alive during the inner backward: an output unless
    // an op saved it, a gradient until the stage's last op has used it.
    st.a[i + 1].clear();
    if (!early.empty()) detach_edges(early);
    ta::variable_list got = backward_releasing(std::move(roots), std::move(seeds), retain, outputs);
    for (size_t k = 0; k < got.size(); ++k) {
      if (slot[k] >= ni) {
        param_grads[slot[k] - ni] = std::move(got[k]);
      } else if (slot[k] >= 0) {
        at::Tensor& gj = grads[slot[k]];
        gj = gj.defined() && got[k].defined() ? gj + got[k] : (gj.defined() ? gj : std::move(got[k]));
      } else {
        accumulate_into(r.other_leaves[-1 - slot[k]].first, got[k]);
      }
    }
  }

  /** The running node's edges at `outputs` stop leading anywhere until this
   *  backward ends: their gradients were delivered already, and the engine
   *  would otherwise call the parameter's hooks again with an undefined
   *  gradient. Put back by a callback at the end of the backward (so the
   *  graph is whole for a retained second backward). */
  void detach_edges(const std::vector<size_t>& outputs) {
    auto node = detail::node_ref(running);
    std::vector<std::pair<size_t, ta::Edge>> saved;
    for (size_t k : outputs) {
      saved.emplace_back(k, node->next_edge(k));
      node->next_edges()[k] = ta::Edge();
    }
    if (detached_edges.empty()) {
      // Once per backward. The callback holds the execution: its nodes let
      // go of it as they finish (retain_graph=false), before the callback.
      ta::Engine::get_default_engine().queue_callback([self = shared_from_this()] { self->restore_edges(); });
    }
    detached_edges.emplace_back(std::move(node), std::move(saved));
  }

  void restore_edges() {
    for (auto& [node, saved] : detached_edges) {
      for (auto& [k, e] : saved) node->next_edges()[k] = std::move(e);
    }
    detached_edges.clear();
  }

  /** Which parameter gradients the stages deliver themselves in this
   *  backward (NOTE [early delivery]): those the backward accumulates into
   *  .grad (a plain backward(), or backward(inputs=) naming them; not
   *  autograd::grad, which captures them) and whose AccumulateGrad no other
   *  edge of this backward's graph reaches (a parameter shared by two
   *  stages, or tied to a head outside the chain, gets one summed
   *  gradient from the engine, as before). */
  void plan_delivery() {
    deliver.assign(L, {});
    const auto* info = ta::get_current_graph_task_exec_info();
    const auto* graph = ta::get_current_graph_task_nodes_in_graph();
    std::unordered_map<const ta::Node*, int> incoming;  // our parameters' accumulators
    for (int i = 0; i < L; ++i) {
      for (size_t k = 0; k < params[i].size(); ++k) {
        const auto& e = nodes[i]->next_edge(nodes[i]->num_outputs() - params[i].size() + k);
        if (e.is_valid()) incoming.emplace(e.function.get(), 0);
      }
    }
    if (info && graph) {
      for (const ta::Node* n : *graph) {
        for (const auto& e : n->next_edges()) {
          auto it = incoming.find(e.function.get());
          if (it != incoming.end()) ++it->second;
        }
      }
    }
    for (int i = 0; i < L; ++i) {
      deliver[i].assign(params[i].size(), 0);
      if (!info || !graph) continue;
      for (size_t k = 0; k < params[i].size(); ++k) {
        const auto& e = nodes[i]->next_edge(nodes[i]->num_outputs() - params[i].size() + k);
        if (!e.is_valid()) continue;
        bool accumulates = info->empty();
        if (!accumulates) {
          auto it = info->find(e.function.get());
          accumulates = it != info->end() && it->second.needed_ && !it->second.captures_;
        }
        deliver[i][k] = accumulates && incoming[e.function.get()] == 1;
      }
    }
  }

  void step(const plan::Op& op, const std::vector<bool>* want, ta::variable_list* param_grads) {
    const int i = op.stage;
    switch (op.kind) {
      case plan::OpKind::kForward: {
        need(!st.a[i].empty(), op, "its input is not live");
        if (i == 0 && !in_forward_part) check_input_unchanged();
        Values y;
        {
          at::NoGradGuard no_grad;
          y = run_stage(i, st.a[i]);
        }
        st.a[i + 1] = std::move(y);
        break;
      }
      case plan::OpKind::kForwardSave: {
        need(!st.a[i].empty(), op, "its input is not live");
        if (i == 0 && !in_forward_part) check_input_unchanged();
        c10::AutoGradMode grad_on(true);
        Values in = st.a[i].detached();
        for (size_t k = 0; k < in.size(); ++k) {
          if (i > 0 ? differentiable(in[k]) : input_requires_grad[k]) in[k].requires_grad_(true);
        }
        const uint64_t seq0 = at::sequence_number::peek();
        // Under a stage option (NOTE [stage options]) the stage runs as a
        // selective region or offloading, and is never cut short.
        const StageLever* lever = nullptr;
        if (op.option > 0) {
          need(entry && entry->levers && static_cast<size_t>(i) < entry->levers->stages.size() &&
                   static_cast<size_t>(op.option) <= entry->levers->stages[i].size(),
               op, "the stage has no such option (profile with ProfileOptions::selective_levels or offload)");
          lever = &entry->levers->stages[i][op.option - 1];
        }
        Values y = run_stage(i, in, lever == nullptr && cut_allowed(i), seq0, lever);
        std::vector<at::Tensor> targets = in.ts;
        targets.insert(targets.end(), params[i].begin(), params[i].end());
        st.edges[i] = redirect_gradient_edges(y.ts, targets, seq0);
        defer_unregistered_leaves(st.edges[i]);
        st.from_forward[i] = in_forward_part;
        st.leaf[i] = std::move(in);
        st.a[i + 1] = y.detached();
        st.out[i] = std::move(y);
        break;
      }
      case plan::OpKind::kBackward: {
        need(!st.out[i].ts.empty(), op, "its saved set is not live");
        need(want != nullptr, op, "a backward of another stage comes first");
        stage_backward(i, *want, *param_grads);
        st.a[i + 1].clear();
        check_kept_state(i);
        rerun_graph_done(i);
        break;
      }
      case plan::OpKind::kDrop: st.a[i].clear(); break;
    }
  }

  /** step() of op pc, its own peak recorded (StepReport::op_peak_bytes)
   *  when measuring: the interval's bytes so far plus the op's peak. */
  void measured_step(OwnInterval& interval, const std::vector<bool>* want, ta::variable_list* param_grads) {
    const plan::Op& op = schedule.ops[pc];
    if (!interval.p) return step(op, want, param_grads);
    const int64_t base = own + interval.p->delta_bytes();
    memory::Probe during(interval.p->device());
    step(op, want, param_grads);
    op_peak[pc] = std::max(op_peak[pc], base + during.peak_bytes());
  }

  /** The forward part: ops up to the first backward. Returns a_L. */
  Values run_forward() {
    own = own_peak = input_bytes;
    op_peak.assign(schedule.ops.size(), probe ? 0 : -1);
    OwnInterval interval(*this);
    in_forward_part = true;
    while (pc < schedule.ops.size() && schedule.ops[pc].kind != plan::OpKind::kBackward) {
      measured_step(interval, nullptr, nullptr);
      ++pc;
    }
    forward_end_pc = pc;
    in_forward_part = false;
    need(!st.out[L - 1].ts.empty(), plan::Op{plan::OpKind::kForwardSave, L - 1}, "the forward part must end with it");
    return st.a[L];
  }

  /** Called by node L-1 first: sets up this backward (retain_graph). */
  void begin_backward() {
    if (backward_started) {
      if (!kept) {
        throw Error(
            "[remat::CheckpointedSequential] internal: a second backward through the chain without its state; "
            "please report this bug.");
      }
      st = *kept;
      pc = forward_end_pc;
    }
    backward_started = true;
    restore_edges();  // a backward that failed left them detached
    // A backward that failed left re-run writes and checks pending.
    restore_rerun_writes();
    rerun_graph.assign(L, 0);
    rerun_graphs = 0;
    kept_check.assign(L, std::nullopt);
    plan_delivery();
    if (ta::get_current_graph_task_keep_graph()) {
      if (!kept) kept = st;
    } else {
      kept.reset();
    }
  }

  /** The gradients node L-1 receives: one per tensor of a_L. A single
   *  tensor result gets zeros when the engine passes none (as before); in
   *  a vector or tuple an unused tensor contributes nothing. */
  std::vector<at::Tensor> final_grads(ta::variable_list& in, const Values& y) const {
    std::vector<at::Tensor> g(in.begin(), in.end());
    if (y.kind == Values::Kind::kTensor && !g[0].defined()) g[0] = at::zeros_like(y[0]);
    return g;
  }

  /** Node i's work. */
  ta::variable_list backward_stage(int i, ta::Node& node, ta::variable_list&& in_grads) {
    std::vector<bool> want(node.num_outputs());
    for (size_t k = 0; k < want.size(); ++k) want[k] = node.task_should_compute_output(k);
    running = &node;
    // Gradients from outside the chain (node L-1's, from the head and loss)
    // become the chain's. Node i < L-1 receives what node i+1 returned,
    // which node i+1's interval counted already (still live at its end).
    int64_t received = 0;
    for (const auto& g : in_grads) {
      if (g.defined() && i == L - 1) received += static_cast<int64_t>(g.storage().nbytes());
    }
    std::optional<OwnInterval> interval;
    interval.emplace(*this, received);
    if (i == L - 1) {
      higher_order = at::GradMode::is_enabled();  // create_graph
      if (higher_order) return higher_order_backward(in_grads);
      begin_backward();
      grads = final_grads(in_grads, st.a[L]);
      // As below: kept here, a dense loss gradient (a head's, not a bare
      // .sum()'s expanded scalar) would live through the whole backward.
      in_grads.clear();
    } else if (higher_order) {
      return std::move(higher_order_grads[i]);
    } else {
      grads.assign(std::make_move_iterator(in_grads.begin()), std::make_move_iterator(in_grads.end()));
      in_grads.clear();  // the only references: freed inside the stage's backward
    }
    ta::variable_list result(node.num_outputs());
    ta::variable_list param_grads(params[i].size());
    bool done = false;
    while (pc < schedule.ops.size() && !done) {
      const plan::Op& op = schedule.ops[pc];
      done = op.kind == plan::OpKind::kBackward && op.stage == i;
      measured_step(*interval, done ? &want : nullptr, &param_grads);
      ++pc;
    }
    need(done, plan::Op{plan::OpKind::kBackward, i}, "the schedule ends before it");
    const size_t n_in = node.num_outputs() - params[i].size();
    for (size_t k = 0; k < param_grads.size(); ++k) result[n_in + k] = std::move(param_grads[k]);
    for (size_t j = 0; j < n_in && j < grads.size(); ++j) {
      if (want[j]) result[j] = std::move(grads[j]);
    }
    grads.clear();
    if (i == 0) {
      interval.reset();  // the chain's last interval ends before the report
      finish();
    }
    return result;
  }

  /** create_graph: recompute the chain with its graph from the attached
   *  input, gradients with create_graph; node L-1 returns its share, the
   *  other nodes theirs (NOTE above). The forward part's state is left as
   *  it is, for a later ordinary backward. */
  ta::variable_list higher_order_backward(ta::variable_list& grads_out) {
    const uint64_t seq0 = at::sequence_number::peek();
    check_input_unchanged();  // the re-run below reads the input
    Values h = input;
    // Re-runs: their writes are undone when the execution ends (the graph
    // made here lives on in the returned gradients).
    ++rerun_graphs;
    if (!rerun_writes) {
      rerun_writes = std::make_unique<WriteGuard>();
      rerun_interceptor = make_write_guard_interceptor(rerun_writes.get());
    }
    for (int i = 0; i < L; ++i) {
      auto& m = *(seq->begin() + i);
      ReplayGuard replay(*first_run[i], /*enable_grad=*/true);
      for (const auto& b : first_run[i]->buffers) rerun_writes->adopt(b);
      dispatch::Scope ops(rerun_interceptor.get());
      h = run_stage_module(m, h, writes_input[i], who(i));
    }
    std::vector<at::Tensor> targets = input.ts;
    std::vector<std::pair<int, int>> where;  // (stage, output index)
    for (size_t j = 0; j < input.size(); ++j) where.emplace_back(0, static_cast<int>(j));
    for (int i = 0; i < L; ++i) {
      const int n_in = static_cast<int>(nodes[i]->num_outputs() - params[i].size());
      for (size_t k = 0; k < params[i].size(); ++k) {
        targets.push_back(params[i][k]);
        where.emplace_back(i, n_in + static_cast<int>(k));
      }
    }
    higher_order_grads.assign(L, {});
    for (int i = 0; i < L; ++i) higher_order_grads[i].resize(nodes[i]->num_outputs());
    Redirected r = redirect_gradient_edges(h.ts, targets, seq0);
    ta::edge_list outputs;
    std::vector<size_t> target_of;
    for (size_t t = 0; t < targets.size(); ++t) {
      const auto [stage, k] = where[t];
      if (r.target_input[t] < 0 || !nodes[stage]->task_should_compute_output(k)) continue;
      if (t < input.size() && !input_requires_grad[t]) continue;
      outputs.push_back(r.edge(r.target_input[t]));
      target_of.push_back(t);
    }
    const size_t n_targets = outputs.size();
    for (const auto& [leaf, nr] : r.other_leaves) outputs.push_back(r.edge(nr));
    std::vector<at::Tensor> g = final_grads(grads_out, h);
    ta::edge_list roots;
    ta::variable_list seeds;
    for (size_t k = 0; k < h.size(); ++k) {
      if (h[k].defined() && h[k].requires_grad() && g[k].defined()) {
        roots.push_back(ta::impl::gradient_edge(h[k]));
        seeds.push_back(g[k]);
      }
    }
    if (!outputs.empty() && !roots.empty()) {
      ta::variable_list got = ta::Engine::get_default_engine().execute(
          // keep_graph: the higher-order backward runs through h's graph.
          roots, seeds, /*keep_graph=*/true, /*create_graph=*/true, /*accumulate_grad=*/false, outputs);
      for (size_t k = 0; k < n_targets; ++k) {
        const auto [stage, idx] = where[target_of[k]];
        higher_order_grads[stage][idx] = std::move(got[k]);
      }
      for (size_t k = 0; k < r.other_leaves.size(); ++k) accumulate_into(r.other_leaves[k].first, got[n_targets + k]);
    }
    return std::move(higher_order_grads[L - 1]);
  }

  void finish() {
    StepReport report;
    report.forwards_per_stage = st.runs;
    report.recompute_ops_skipped = ops_skipped;
    report.chain_ms =
        own_ms +
        (open_since ? std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - *open_since).count()
                    : 0.0);
    own_ms = 0;
    ops_skipped = 0;
    if (probe) {
      report.measured_peak_bytes = probe->peak_bytes() + input_bytes;
      report.chain_peak_bytes = std::max(own_peak, own);  // node 0's interval is still open
      report.op_peak_bytes = std::move(op_peak);
    }
    op_peak.clear();
    probe.reset();
    restore_rerun_writes();
    st = State();
    std::lock_guard<std::mutex> lock(*owner->mu_);
    report.step_peak_bytes = owner->last_step_.step_peak_bytes;
    report.outside_bytes = owner->last_step_.outside_bytes;
    const double chain_ms = report.chain_ms;
    owner->last_step_ = std::move(report);
    owner->last_chain_entry_ = const_cast<CheckpointedSequentialImpl::Entry*>(entry);
    ++owner->chain_steps_;
    if (entry && device_of(input).is_cpu()) {  // CPU times only: a CUDA chain's are not synchronized here
      owner->note_step_time(*owner->last_chain_entry_, schedule, predicted_ms, chain_ms);
    }
  }
};

namespace {

struct StageBackward : ta::Node {
  std::shared_ptr<Execution> exec;
  int stage = 0;

  ta::variable_list apply(ta::variable_list&& grads) override {
    if (!exec) {
      throw Error(
          "[remat::CheckpointedSequential] backward through the chain after its graph was freed; run forward "
          "again, or pass retain_graph=true to the first backward.");
    }
    return exec->backward_stage(stage, *this, std::move(grads));
  }
  void release_variables() override { exec.reset(); }
  std::string name() const override { return "remat::CheckpointedSequentialBackward"; }
};

/** Everything that changes the chain's costs: kind, dtype, device, sizes
 *  and layout of each input tensor, whether each and each parameter require
 *  grad, train/eval mode, and the autocast state. */
std::vector<int64_t> plan_key(const Values& x, const torch::nn::Sequential& seq) {
  std::vector<int64_t> key{static_cast<int64_t>(x.kind), static_cast<int64_t>(x.size()), seq->is_training()};
  const AutocastState ac = AutocastState::capture();
  key.insert(key.end(), {ac.cpu_enabled, static_cast<int64_t>(ac.cpu_dtype), ac.cuda_enabled,
                         static_cast<int64_t>(ac.cuda_dtype)});
  for (const auto& m : seq->modules(/*include_self=*/false)) key.push_back(m->is_training());
  for (const auto& p : seq->parameters()) key.push_back(p.requires_grad());
  for (const auto& t : x.ts) {
    key.push_back(-1);  // separates the tensors
    if (!t.defined()) continue;
    key.insert(key.end(),
               {static_cast<int64_t>(t.scalar_type()), static_cast<int64_t>(t.device().type()), t.device().index(),
                t.requires_grad(), t.is_contiguous(), t.is_contiguous(at::MemoryFormat::ChannelsLast)});
    key.push_back(-2);  // separates the flags from the sizes
    for (auto d : t.sizes()) key.push_back(d);
  }
  return key;
}

}  // namespace

/** NOTE [parameter gradients in the plan]: a stage's backward that finds a
 *  parameter's .grad undefined (the first step, or zero_grad() setting
 *  gradients to none, LibTorch's default) allocates it, and it stays until
 *  the optimizer's step; with .grad kept (zeroed in place) nothing is
 *  allocated. Per stage: the bytes of the gradients its backward would
 *  allocate now (each parameter counted at the last stage that uses it,
 *  whose backward runs first). */
std::vector<int64_t> new_param_grad_bytes(const torch::nn::Sequential& seq) {
  std::vector<int64_t> out(seq->size(), 0);
  std::unordered_set<const c10::TensorImpl*> seen;
  for (size_t i = seq->size(); i-- > 0;) {
    for (const auto& p : (seq->begin() + static_cast<std::ptrdiff_t>(i))->ptr()->parameters()) {
      if (!p.requires_grad() || !seen.insert(p.unsafeGetTensorImpl()).second || p.grad().defined()) continue;
      out[i] += static_cast<int64_t>(p.numel()) * static_cast<int64_t>(p.element_size());
    }
  }
  return out;
}

/** The chain with the parameter gradients that its stages' backwards
 *  allocate charged to the boundary gradients: |grad_j| grows by those of
 *  stages j..L-1, which are live from their backward on, so every op after
 *  backward(i) counts them. backward(i) allocates grad_i, which now holds
 *  the gradients of stages above i as well, while grad_{i+1} still holds
 *  them: its backward_freed_bytes grow by those, so that its peak counts
 *  them once, plus its own. The op model needs nothing new. */
plan::Chain with_param_grads(const plan::Chain& chain, const std::vector<int64_t>& grad_bytes) {
  plan::Chain c = chain;
  int64_t after = 0;  // stages above i
  for (int i = c.size() - 1; i >= 0; --i) {
    plan::Stage& st = c.stages[i];
    st.output_grad_bytes = chain.stages[i].grad_bytes() + after;
    st.backward_freed_bytes += after;
    for (plan::StageOption& o : st.options) o.backward_freed_bytes += after;
    after += grad_bytes[static_cast<size_t>(i)];
  }
  c.input_grad_bytes = chain.grad_bytes(0) + after;
  return c;
}

/** NOTE [the caller's output]: the runtime frees the chain's output a_L at
 *  the start of the last stage's backward (or with its saved set), and the
 *  op model with it. A caller that still holds it (`auto y = net->forward(x)`,
 *  or a step written as one expression, whose temporaries live until
 *  backward() returns) keeps |a_L| live from there to the end: the chain
 *  with those bytes charged, as with_param_grads charges gradients, to every
 *  boundary gradient below L (each backward(i < L-1) frees them again at its
 *  peak, so that they count once), and never freed by backward(L-1). */
plan::Chain with_held_output(const plan::Chain& chain) {
  plan::Chain c = chain;
  const int L = c.size();
  const int64_t held = c.stages[static_cast<size_t>(L - 1)].output_bytes;
  for (int i = 0; i < L - 1; ++i) {
    plan::Stage& st = c.stages[static_cast<size_t>(i)];
    st.output_grad_bytes = chain.stages[static_cast<size_t>(i)].grad_bytes() + held;
    st.backward_freed_bytes += held;
    for (plan::StageOption& o : st.options) o.backward_freed_bytes += held;
  }
  c.input_grad_bytes = chain.grad_bytes(0) + held;
  return c;
}

}  // namespace detail

namespace detail {

// NOTE [drop-in through a Sequential member]: the usual C++ model holds its
// body as a member (`torch::nn::Sequential body{nullptr};`, registered as
// "body") and its forward calls `body->forward(x)`. replace_module("body",
// ck) then changes only the model's registry: forward still calls the
// plain Sequential, and training runs at plain memory with nothing to show
// for it. The Sequential cannot be planned in place (its forward is not
// virtual, and LibTorch has no forward hooks), so the wrapper detects it:
// a tensor hook on the Sequential's first parameter that requires grad,
// shared by every wrapper of that Sequential, throws when a backward
// reaches it while no wrapper of the Sequential has run a forward yet
// (their chains' backwards reach it only after such a forward) and one of
// them is held by a registry: by a reference that is no
// CheckpointedSequential holder (the holders count themselves in
// holder_count()): a model's children beside the user's holder
// (replace_module(name, ck.ptr())), or alone (replace_module with a
// temporary holder, the usual way to write it). A wrapper held by the
// user's holders alone (copies included), built next to its Sequential to
// compare with a plain run or to look at a plan, is left alone. The hook is removed when the last
// wrapper of the Sequential is destroyed. Not covered: a model that calls
// the wrapper once and then its plain member, and a wrapper registered in a
// model through which nothing has run while its Sequential is also run
// plain elsewhere (that throws: call the wrapper).
struct Tripwire {
  std::atomic<bool> ran{false};
  at::Tensor param;
  unsigned hook = 0;
  std::mutex mu;
  std::vector<const CheckpointedSequentialImpl*> owners;  // the wrappers alive
  /** One wrapper is held by a registry: by a reference that is no
   *  CheckpointedSequential holder (a model's children, beside the user's
   *  holder or alone when the user's was a temporary). A wrapper held by the
   *  user's holders alone (copies included) is left alone. */
  bool registered() {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto* o : owners) {
      if (o->weak_from_this().use_count() > o->holder_count()->load()) return true;
    }
    return false;
  }
  ~Tripwire() {
    if (!param.defined()) return;
    try {
      param.remove_hook(hook);
    } catch (...) {  // a destructor does not throw
    }
  }
};

namespace {

std::string member_call_error(const std::string& param) {
  return "[remat::CheckpointedSequential] a backward reached parameter \"" + param +
         "\" of the wrapped Sequential through a plain run of its modules, and no CheckpointedSequential over "
         "them has run: the model's forward calls its own torch::nn::Sequential member, and replace_module(name, "
         "ck) changed only the registry (training would run plain, at plain memory). Call the wrapper instead: "
         "hold it in the member that forward calls (declare `remat::CheckpointedSequential body{nullptr};` and "
         "assign `body = register_module(\"body\", remat::CheckpointedSequential(seq, options));`), or call "
         "ck->forward(x) where forward called the Sequential.";
}

std::shared_ptr<Tripwire> tripwire_for(const torch::nn::Sequential& seq) {
  static std::mutex mu;
  static std::map<const torch::nn::SequentialImpl*, std::weak_ptr<Tripwire>> all;
  std::lock_guard<std::mutex> lock(mu);
  for (auto it = all.begin(); it != all.end();) it = it->second.expired() ? all.erase(it) : std::next(it);
  if (auto t = all[seq.get()].lock()) return t;
  auto t = std::make_shared<Tripwire>();
  for (const auto& item : seq->named_parameters()) {
    if (!item.value().requires_grad()) continue;
    std::weak_ptr<Tripwire> weak = t;
    const std::string name = item.key();
    t->hook = item.value().register_hook([weak, name](const at::Tensor&) {
      auto w = weak.lock();
      if (w && !w->ran.load() && w->registered()) throw Error(member_call_error(name));
    });
    t->param = item.value();
    break;
  }
  all[seq.get()] = t;
  return t;
}

}  // namespace
}  // namespace detail

namespace {

/** NOTE [stage options]: a stage's menu (ProfileOptions::selective_levels,
 *  offload) is planned by optimal() with the rest of the schedule, in the
 *  persistent class (plan::OptimalScope). A plan that uses a disk offload
 *  option must fit with the stores' in-flight bytes (Levers::
 *  inflight_margin) added, whatever the disk's pace. So the optimal plan is
 *  the fastest of: the chain without its menu (in the scope asked for, all
 *  schedules where cheap), without its disk options at the budget, and
 *  with them at the budget less the margin. The menu never makes a plan
 *  slower than the same profile without it. */
int64_t lowest_peak(const plan::Chain& chain, const detail::Levers* levers) {
  const int64_t margin = levers ? levers->inflight_margin() : 0;
  if (margin == 0) return plan::min_feasible_peak_bytes(chain);
  return std::min(plan::min_feasible_peak_bytes(levers->without_disk(chain)),
                  plan::min_feasible_peak_bytes(chain) + margin);
}

plan::Plan solve_chain(const plan::Chain& chain, const detail::Levers* levers, const plan::SolveOptions& so) {
  if (!chain.has_options() || so.budget_bytes <= 0 || so.algorithm != plan::Algorithm::kOptimal) {
    plan::Chain bare = chain;
    for (auto& st : bare.stages) st.options.clear();
    return plan::solve(bare, so);
  }
  // Candidates: without the menu (in the scope asked for: all schedules
  // where cheap, which the menu's persistent scope does not search),
  // without disk offload, and with it at the budget less the margin.
  const int64_t margin = levers ? levers->inflight_margin() : 0;
  const int64_t lowest = lowest_peak(chain, levers);
  std::vector<plan::Plan> fit;
  std::string first_error;  // a failure other than "does not fit" (a DP table too large)
  auto attempt = [&](const plan::Chain& c, int64_t budget, plan::OptimalScope scope) {
    if (budget <= 0) return;
    plan::SolveOptions o = so;
    o.budget_bytes = budget;
    o.scope = scope;
    try {
      fit.push_back(plan::solve(c, o));
    } catch (const Error& e) {
      if (budget >= plan::min_feasible_peak_bytes(c) && first_error.empty()) first_error = e.what();
    }
  };
  plan::Chain bare = chain;
  for (auto& st : bare.stages) st.options.clear();
  attempt(bare, so.budget_bytes, so.scope);
  const plan::Chain kept = levers ? levers->without_disk(chain) : chain;
  const plan::OptimalScope menu_scope = plan::OptimalScope::kPersistent;
  attempt(kept, so.budget_bytes, menu_scope);
  if (margin > 0) attempt(chain, so.budget_bytes - margin, menu_scope);
  if (fit.empty() && !first_error.empty() && so.budget_bytes >= lowest) throw Error(first_error);
  if (fit.empty()) {
    throw Error("[remat::plan] no schedule fits in " + format_bytes(so.budget_bytes) +
                "; the smallest feasible peak is " + format_bytes(lowest) +
                (margin > 0 ? " (a plan that offloads to disk counts " + format_bytes(margin) +
                                  " for the stores' writes and reads in flight)"
                            : std::string()) +
                ". Raise memory_budget_bytes" +
                (margin > 0 ? std::string(", or lower the offload options' max_inflight_bytes.") : std::string(".")));
  }
  size_t best = 0;
  for (size_t k = 1; k < fit.size(); ++k) {
    if (fit[k].prediction.time_ms < fit[best].prediction.time_ms) best = k;
  }
  return fit[best];
}

torch::nn::Sequential join(const std::vector<torch::nn::Sequential>& parts) {
  if (parts.empty()) {
    throw Error("[remat::CheckpointedSequential] no modules given; pass the Sequentials of the chain in order.");
  }
  torch::nn::Sequential seq;
  for (size_t p = 0; p < parts.size(); ++p) {
    if (parts[p].is_empty()) {
      throw Error("[remat::CheckpointedSequential] part " + std::to_string(p) +
                  " is a null Sequential; construct it before building the chain.");
    }
    const auto names = parts[p]->named_children().keys();
    for (size_t k = 0; k < parts[p]->size(); ++k) {
      seq->push_back(std::to_string(p) + "_" + names[k], *(parts[p]->begin() + static_cast<std::ptrdiff_t>(k)));
    }
  }
  return seq;
}

}  // namespace

CheckpointedSequentialImpl::CheckpointedSequentialImpl(std::vector<torch::nn::Sequential> parts,
                                                       SequentialOptions options)
    : CheckpointedSequentialImpl(join(parts), std::move(options), /*own_children=*/false) {}

CheckpointedSequentialImpl::CheckpointedSequentialImpl(torch::nn::Sequential seq, SequentialOptions options)
    : CheckpointedSequentialImpl(std::move(seq), std::move(options), /*own_children=*/true) {}

CheckpointedSequentialImpl::CheckpointedSequentialImpl(torch::nn::Sequential seq, SequentialOptions options,
                                                       bool own_children)
    : seq_(std::move(seq)), options_(std::move(options)), own_children_(own_children) {
  if (seq_.is_empty() || seq_->size() == 0) {
    throw Error("[remat::CheckpointedSequential] the Sequential is empty; add modules before wrapping it.");
  }
  if (options_.segments() < 0 || options_.segments() > static_cast<int>(seq_->size())) {
    throw Error("[remat::CheckpointedSequential] segments must be in [1, " + std::to_string(seq_->size()) +
                "] (the number of modules), or 0 for none, got " + std::to_string(options_.segments()) + ".");
  }
  if (options_.memory_budget_bytes() == 0 || options_.memory_budget_bytes() < -1) {
    throw Error("[remat::CheckpointedSequential] memory_budget_bytes must be positive (or -1 for none), got " +
                std::to_string(options_.memory_budget_bytes()) + ".");
  }
  const double f = options_.memory_budget_fraction();
  if (f != -1 && !(f > 0 && f <= 1)) {
    throw Error(
        "[remat::CheckpointedSequential] memory_budget_fraction must be in (0, 1] (of the chain's plain "
        "peak), or -1 for none, got " +
        std::to_string(f) + ".");
  }
  if (f != -1 && options_.memory_budget_bytes() > 0) {
    throw Error(
        "[remat::CheckpointedSequential] memory_budget_bytes and memory_budget_fraction are both set; give one "
        "budget.");
  }
  const int64_t step = options_.step_memory_budget_bytes();
  if (step == 0 || step < -1) {
    throw Error("[remat::CheckpointedSequential] step_memory_budget_bytes must be positive (or -1 for none), got " +
                std::to_string(step) + ".");
  }
  if (step > 0 && (f != -1 || options_.memory_budget_bytes() > 0 || options_.segments() > 0 || options_.schedule() ||
                   !(options_.algorithm().empty() || options_.algorithm() == "optimal"))) {
    throw Error(
        "[remat::CheckpointedSequential] step_memory_budget_bytes plans the chain itself (algorithm optimal); "
        "leave memory_budget_bytes, memory_budget_fraction, segments, schedule and algorithm unset with it.");
  }
  if (step > 0 && !options_.measure_memory()) {
    throw Error(
        "[remat::CheckpointedSequential] step_memory_budget_bytes needs the steps measured; leave "
        "measure_memory on.");
  }
  reset();
}

void CheckpointedSequentialImpl::reset() {
  // Registered under their own names, not under a "seq" child: swapping a
  // model's Sequential for this wrapper keeps parameter names and the layout
  // of saved weights, and parameters() lists each one once. A chain over
  // several modules registers nothing: they stay registered where they are.
  if (own_children_) {
    for (const auto& item : seq_->named_children()) register_module(item.key(), item.value());
    if (!tripwire_) {
      tripwire_ = detail::tripwire_for(seq_);
      std::lock_guard<std::mutex> lock(tripwire_->mu);
      tripwire_->owners.push_back(this);
    }
  }
  plans_.clear();
  last_ = nullptr;
}

CheckpointedSequentialImpl::~CheckpointedSequentialImpl() {
  if (!tripwire_) return;
  std::lock_guard<std::mutex> lock(tripwire_->mu);
  auto& o = tripwire_->owners;
  o.erase(std::remove(o.begin(), o.end(), this), o.end());
}

void CheckpointedSequentialImpl::train(bool on) {
  torch::nn::Module::train(on);
  seq_->train(on);
}

std::shared_ptr<torch::nn::Module> CheckpointedSequentialImpl::clone(const std::optional<c10::Device>& device) const {
  if (!own_children_) {
    throw Error(
        "[remat::CheckpointedSequential] a chain over several modules does not own them and cannot be cloned; "
        "clone the model that registers them, then build a new CheckpointedSequential over the clone's modules.");
  }
  // Cloneable::clone would re-register the same Sequential in the copy and
  // then overwrite its parameters, changing the original: copy it deeply.
  auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(seq_->clone(device));
  if (!seq) throw Error("[remat::CheckpointedSequential] internal: Sequential::clone returned another type.");
  auto copy = std::make_shared<CheckpointedSequentialImpl>(torch::nn::Sequential(seq), options_);
  copy->train(is_training());
  return copy;
}

const CheckpointedSequentialImpl::Entry& CheckpointedSequentialImpl::entry_for(const detail::Values& x, bool forced) {
  auto key = detail::plan_key(x, seq_);
  // NOTE [parameter gradients in the plan]: with count_parameter_gradients,
  // does this step's backward allocate parameter gradients (some .grad
  // undefined: the first step, or zero_grad setting them to none)? Then
  // they are in the plan.
  const std::vector<int64_t> grad_bytes =
      options_.count_parameter_gradients() ? detail::new_param_grad_bytes(seq_) : std::vector<int64_t>(seq_->size(), 0);
  const bool allocates = std::any_of(grad_bytes.begin(), grad_bytes.end(), [](int64_t b) { return b > 0; });
  key.push_back(allocates);
  auto it = plans_.find(key);
  if (it != plans_.end()) {
    if (!forced && !it->second.own_plan) solve_own(it->second);  // profiled under the whole-step planner
    if (it->second.pending_ms_per_byte != 0) apply_reprice(it->second);
    return it->second;
  }
  Entry e;
  auto other = key;
  other.back() = !allocates;
  if (auto sibling = plans_.find(other); sibling != plans_.end()) {
    // The same profile, the other accounting: solved again, not measured again.
    const Entry& s = sibling->second;
    e.profiled = s.profiled;
    e.levers = s.levers;
    e.result = s.result;
    e.stops = s.stops;
    e.writes_input = s.writes_input;
  } else {
    detail::Values result;
    ProfileOptions popts = options_.profile();
    if (!options_.early_stop()) popts.recompute(false);  // no cut recomputes to time
    auto levers = std::make_shared<detail::Levers>();
    e.profiled = detail::profile_values(seq_, x, popts, &result, &e.writes_input, levers.get());
    e.levers = levers;
    e.result = std::make_shared<detail::Values>(std::move(result));
    e.stops = std::make_shared<detail::StopRecords>(static_cast<int>(e.profiled.stages.size()));
    ++profiles_;
  }
  e.chain = planned(allocates ? detail::with_param_grads(e.profiled, grad_bytes) : e.profiled);
  e.param_grad_bytes = allocates ? std::accumulate(grad_bytes.begin(), grad_bytes.end(), int64_t{0}) : 0;
  if (forced) {
    // The whole-step planner runs its own schedule: the options' plan is
    // solved later, when a call runs without it (and may throw then).
    e.plan = plan::store_all(e.chain);
    e.own_plan = false;
    return plans_.emplace(std::move(key), std::move(e)).first->second;
  }
  solve_own(e);
  return plans_.emplace(std::move(key), std::move(e)).first->second;
}

plan::Chain CheckpointedSequentialImpl::planned(const plan::Chain& chain) const {
  return options_.count_held_output() ? detail::with_held_output(chain) : chain;
}

void CheckpointedSequentialImpl::solve_own(Entry& e) {
  try {
    solve_own_budget(e);
  } catch (const Error& err) {
    // A budget below the least peak: say what sets it and what lowers it.
    auto with_reason = [&]() -> Error {
      const std::string what = err.what();
      if (what.find("the smallest feasible peak is") == std::string::npos) return err;
      const int64_t without = e.param_grad_bytes > 0 ? lowest_peak(planned(e.profiled), e.levers.get()) : 0;
      return Error(what + detail::least_peak_reason(e.chain, e.param_grad_bytes, without));
    };
    if (e.param_grad_bytes <= 0) throw with_reason();
    // NOTE [parameter gradients in the plan]: where the same options fit
    // without the gradients, say what the budget counts and the two ways
    // to leave the gradients out of it.
    Entry bare = e;
    bare.chain = planned(e.profiled);
    bare.param_grad_bytes = 0;
    try {
      solve_own_budget(bare);
    } catch (...) {
      throw with_reason();  // they are not the whole reason
    }
    throw Error(std::string(err.what()) + " The plan counts the " + format_bytes(e.param_grad_bytes) +
                " of parameter gradients that this step's backward allocates (their .grad is undefined when the "
                "step starts: the first step, or zero_grad() setting them to none); allocate them before the "
                "first step and zero them with zero_grad(false) to keep them out of the chain's peak, or set "
                "count_parameter_gradients(false) for a budget of the chain's activations only.");
  }
}

void CheckpointedSequentialImpl::solve_own_budget(Entry& e) {
  int64_t budget = options_.memory_budget_bytes();
  const double fraction = options_.memory_budget_fraction();
  int64_t plain = -1;
  std::string fraction_is;  // "memory_budget_fraction 0.05 (a budget of ... of the chain's plain peak ...)"
  if (fraction > 0) {
    plain = plan::store_all(e.chain).prediction.peak_bytes;
    budget = std::max<int64_t>(1, static_cast<int64_t>(fraction * static_cast<double>(plain)));
    char f[32];
    std::snprintf(f, sizeof f, "%g", fraction);
    fraction_is = std::string("memory_budget_fraction ") + f + " (a budget of " + format_bytes(budget) +
                  " of the chain's plain peak, " + format_bytes(plain) + ")";
    const int64_t lowest = lowest_peak(e.chain, e.levers.get());
    if (budget < lowest) {
      char need[32];
      const double at_least = std::ceil(1000.0 * static_cast<double>(lowest) / static_cast<double>(plain)) / 1000.0;
      std::snprintf(need, sizeof need, "%.3f", at_least);
      throw Error("[remat::CheckpointedSequential] no schedule fits in " + fraction_is +
                  "; the smallest feasible peak is " + format_bytes(lowest) + ". Raise memory_budget_fraction to " +
                  "at least " + need + ".");
    }
  }
  if (options_.step_memory_budget_bytes() > 0) {
    // The first step of this shape runs the leanest schedule and measures
    // what lies outside the chain; end_step() plans for what is left.
    budget = lowest_peak(e.chain, e.levers.get());
  }
  if (options_.schedule()) {
    e.plan = {"explicit", *options_.schedule(), plan::simulate(e.chain, *options_.schedule())};
  } else if (options_.segments() > 0) {
    e.plan = plan::uniform(e.chain, options_.segments());
  } else {
    std::string algorithm = options_.algorithm();
    if (algorithm.empty()) algorithm = budget > 0 ? "optimal" : "sqrt";
    auto solve =
        plan::parse_algorithm(algorithm).with_memory_slots(options_.memory_slots()).with_scope(options_.scope());
    if (budget > 0) solve.with_budget_bytes(budget);
    // The remedy names the option the user set.
    const std::string raise = fraction > 0 ? "memory_budget_fraction" : "memory_budget_bytes";
    try {
      e.plan = solve_chain(e.chain, e.levers.get(), solve);
      e.solve = solve;
    } catch (const Error& err) {
      if (fraction <= 0) throw;
      std::string what = err.what();
      for (const char* from : {"Raise memory_budget_bytes", "raise memory_budget_bytes"}) {
        const size_t at = what.find(from);
        if (at != std::string::npos) what.replace(at, std::strlen(from), std::string(from).substr(0, 6) + raise);
      }
      throw Error("[remat::CheckpointedSequential] " + fraction_is + ": " + what);
    }
    if (budget > 0 && e.plan.prediction.peak_bytes > budget) {
      throw Error("[remat::CheckpointedSequential] the " + algorithm + " schedule peaks at " +
                  format_bytes(e.plan.prediction.peak_bytes) + ", over the budget of " + format_bytes(budget) +
                  (fraction > 0 ? " (" + fraction_is + ")" : std::string()) +
                  "; use algorithm \"optimal\" (the default with a budget) or raise " + raise + ".");
    }
  }
  e.own_plan = true;
}

const plan::Plan& CheckpointedSequentialImpl::plan(const at::Tensor& x) {
  std::lock_guard<std::mutex> lock(*mu_);
  last_ = &entry_for(detail::Values(x));
  return last_->plan;
}

const plan::Plan& CheckpointedSequentialImpl::plan_values(const std::vector<at::Tensor>& xs) {
  std::lock_guard<std::mutex> lock(*mu_);
  last_ = &entry_for(detail::Values(detail::Values::Kind::kVector, xs));
  return last_->plan;
}

const CheckpointedSequentialImpl::Entry& CheckpointedSequentialImpl::last_entry() const {
  std::lock_guard<std::mutex> lock(*mu_);
  if (!last_) {
    throw Error("[remat::CheckpointedSequential] no plan yet: run forward once, or call plan(x) with a sample.");
  }
  return *last_;
}

const plan::Plan& CheckpointedSequentialImpl::plan() const { return last_entry().plan; }

const plan::Chain& CheckpointedSequentialImpl::chain() const { return last_entry().chain; }

at::Tensor CheckpointedSequentialImpl::forward(const at::Tensor& x) {
  detail::Values y = run(detail::Values(x), /*want_tensor=*/true);
  return y[0];
}

std::vector<at::Tensor> CheckpointedSequentialImpl::forward_values(const std::vector<at::Tensor>& xs) {
  if (xs.empty()) {
    throw Error("[remat::CheckpointedSequential] forward_values got no tensors; pass the first module's inputs.");
  }
  return run(detail::Values(detail::Values::Kind::kVector, xs), /*want_tensor=*/false).ts;
}

namespace detail {
namespace {
thread_local ChainObserver* tls_chain_observer = nullptr;
}  // namespace
ChainObserver* chain_observer() { return tls_chain_observer; }
ChainObserver* set_chain_observer(ChainObserver* o) { return std::exchange(tls_chain_observer, o); }

void ChainAccess::force(CheckpointedSequentialImpl& chain, std::shared_ptr<const ForcedSchedule> forced) {
  std::lock_guard<std::mutex> lock(*chain.mu_);
  chain.forced_ = std::move(forced);
}
std::shared_ptr<const ForcedSchedule> ChainAccess::forced(CheckpointedSequentialImpl& chain) {
  std::lock_guard<std::mutex> lock(*chain.mu_);
  return chain.forced_;
}
}  // namespace detail

detail::Values CheckpointedSequentialImpl::run(const detail::Values& x, bool want_tensor) {
  detail::ChainObserver* observer = detail::chain_observer();
  if (observer == nullptr || !at::GradMode::is_enabled()) return run_planned(x, want_tensor, nullptr);
  auto self = std::static_pointer_cast<CheckpointedSequentialImpl>(shared_from_this());
  const detail::Values::Kind kind = x.kind;
  detail::ChainRun again = [self, kind, want_tensor](const std::optional<plan::Schedule>& s,
                                                     const std::vector<at::Tensor>& in) {
    detail::ForcedSchedule trial;
    trial.store_all = !s.has_value();
    if (s) trial.schedule = *s;
    return self->run_planned(detail::Values(kind, in), want_tensor, &trial).ts;
  };
  detail::ChainMenu menu = [self, &x](int budgets) { return self->menu_for(x, budgets); };
  std::unique_ptr<detail::UnitObserver::Call> call = observer->begin(*this, x.ts, again, menu);
  detail::Values y = run_planned(x, want_tensor, nullptr);
  if (call) call->finish(y.ts);
  return y;
}

std::vector<detail::ChainOption> CheckpointedSequentialImpl::menu_for(const detail::Values& x, int budgets) {
  std::lock_guard<std::mutex> lock(*mu_);
  const Entry& e = entry_for(x, /*forced=*/true);
  // Without the stages' disk levers: the whole-step planner measures each
  // schedule in one isolated run, which cannot bound the disk's writes in
  // flight (they are last in each stage's menu, so the others' indices hold).
  const plan::Chain chain = e.levers ? e.levers->without_disk(e.chain) : e.chain;
  std::vector<detail::ChainOption> out;
  auto add = [&](std::string name, plan::Plan p) {
    for (const auto& o : out) {
      if (o.schedule == p.schedule) return;
    }
    out.push_back({std::move(name), std::move(p.schedule), std::move(p.prediction)});
  };
  plan::Plan all = plan::store_all(chain);
  const int64_t high = all.prediction.peak_bytes;
  add("store-all", std::move(all));
  const int64_t low = lowest_peak(chain, nullptr);
  for (int j = 0; j < budgets && low < high; ++j) {
    const int64_t budget = low + (high - low) * j / std::max(1, budgets);
    auto solve = plan::parse_algorithm("optimal")
                     .with_memory_slots(options_.memory_slots())
                     .with_scope(options_.scope())
                     .with_budget_bytes(budget);
    plan::Plan p;
    try {
      p = solve_chain(chain, nullptr, solve);
    } catch (const Error&) {
      continue;  // the DP's memory slots can miss the leanest budget by a slot
    }
    // Stages run under a selective level: each runs again in its backward.
    int64_t selective = 0;
    for (const plan::Op& op : p.schedule.ops) {
      selective += op.option > 0 && e.levers && e.levers->stages[op.stage][op.option - 1].region ? 1 : 0;
    }
    char name[128];
    std::snprintf(name, sizeof name, "schedule: %lld stage forwards%s, %s predicted",
                  static_cast<long long>(p.prediction.forward_executions),
                  selective > 0 ? (", " + std::to_string(selective) + " selective").c_str() : "",
                  format_bytes(p.prediction.peak_bytes).c_str());
    add(name, std::move(p));
  }
  return out;
}

detail::Values CheckpointedSequentialImpl::run_planned(const detail::Values& x, bool want_tensor,
                                                       const detail::ForcedSchedule* trial) {
  if (tripwire_) tripwire_->ran.store(true);
  const int L = static_cast<int>(seq_->size());
  // Per stage: its parameters that require grad, each once.
  std::vector<std::vector<at::Tensor>> params(L);
  bool any_grad = false;
  for (const auto& t : x.ts) any_grad |= t.defined() && t.requires_grad();
  for (int i = 0; i < L; ++i) {
    std::unordered_set<const c10::TensorImpl*> seen;
    for (auto& p : (seq_->begin() + i)->ptr()->parameters()) {
      if (p.requires_grad() && seen.insert(p.unsafeGetTensorImpl()).second) params[i].push_back(p);
    }
    any_grad |= !params[i].empty();
  }
  auto check_result = [&](const detail::Values& y) {
    if (want_tensor && y.kind != detail::Values::Kind::kTensor) {
      throw Error("[remat::CheckpointedSequential] the last stage returns a " + y.describe() +
                  "; call forward_values() for a chain whose result is not one tensor.");
    }
  };
  if (!at::GradMode::is_enabled() || !any_grad) {  // nothing to save
    detail::Values h = x;
    for (int i = 0; i < L; ++i) {
      h = detail::run_module(*(seq_->begin() + i), h, "[remat::CheckpointedSequential] stage " + std::to_string(i));
    }
    check_result(h);
    return h;
  }

  const Entry* entry;
  plan::Schedule schedule;
  double predicted_ms = 0;
  {
    // Entries are never erased while the module lives (map nodes are
    // stable), so the pointer stays valid after the lock is released; the
    // schedule is copied here (end_step may re-plan it meanwhile).
    std::lock_guard<std::mutex> lock(*mu_);
    if (options_.step_memory_budget_bytes() > 0 && open_steps_ == 0) {
      throw Error(
          "[remat::CheckpointedSequential] step_memory_budget_bytes needs each training step measured: open "
          "`auto step = net->begin_step();` before the model's forward and keep it until the step ends (after "
          "the optimizer step).");
    }
    entry = last_ = &entry_for(x, trial != nullptr || forced_ != nullptr);
    if (!entry->step_error.empty()) throw Error(entry->step_error);
    schedule = entry->plan.schedule;
    predicted_ms = entry->plan.prediction.time_ms;
    // The whole-step planner's schedule, or one of its isolated runs'.
    const detail::ForcedSchedule* forced = trial != nullptr ? trial : forced_.get();
    if (forced != nullptr) {
      try {
        schedule = forced->store_all ? plan::store_all(entry->chain).schedule : forced->schedule;
        predicted_ms = plan::simulate(entry->chain, schedule).time_ms;
      } catch (const Error& err) {
        throw Error(std::string("[remat::CheckpointedSequential] the schedule that the whole-step planner "
                                "(remat::auto_checkpoint) chose does not fit this call's chain: ") +
                    err.what() + " Profile a step of this shape again (AutoCheckpoint::profile_step).");
      }
    }
  }
  // Checked before running anything: a wrong call changes no buffer or RNG.
  check_result(*entry->result);
  auto exec = std::make_shared<detail::Execution>();
  exec->owner = std::static_pointer_cast<CheckpointedSequentialImpl>(shared_from_this());
  exec->seq = seq_;
  exec->schedule = std::move(schedule);
  exec->predicted_ms = predicted_ms;
  exec->entry = entry;
  exec->L = L;
  exec->st.a.resize(L + 1);
  exec->st.leaf.resize(L);
  exec->st.out.resize(L);
  exec->st.edges.resize(L);
  exec->st.from_forward.assign(L, false);
  exec->st.runs.assign(L, 0);
  exec->out_meta.resize(L);
  exec->first_run.resize(L);
  exec->writes_input = entry->writes_input;
  exec->rerun_graph.assign(L, 0);
  exec->kept_check.resize(L);
  exec->params = std::move(params);
  exec->preserve_rng = options_.preserve_rng_state();
  for (const auto& t : x.ts) exec->input_requires_grad.push_back(t.defined() && t.requires_grad());
  exec->input = x;
  exec->input_bytes = entry->chain.input_bytes;
  if (options_.measure_memory()) {
    // Capture the RNG state once before measuring: stages that draw no random
    // numbers then share this copy instead of allocating inside the window.
    detail::ReplayState::capture(exec->preserve_rng, {detail::Execution::device_of(x)}, {});
    // A CUDA chain is measured in CUDA bytes (the caching allocator's).
    exec->probe = std::make_unique<memory::Probe>(detail::memory_device(x.ts, seq_->parameters()));
  }
  exec->st.a[0] = x.detached();
  detail::Values y = exec->run_forward().detached();  // shares a_L's storages
  for (const auto& t : x.ts) {
    exec->input_versions.push_back(t.defined() && !t.is_inference() ? static_cast<int64_t>(t._version()) : -1);
  }

  // One node per stage. Node i's first edges lead to node i-1, one per
  // tensor of a_i (node 0's to the tensors of x), then one per parameter.
  namespace ta = torch::autograd;
  std::vector<detail::NodePtr<detail::StageBackward>> nodes(L);
  for (int i = 0; i < L; ++i) {
    auto node = detail::make_node<detail::StageBackward>();
    node->stage = i;
    node->exec = exec;
    ta::edge_list edges;
    if (i == 0) {
      for (const auto& t : x.ts) {
        edges.push_back(t.defined() && t.requires_grad() ? ta::impl::gradient_edge(t) : ta::Edge());
      }
    } else {
      for (size_t k = 0; k < exec->out_meta[i - 1].size(); ++k) edges.emplace_back(nodes[i - 1], k);
    }
    auto rest = ta::collect_next_edges(exec->params[i]);
    edges.insert(edges.end(), rest.begin(), rest.end());
    node->set_next_edges(std::move(edges));
    if (i < L - 1) {
      for (const auto& m : exec->out_meta[i]) {
        if (m.defined) {
          node->add_input_metadata(m.options, c10::fromIntArrayRefSlow(m.sizes), false, false, std::nullopt);
        } else {
          node->add_input_metadata(ta::Node::undefined_input());
        }
      }
    }
    exec->nodes.push_back(node.get());
    nodes[i] = std::move(node);
  }
  // The result's tensors that carry a gradient get node L-1's inputs; the
  // others (a mask, an integer tensor) only hold their place.
  const detail::Values& last = exec->st.out[L - 1];
  for (size_t k = 0; k < y.size(); ++k) {
    if (y[k].defined() && last[k].defined() && last[k].requires_grad()) {
      ta::create_gradient_edge(y[k], nodes[L - 1]);
    } else {
      nodes[L - 1]->add_input_metadata(ta::Node::undefined_input());
    }
  }
  check_result(y);
  return y;
}

StepScope::StepScope(std::shared_ptr<CheckpointedSequentialImpl> owner, int64_t chain_steps)
    : owner_(std::move(owner)),
      probe_(std::make_unique<memory::Probe>(detail::memory_device({}, owner_->sequential()->parameters()))),
      chain_steps_(chain_steps) {}

StepScope::StepScope(StepScope&& other) noexcept
    : owner_(std::move(other.owner_)), probe_(std::move(other.probe_)), chain_steps_(other.chain_steps_) {}

StepScope::~StepScope() {
  if (owner_) owner_->end_step(probe_->peak_bytes(), chain_steps_);
}

StepScope CheckpointedSequentialImpl::begin_step() {
  std::lock_guard<std::mutex> lock(*mu_);
  ++open_steps_;
  return StepScope(std::static_pointer_cast<CheckpointedSequentialImpl>(shared_from_this()), chain_steps_);
}

void CheckpointedSequentialImpl::end_step(int64_t step_peak, int64_t chain_steps_before) {
  std::lock_guard<std::mutex> lock(*mu_);
  --open_steps_;
  last_step_.step_peak_bytes = step_peak;
  const int64_t budget = options_.step_memory_budget_bytes();
  // A scope in which no step of the chain completed says nothing about it.
  if (budget <= 0 || chain_steps_ == chain_steps_before || !last_chain_entry_) return;
  Entry& e = *last_chain_entry_;
  const int64_t chain_own = last_step_.chain_peak_bytes;
  if (chain_own <= 0) return;
  // Conservative: all of the step's peak above the chain's own peak is taken
  // to coexist with the chain's peak.
  const int64_t outside = std::max<int64_t>(0, step_peak - chain_own);
  last_step_.outside_bytes = outside;
  // Re-planned after each of the first two measured steps (the first one
  // also allocates what persists after it, e.g. the optimizer's state), and
  // afterwards only when a step goes over the budget.
  const bool over = step_peak > budget;
  if (++e.steps_measured > 2 && !over) return;
  e.outside_bytes = over ? std::max(e.outside_bytes, outside) : outside;
  // What the chain may measure, as a prediction: the prediction's error on
  // this chain (predicted / measured on this step) carried over.
  const double calibration =
      std::clamp(static_cast<double>(e.plan.prediction.peak_bytes) / static_cast<double>(chain_own), 0.5, 2.0);
  const int64_t left = budget - e.outside_bytes;
  const int64_t chain_budget = static_cast<int64_t>(static_cast<double>(std::max<int64_t>(left, 0)) * calibration);
  const int64_t lowest = lowest_peak(e.chain, e.levers.get());
  if (chain_budget < lowest) {
    e.step_error = "[remat::CheckpointedSequential] the step budget of " + format_bytes(budget) +
                   " cannot be met: outside the chain the step holds " + format_bytes(e.outside_bytes) +
                   " (measured: the step's peak " + format_bytes(step_peak) + " minus the chain's own " +
                   format_bytes(chain_own) + "), and the chain needs at least " +
                   format_bytes(static_cast<int64_t>(static_cast<double>(lowest) / calibration)) +
                   "; raise step_memory_budget_bytes, or shrink what is outside the chain (batch, head).";
    return;
  }
  // Runs in StepScope's destructor: an error is kept for the next forward
  // to throw, never thrown from here.
  try {
    auto solve = plan::parse_algorithm("optimal")
                     .with_memory_slots(options_.memory_slots())
                     .with_scope(options_.scope())
                     .with_budget_bytes(chain_budget);
    e.plan = solve_chain(e.chain, e.levers.get(), solve);
    e.solve = solve;
  } catch (const std::exception& err) {
    e.step_error = std::string("[remat::CheckpointedSequential] planning for the step budget failed: ") + err.what();
  }
}

/** NOTE [chain offload priced by the step]: a stage's disk offload is
 *  profiled on its own, one stage's tensors through a warm page cache; a
 *  step sends every offloaded stage's at once, and a disk (or a machine
 *  whose fresh pages are slow) can take far longer for that (this VM, the
 *  reference GPT stack unrepriced: 1.62x plain measured where 6-10% less
 *  than recompute's time was predicted). When two steps in a row of a plan that offloads
 *  to disk (CPU chains) each take more than 10% over its predicted time,
 *  the second one's excess is charged to the disk options per byte they
 *  send (what keeping everything would keep less what the option keeps),
 *  on every stage, and the next forward solves again (on the caller's
 *  thread; the prices change only with a plan solved for them). Two steps
 *  in a row more than 10% under the prediction give the charge back, down
 *  to no surcharge at most (plan::TransferPrice has the rule, which the
 *  whole-step planner shares, charging after one slow step there). The
 *  profile's own prices are never lowered. */
void CheckpointedSequentialImpl::note_step_time(Entry& e, const plan::Schedule& ran, double predicted_ms,
                                                double chain_ms) {
  const bool offloading = e.levers && e.solve && chain_ms > 0 && e.plan.schedule == ran && e.levers->uses_disk(ran);
  double sent = 0;  // bytes the schedule's disk options send
  for (const plan::Op& op : ran.ops) {
    if (!offloading || op.option <= 0 || !e.levers->stages[op.stage][op.option - 1].disk()) continue;
    const plan::Stage& st = e.chain.stages[op.stage];
    sent += static_cast<double>(std::max<int64_t>(0, st.saved_bytes - st.options[op.option - 1].saved_bytes));
  }
  const double per_byte =
      e.transfer_price.observe(chain_ms, predicted_ms, sent, e.offload_ms_per_gib / double(int64_t{1} << 30));
  if (per_byte != 0) e.pending_ms_per_byte = per_byte;
}

void CheckpointedSequentialImpl::apply_reprice(Entry& e) {
  const double per_byte = e.pending_ms_per_byte;
  e.pending_ms_per_byte = 0;
  if (per_byte == 0 || !e.levers || !e.solve) return;
  plan::Chain chain = e.chain, profiled = e.profiled;
  for (plan::Chain* c : {&profiled, &chain}) {
    for (size_t i = 0; i < c->stages.size() && i < e.levers->stages.size(); ++i) {
      plan::Stage& st = c->stages[i];
      for (size_t k = 0; k < st.options.size() && k < e.levers->stages[i].size(); ++k) {
        if (!e.levers->stages[i][k].disk()) continue;
        // Floored at the stage's own: a give-back of the whole surcharge
        // lands a rounding error below an option the profiler raised to the
        // stage's price, which the chain would refuse.
        const double sent = static_cast<double>(std::max<int64_t>(0, st.saved_bytes - st.options[k].saved_bytes));
        st.options[k].forward_ms = std::max(st.forward_ms, st.options[k].forward_ms + per_byte * sent);
      }
    }
  }
  try {
    plan::Plan p = solve_chain(chain, e.levers.get(), *e.solve);
    e.chain = std::move(chain);
    e.profiled = std::move(profiled);
    e.plan = std::move(p);
    e.offload_ms_per_gib = std::max(0.0, e.offload_ms_per_gib + per_byte * static_cast<double>(int64_t{1} << 30));
    ++e.reprices;
  } catch (const std::exception&) {
    // The plan in force stays, at its prices.
  }
}

std::string CheckpointedSequentialImpl::explain() const {
  const Entry& e = last_entry();
  const auto& c = e.chain;
  const auto& p = e.plan;
  const StepReport last_step = this->last_step();
  // Which boundary values stay live after the forward part (checkpoints).
  std::vector<bool> live(c.stages.size() + 1, false);
  live[0] = true;
  for (const auto& op : p.schedule.ops) {
    if (op.kind == plan::OpKind::kBackward) break;
    if (op.kind == plan::OpKind::kForward || op.kind == plan::OpKind::kForwardSave) live[op.stage + 1] = true;
    if (op.kind == plan::OpKind::kDrop) live[op.stage] = false;
  }
  std::ostringstream os;
  char line[256];
  std::snprintf(line, sizeof line, "%-4s %-22s %8s %6s %12s %12s %10s %10s\n", "#", "stage", "forwards", "kept",
                "output", "saved", "fwd ms", "bwd ms");
  os << "plan: " << p.algorithm << "\n" << line;
  for (size_t i = 0; i < c.stages.size(); ++i) {
    const auto& s = c.stages[i];
    std::snprintf(line, sizeof line, "%-4zu %-22s %8d %6s %12s %12s %10.3f %10.3f\n", i, s.name.substr(0, 22).c_str(),
                  p.prediction.forwards_per_stage[i], live[i + 1] ? "yes" : "no", format_bytes(s.output_bytes).c_str(),
                  format_bytes(s.saved_bytes).c_str(), s.forward_ms, s.backward_ms);
    os << line;
  }
  // The stages' menus (ProfileOptions::selective_levels, offload), the
  // options the plan's forward_saves use marked.
  for (size_t i = 0; i < c.stages.size(); ++i) {
    const auto& opts = c.stages[i].options;
    if (opts.empty()) continue;
    os << (i == 0 || std::all_of(c.stages.begin(), c.stages.begin() + static_cast<std::ptrdiff_t>(i),
                                 [](const plan::Stage& st) { return st.options.empty(); })
               ? "stage menus (kept bytes, fwd ms, bwd ms; * used by the plan):\n"
               : "");
    os << "  " << i << ":";
    for (size_t k = 0; k < opts.size(); ++k) {
      const bool used = std::any_of(p.schedule.ops.begin(), p.schedule.ops.end(), [&](const plan::Op& op) {
        return op.stage == static_cast<int>(i) && op.option == static_cast<int>(k + 1);
      });
      std::snprintf(line, sizeof line, " %s[%s %s %.3f %.3f]", k ? "" : "", opts[k].name.c_str(),
                    format_bytes(opts[k].saved_bytes).c_str(), opts[k].forward_ms, opts[k].backward_ms);
      os << line << (used ? "*" : "");
    }
    os << "\n";
  }
  if (e.reprices > 0) {
    std::snprintf(line, sizeof line,
                  "disk offload repriced %dx from measured steps: +%.0f ms per GiB sent (NOTE [chain offload priced "
                  "by the step])\n",
                  e.reprices, e.offload_ms_per_gib);
    os << line;
  }
  os << "predicted peak: " << format_bytes(p.prediction.peak_bytes) << " (input " << format_bytes(c.input_bytes)
     << " included), predicted time " << p.prediction.time_ms << " ms, " << p.prediction.forward_executions
     << " forward executions for " << c.stages.size() << " stages\n";
  if (p.optimality_gap_ms >= 0) {
    std::snprintf(line, sizeof line,
                  "optimality gap: at most %.3f ms (%.2f%%) over the exact optimum; lower bound %.3f ms, unit %lld "
                  "bytes\n",
                  p.optimality_gap_ms, 100.0 * p.relative_gap(), p.lower_bound_ms,
                  static_cast<long long>(p.memory_unit_bytes));
    os << line;
  }
  if (last_step.measured_peak_bytes >= 0) {
    os << "measured peak (last step): " << format_bytes(last_step.measured_peak_bytes) << " ("
       << (100.0 * static_cast<double>(last_step.measured_peak_bytes) /
           static_cast<double>(std::max<int64_t>(1, p.prediction.peak_bytes)))
       << "% of predicted)\n";
  } else {
    os << "measured peak: none yet (run a forward and backward step)\n";
  }
  if (last_step.chain_peak_bytes >= 0) {
    os << "  of which the chain's own: " << format_bytes(last_step.chain_peak_bytes) << " ("
       << (100.0 * static_cast<double>(last_step.chain_peak_bytes) /
           static_cast<double>(std::max<int64_t>(1, p.prediction.peak_bytes)))
       << "% of predicted); the rest was allocated outside it (head, loss) during its forward and backward\n";
  }
  const auto& op_bytes = p.prediction.op_bytes;
  if (last_step.op_peak_bytes.size() == op_bytes.size() && !op_bytes.empty()) {
    // Where the model is furthest off: the op to look at when the peaks differ.
    size_t worst = 0;
    for (size_t k = 1; k < op_bytes.size(); ++k) {
      if (std::abs(last_step.op_peak_bytes[k] - op_bytes[k]) >
          std::abs(last_step.op_peak_bytes[worst] - op_bytes[worst]))
        worst = k;
    }
    const size_t at =
        static_cast<size_t>(std::max_element(last_step.op_peak_bytes.begin(), last_step.op_peak_bytes.end()) -
                            last_step.op_peak_bytes.begin());
    os << "  per op (chain's own, measured / predicted): peak at op " << at << " "
       << plan::to_string(p.schedule.ops[at]) << " " << format_bytes(last_step.op_peak_bytes[at]) << " / "
       << format_bytes(op_bytes[at]) << "; furthest off at op " << worst << " "
       << plan::to_string(p.schedule.ops[worst]) << " " << format_bytes(last_step.op_peak_bytes[worst]) << " / "
       << format_bytes(op_bytes[worst]) << "\n";
  }
  if (last_step.step_peak_bytes >= 0) {
    os << "step peak (last begin_step scope): " << format_bytes(last_step.step_peak_bytes);
    if (options_.step_memory_budget_bytes() > 0) {
      os << ", step budget " << format_bytes(options_.step_memory_budget_bytes());
      if (last_step.outside_bytes >= 0) os << ", outside the chain " << format_bytes(last_step.outside_bytes);
    }
    os << "\n";
  }
  return os.str();
}

}  // namespace remat
