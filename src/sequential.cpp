// remat::CheckpointedSequential: executes a planner Schedule op by op.
// NOTE [planned execution]: forward runs the ops before the first backward
// (kForward without grad, kForwardSave with grad on a detached input that
// becomes a leaf) and returns a_L attached to a chain of autograd nodes, one
// per stage: node i has an edge to node i-1 (node 0: to x) and one to each
// parameter of stage i. Autograd calls node L-1 with dL/da_L; node i runs
// the schedule's ops up to and including kBackward(i) (the recomputations
// that precede it too) and returns dL/da_i and stage i's parameter
// gradients as its outputs. So parameter gradients flow through autograd as
// in a plain run: each parameter's hooks fire once per backward with its
// whole gradient, as soon as its stage is done (DDP's Reducer overlaps), and
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
#include <remat/sequential.h>

#include <cstdio>
#include <sstream>
#include <unordered_set>

#include <ATen/SequenceNumber.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <remat/error.h>
#include <remat/hooks.h>
#include <remat/memory.h>

#include "grad_edges.h"
#include "replay.h"

namespace remat {
namespace detail {

namespace ta = torch::autograd;

struct Execution {
  /** What the forward part leaves; restored for each further backward. */
  struct State {
    std::vector<at::Tensor> a;       // boundary values a_0..a_L (detached)
    std::vector<at::Tensor> leaf;    // s_i: stage input leaf ...
    std::vector<at::Tensor> out;     // ... and output with its graph
    std::vector<Redirected> edges;   // ... whose gradient edges lead to a sink
    std::vector<bool> from_forward;  // the graph was made by the forward part
    std::vector<int> runs;
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
  at::Tensor grad;                                                           // gradient at the current boundary
  std::vector<std::vector<at::Tensor>> params;                               // per stage: requires grad, distinct
  std::vector<ta::Node*> nodes;                                              // per stage (owned by the graph)
  std::vector<std::pair<at::TensorOptions, std::vector<int64_t>>> out_meta;  // a_1..a_L
  std::vector<std::optional<ReplayState>> first_run;                         // per stage
  at::Tensor input;                                                          // x as given (attached), for create_graph
  bool preserve_rng = true;
  bool input_requires_grad = false;
  std::unique_ptr<memory::Probe> probe;
  int64_t input_bytes = 0;
  // create_graph: per stage, the node's outputs computed by node L-1.
  bool higher_order = false;
  std::vector<ta::variable_list> higher_order_grads;

  at::Tensor run_stage(int i, const at::Tensor& in) {
    auto& m = *(seq->begin() + i);
    if (st.runs[i]++ == 0) {
      RngRegionLock rng_lock(preserve_rng);  // NOTE [RNG regions and threads]
      first_run[i] = ReplayState::capture(preserve_rng, {in.device()}, m.ptr()->buffers());
      at::Tensor y = m.forward<at::Tensor>(in);
      out_meta[i] = {y.options(), y.sizes().vec()};
      return y;
    }
    ReplayGuard replay(*first_run[i], /*enable_grad=*/false);
    return m.forward<at::Tensor>(in);
  }

  void need(bool ok, const plan::Op& op, const char* what) const {
    if (!ok) {
      throw Error("[remat::CheckpointedSequential] op #" + std::to_string(pc) + " " + plan::to_string(op) + ": " +
                  what + "; the schedule does not fit this chain (validate it with remat::plan::simulate).");
    }
  }

