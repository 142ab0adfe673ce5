// remat::CheckpointedSequential: executes a planner Schedule op by op.
// NOTE [planned execution]: forward runs the ops before the first backward
// (kForward without grad, kForwardSave with grad on a detached input that
// becomes a leaf), and returns a_L attached to a ChainBackward node whose
// edges go to x and to the parameters. Autograd calls that node with dL/da_L;
// it runs the remaining ops: recomputations, and kBackward(i) as an inner
// backward of stage i's small graph, which accumulates the parameters'
// gradients into .grad and leaves dL/da_i on the stage's input leaf. Every
// execution of a stage after its first replays the first one's RNG and
// autocast state and puts its buffers back, so BatchNorm statistics move
// once per step and dropout masks match a plain run.
#include <remat/sequential.h>

#include <cstdio>
#include <sstream>

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <remat/error.h>
#include <remat/hooks.h>
#include <remat/memory.h>

#include "replay.h"

namespace remat {
namespace detail {

struct Execution {
  std::shared_ptr<CheckpointedSequentialImpl> owner;
  torch::nn::Sequential seq;
  plan::Schedule schedule;
  size_t pc = 0;
  int L = 0;
  std::vector<at::Tensor> a;     // boundary values a_0..a_L (detached)
  std::vector<at::Tensor> leaf;  // s_i: stage input leaf ...
  std::vector<at::Tensor> out;   // ... and output with its graph
  at::Tensor grad;               // gradient at the current boundary
  std::vector<int> runs;
  std::vector<std::optional<ReplayState>> first_run;  // per stage
  bool preserve_rng = true;
  bool input_requires_grad = false;
  std::unique_ptr<memory::Probe> probe;
  int64_t input_bytes = 0;

  at::Tensor run_stage(int i, const at::Tensor& in) {
    auto& m = *(seq->begin() + i);
    if (runs[i]++ == 0) {
      first_run[i] = ReplayState::capture(preserve_rng, {in.device()}, m.ptr()->buffers());
      return m.forward<at::Tensor>(in);
    }
    ReplayGuard replay(*first_run[i], /*enable_grad=*/false);
    return m.forward<at::Tensor>(in);
  }

  void need(bool ok, const plan::Op& op, const char* what) const {
    if (!ok) {
      throw Error("[remat::CheckpointedSequential] op #" + std::to_string(pc) + " " + plan::to_string(op) +
                  ": " + what + "; the schedule does not fit this chain (validate it with remat::plan::simulate).");
    }
  }

  void step(const plan::Op& op) {
    const int i = op.stage;
    switch (op.kind) {
      case plan::OpKind::kForward: {
        need(a[i].defined(), op, "its input is not live");
        at::Tensor y;
        {
          at::NoGradGuard no_grad;
          y = run_stage(i, a[i]);
        }
        a[i + 1] = y;
        break;
      }
      case plan::OpKind::kForwardSave: {
        need(a[i].defined(), op, "its input is not live");
        c10::AutoGradMode grad_on(true);
        at::Tensor in = a[i].detach();
        if (i > 0 ? (in.is_floating_point() || in.is_complex()) : input_requires_grad) in.requires_grad_(true);
        at::Tensor y = run_stage(i, in);
        leaf[i] = in;
        out[i] = y;
        a[i + 1] = y.detach();
        break;
      }
      case plan::OpKind::kBackward: {
        need(out[i].defined(), op, "its saved set is not live");
        if (out[i].requires_grad() && grad.defined()) {
          c10::AutoGradMode grad_on(true);
          torch::autograd::backward({out[i]}, {grad});
          grad = leaf[i].requires_grad() ? leaf[i].grad() : at::Tensor();
        } else {
          grad = at::Tensor();
        }
        leaf[i] = at::Tensor();
        out[i] = at::Tensor();
        a[i + 1] = at::Tensor();
        break;
      }
      case plan::OpKind::kDrop:
        a[i] = at::Tensor();
        break;
    }
  }

  /** The forward phase: ops up to the first backward. Returns a_L. */
  at::Tensor run_forward() {
    while (pc < schedule.ops.size() && schedule.ops[pc].kind != plan::OpKind::kBackward) step(schedule.ops[pc++]);
    need(out[L - 1].defined(), plan::Op{plan::OpKind::kForwardSave, L - 1}, "the forward part must end with it");
    return a[L];
  }