  /** Stage i's backward: dL/da_i into `grad` (when wanted) and the wanted
   *  parameter gradients into param_grads (aligned with params[i]). */
  void stage_backward(int i, const std::vector<bool>& want, ta::variable_list& param_grads) {
    at::Tensor o = std::move(st.out[i]);
    at::Tensor in = std::move(st.leaf[i]);
    Redirected r = std::move(st.edges[i]);
    st.out[i] = at::Tensor();
    st.leaf[i] = at::Tensor();
    st.edges[i] = Redirected();
    const bool retain = kept.has_value() && st.from_forward[i];
    at::Tensor g = std::move(grad);
    grad = at::Tensor();
    if (!o.requires_grad() || !g.defined()) return;
    if (o.unsafeGetTensorImpl() == in.unsafeGetTensorImpl()) {  // identity stage
      if (want[0]) grad = g;
      return;
    }
    // Sink inputs to capture: the input (target 0), wanted parameters, and
    // leaves used but not registered (delivered to them afterwards).
    ta::edge_list outputs;
    std::vector<int> slot;  // -1: input, k >= 0: parameter k, <= -2: other leaf
    if (want[0] && r.target_input[0] >= 0) {
      outputs.push_back(r.edge(r.target_input[0]));
      slot.push_back(-1);
    }
    for (size_t k = 0; k < params[i].size(); ++k) {
      if (want[1 + k] && r.target_input[1 + k] >= 0) {
        outputs.push_back(r.edge(r.target_input[1 + k]));
        slot.push_back(static_cast<int>(k));
      }
    }
    for (size_t k = 0; k < r.other_leaves.size(); ++k) {
      outputs.push_back(r.edge(r.other_leaves[k].second));
      slot.push_back(-2 - static_cast<int>(k));
    }
    if (outputs.empty()) return;
    // Only the graph's own references keep the stage's output and the
    // gradient at it alive during the inner backward: the output unless an
    // op saved it, the gradient until the stage's last op has used it.
    st.a[i + 1] = at::Tensor();
    ta::variable_list got = backward_releasing(std::move(o), std::move(g), retain, outputs);
    for (size_t k = 0; k < got.size(); ++k) {
      if (slot[k] == -1) {
        grad = std::move(got[k]);
      } else if (slot[k] >= 0) {
        param_grads[slot[k]] = std::move(got[k]);
      } else {
        accumulate_into(r.other_leaves[-2 - slot[k]].first, got[k]);
      }
    }
  }

  void step(const plan::Op& op, const std::vector<bool>* want, ta::variable_list* param_grads) {
    const int i = op.stage;
    switch (op.kind) {
      case plan::OpKind::kForward: {
        need(st.a[i].defined(), op, "its input is not live");
        at::Tensor y;
        {
          at::NoGradGuard no_grad;
          y = run_stage(i, st.a[i]);
        }
        st.a[i + 1] = y;
        break;
      }
      case plan::OpKind::kForwardSave: {
        need(st.a[i].defined(), op, "its input is not live");
        c10::AutoGradMode grad_on(true);
        at::Tensor in = st.a[i].detach();
        if (i > 0 ? (in.is_floating_point() || in.is_complex()) : input_requires_grad) in.requires_grad_(true);
        const uint64_t seq0 = at::sequence_number::peek();
        at::Tensor y = run_stage(i, in);
        std::vector<at::Tensor> targets{in};
        targets.insert(targets.end(), params[i].begin(), params[i].end());
        st.edges[i] = redirect_gradient_edges(y, targets, seq0);
        st.from_forward[i] = in_forward_part;
        st.leaf[i] = in;
        st.out[i] = y;
        st.a[i + 1] = y.detach();
        break;
      }
      case plan::OpKind::kBackward: {
        need(st.out[i].defined(), op, "its saved set is not live");
        need(want != nullptr, op, "a backward of another stage comes first");
        stage_backward(i, *want, *param_grads);
        st.a[i + 1] = at::Tensor();
        break;
      }
      case plan::OpKind::kDrop: st.a[i] = at::Tensor(); break;
    }
  }

  /** The forward part: ops up to the first backward. Returns a_L. */
  at::Tensor run_forward() {
    in_forward_part = true;
    while (pc < schedule.ops.size() && schedule.ops[pc].kind != plan::OpKind::kBackward) {
      step(schedule.ops[pc], nullptr, nullptr);
      ++pc;
    }
    forward_end_pc = pc;
    in_forward_part = false;
    need(st.out[L - 1].defined(), plan::Op{plan::OpKind::kForwardSave, L - 1}, "the forward part must end with it");
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
    if (ta::get_current_graph_task_keep_graph()) {
      if (!kept) kept = st;
    } else {
      kept.reset();
    }
  }

  /** Node i's work. */
  ta::variable_list backward_stage(int i, ta::Node& node, ta::variable_list&& grads) {
    std::vector<bool> want(node.num_outputs());
    for (size_t k = 0; k < want.size(); ++k) want[k] = node.task_should_compute_output(k);
    if (i == L - 1) {
      higher_order = at::GradMode::is_enabled();  // create_graph
      if (higher_order) return higher_order_backward(grads[0]);
      begin_backward();
      grad = grads[0].defined() ? std::move(grads[0]) : at::zeros_like(st.a[L]);
    } else if (higher_order) {
      return std::move(higher_order_grads[i]);
    } else {
      grad = std::move(grads[0]);  // the only reference: freed inside the stage's backward
    }
    ta::variable_list result(node.num_outputs());
    ta::variable_list param_grads(params[i].size());
    bool done = false;
    while (pc < schedule.ops.size() && !done) {
      const plan::Op& op = schedule.ops[pc];
      done = op.kind == plan::OpKind::kBackward && op.stage == i;
      step(op, op.kind == plan::OpKind::kBackward && op.stage == i ? &want : nullptr, &param_grads);
      ++pc;
    }
    need(done, plan::Op{plan::OpKind::kBackward, i}, "the schedule ends before it");
    for (size_t k = 0; k < param_grads.size(); ++k) result[1 + k] = std::move(param_grads[k]);
    if (want[0]) result[0] = grad;
    grad = at::Tensor();
    if (i == 0) finish();
    return result;
  }