  /** The rest, given dL/da_L; returns dL/dx (undefined if x needs none). */
  at::Tensor run_backward(const at::Tensor& grad_out) {
    if (pc >= schedule.ops.size()) {
      throw Error(
          "[remat::CheckpointedSequential] backward through the chain a second time; planned execution "
          "frees its state as it goes, so retain_graph is not supported. Run forward again for another backward.");
    }
    grad = grad_out.defined() ? grad_out : at::zeros_like(a[L]);
    while (pc < schedule.ops.size()) step(schedule.ops[pc++]);
    at::Tensor dx = input_requires_grad ? grad : at::Tensor();
    grad = at::Tensor();
    a.clear();
    StepReport report;
    report.forwards_per_stage = runs;
    if (probe) report.measured_peak_bytes = probe->peak_bytes() + input_bytes;
    probe.reset();
    owner->last_step_ = std::move(report);
    return dx;
  }
};

namespace {

struct ChainBackward : torch::autograd::Node {
  std::shared_ptr<Execution> exec;
  bool input_edge = false;

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (!exec) {
      throw Error(
          "[remat::CheckpointedSequential] backward through the chain after its graph was freed; run forward "
          "again for another backward.");
    }
    at::Tensor dx = exec->run_backward(grads[0]);
    torch::autograd::variable_list result(num_outputs());
    if (input_edge) result[0] = dx;
    return result;
  }
  void release_variables() override { exec.reset(); }
  std::string name() const override { return "remat::CheckpointedSequentialBackward"; }
};

std::vector<int64_t> shape_key(const at::Tensor& x) {
  std::vector<int64_t> key{static_cast<int64_t>(x.scalar_type()), static_cast<int64_t>(x.device().type()),
                           x.device().index()};
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
  reset();
}

void CheckpointedSequentialImpl::reset() {
  seq_ = register_module("seq", seq_);
  plans_.clear();
  last_ = nullptr;
}

const CheckpointedSequentialImpl::Entry& CheckpointedSequentialImpl::entry_for(const at::Tensor& x) {
  auto key = detail::shape_key(x);
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second;
  Entry e;
  e.chain = profile(seq_, x, options_.profile());
  ++profiles_;
  const int64_t budget = options_.memory_budget_bytes();
  if (options_.schedule()) {
    e.plan = {"explicit", *options_.schedule(), plan::simulate(e.chain, *options_.schedule())};
  } else if (options_.segments() > 0) {
    e.plan = plan::uniform(e.chain, options_.segments());
  } else {
    std::string algorithm = options_.algorithm();
    if (algorithm.empty()) algorithm = budget > 0 ? "optimal" : "sqrt";
    auto solve = plan::parse_algorithm(algorithm).with_memory_slots(options_.memory_slots()).with_scope(options_.scope());
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
  last_ = &entry_for(x);
  return last_->plan;
}

const plan::Plan& CheckpointedSequentialImpl::plan() const {
  if (!last_) {
    throw Error("[remat::CheckpointedSequential] no plan yet: run forward once, or call plan(x) with a sample.");
  }
  return last_->plan;
}

const plan::Chain& CheckpointedSequentialImpl::chain() const {
  plan();  // throws if none
  return last_->chain;
}

at::Tensor CheckpointedSequentialImpl::forward(const at::Tensor& x) {
  bool any_grad = x.requires_grad();
  std::vector<at::Tensor> params;
  for (auto& p : seq_->parameters()) {
    if (p.requires_grad()) {
      params.push_back(p);
      any_grad = true;
    }
  }
  if (!at::GradMode::is_enabled() || !any_grad) return seq_->forward(x);  // nothing to save

  last_ = &entry_for(x);
  auto exec = std::make_shared<detail::Execution>();
  exec->owner = std::static_pointer_cast<CheckpointedSequentialImpl>(shared_from_this());
  exec->seq = seq_;
  exec->schedule = last_->plan.schedule;
  exec->L = static_cast<int>(seq_->size());
  exec->a.resize(exec->L + 1);
  exec->leaf.resize(exec->L);
  exec->out.resize(exec->L);
  exec->runs.assign(exec->L, 0);
  exec->first_run.resize(exec->L);
  exec->preserve_rng = options_.preserve_rng_state();
  exec->input_requires_grad = x.requires_grad();
  exec->input_bytes = last_->chain.input_bytes;
  if (options_.measure_memory()) {
    // Capture the RNG state once before measuring: stages that draw no random
    // numbers then share this copy instead of allocating inside the window.
    detail::ReplayState::capture(exec->preserve_rng, {x.device()}, {});
    exec->probe = std::make_unique<memory::Probe>();
  }
  exec->a[0] = x.detach();

  at::Tensor y = exec->run_forward().detach();  // shares a_L's storage
  auto node = c10::make_intrusive<detail::ChainBackward>();
  std::vector<at::Tensor> edges;
  if (x.requires_grad()) {
    edges.push_back(x);
    node->input_edge = true;
  }
  edges.insert(edges.end(), params.begin(), params.end());
  node->set_next_edges(torch::autograd::collect_next_edges(edges));
  node->exec = std::move(exec);
  torch::autograd::create_gradient_edge(y, node);
  return y;
}

std::string CheckpointedSequentialImpl::explain() const {
  const auto& c = chain();
  const auto& p = last_->plan;
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
  if (last_step_.measured_peak_bytes >= 0) {
    os << "measured peak (last step): " << format_bytes(last_step_.measured_peak_bytes) << " ("
       << (100.0 * static_cast<double>(last_step_.measured_peak_bytes) /
           static_cast<double>(std::max<int64_t>(1, p.prediction.peak_bytes)))
       << "% of predicted)\n";
  } else {
    os << "measured peak: none yet (run a forward and backward step)\n";
  }
  return os.str();
}

}  // namespace remat