  /** create_graph: recompute the chain with its graph from the attached
   *  input, gradients with create_graph; node L-1 returns its share, the
   *  other nodes theirs (NOTE above). The forward part's state is left as
   *  it is, for a later ordinary backward. */
  ta::variable_list higher_order_backward(const at::Tensor& grad_out) {
    const uint64_t seq0 = at::sequence_number::peek();
    at::Tensor h = input;
    for (int i = 0; i < L; ++i) {
      auto& m = *(seq->begin() + i);
      ReplayGuard replay(*first_run[i], /*enable_grad=*/true);
      h = m.forward<at::Tensor>(h);
    }
    std::vector<at::Tensor> targets{input};
    std::vector<std::pair<int, int>> where{{0, 0}};  // (stage, output index)
    for (int i = 0; i < L; ++i) {
      for (size_t k = 0; k < params[i].size(); ++k) {
        targets.push_back(params[i][k]);
        where.emplace_back(i, static_cast<int>(1 + k));
      }
    }
    higher_order_grads.assign(L, {});
    for (int i = 0; i < L; ++i) higher_order_grads[i].resize(nodes[i]->num_outputs());
    Redirected r = redirect_gradient_edges(h, targets, seq0);
    ta::edge_list outputs;
    std::vector<size_t> target_of;
    for (size_t t = 0; t < targets.size(); ++t) {
      const auto [stage, k] = where[t];
      if (r.target_input[t] < 0 || !nodes[stage]->task_should_compute_output(k)) continue;
      if (t == 0 && !input_requires_grad) continue;
      outputs.push_back(r.edge(r.target_input[t]));
      target_of.push_back(t);
    }
    const size_t n_targets = outputs.size();
    for (const auto& [leaf, nr] : r.other_leaves) outputs.push_back(r.edge(nr));
    if (!outputs.empty()) {
      at::Tensor g = grad_out.defined() ? grad_out : at::zeros_like(h);
      ta::variable_list got = ta::Engine::get_default_engine().execute(
          // keep_graph: the higher-order backward runs through h's graph.
          {ta::impl::gradient_edge(h)}, {g}, /*keep_graph=*/true, /*create_graph=*/true,
          /*accumulate_grad=*/false, outputs);
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
    if (probe) report.measured_peak_bytes = probe->peak_bytes() + input_bytes;
    probe.reset();
    st = State();
    std::lock_guard<std::mutex> lock(*owner->mu_);
    owner->last_step_ = std::move(report);
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

/** Everything that changes the chain's costs: dtype, device, sizes and
 *  layout of x, whether x and each parameter require grad, train/eval
 *  mode, and the autocast state. */
std::vector<int64_t> plan_key(const at::Tensor& x, const torch::nn::Sequential& seq) {
  std::vector<int64_t> key{static_cast<int64_t>(x.scalar_type()),
                           static_cast<int64_t>(x.device().type()),
                           x.device().index(),
                           x.requires_grad(),
                           x.is_contiguous(),
                           x.is_contiguous(at::MemoryFormat::ChannelsLast),
                           seq->is_training()};
  const AutocastState ac = AutocastState::capture();
  key.insert(key.end(), {ac.cpu_enabled, static_cast<int64_t>(ac.cpu_dtype), ac.cuda_enabled,
                         static_cast<int64_t>(ac.cuda_dtype)});
  for (const auto& m : seq->modules(/*include_self=*/false)) key.push_back(m->is_training());
  for (const auto& p : seq->parameters()) key.push_back(p.requires_grad());
  key.push_back(-1);  // separates the flags from the sizes
  for (auto s : x.sizes()) key.push_back(s);
  return key;
}

}  // namespace
}  // namespace detail

CheckpointedSequentialImpl::CheckpointedSequentialImpl(torch::nn::Sequential seq, SequentialOptions options)
    : seq_(std::move(seq)), options_(std::move(options)) {
  if (seq_->size() == 0) {
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
  reset();
}

void CheckpointedSequentialImpl::reset() {
  // Registered under their own names, not under a "seq" child: swapping a
  // model's Sequential for this wrapper keeps parameter names and the layout
  // of saved weights, and parameters() lists each one once.
  for (const auto& item : seq_->named_children()) register_module(item.key(), item.value());
  plans_.clear();
  last_ = nullptr;
}

void CheckpointedSequentialImpl::train(bool on) {
  torch::nn::Module::train(on);
  seq_->train(on);
}

std::shared_ptr<torch::nn::Module> CheckpointedSequentialImpl::clone(const std::optional<c10::Device>& device) const {
  // Cloneable::clone would re-register the same Sequential in the copy and
  // then overwrite its parameters, changing the original: copy it deeply.
  auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(seq_->clone(device));
  if (!seq) throw Error("[remat::CheckpointedSequential] internal: Sequential::clone returned another type.");
  auto copy = std::make_shared<CheckpointedSequentialImpl>(torch::nn::Sequential(seq), options_);
  copy->train(is_training());
  return copy;
}

const CheckpointedSequentialImpl::Entry& CheckpointedSequentialImpl::entry_for(const at::Tensor& x) {
  auto key = detail::plan_key(x, seq_);
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second;
  Entry e;
  e.chain = profile(seq_, x, options_.profile());
  ++profiles_;
  int64_t budget = options_.memory_budget_bytes();
  if (options_.memory_budget_fraction() > 0) {
    const int64_t plain = plan::store_all(e.chain).prediction.peak_bytes;
    budget = std::max<int64_t>(1, static_cast<int64_t>(options_.memory_budget_fraction() * static_cast<double>(plain)));
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
    e.plan = plan::solve(e.chain, solve);
    if (budget > 0 && e.plan.prediction.peak_bytes > budget) {
      throw Error("[remat::CheckpointedSequential] the " + algorithm + " schedule peaks at " +
                  format_bytes(e.plan.prediction.peak_bytes) + ", over the budget of " + format_bytes(budget) +
                  "; use algorithm \"optimal\" (the default with a budget) or raise memory_budget_bytes.");
    }
  }
  return plans_.emplace(std::move(key), std::move(e)).first->second;
}

const plan::Plan& CheckpointedSequentialImpl::plan(const at::Tensor& x) {
  std::lock_guard<std::mutex> lock(*mu_);
  last_ = &entry_for(x);
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
  const int L = static_cast<int>(seq_->size());
  // Per stage: its parameters that require grad, each once.
  std::vector<std::vector<at::Tensor>> params(L);
  bool any_grad = x.requires_grad();
  for (int i = 0; i < L; ++i) {
    std::unordered_set<const c10::TensorImpl*> seen;
    for (auto& p : (seq_->begin() + i)->ptr()->parameters()) {
      if (p.requires_grad() && seen.insert(p.unsafeGetTensorImpl()).second) params[i].push_back(p);
    }
    any_grad |= !params[i].empty();
  }
  if (!at::GradMode::is_enabled() || !any_grad) return seq_->forward(x);  // nothing to save

  const Entry* entry;
  {
    // Entries are never erased while the module lives (map nodes are
    // stable), so the pointer stays valid after the lock is released.
    std::lock_guard<std::mutex> lock(*mu_);
    entry = last_ = &entry_for(x);
  }
  auto exec = std::make_shared<detail::Execution>();
  exec->owner = std::static_pointer_cast<CheckpointedSequentialImpl>(shared_from_this());
  exec->seq = seq_;
  exec->schedule = entry->plan.schedule;
  exec->L = L;
  exec->st.a.resize(L + 1);
  exec->st.leaf.resize(L);
  exec->st.out.resize(L);
  exec->st.edges.resize(L);
  exec->st.from_forward.assign(L, false);
  exec->st.runs.assign(L, 0);
  exec->out_meta.resize(L);
  exec->first_run.resize(L);
  exec->params = std::move(params);
  exec->preserve_rng = options_.preserve_rng_state();
  exec->input_requires_grad = x.requires_grad();
  exec->input = x;
  exec->input_bytes = entry->chain.input_bytes;
  if (options_.measure_memory()) {
    // Capture the RNG state once before measuring: stages that draw no random
    // numbers then share this copy instead of allocating inside the window.
    detail::ReplayState::capture(exec->preserve_rng, {x.device()}, {});
    exec->probe = std::make_unique<memory::Probe>();
  }
  exec->st.a[0] = x.detach();
  at::Tensor y = exec->run_forward().detach();  // shares a_L's storage

  // One node per stage, node i's first edge to node i-1 (node 0's to x).
  std::vector<c10::intrusive_ptr<detail::StageBackward>> nodes(L);
  for (int i = 0; i < L; ++i) {
    auto node = c10::make_intrusive<detail::StageBackward>();
    node->stage = i;
    node->exec = exec;
    torch::autograd::edge_list edges;
    if (i == 0) {
      edges.push_back(x.requires_grad() ? torch::autograd::impl::gradient_edge(x) : torch::autograd::Edge());
    } else {
      edges.emplace_back(nodes[i - 1], 0);
    }
    auto rest = torch::autograd::collect_next_edges(exec->params[i]);
    edges.insert(edges.end(), rest.begin(), rest.end());
    node->set_next_edges(std::move(edges));
    if (i < L - 1) {
      const auto& [opts, sizes] = exec->out_meta[i];
      node->add_input_metadata(opts, c10::fromIntArrayRefSlow(sizes), false, false, std::nullopt);
    }
    exec->nodes.push_back(node.get());
    nodes[i] = std::move(node);
  }
  torch::autograd::create_gradient_edge(y, nodes[L - 1]);
  return y;
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
  return os.str();
}

}  // namespace remat
