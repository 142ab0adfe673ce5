// Tests of the whole-step planner (auto.h) on four kinds of step: remat's
// GPT with embedding, head and loss (also under bf16 autocast, and with two
// micro-batches per step); a ResNet with BatchNorm; a U-Net whose skips
// cross nested checkpointable stages, with in-place ReLUs; and a GAN step
// whose discriminator runs twice before its backward; a CheckpointedSequential
// beside a unit (its schedules as options, its stage forwards counted by the
// stages, with and without selective stage levers) and remat's GPT with its
// blocks as a chain. Each is trained
// plainly and under auto plans at three budgets, with both zero_grad styles:
// parameters and BatchNorm statistics must be bitwise equal to the plain run
// after every step, and each planned step's measured peak within the budget
// (+1% allocator slack). Also: recomputes counted against the plan, explain()
// and the trace, and every error a user can provoke, pinned.
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <remat/auto.h>
#include <remat/memory.h>
#include <remat/models/gpt.h>
#include <remat/models/resnet.h>
#include <remat/plan/error.h>

#include "../../src/offload/offload_internal.h"
#include "../common.h"

namespace {

const bool kOneThread = (torch::set_num_threads(1), true);
// Every tensor of every run counted, parameters included, as a user who
// calls it first thing in main() gets.
const bool kTracking = (remat::memory::enable_tracking(), true);

// --- test models -------------------------------------------------------------

/** conv-BN-ReLU x2 with in-place ReLUs; a unit of its own. */
struct ConvBlockImpl : torch::nn::Module, remat::Checkpointable {
  ConvBlockImpl(int64_t in, int64_t out)
      : c1(register_module("c1", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).padding(1).bias(false)))),
        b1(register_module("b1", torch::nn::BatchNorm2d(out))),
        c2(register_module("c2", torch::nn::Conv2d(torch::nn::Conv2dOptions(out, out, 3).padding(1).bias(false)))),
        b2(register_module("b2", torch::nn::BatchNorm2d(out))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return checkpointed([this](const torch::Tensor& h) { return body(h); }, x);
  }
  torch::Tensor body(const torch::Tensor& x) {
    auto h = b1(c1(x));
    h.relu_();
    auto y = b2(c2(h));
    return y.relu_();
  }
  torch::nn::Conv2d c1;
  torch::nn::BatchNorm2d b1;
  torch::nn::Conv2d c2;
  torch::nn::BatchNorm2d b2;
};
TORCH_MODULE(ConvBlock);

/** Two ConvBlocks: a checkpointable stage holding checkpointable blocks. */
struct StageImpl : torch::nn::Module, remat::Checkpointable {
  StageImpl(int64_t in, int64_t out)
      : a(register_module("a", ConvBlock(in, out))), b(register_module("b", ConvBlock(out, out))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return checkpointed([this](const torch::Tensor& h) { return b->forward(a->forward(h)); }, x);
  }
  ConvBlock a, b;
};
TORCH_MODULE(Stage);

/** A U-Net: two encoder stages, a middle, two decoder blocks that take the
 *  encoders' outputs through skips. Not remat's. */
struct UNetImpl : torch::nn::Module {
  explicit UNetImpl(int64_t w)
      : enc1(register_module("enc1", Stage(3, w))),
        enc2(register_module("enc2", Stage(w, 2 * w))),
        mid(register_module("mid", ConvBlock(2 * w, 4 * w))),
        dec2(register_module("dec2", ConvBlock(4 * w + 2 * w, 2 * w))),
        dec1(register_module("dec1", ConvBlock(2 * w + w, w))),
        head(register_module("head", torch::nn::Conv2d(torch::nn::Conv2dOptions(w, 2, 1)))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto e1 = enc1->forward(x);                         // (B, w, H, W)
    auto e2 = enc2->forward(torch::max_pool2d(e1, 2));  // (B, 2w, H/2, W/2)
    auto m = mid->forward(torch::max_pool2d(e2, 2));    // (B, 4w, H/4, W/4)
    auto up2 = torch::upsample_nearest2d(m, std::vector<int64_t>{e2.size(2), e2.size(3)});
    auto d2 = dec2->forward(torch::cat({up2, e2}, 1));  // (B, 2w, H/2, W/2)
    auto up1 = torch::upsample_nearest2d(d2, std::vector<int64_t>{e1.size(2), e1.size(3)});
    return head(dec1->forward(torch::cat({up1, e1}, 1)));  // (B, 2, H, W)
  }
  Stage enc1, enc2;
  ConvBlock mid, dec2, dec1;
  torch::nn::Conv2d head;
};
TORCH_MODULE(UNet);

/** A residual MLP block with dropout: the GAN's units. */
struct DenseImpl : torch::nn::Module, remat::Checkpointable {
  explicit DenseImpl(int64_t d)
      : fc1(register_module("fc1", torch::nn::Linear(d, 4 * d))),
        fc2(register_module("fc2", torch::nn::Linear(4 * d, d))),
        drop(register_module("drop", torch::nn::Dropout(0.1))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return checkpointed([this](const torch::Tensor& h) { return h + drop(fc2(torch::gelu(fc1(h)))); }, x);
  }
  torch::nn::Linear fc1, fc2;
  torch::nn::Dropout drop;
};
TORCH_MODULE(Dense);

struct GanImpl : torch::nn::Module {
  explicit GanImpl(int64_t d) {
    g_in = register_module("g_in", torch::nn::Linear(16, d));
    g = register_module("g", torch::nn::Sequential(Dense(d), Dense(d), Dense(d)));
    d_blocks = register_module("d", torch::nn::Sequential(Dense(d), Dense(d)));
    d_out = register_module("d_out", torch::nn::Linear(d, 1));
  }
  torch::Tensor generate(const torch::Tensor& z) { return g->forward(g_in(z)); }
  torch::Tensor discriminate(const torch::Tensor& x) { return d_out(d_blocks->forward(x)); }
  std::vector<torch::Tensor> g_parameters() {
    auto p = g_in->parameters();
    for (auto& t : g->parameters()) p.push_back(t);
    return p;
  }
  std::vector<torch::Tensor> d_parameters() {
    auto p = d_blocks->parameters();
    for (auto& t : d_out->parameters()) p.push_back(t);
    return p;
  }
  torch::nn::Linear g_in{nullptr}, d_out{nullptr};
  torch::nn::Sequential g{nullptr}, d_blocks{nullptr};
};
TORCH_MODULE(Gan);

/** A residual MLP block whose output is thresholded at 1.5: mostly zeros,
 *  so the next block's input compresses well. threshold saves its input,
 *  not its output (a ReLU would save the next block's input, which would
 *  then never be free to go). */
struct SparseDenseImpl : torch::nn::Module, remat::Checkpointable {
  explicit SparseDenseImpl(int64_t d)
      : fc1(register_module("fc1", torch::nn::Linear(d, 4 * d))),
        fc2(register_module("fc2", torch::nn::Linear(4 * d, d))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return checkpointed(
        [this](const torch::Tensor& h) { return torch::threshold(h + fc2(torch::gelu(fc1(h))), 1.5, 0.0); }, x);
  }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(SparseDense);

/** Counts its calls: the first module of each chain stage, so that stage
 *  forwards are counted apart from what the planner says it runs. */
struct CountImpl : torch::nn::Module {
  explicit CountImpl(std::shared_ptr<std::atomic<int64_t>> n) : n(std::move(n)) {}
  torch::Tensor forward(const torch::Tensor& x) {
    ++*n;
    return x;
  }
  std::shared_ptr<std::atomic<int64_t>> n;
};
TORCH_MODULE(Count);

/** One stage of ChainNet: counted, then an MLP with BatchNorm and dropout. */
struct MlpStageImpl : torch::nn::Module {
  MlpStageImpl(int64_t d, std::shared_ptr<std::atomic<int64_t>> n)
      : count(register_module("count", Count(std::move(n)))),
        fc1(register_module("fc1", torch::nn::Linear(d, 4 * d))),
        fc2(register_module("fc2", torch::nn::Linear(4 * d, d))),
        bn(register_module("bn", torch::nn::BatchNorm1d(d))),
        drop(register_module("drop", torch::nn::Dropout(0.1))) {}
  torch::Tensor forward(const torch::Tensor& x) { return drop(bn(fc2(torch::gelu(fc1(count(x)))))); }
  Count count;
  torch::nn::Linear fc1, fc2;
  torch::nn::BatchNorm1d bn;
  torch::nn::Dropout drop;
};
TORCH_MODULE(MlpStage);

/** An input layer, a CheckpointedSequential of MLP stages with BatchNorm
 *  and dropout, and a checkpointable Dense block beside it: a chain unit
 *  and a module unit in one step. */
struct ChainNetImpl : torch::nn::Module {
  ChainNetImpl(int64_t d, int64_t stages, std::shared_ptr<std::atomic<int64_t>> n,
               const remat::SequentialOptions& options = remat::SequentialOptions()) {
    in = register_module("in", torch::nn::Linear(16, d));
    torch::nn::Sequential seq;
    for (int64_t i = 0; i < stages; ++i) {
      seq->push_back(MlpStage(d, n));
    }
    body = register_module("body", remat::CheckpointedSequential(seq, options));
    head = register_module("head", Dense(d));
    out = register_module("out", torch::nn::Linear(d, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) { return out(head->forward(body->forward(in(x)))); }
  torch::nn::Linear in{nullptr}, out{nullptr};
  remat::CheckpointedSequential body{nullptr};
  Dense head{nullptr};
};
TORCH_MODULE(ChainNet);

// --- the harness ---------------------------------------------------------------

/** Parameters then buffers, as bytes outside the tracked allocator (so that
 *  keeping them does not change the peaks the test measures). */
using Bytes = std::vector<uint8_t>;
std::vector<Bytes> state_of(torch::nn::Module& m) {
  std::vector<Bytes> out;
  auto add = [&](const torch::Tensor& t) {
    const torch::Tensor c = t.detach().contiguous();
    const auto* p = static_cast<const uint8_t*>(c.data_ptr());
    out.emplace_back(p, p + c.nbytes());
  };
  for (const auto& p : m.parameters()) add(p);
  for (const auto& b : m.buffers()) add(b);
  return out;
}

/** A model and its training step. */
struct Workload {
  std::shared_ptr<torch::nn::Module> model;
  std::function<void(int step)> step;  // one training step on batch `step`
  // A chain unit's stage forwards, counted by its stages (CountImpl);
  // nullptr without a chain.
  std::shared_ptr<std::atomic<int64_t>> stage_forwards;
  std::string chain;          // the chain unit's name
  int64_t chain_stages = 0;   // its stages
  bool chain_levers = false;  // its stages offer selective levels, which the leanest plans use
  /** The step's optimizers, for AutoOptions::optimizers (the model-state levers). */
  std::vector<torch::optim::Optimizer*> optimizers;
};
using Make = std::function<Workload(bool set_to_none)>;

struct Result {
  std::vector<std::vector<Bytes>> states;  // parameters then buffers, after each step
  std::vector<int64_t> peaks;              // measured peak of each planned step
  std::vector<int64_t> predicted;          // the plan's prediction at each planned step
  std::vector<int64_t> inflight;           // and the room it keeps above it (inflight_bytes())
  int64_t budget = 0, profiled_peak = 0, min_peak = 0;
  std::vector<int64_t> recomputes, expected_recomputes;
  std::vector<int64_t> stage_forwards, expected_stage_forwards;  // chain workloads
  std::string chain_choice;                                      // the chain unit's option in the last plan
  bool chain_levers = false;
  std::vector<std::string> choices;  // the options of the last plan, per unit
  std::string explain;
  int inner_chosen = 0;   // inner units given an option other than keep by the last plan
  int nested_chosen = 0;  // units recomputing with their inner units checkpointed
};

constexpr int kSteps = 4;  // 1 warm-up, 1 profiled, 2 planned

/** With a state_dir, the model-state levers join the menu: the workload's
 *  optimizers step in backward, and their state may go to a disk store
 *  there. */
Result run(const Make& make, bool set_to_none, std::optional<remat::AutoOptions> options,
           const std::string& state_dir = "", std::optional<double> fraction = std::nullopt) {
  torch::manual_seed(0);
  Workload w = make(set_to_none);
  torch::manual_seed(1);
  if (options && !state_dir.empty()) {
    options->optimizers(w.optimizers)
        .optimizer_state_store(remat::OffloadOptions(remat::OffloadTarget::kDisk).directory(state_dir));
  }
  Result r;
  if (!options) {
    for (int k = 0; k < kSteps; ++k) {
      w.step(k);
      r.states.push_back(state_of(*w.model));
    }
    return r;
  }
  if (fraction) options->memory_budget_fraction(1.0);
  auto planner = remat::auto_checkpoint(*w.model, options->profile_repeats(1));
  for (int k = 0; k < kSteps; ++k) {
    const bool planned_step = planner.planned();
    if (fraction && k == kSteps - 2) {
      EXPECT_TRUE(planned_step) << "the first planned step is step " << k << ": its budget is the fraction's";
      // The budget `fraction` of the way from this profile's leanest plan
      // to its plain peak: menus measured by time (a chain's schedules,
      // selective levels) differ from one profile to the next, and so
      // does the leanest plan.
      const int64_t low = planner.leanest_peak_bytes(), high = planner.profiled_peak_bytes();
      planner.replan(low + static_cast<int64_t>(*fraction * static_cast<double>(high - low)));
    }
    // The plan in force for this step (an overrun re-plans after it).
    int64_t expected = 0, predicted = 0, expected_forwards = 0, inflight = 0;
    if (planned_step) {
      predicted = planner.plan().prediction.peak_bytes;
      inflight = planner.inflight_bytes();
      const auto units = planner.units();
      for (const auto& u : units) {
        const std::string& o = u.options[u.choice];
        if (u.name == w.chain) {
          // "schedule: N stage forwards[, S selective], ...": N forwards, and S
          // stages under a selective level, each run again in its backward.
          const size_t at = o.find(" selective");
          const int64_t selective = at == std::string::npos ? 0 : std::stoll(o.substr(o.rfind(", ", at) + 2));
          expected_forwards +=
              u.calls * (o == "keep" ? w.chain_stages : std::stoll(o.substr(o.find(':') + 1)) + selective);
          expected += u.calls * selective;
          continue;
        }
        expected += o == "keep" || o.rfind("offload", 0) == 0 ? 0 : u.calls;
        // Its inner units recompute inside its recompute, once per call of theirs.
        if (o != "recompute, inner units too") continue;
        for (const auto& v : units) expected += v.name.rfind(u.name + ".", 0) == 0 ? v.calls : 0;
      }
    }
    remat::reset_checkpoint_stats();
    if (w.stage_forwards) *w.stage_forwards = 0;
    planner.step([&] { w.step(k); });
    r.states.push_back(state_of(*w.model));
    if (planned_step) {
      r.peaks.push_back(planner.measured_peak_bytes());
      r.predicted.push_back(predicted);
      r.inflight.push_back(inflight);
      r.recomputes.push_back(remat::checkpoint_stats().recomputations);
      r.expected_recomputes.push_back(expected);
      if (w.stage_forwards) {
        r.stage_forwards.push_back(*w.stage_forwards);
        r.expected_stage_forwards.push_back(expected_forwards);
      }
    }
  }
  const auto units = planner.units();
  for (size_t j = 0; j < units.size(); ++j) {
    const auto& u = units[j];
    r.choices.push_back(u.options[u.choice]);
    if (u.name == w.chain) r.chain_choice = u.options[u.choice];
    r.chain_levers = w.chain_levers;
    r.inner_chosen += planner.step_model().units[j].parent >= 0 && u.choice != 0;
    r.nested_chosen += u.options[u.choice] == "recompute, inner units too";
    if (!u.runs_in.empty()) {  // inside a unit that does not keep: part of it
      EXPECT_EQ(u.choice, 0) << u.name;
      EXPECT_EQ(u.kept_bytes, 0) << u.name;
      EXPECT_NE(planner.explain().find("part of " + u.runs_in + "\n"), std::string::npos) << planner.explain();
    }
  }
  r.budget = planner.budget_bytes();
  r.profiled_peak = planner.profiled_peak_bytes();
  r.min_peak = planner.leanest_peak_bytes();
  r.explain = planner.explain();
  if (std::getenv("REMAT_AUTO_TEST_DUMP")) {
    const auto& m = planner.step_model();
    std::ostringstream os;
    for (size_t s = 0; s < m.segment_peak_bytes.size(); ++s) os << " " << m.segment_peak_bytes[s];
    os << "\n";
    for (const auto& u : m.units) {
      for (const auto& c : u.calls) {
        os << u.name << " [" << c.forward_begin << " " << c.forward_end << " " << c.backward_begin << " "
           << c.backward_end << "] release " << c.release_begin;
        for (size_t k = 0; k < c.costs.size(); ++k) {
          os << " | " << u.options[k] << " F" << c.costs[k].forward_peak_bytes << " K" << c.costs[k].kept_bytes << " B"
             << c.costs[k].backward_peak_bytes << " R" << c.costs[k].released_bytes;
        }
        os << "\n";
      }
    }
    r.explain += os.str();
  }
  return r;
}

void expect_bitwise(const Result& plain, const Result& got, const std::string& what) {
  ASSERT_EQ(plain.states.size(), got.states.size());
  for (size_t k = 0; k < plain.states.size(); ++k) {
    ASSERT_EQ(plain.states[k].size(), got.states[k].size());
    for (size_t i = 0; i < plain.states[k].size(); ++i) {
      ASSERT_TRUE(plain.states[k][i] == got.states[k][i]) << what << ": tensor " << i << " differs after step " << k;
    }
  }
}

/** Plain against auto at three budgets from the leanest feasible to the
 *  plain peak (of each run's own profile), both zero_grad
 *  styles; base gives the options but the budget. With `lean_solver`, the
 *  plan nearest the leanest must be that solver's. */
void check_workload(const Make& make, const std::string& name, const remat::AutoOptions& base = remat::AutoOptions(),
                    bool has_inner_units = false, const std::string& lean_solver = "",
                    const std::string& state_dir = "", bool state_in_store_at_lean = false) {
  int inner_chosen = 0, nested_chosen = 0;  // over every plan: the nesting is exercised, not only kept at keep
  for (bool set_to_none : {true, false}) {
    const Result plain = run(make, set_to_none, std::nullopt);
    // A run at the plain peak: bitwise, and something to plan. Each run
    // below takes its budgets from its own profile's range.
    const Result probe = run(make, set_to_none, remat::AutoOptions(base).memory_budget_fraction(1.0), state_dir);
    expect_bitwise(plain, probe, name + " at the plain peak");
    const int64_t low = probe.min_peak, high = probe.profiled_peak;
    if (std::getenv("REMAT_AUTO_TEST_DUMP")) std::printf("probe %s\n%s", name.c_str(), probe.explain.c_str());
    ASSERT_LT(low, high) << name << ": nothing to plan";
    for (double f : {0.05, 0.5, 0.9}) {
      const Result got = run(make, set_to_none, remat::AutoOptions(base), state_dir, f);
      const std::string what = name + " at " + std::to_string(got.budget) + " B (" + std::to_string(f) +
                               " of the way from its profile's leanest plan to plain), zero_grad(set_to_none=" +
                               (set_to_none ? "true" : "false") + ")";
      if (!state_dir.empty()) {
        EXPECT_EQ(remat_test::files_in(state_dir), 0u) << what << ": the state's files outlive the planner";
        EXPECT_TRUE(got.explain.find("updating each parameter inside backward") != std::string::npos ||
                    got.explain.find("updating every parameter at the end of backward") != std::string::npos)
            << got.explain;
        // The leanest plans take the state off where it saves more than the
        // store holds in flight (not the ResNet's and U-Net's: one conv's
        // state is a third of their whole).
        if (f == 0.05 && state_in_store_at_lean) {
          EXPECT_NE(got.explain.find("of state in the store"), std::string::npos) << what << "\n" << got.explain;
          // The states being written are room in flight, not the prediction
          // (NOTE [state writes in flight]).
          EXPECT_NE(got.explain.find("of them optimizer state being written"), std::string::npos) << what << "\n"
                                                                                                  << got.explain;
        }
      }
      expect_bitwise(plain, got, what);
      inner_chosen += got.inner_chosen;
      nested_chosen += got.nested_chosen;
      if (std::getenv("REMAT_AUTO_TEST_DUMP")) std::printf("%s\n%s", what.c_str(), got.explain.c_str());
      ASSERT_EQ(got.peaks.size(), 2u) << what;
      for (size_t i = 0; i < got.peaks.size(); ++i) {
        std::printf("%s: step %zu measured %lld, predicted %lld (%.2f%% of the budget); recomputes %lld\n",
                    what.c_str(), i, static_cast<long long>(got.peaks[i]), static_cast<long long>(got.predicted[i]),
                    100.0 * got.peaks[i] / got.budget, static_cast<long long>(got.recomputes[i]));
        EXPECT_LE(static_cast<double>(got.peaks[i]), 1.01 * static_cast<double>(got.budget)) << what << "\n"
                                                                                             << got.explain;
        // At most the prediction plus the room kept in flight (3% for the
        // model's own error).
        EXPECT_LE(static_cast<double>(got.peaks[i]), 1.03 * static_cast<double>(got.predicted[i] + got.inflight[i]))
            << what << "\n"
            << got.explain;

        // Each unit with a recompute option runs its function again once per call.
        EXPECT_EQ(got.recomputes[i], got.expected_recomputes[i]) << what << "\n" << got.explain;
        // A chain runs its stages as often as its schedule says, counted by the stages.
        if (!got.stage_forwards.empty()) {
          EXPECT_EQ(got.stage_forwards[i], got.expected_stage_forwards[i]) << what << "\n" << got.explain;
        }
      }
      if (!lean_solver.empty() && f == 0.05) {
        EXPECT_NE(got.explain.find("solver: " + lean_solver + ", optimal"), std::string::npos) << what << "\n"
                                                                                               << got.explain;
      }
      // The leanest plans recompute inside the chain: its schedules are used, not only store-all.
      if (!got.chain_choice.empty() && f == 0.05) {
        EXPECT_EQ(got.chain_choice.rfind("schedule: ", 0), 0u) << what << "\n" << got.explain;
        if (got.chain_levers) {
          EXPECT_NE(got.chain_choice.find(" selective"), std::string::npos) << got.explain;
        }
      }
    }
  }
  std::printf("%s: inner units given an option %d times, nested recompute chosen %d times over 6 plans\n", name.c_str(),
              inner_chosen, nested_chosen);
  if (has_inner_units) {
    EXPECT_GT(inner_chosen, 0) << name;
    EXPECT_GT(nested_chosen, 0) << name;
  }
}

std::vector<torch::Tensor> batches(int n, std::vector<int64_t> shape, bool integer = false, int64_t high = 0) {
  torch::manual_seed(1234);
  std::vector<torch::Tensor> out;
  for (int i = 0; i < n; ++i) out.push_back(integer ? torch::randint(high, shape, torch::kLong) : torch::randn(shape));
  return out;
}

/** A classifier's step: cross-entropy of net(xs[k]) against ys[k]. */
template <class Net>
Workload classifier(Net net, std::shared_ptr<torch::optim::Optimizer> opt, std::vector<torch::Tensor> xs,
                    std::vector<torch::Tensor> ys, bool set_to_none) {
  Workload w;
  w.model = net.ptr();
  w.optimizers = {opt.get()};
  w.step = [net, opt, xs, ys, set_to_none](int k) mutable {
    opt->zero_grad(set_to_none);
    torch::nn::functional::cross_entropy(net->forward(xs[k]), ys[k]).backward();
    opt->step();
  };
  return w;
}

/** The tests' GPT: vocabulary 256, T 64, d_model 64, 4 heads, dropout 0.1. */
remat::models::GptConfig small_gpt(int64_t layers) {
  remat::models::GptConfig c;
  c.vocab = 256;
  c.seq_len = 64;
  c.d_model = 64;
  c.heads = 4;
  c.layers = layers;
  c.dropout = 0.1;
  return c;
}

Make gpt_workload(int64_t layers = 4) {
  return [layers](bool set_to_none) {
    const remat::models::GptConfig c = small_gpt(layers);
    auto gpt = remat::models::Gpt(c);
    auto opt = std::make_shared<torch::optim::AdamW>(gpt->parameters(), torch::optim::AdamWOptions(1e-3));
    auto idx = batches(kSteps + 1, {8, 65}, true, c.vocab);
    Workload w;
    w.model = gpt.ptr();
    w.optimizers = {opt.get()};
    w.step = [gpt, opt, idx, set_to_none](int k) mutable {
      auto x = idx[k].slice(1, 0, 64), y = idx[k].slice(1, 1, 65);
      opt->zero_grad(set_to_none);
      auto loss = gpt->loss(gpt->blocks->forward(gpt->embed(x)), y);
      loss.backward();
      opt->step();
    };
    return w;
  };
}

/** Six SparseDense blocks after an input layer, classifying into 4096
 *  classes: the head's logits and their gradient peak the step while every
 *  block holds what it keeps. */
Make sparse_dense_workload() {
  return [](bool set_to_none) {
    torch::nn::Sequential net(torch::nn::Linear(16, 128));
    for (int i = 0; i < 6; ++i) net->push_back(SparseDense(128));
    net->push_back(torch::nn::Linear(128, 4096));
    auto opt = std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(1e-3));
    return classifier(net, opt, batches(kSteps, {256, 16}), batches(kSteps, {256}, true, 4096), set_to_none);
  };
}

/** ChainNet (a chain of 6 stages beside a Dense unit), classifying. */
Make chain_net_workload(const remat::SequentialOptions& options = remat::SequentialOptions()) {
  return [options](bool set_to_none) {
    auto n = std::make_shared<std::atomic<int64_t>>(0);
    auto net = ChainNet(64, 6, n, options);
    auto opt = std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(1e-3));
    Workload w = classifier(net, opt, batches(kSteps, {256, 16}), batches(kSteps, {256}, true, 4), set_to_none);
    w.stage_forwards = n;
    w.chain = "body";
    w.chain_stages = 6;
    w.chain_levers = options.profile().selective_levels() > 0;
    return w;
  };
}

/** remat's GPT whose blocks run as a CheckpointedSequential: the blocks'
 *  own switches are not planned; the chain's schedules are. */
struct ChainedGptImpl : torch::nn::Module {
  explicit ChainedGptImpl(const remat::models::GptConfig& c) : gpt(register_module("gpt", remat::models::Gpt(c))) {
    blocks = register_module("blocks", remat::CheckpointedSequential(gpt->blocks));
  }
  remat::models::Gpt gpt;
  remat::CheckpointedSequential blocks{nullptr};
};
TORCH_MODULE(ChainedGpt);

Make chained_gpt_workload() {
  return [](bool set_to_none) {
    const remat::models::GptConfig c = small_gpt(6);
    auto net = ChainedGpt(c);
    auto opt = std::make_shared<torch::optim::AdamW>(net->gpt->parameters(), torch::optim::AdamWOptions(1e-3));
    auto idx = batches(kSteps + 1, {8, 65}, true, c.vocab);
    Workload w;
    w.model = net.ptr();
    w.step = [net, opt, idx, set_to_none](int k) mutable {
      auto x = idx[k].slice(1, 0, 64), y = idx[k].slice(1, 1, 65);
      opt->zero_grad(set_to_none);
      net->gpt->loss(net->blocks->forward(net->gpt->embed(x)), y).backward();
      opt->step();
    };
    w.chain = "blocks";
    return w;
  };
}

}  // namespace

TEST(Auto, ChainUnitRunsItsOwnSchedulesBitwiseWithinBudgetCountedByItsStages) {
  check_workload(chain_net_workload(), "chain beside a unit");
}

TEST(Auto, ChainUnitWithSelectiveStageLeversBitwiseAndWithinBudget) {
  // The chain's stage menu (selective levels) joins its schedules; its own
  // budget is overridden by the planner's.
  check_workload(chain_net_workload(remat::SequentialOptions().memory_budget_fraction(0.5).profile(
                     remat::ProfileOptions().selective_levels(2))),
                 "chain with selective stage levers");
}

TEST(Auto, AChainWithAStepBudgetIsRefused) {
  remat::CheckpointedSequential chain(torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::ReLU()),
                                      remat::SequentialOptions().step_memory_budget_bytes(1 << 20));
  try {
    remat::auto_checkpoint(*chain, remat::AutoOptions().memory_budget_bytes(1 << 20));
    FAIL();
  } catch (const remat::Error& e) {
    EXPECT_STREQ(e.what(),
                 "[remat::auto] the CheckpointedSequential '(root)' has a step budget (step_memory_budget_bytes "
                 "1048576), and the whole-step planner plans its schedule under the planner's own budget; build it "
                 "without step_memory_budget_bytes.");
  }
}

TEST(Auto, AChainScheduleThatDoesNotFitAnotherShapeSaysSo) {
  // Planned at batch 256, where the leanest plan runs stages under selective
  // levels; at batch 2 the stages' menus are empty (every level saves under
  // 4 KiB), so the schedule names options that do not exist.
  const Workload w = chain_net_workload(
      remat::SequentialOptions().profile(remat::ProfileOptions().selective_levels(2)))(/*set_to_none=*/true);
  auto* net = dynamic_cast<ChainNetImpl*>(w.model.get());
  ASSERT_NE(net, nullptr);
  auto planner = remat::auto_checkpoint(*net, remat::AutoOptions().memory_budget_fraction(1.0).profile_repeats(1));
  for (int k = 0; k < 2; ++k) planner.step([&] { w.step(k); });
  planner.replan(planner.leanest_peak_bytes());
  ASSERT_NE(planner.units()[0].options[planner.units()[0].choice].find(" selective"), std::string::npos)
      << planner.explain();
  try {
    net->forward(torch::randn({2, 16}));
    FAIL() << "a schedule with stage options ran on a chain without them";
  } catch (const remat::Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.rfind("[remat::CheckpointedSequential] the schedule that the whole-step planner "
                      "(remat::auto_checkpoint) chose does not fit this call's chain: ",
                      0),
              0u)
        << m;
    EXPECT_NE(m.find(" Profile a step of this shape again (AutoCheckpoint::profile_step)."), std::string::npos) << m;
  }
}

TEST(Auto, AGraphKeptPastTheProfiledStepIsBackpropagatedLater) {
  // Each step backpropagates the previous step's forward (a pipelined
  // loop): the profiled step's graph is unpacked in the next step, after the
  // profiler's timeline is gone (under ASan, a read of it would be caught).
  // A warm-up step first: a first step runs no backward, so a profile of it
  // holds neither a backward nor the gradients every later step holds (its
  // plan would overrun the budget, which step() reports).
  auto run = [](bool planned) {
    torch::manual_seed(0);
    torch::nn::Sequential net(Dense(32), Dense(32), Dense(32));
    std::optional<remat::AutoCheckpoint> planner;
    if (planned) {
      planner.emplace(remat::auto_checkpoint(*net, remat::AutoOptions().memory_budget_fraction(1.0).warmup_steps(1)));
    }
    torch::manual_seed(1);
    torch::Tensor pending;
    for (int k = 0; k < 3; ++k) {
      auto step = [&] {
        if (pending.defined()) pending.backward();
        pending = net->forward(torch::randn({16, 32})).square().sum();
      };
      planner ? planner->step(step) : step();
    }
    pending.backward();
    std::vector<torch::Tensor> grads;
    for (const auto& p : net->parameters()) grads.push_back(p.grad().clone());
    return grads;
  };
  const auto plain = run(false), planned = run(true);
  ASSERT_EQ(plain.size(), planned.size());
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(torch::equal(plain[i], planned[i])) << "gradient " << i;
}

TEST(Auto, RecomputeWithItsInputSentAwayIsCreditedAndChosenWhereItIsLeanest) {
  // Each block's input is mostly zeros: sent to a compressing store it
  // holds far less than recompute's kept input, and it is credited once
  // the next block starts. The leanest plan must use it.
  const auto base = remat::AutoOptions().selective_levels(0).offload(
      {remat::OffloadOptions(remat::OffloadTarget::kMemory).codec(remat::Codec::kLz4).min_bytes(0)});
  const Make make = sparse_dense_workload();
  check_workload(make, "blocks with sparse inputs", base);
  const Result plain = run(make, true, std::nullopt);
  const Result probe = run(make, true, remat::AutoOptions(base).memory_budget_fraction(1.0));
  const Result lean = run(make, true, remat::AutoOptions(base).memory_budget_bytes(probe.min_peak));
  expect_bitwise(plain, lean, "the leanest plan");
  int chosen = 0;
  for (const auto& c : lean.choices) chosen += c == "recompute, inputs to memory lz4";
  EXPECT_GT(chosen, 0) << lean.explain;
  for (int64_t p : lean.peaks)
    EXPECT_LE(static_cast<double>(p), 1.01 * static_cast<double>(lean.budget)) << lean.explain;
}

TEST(Auto, GptBlocksAsAChainBitwiseAndWithinBudget) { check_workload(chained_gpt_workload(), "GPT blocks as a chain"); }

TEST(Auto, GptBitwiseAndWithinBudget) { check_workload(gpt_workload(), "GPT", remat::AutoOptions(), true); }

TEST(Auto, GptUnderBf16AutocastBitwiseAndWithinBudget) {
  const Make base = gpt_workload();
  check_workload(
      [base](bool set_to_none) {
        Workload w = base(set_to_none);
        w.step = [inner = w.step](int k) {
          // The forward under CPU autocast to bfloat16, as a mixed-precision loop runs it.
          at::autocast::set_autocast_enabled(at::kCPU, true);
          at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
          at::autocast::increment_nesting();
          inner(k);
          if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
          at::autocast::set_autocast_enabled(at::kCPU, false);
        };
        return w;
      },
      "GPT under bf16 autocast");
}

// Two micro-batches per step: a backward per micro-batch (gradient
// accumulation), or with `one_backward` both forwards before one backward
// of their summed losses (not a chain per micro-batch: GLPK's program).
// The second micro-batch has `second_rows` sequences (the first 4).
Make gpt_micro_batches_workload(bool one_backward = false, int64_t second_rows = 4) {
  return [one_backward, second_rows](bool set_to_none) {
    const remat::models::GptConfig c = small_gpt(3);
    auto gpt = remat::models::Gpt(c);
    auto opt = std::make_shared<torch::optim::AdamW>(gpt->parameters(), torch::optim::AdamWOptions(1e-3));
    auto idx = batches(2 * (kSteps + 1), {4, 65}, true, c.vocab);
    Workload w;
    w.model = gpt.ptr();
    w.step = [gpt, opt, idx, set_to_none, one_backward, second_rows](int k) mutable {
      opt->zero_grad(set_to_none);
      torch::Tensor total;
      for (int micro = 0; micro < 2; ++micro) {
        const auto b = micro == 0 ? idx[2 * k] : idx[2 * k + 1].slice(0, 0, second_rows);
        auto loss = gpt->loss(gpt->blocks->forward(gpt->embed(b.slice(1, 0, 64))), b.slice(1, 1, 65)) / 2;
        if (!one_backward) {
          loss.backward();
        } else {
          total = micro == 0 ? loss : total + loss;
        }
      }
      if (one_backward) total.backward();
      opt->step();
    };
    return w;
  };
}

TEST(Auto, GptWithTwoMicroBatchesPerStepBitwiseAndWithinBudget) {
  // A chain per micro-batch: the DP plans them under one choice.
  check_workload(gpt_micro_batches_workload(), "GPT, 2 micro-batches", remat::AutoOptions(), false, "chain DP");
}

// Micro-batches of other sizes (a last, short one): each unit's calls keep
// other bytes per micro-batch, and the DP one prefix per micro-batch.
TEST(Auto, GptWithUnequalMicroBatchesBitwiseAndWithinBudget) {
  check_workload(gpt_micro_batches_workload(false, 1), "GPT, micro-batches of 4 and 1", remat::AutoOptions(), false,
                 "chain DP");
}

Make resnet_workload() {
  return [](bool set_to_none) {
    remat::models::ResNetConfig c;
    c.depth = 10;
    c.width = 8;
    auto net = remat::models::ResNet(c);
    auto opt = std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
    return classifier(net, opt, batches(kSteps, {16, 3, 32, 32}), batches(kSteps, {16}, true, 10), set_to_none);
  };
}

/** An RNN cell, a unit applied to its own output: h = tanh(W_o gelu(W_ih x +
 *  W_hh h)), unrolled over 8 steps of (128, 128), then a linear head. tanh
 *  saves its output, the next call's input; gelu's input and output are
 *  what a recompute drops. */
struct RnnCellImpl : torch::nn::Module, remat::Checkpointable {
  RnnCellImpl()
      : ih(register_module("ih", torch::nn::Linear(128, 128))),
        hh(register_module("hh", torch::nn::Linear(128, 128))),
        o(register_module("o", torch::nn::Linear(128, 128))) {}
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& h) {
    return checkpointed(
        [this](const torch::Tensor& x, const torch::Tensor& h) { return torch::tanh(o(torch::gelu(ih(x) + hh(h)))); },
        x, h);
  }
  torch::nn::Linear ih, hh, o;
};
TORCH_MODULE(RnnCell);
struct RnnImpl : torch::nn::Module {
  RnnImpl() : cell(register_module("cell", RnnCell())), out(register_module("out", torch::nn::Linear(128, 10))) {}
  torch::Tensor forward(const torch::Tensor& xs) {  // (T, B, 128)
    auto h = torch::zeros({xs.size(1), xs.size(2)});
    for (int64_t t = 0; t < xs.size(0); ++t) h = cell->forward(xs[t], h);
    return out(h);
  }
  RnnCell cell;
  torch::nn::Linear out;
};
TORCH_MODULE(Rnn);

Make rnn_workload() {
  return [](bool set_to_none) {
    auto net = Rnn();
    auto opt = std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
    return classifier(net, opt, batches(kSteps, {8, 128, 128}), batches(kSteps, {128}, true, 10), set_to_none);
  };
}

// A unit whose call takes its own previous call's output (an RNN cell):
// the input both calls hold pairs the unit with itself, which the step
// model does not take; such a pair is left uncredited. The planner threw
// "[remat::plan] unit 0 ('cell') call 1 shares its inputs with unit 0 call
// 0; give a call of another unit, or pair_unit -1 for none" at the profiled
// step.
TEST(Auto, AUnitAppliedToItsOwnOutputBitwiseAndWithinBudget) { check_workload(rnn_workload(), "RNN cell"); }

// The RNN under CPU autocast to bfloat16 as a C++ loop turns it on (no
// autocast nesting; the cache cleared after the step): its cell, called 8
// times a step, uses the same casts of its weights in every call, in the
// profiled step too, whose isolated runs of the cell's options cleared the
// cache between the calls (its weights' gradients differed in the last bits).
TEST(Auto, AUnitCalledSeveralTimesUnderBf16AutocastBitwise) {
  const Make base = rnn_workload();
  const Make under_autocast = [base](bool set_to_none) {
    Workload w = base(set_to_none);
    w.step = [inner = w.step](int k) {
      at::autocast::set_autocast_enabled(at::kCPU, true);
      at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
      inner(k);
      at::autocast::set_autocast_enabled(at::kCPU, false);
      at::autocast::clear_cache();
    };
    return w;
  };
  // Its peak is not the cell's (bfloat16 halves what the cell saves): the
  // run at the plain peak, whose step 2 is the profiled one, is the test.
  for (bool set_to_none : {true, false}) {
    const Result plain = run(under_autocast, set_to_none, std::nullopt);
    const Result got = run(under_autocast, set_to_none, remat::AutoOptions().memory_budget_fraction(1.0));
    expect_bitwise(plain, got, "RNN cell under bf16 autocast");
  }
}

// Planners count every tensor of the process: one cannot profile while
// another does (here inside the other's profiled step; two threads are the
// same). The second is refused before its step runs, with the remedy, and
// both go on: the first plans, the second profiles once the first is done.
// It said "[remat::memory] a Timeline is already recording".
TEST(Auto, APlannerProfilingWhileAnotherDoesIsRefusedAndBothGoOn) {
  Workload w1 = rnn_workload()(true), w2 = rnn_workload()(true);
  auto a = remat::auto_checkpoint(*w1.model, remat::AutoOptions().memory_budget_fraction(1.0).profile_repeats(1));
  auto b = remat::auto_checkpoint(*w2.model, remat::AutoOptions().memory_budget_fraction(1.0).profile_repeats(1));
  a.step([&] { w1.step(0); });  // warm-ups
  b.step([&] { w2.step(0); });
  std::string refused;
  bool ran = false;
  a.step([&] {
    w1.step(1);
    try {
      b.step([&] {
        ran = true;
        w2.step(1);
      });
    } catch (const remat::Error& e) {
      refused = e.what();
    }
  });
  EXPECT_EQ(refused,
            "[remat::auto] the profiled step cannot start: the process's memory is being recorded already (another "
            "auto_checkpoint planner profiling its step, on this thread or another, or a remat::memory::Timeline of "
            "yours). A planner counts every tensor of the process, so planners profiling at once would measure each "
            "other: let one planner reach planned() before another profiles (the steps of planners on one thread "
            "take turns), or train the models in separate processes. The step did not run.");
  EXPECT_FALSE(ran);
  EXPECT_TRUE(a.planned());
  EXPECT_FALSE(b.planned());
  b.step([&] { w2.step(1); });
  EXPECT_TRUE(b.planned());
  a.step([&] { w1.step(2); });
  b.step([&] { w2.step(2); });
}

TEST(Auto, ResNetWithBatchNormBitwiseAndWithinBudget) {
  check_workload(resnet_workload(), "ResNet", remat::AutoOptions(), true);
}

// NOTE [inputs two calls hold]: a ResNet block's input is the output its
// previous block's ReLU saves; offloading one of the two frees nothing of
// it, offloading both does. The step model pairs each block with the one
// before, and plans that offload neighbours are credited, bitwise and
// within budget.
TEST(Auto, ResNetBlocksShareTheirInputWithTheBlockBefore) {
  const std::string dir = remat_test::fresh_dir("auto_pairs");
  const auto base = remat::AutoOptions().offload(
      {remat::OffloadOptions(remat::OffloadTarget::kDisk).directory(dir).min_bytes(0).max_inflight_bytes(64 << 10),
       remat::OffloadOptions(remat::OffloadTarget::kMemory).codec(remat::Codec::kLz4).min_bytes(0)});
  check_workload(resnet_workload(), "ResNet with offload", base);
  EXPECT_EQ(remat_test::files_in(dir), 0u) << "the offload files outlive the steps";
  torch::manual_seed(0);
  Workload w = resnet_workload()(true);
  auto planner = remat::auto_checkpoint(*w.model, remat::AutoOptions(base).memory_budget_fraction(1.0));
  for (int k = 0; k < 2; ++k) planner.step([&] { w.step(k); });
  ASSERT_TRUE(planner.planned());
  const remat::plan::StepModel& m = planner.step_model();
  std::vector<size_t> top;  // the stem and the blocks, in forward order
  for (size_t u = 0; u < m.units.size(); ++u) {
    if (m.units[u].parent < 0) top.push_back(u);
  }
  std::sort(top.begin(), top.end(),
            [&](size_t a, size_t b) { return m.units[a].calls[0].forward_begin < m.units[b].calls[0].forward_begin; });
  ASSERT_GE(top.size(), 4u);
  int paired = 0;
  for (size_t i = 1; i < top.size(); ++i) {
    const remat::plan::StepUnit& u = m.units[top[i]];
    const remat::plan::StepCall& c = u.calls[0];
    if (c.pair_unit < 0) continue;
    ++paired;
    EXPECT_EQ(c.pair_unit, static_cast<int64_t>(top[i - 1])) << u.name;
    EXPECT_GE(c.pair_begin, c.forward_end) << u.name;
    if (i + 1 < top.size()) {
      EXPECT_LE(c.pair_begin, m.units[top[i + 1]].calls[0].forward_begin) << u.name;
    }
    // Offloading lets go of the input here and of the output there; keep holds both.
    const auto off = [](const remat::plan::StepUnit& x) {
      return static_cast<size_t>(std::find(x.options.begin(), x.options.end(), "offload disk") - x.options.begin());
    };
    ASSERT_LT(off(u), u.options.size()) << u.name;
    EXPECT_TRUE(c.pair_lets_go[off(u)]) << u.name;
    EXPECT_FALSE(c.pair_lets_go[0]) << u.name;
    const remat::plan::StepUnit& before = m.units[top[i - 1]];
    ASSERT_LT(off(before), before.options.size()) << before.name;
    EXPECT_TRUE(c.pair_other_lets_go[off(before)]) << u.name;
    EXPECT_GT(c.pair_bytes, 0) << u.name;
  }
  EXPECT_GE(paired, static_cast<int>(top.size()) - 2) << "every block after the first pairs with the one before";
  // Every block offloaded: each pair's input is credited from its start to
  // its block's backward; without the pairs, the model would not see it.
  remat::plan::StepModel unpaired = m;
  for (auto& u : unpaired.units) {
    for (auto& c : u.calls) c.pair_unit = -1;
  }
  std::vector<int> all_off(m.units.size(), 0);
  for (size_t u : top) {
    const auto& o = m.units[u].options;
    all_off[u] = static_cast<int>(std::find(o.begin(), o.end(), "offload disk") - o.begin());
  }
  const remat::plan::StepPrediction with = remat::plan::simulate_step(m, all_off);
  const remat::plan::StepPrediction without = remat::plan::simulate_step(unpaired, all_off);
  std::vector<int64_t> credit(m.segment_peak_bytes.size(), 0);
  for (size_t u : top) {
    const remat::plan::StepCall& c = m.units[u].calls[0];
    if (c.pair_unit < 0) continue;
    for (int64_t s = c.pair_begin; s < c.backward_begin; ++s) credit[static_cast<size_t>(s)] += c.pair_bytes;
  }
  for (size_t s = 0; s < credit.size(); ++s) EXPECT_EQ(with.segment_bytes[s], without.segment_bytes[s] - credit[s]);
  EXPECT_LT(with.peak_bytes, without.peak_bytes);
  // At the leanest plan the measured steps stay within the budget.
  const int64_t leanest = planner.leanest_peak_bytes();
  planner.replan(leanest);
  std::printf("%s", planner.explain().c_str());
  for (int k = 2; k < 4; ++k) {
    planner.step([&] { w.step(k); });
    EXPECT_LE(static_cast<double>(planner.measured_peak_bytes()), 1.01 * static_cast<double>(leanest))
        << planner.explain();
  }
  EXPECT_EQ(remat_test::files_in(dir), 0u) << "the offload files outlive the steps";
}

/** Linear then ReLU: the Linear saves the block's input, the ReLU its
 *  output, which the next block's Linear saves again. */
struct LinearReluImpl : torch::nn::Module, remat::Checkpointable {
  explicit LinearReluImpl(int64_t d) : fc(register_module("fc", torch::nn::Linear(d, d))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return checkpointed([this](const torch::Tensor& h) { return torch::relu(fc(h)); }, x);
  }
  torch::nn::Linear fc;
};
TORCH_MODULE(LinearRelu);

/** A Linear, then an inner Linear-ReLU unit whose output it returns as its
 *  own: the ReLU that saves it runs in the inner unit. */
struct WrappedLinearReluImpl : torch::nn::Module, remat::Checkpointable {
  explicit WrappedLinearReluImpl(int64_t d)
      : fc(register_module("fc", torch::nn::Linear(d, d))), inner(register_module("inner", LinearRelu(d))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return checkpointed([this](const torch::Tensor& h) { return inner(fc(h)); }, x);
  }
  torch::nn::Linear fc;
  LinearRelu inner;
};
TORCH_MODULE(WrappedLinearRelu);

// NOTE [inputs two calls hold]: in a stack of Linear-ReLU blocks every
// activation is held by two blocks, so offloading a block frees nothing
// unless its neighbour lets go too, and recompute frees nothing at all
// (a checkpoint keeps the block's input). Only the pair credit shows the
// planner that offloading neighbours pays: the leanest plan offloads
// them, and the real step stays within its prediction (plus what the disk
// holds in flight) and bitwise equal to plain. With a Linear before each
// block's Linear-ReLU, an inner unit, recompute frees that Linear's
// output, but the credit still lowers the floor. Each outermost block after
// the first is paired with the outermost block before it, also where that
// block's output comes from an inner unit (then the step is still a chain,
// solved by the DP).
void check_neighbours(const std::function<torch::nn::AnyModule()>& block, bool recompute_frees_nothing,
                      const std::string& what) {
  SCOPED_TRACE(what);
  const std::string dir = remat_test::fresh_dir("auto_neighbours");
  const auto base = remat::AutoOptions().offload(
      {remat::OffloadOptions(remat::OffloadTarget::kDisk).directory(dir).min_bytes(0).max_inflight_bytes(64 << 10)});
  const Make make = [block](bool set_to_none) {
    torch::manual_seed(5);
    torch::nn::Sequential net;
    for (int i = 0; i < 8; ++i) net->push_back(block());
    net->push_back(torch::nn::Linear(128, 10));
    auto opt = std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.01));
    return classifier(net, opt, batches(kSteps, {1024, 128}), batches(kSteps, {1024}, true, 10), set_to_none);
  };
  const Result plain = run(make, true, std::nullopt);
  torch::manual_seed(0);
  Workload w = make(true);
  auto planner = remat::auto_checkpoint(*w.model, remat::AutoOptions(base).memory_budget_fraction(1.0));
  for (int k = 0; k < 2; ++k) planner.step([&] { w.step(k); });
  ASSERT_TRUE(planner.planned());
  const remat::plan::StepModel& m = planner.step_model();
  int64_t before = -1;  // the previous outermost unit
  int paired = 0;
  for (size_t u = 0; u < m.units.size(); ++u) {
    const remat::plan::StepCall& c = m.units[u].calls[0];
    if (m.units[u].parent >= 0) {
      EXPECT_EQ(c.pair_unit, -1) << m.units[u].name << ": an inner unit's input is its outer unit's";
      continue;
    }
    if (before >= 0) {
      EXPECT_EQ(c.pair_unit, before) << m.units[u].name << " shares its input with the block before";
    }
    paired += c.pair_unit >= 0;
    before = static_cast<int64_t>(u);
  }
  EXPECT_EQ(paired, 7);
  remat::plan::StepModel unpaired = m;
  for (auto& u : unpaired.units) u.calls[0].pair_unit = -1;
  const int64_t leanest = planner.leanest_peak_bytes();
  // The credit lowers the floor (the model alone, then with the disk's
  // bytes in flight); where recompute frees nothing, without it no plan is
  // leaner than plain.
  const int64_t unpaired_floor = remat::plan::min_peak_step(unpaired).prediction.peak_bytes;
  if (recompute_frees_nothing) {
    EXPECT_EQ(unpaired_floor, planner.profiled_peak_bytes());
  }
  EXPECT_LT(remat::plan::min_peak_step(m).prediction.peak_bytes, unpaired_floor * 9 / 10);
  EXPECT_LT(leanest, planner.profiled_peak_bytes());
  planner.replan(leanest);
  std::printf("%s", planner.explain().c_str());
  EXPECT_EQ(planner.plan().solver, "chain DP");
  int earned = 0;
  const auto& choice = planner.plan().prediction.choice;
  for (size_t u = 0; u < m.units.size(); ++u) {
    const remat::plan::StepCall& c = m.units[u].calls[0];
    earned += c.pair_unit >= 0 && c.pair_lets_go[static_cast<size_t>(choice[u])] &&
              c.pair_other_lets_go[static_cast<size_t>(choice[static_cast<size_t>(c.pair_unit)])];
  }
  EXPECT_GE(earned, 1) << planner.explain();
  EXPECT_GT(planner.inflight_bytes(), 0);
  for (int k = 2; k < kSteps; ++k) {
    planner.step([&] { w.step(k); });
    const double measured = static_cast<double>(planner.measured_peak_bytes());
    EXPECT_LE(measured, 1.01 * static_cast<double>(leanest)) << planner.explain();
    EXPECT_LE(measured, 1.01 * static_cast<double>(planner.plan().prediction.peak_bytes + planner.inflight_bytes()))
        << planner.explain();
  }
  const std::vector<Bytes> got = state_of(*w.model);
  ASSERT_EQ(got.size(), plain.states.back().size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(got[i] == plain.states.back()[i]) << "tensor " << i;
  EXPECT_EQ(remat_test::files_in(dir), 0u) << "the offload files outlive the steps";
}

TEST(Auto, OffloadingNeighboursThatShareATensorIsCreditedAndHoldsInTheRealStep) {
  check_neighbours([] { return torch::nn::AnyModule(LinearRelu(128)); }, true, "Linear-ReLU blocks");
}

TEST(Auto, ABlockWhoseOutputAnInnerUnitSavesIsPairedAsAWhole) {
  check_neighbours([] { return torch::nn::AnyModule(WrappedLinearRelu(128)); }, false, "wrapped Linear-ReLU blocks");
}

/** x * sigmoid(x): two saved activations for almost no compute, so that
 *  its writes to a disk store, not its compute, set its time. */
struct SiluUnitImpl : torch::nn::Module, remat::Checkpointable {
  torch::Tensor forward(const torch::Tensor& x) {
    return checkpointed([](const torch::Tensor& h) { return h * torch::sigmoid(h); }, x);
  }
};
TORCH_MODULE(SiluUnit);

/** 16 SiluUnits between two Linear(256) layers, batch 1024, SGD: units
 *  whose writes to a zstd disk store outlast their compute. */
Workload silu_stack(int steps, uint64_t seed) {
  torch::manual_seed(seed);
  torch::nn::Sequential net;
  net->push_back(torch::nn::Linear(256, 256));
  for (int i = 0; i < 16; ++i) net->push_back(SiluUnit());
  net->push_back(torch::nn::Linear(256, 10));
  auto opt = std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.01));
  return classifier(net, opt, batches(steps, {1024, 256}), batches(steps, {1024}, true, 10), true);
}

// NOTE [in flight planned]: a disk store's in-flight bytes are the plan's.
// Given a cap below one saved activation (which a store lets go alone, so
// the margin is that entry's bytes anyway), the plans run the store with
// at least an entry in flight: as much room, writes beside the compute.
// The units' writes take longer than their compute (SiluUnit, and a zstd
// codec on the writer threads), so that more in flight pays whatever the
// machine's load.
// The leanest plan's margin is one entry (and the codec's buffers); a cap
// above the given one is counted in the margin. Every offloading unit runs at the plan's cap,
// explain() says so, the measured peak stays within the budget and the
// step within its prediction plus that margin, bitwise equal to plain, no
// files left.
TEST(Auto, ADiskStoreRunsWithTheInFlightBytesThePlanChose) {
  const std::string dir = remat_test::fresh_dir("auto_inflight");
  const int64_t given = 64 << 10, entry = 1 << 20;  // a saved activation: 1024 x 256 float32
  const auto base = remat::AutoOptions().offload({remat::OffloadOptions(remat::OffloadTarget::kDisk)
                                                      .directory(dir)
                                                      .min_bytes(0)
                                                      .max_inflight_bytes(given)
                                                      .codec(remat::Codec::kZstd)});
  constexpr int kBudgets = 4, kRun = 2 + kBudgets;  // warm-up, profiled, one planned step per budget
  const auto make = [] { return silu_stack(kRun, 5); };
  std::vector<Bytes> want;
  {
    Workload plain = make();
    for (int k = 0; k < kRun; ++k) plain.step(k);
    want = state_of(*plain.model);
  }
  torch::manual_seed(0);
  Workload w = make();
  auto planner = remat::auto_checkpoint(*w.model, remat::AutoOptions(base).memory_budget_fraction(1.0));
  for (int k = 0; k < 2; ++k) planner.step([&] { w.step(k); });
  ASSERT_TRUE(planner.planned());
  const int64_t low = planner.leanest_peak_bytes(), high = planner.profiled_peak_bytes();
  ASSERT_LT(low, high);
  // The cap each unit that sends to disk runs with (-1: none sends).
  const auto caps = [&] {
    std::vector<int64_t> out;
    for (const auto& m : w.model->modules(/*include_self=*/false)) {
      const auto* c = dynamic_cast<const remat::Checkpointable*>(m.get());
      if (c == nullptr) continue;
      if (const auto& o = c->offloading_options(); o && o->target() == remat::OffloadTarget::kDisk)
        out.push_back(o->max_inflight_bytes());
      if (const auto& cp = c->checkpointing_options(); cp && cp->offload())
        out.push_back(cp->offload()->max_inflight_bytes());
    }
    return out;
  };
  int above = 0, offloading = 0;
  for (int b = 0; b < kBudgets; ++b) {
    const int64_t budget = low + (high - low) * b / (kBudgets + 1);
    planner.replan(budget);
    const std::string text = planner.explain();
    const std::vector<int64_t> in_force = caps();
    offloading += !in_force.empty();
    for (int64_t c : in_force) EXPECT_EQ(c, in_force[0]) << "one store, one cap\n" << text;
    if (std::getenv("REMAT_AUTO_TEST_DUMP")) std::printf("budget %d\n%s", b, text.c_str());
    if (b == 0) {
      ASSERT_FALSE(in_force.empty()) << "the leanest plan sends to disk\n" << text;
      // One entry in flight, and the codec's buffer beside an entry being
      // written (one writer thread) and one being read.
      EXPECT_EQ(planner.inflight_bytes(), entry + 2 * (entry + entry / 255 + 64))
          << "the leanest plan keeps one entry in flight\n"
          << text;
    }
    if (!in_force.empty() && in_force[0] != given) {
      ++above;
      EXPECT_GT(in_force[0], given) << text;
      EXPECT_GE(planner.inflight_bytes(), in_force[0]) << "the margin holds the cap\n" << text;
      EXPECT_NE(text.find("runs with max_inflight_bytes " + remat::plan::format_bytes(in_force[0]) +
                          " (planned; given 64.00 KiB)"),
                std::string::npos)
          << text;
    }
    planner.step([&] { w.step(2 + b); });
    const double measured = static_cast<double>(planner.measured_peak_bytes());
    EXPECT_LE(measured, 1.01 * static_cast<double>(budget)) << text;
    EXPECT_LE(measured, 1.01 * static_cast<double>(planner.plan().prediction.peak_bytes + planner.inflight_bytes()))
        << text;
  }
  EXPECT_GE(offloading, 2);
  EXPECT_GE(above, 1) << "no plan with room ran its store with more in flight";
  const std::vector<Bytes> got = state_of(*w.model);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(got[i] == want[i]) << "tensor " << i;
  EXPECT_EQ(remat_test::files_in(dir), 0u) << "the offload files outlive the steps";
}

// recompute(false): every unit keeps or offloads, at every budget; no
// planned step runs a forward twice; the leanest plan sends the saves to
// disk with one entry in flight, below the store's default cap (256 MiB,
// more than the whole step holds); bitwise equal to plain, within the
// budget, no files left.
/** Six Dense blocks (residual: a block's output is not its own save) and a
 *  classifier, SGD with momentum, `steps` batches. */
Workload dense_blocks(int steps) {
  torch::manual_seed(5);
  torch::nn::Sequential net;
  for (int i = 0; i < 6; ++i) net->push_back(Dense(128));
  net->push_back(torch::nn::Linear(128, 10));
  auto opt = std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  return classifier(net, opt, batches(steps, {512, 128}), batches(steps, {512}, true, 10), true);
}

/** auto over w's units, each keeping or sending its saves to a disk store
 *  in dir, profiled (a warm-up step and the profiled one: w's steps 0, 1). */
remat::AutoCheckpoint keep_or_disk(Workload& w, const std::string& dir) {
  auto planner =
      remat::auto_checkpoint(*w.model, remat::AutoOptions().memory_budget_fraction(1.0).recompute(false).offload(
                                           {remat::OffloadOptions(remat::OffloadTarget::kDisk).directory(dir)}));
  for (int k = 0; k < 2; ++k) planner.step([&] { w.step(k); });
  return planner;
}

TEST(Auto, WithoutRecomputeEveryUnitKeepsOrOffloadsAndNothingRunsTwice) {
  const std::string dir = remat_test::fresh_dir("auto_no_recompute");
  constexpr int kBudgets = 3, kRun = 2 + kBudgets;
  const auto make = [] { return dense_blocks(kRun); };
  std::vector<Bytes> want;
  {
    Workload plain = make();
    for (int k = 0; k < kRun; ++k) plain.step(k);
    want = state_of(*plain.model);
  }
  Workload w = make();
  auto planner = remat::auto_checkpoint(
      *w.model, remat::AutoOptions().memory_budget_fraction(1.0).recompute(false).offload(
                    {remat::OffloadOptions(remat::OffloadTarget::kDisk).directory(dir).min_bytes(0)}));
  for (int k = 0; k < 2; ++k) planner.step([&] { w.step(k); });
  ASSERT_TRUE(planner.planned());
  for (const auto& u : planner.units()) {
    EXPECT_EQ(u.options, (std::vector<std::string>{"keep", "offload disk"})) << u.name;
  }
  const int64_t low = planner.leanest_peak_bytes(), high = planner.profiled_peak_bytes();
  ASSERT_LT(low, high) << planner.explain();
  for (int b = 0; b < kBudgets; ++b) {
    const int64_t budget = low + (high - low) * b / kBudgets;
    planner.replan(budget);
    const auto units = planner.units();
    const std::string text = planner.explain();
    if (b == 0) {
      // Every unit but the last (whose saves its backward needs at once)
      // sends its saves; the store runs one entry (fc1's output, 512 x 512
      // float32) at a time, below the default cap, which the budget has no
      // room for.
      size_t sending = 0;
      for (const auto& u : units) sending += u.options[u.choice] == "offload disk";
      EXPECT_GE(sending, units.size() - 1) << text;
      EXPECT_NE(text.find("offload disk runs with max_inflight_bytes 1.00 MiB (planned; given 256.00 MiB)"),
                std::string::npos)
          << text;
    }
    remat::reset_checkpoint_stats();
    planner.step([&] { w.step(2 + b); });
    EXPECT_EQ(remat::checkpoint_stats().recomputations, 0) << text;
    EXPECT_LE(static_cast<double>(planner.measured_peak_bytes()), 1.01 * static_cast<double>(budget)) << text;
  }
  const std::vector<Bytes> got = state_of(*w.model);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(got[i] == want[i]) << "tensor " << i;
  // A chain keeps store-all (its other schedules run stages again); the
  // unit beside it keeps or offloads.
  Workload chain = chain_net_workload()(true);
  auto chain_planner =
      remat::auto_checkpoint(*chain.model, remat::AutoOptions().memory_budget_fraction(1.0).recompute(false).offload(
                                               {remat::OffloadOptions(remat::OffloadTarget::kDisk).directory(dir)}));
  for (int k = 0; k < 2; ++k) chain_planner.step([&] { chain.step(k); });
  int chains = 0;
  for (const auto& u : chain_planner.units()) {
    if (u.name == "body") {
      ++chains;
      EXPECT_EQ(u.options, std::vector<std::string>{"keep"});
    } else {
      EXPECT_EQ(u.options, (std::vector<std::string>{"keep", "offload disk"})) << u.name;
    }
  }
  EXPECT_EQ(chains, 1) << chain_planner.explain();
  EXPECT_EQ(remat_test::files_in(dir), 0u) << "the offload files outlive the steps";
}

// NOTE [offload priced by the step]: one planned step far over its
// predicted time (a plan's first, which starts its store's writer threads
// and files) charges offload nothing; a second one in a row does, and the
// plan is solved again with the charge.
TEST(Auto, OneSlowStepDoesNotPriceOffloadTwoInARowDo) {
  const std::string dir = remat_test::fresh_dir("auto_reprice");
  Workload w = dense_blocks(4);
  auto planner = keep_or_disk(w, dir);
  planner.replan(planner.leanest_peak_bytes());  // every unit but the last offloads
  const auto slow = [&](int k) {
    const auto extra = std::chrono::duration<double, std::milli>(planner.plan().prediction.time_ms);
    planner.step([&] {
      w.step(k);
      std::this_thread::sleep_for(extra);  // twice the predicted time
    });
  };
  slow(2);
  EXPECT_EQ(planner.explain().find("offload repriced"), std::string::npos) << planner.explain();
  slow(3);
  EXPECT_NE(planner.explain().find("offload repriced 1x from measured steps"), std::string::npos) << planner.explain();
  EXPECT_EQ(remat_test::files_in(dir), 0u);
}

// A choice given with apply_choice is repriced as a solved plan is (two
// slow steps in a row), keeps its choice, and predicts at the new prices;
// the next slow step starts a new streak (one more charge takes two more).
TEST(Auto, AGivenChoiceIsRepricedLikeASolvedOneAndStays) {
  const std::string dir = remat_test::fresh_dir("auto_given_reprice");
  Workload w = dense_blocks(6);
  auto planner = keep_or_disk(w, dir);
  planner.replan(planner.leanest_peak_bytes());
  const std::vector<int> lean = planner.plan().prediction.choice;
  planner.replan(planner.profiled_peak_bytes());
  planner.apply_choice(lean);  // the budget has room: no overrun replaces it
  const double before_ms = planner.plan().prediction.time_ms;
  const auto slow = [&](int k) {
    const auto extra = std::chrono::duration<double, std::milli>(planner.plan().prediction.time_ms);
    planner.step([&] {
      w.step(k);
      std::this_thread::sleep_for(extra);  // twice the predicted time
    });
  };
  slow(2);
  slow(3);
  EXPECT_NE(planner.explain().find("offload repriced 1x from measured steps"), std::string::npos) << planner.explain();
  EXPECT_EQ(planner.plan().prediction.choice, lean);
  EXPECT_EQ(planner.plan().solver, "given");
  EXPECT_NE(planner.explain().find("solver: given, your choice (apply_choice)"), std::string::npos)
      << planner.explain();
  EXPECT_GT(planner.plan().prediction.time_ms, before_ms);
  slow(4);
  EXPECT_NE(planner.explain().find("offload repriced 1x from measured steps"), std::string::npos) << planner.explain();
  slow(5);
  EXPECT_NE(planner.explain().find("offload repriced 2x from measured steps"), std::string::npos) << planner.explain();
  EXPECT_EQ(planner.plan().prediction.choice, lean);
  EXPECT_EQ(remat_test::files_in(dir), 0u);
}

// NOTE [plain time calibrated]: the profile runs in a process's first
// steps, which may be slower than the steps after it. A plan's first step is
// left out, the next two of a plan that sends nothing and adds little set
// the plain time the predictions add to; a plan that adds much (recompute
// everywhere) or sends to a store leaves it. No choice changes.
TEST(Auto, PlannedStepsThatSendNothingAndAddLittleCalibrateThePlainTime) {
  static constexpr double kSlowMs = 400;  // what the profile's two steps take more
  const auto slow = [&](Workload& w, int k) {
    return [&w, k] {
      w.step(k);
      std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(kSlowMs));
    };
  };
  Workload w = dense_blocks(10);
  auto planner = remat::auto_checkpoint(*w.model, remat::AutoOptions().memory_budget_fraction(1.0));
  for (int k = 0; k < 2; ++k) planner.step(slow(w, k));
  ASSERT_TRUE(planner.planned());
  const double profiled = planner.profiled_time_ms();
  ASSERT_GT(profiled, kSlowMs);
  EXPECT_EQ(planner.plain_time_ms(), profiled);
  const auto choice = [&] {
    std::vector<int> c;
    for (const auto& u : planner.units()) c.push_back(u.choice);
    return c;
  };
  const std::vector<int> kept = choice();
  for (int c : kept) EXPECT_EQ(c, 0) << planner.explain();  // the whole budget: every unit keeps
  planner.step([&] { w.step(2); });
  planner.step([&] { w.step(3); });
  EXPECT_EQ(planner.plain_time_ms(), profiled) << "the plan's first step is left out, and one more sets nothing";
  const double second = planner.measured_time_ms();
  planner.step([&] { w.step(4); });
  const double third = planner.measured_time_ms();
  // Keep adds nothing: the plain time is the two steps' mean.
  EXPECT_NEAR(planner.plain_time_ms(), 0.5 * (second + third), 1e-9 * profiled);
  EXPECT_LT(planner.plain_time_ms(), profiled - kSlowMs / 2) << planner.explain();
  EXPECT_NEAR(planner.plan().prediction.time_ms, planner.plain_time_ms(), 1e-9 * profiled);
  EXPECT_EQ(choice(), kept);
  EXPECT_NE(planner.explain().find("plain as measured by planned steps since: "), std::string::npos)
      << planner.explain();
  // Every unit recomputes: what that adds (each unit's forward again) is
  // over 10% of the plain step, so its steps (slow ones here) leave the plain
  // time. Not the leanest plan: it mixes keep and selective options, and
  // on a loaded machine it measured +9.1%, too near the line.
  const double plain = planner.plain_time_ms();
  const auto units = planner.units();  // a copy
  std::vector<int> recompute_all(units.size(), 0);
  for (size_t i = 0; i < recompute_all.size(); ++i) {
    const auto& options = units[i].options;
    const auto at = std::find(options.begin(), options.end(), "recompute");
    ASSERT_NE(at, options.end()) << planner.explain();
    recompute_all[i] = static_cast<int>(at - options.begin());
  }
  planner.apply_choice(recompute_all);
  EXPECT_EQ(planner.plain_time_ms(), plain) << "a new plan keeps the calibration";
  ASSERT_GT(planner.plan().prediction.time_ms - plain, 0.1 * plain) << planner.explain();
  for (int k = 5; k < 8; ++k) planner.step(slow(w, k));
  EXPECT_EQ(planner.plain_time_ms(), plain) << planner.explain();
  // A plan that sends to disk: its steps leave it too.
  const std::string dir = remat_test::fresh_dir("auto_plain_time");
  Workload w2 = dense_blocks(7);
  auto sending = keep_or_disk(w2, dir);
  sending.replan(sending.leanest_peak_bytes());
  bool sends = false;
  for (const auto& u : sending.units()) sends |= u.options[u.choice] == "offload disk";
  ASSERT_TRUE(sends) << sending.explain();
  for (int k = 2; k < 7; ++k) sending.step(slow(w2, k));
  EXPECT_EQ(sending.plain_time_ms(), sending.profiled_time_ms());
  EXPECT_EQ(remat_test::files_in(dir), 0u);
}

// NOTE [no option runs faster than keep]: units whose writes to a zstd
// disk store take about what their isolated runs waited for them, so that
// at the rungs with room in flight the option's time above keep is noise
// around 0. No option is priced faster than keep, on any rung, and the
// whole budget's plan keeps every unit: noise alone never makes a plan
// offload or recompute.
TEST(Auto, NoOptionIsPricedFasterThanKeep) {
  const std::string dir = remat_test::fresh_dir("auto_no_faster");
  Workload w = silu_stack(2, 3);
  auto planner = remat::auto_checkpoint(*w.model, remat::AutoOptions().memory_budget_fraction(1.0).offload(
                                                      {remat::OffloadOptions(remat::OffloadTarget::kDisk)
                                                           .directory(dir)
                                                           .min_bytes(0)
                                                           .max_inflight_bytes(64 << 10)
                                                           .codec(remat::Codec::kZstd)}));
  for (int k = 0; k < 2; ++k) planner.step([&] { w.step(k); });
  ASSERT_TRUE(planner.planned());
  const remat::plan::StepModel& m = planner.step_model();
  size_t options = 0;
  for (const auto& u : m.units) {
    for (const auto& c : u.calls) {
      for (size_t k = 1; k < c.costs.size(); ++k, ++options) {
        EXPECT_GE(c.costs[k].time_ms, c.costs[0].time_ms) << u.name << " " << u.options[k];
      }
    }
  }
  EXPECT_GE(options, 16u * 2);
  // At budgets from the leanest up, each plan priced at its own rung.
  const int64_t low = planner.leanest_peak_bytes(), high = planner.profiled_peak_bytes();
  for (int b = 0; b <= 8; ++b) {
    planner.replan(low + (high - low) * b / 8);
    for (const auto& u : planner.units()) {
      EXPECT_GE(u.time_added_ms, 0.0) << u.name << " " << u.options[u.choice] << "\n" << planner.explain();
    }
  }
  for (const auto& u : planner.units()) EXPECT_EQ(u.choice, 0) << planner.explain();
  EXPECT_EQ(remat_test::files_in(dir), 0u);
}

// The backward-peak model, option by option: on remat's GPT (3 blocks,
// T 160, no dropout, AdamW), each option of each block is put in force
// alone (apply_choice) and one step measured against its prediction. The
// last block's backward starts beside the head's gradients, where an
// option that peaks early (a selective level recomputing as its backward
// starts) and keep, whose peak is later, differ most.
TEST(Auto, EachOptionAlonePeaksWhereItIsPredicted) {
  torch::manual_seed(0);
  remat::models::GptConfig c = small_gpt(3);
  c.dropout = 0;
  c.seq_len = 160;
  c.d_model = 32;
  c.heads = 2;
  c.vocab = 96;
  auto gpt = remat::models::Gpt(c);
  torch::optim::AdamW opt(gpt->parameters(), torch::optim::AdamWOptions(1e-3));
  const auto idx = batches(1, {2, c.seq_len + 1}, true, c.vocab)[0];
  const auto x = idx.slice(1, 0, c.seq_len), y = idx.slice(1, 1, c.seq_len + 1);
  auto step = [&] {
    opt.zero_grad();
    gpt->loss(gpt->blocks->forward(gpt->embed(x)), y).backward();
    opt.step();
  };
  auto planner = remat::auto_checkpoint(
      *gpt, remat::AutoOptions().memory_budget_fraction(1.0).inner_units(false).replan_on_overrun(false));
  for (int k = 0; k < 2; ++k) planner.step(step);
  const std::vector<remat::AutoUnit> units = planner.units();
  ASSERT_EQ(units.size(), 3u);
  int forced = 0;
  for (size_t j = 0; j < units.size(); ++j) {
    for (size_t k = 0; k < units[j].options.size(); ++k) {
      std::vector<int> choice(units.size(), 0);
      choice[j] = static_cast<int>(k);
      planner.apply_choice(choice);
      ASSERT_EQ(planner.plan().prediction.choice, choice);
      EXPECT_EQ(planner.units()[j].choice, static_cast<int>(k));
      planner.step(step);
      ++forced;
      const int64_t predicted = planner.plan().prediction.peak_bytes, measured = planner.measured_peak_bytes();
      std::cout << units[j].name << " " << units[j].options[k] << ": predicted " << predicted << " B, measured "
                << measured << " B (" << measured - predicted << ")\n";
      // At most 0.2% above (the last block's selective levels measured
      // 0.7% above while the isolated runs held the output's gradient to
      // the end), at least 3% below (a level whose isolated backward peaks
      // above keep's where the step holds less is over-predicted, ~1%).
      EXPECT_LE(measured, predicted + predicted / 500) << units[j].name << " " << units[j].options[k];
      EXPECT_GE(measured, predicted - 3 * predicted / 100) << units[j].name << " " << units[j].options[k];
    }
  }
  EXPECT_GE(forced, 3 * 3);
  // A choice given is checked before anything changes.
  const std::vector<int> in_force = planner.plan().prediction.choice;
  auto error_of = [&](const std::vector<int>& choice) {
    try {
      planner.apply_choice(choice);
    } catch (const remat::Error& e) {
      EXPECT_EQ(planner.plan().prediction.choice, in_force);
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_EQ(error_of({0, 0}),
            "[remat::auto] apply_choice got 2 option indices for the step's 3 units; give one per entry of units(), in "
            "its order.");
  const int n = static_cast<int>(units[1].options.size());
  EXPECT_EQ(error_of({0, n, 0}), "[remat::auto] apply_choice: option " + std::to_string(n) +
                                     " of unit 'blocks.1', which has " + std::to_string(n) + " (0 to " +
                                     std::to_string(n - 1) + ", as units()[1].options lists them).");
  EXPECT_EQ(error_of({-1, 0, 0}), "[remat::auto] apply_choice: option -1 of unit 'blocks.0', which has " +
                                      std::to_string(units[0].options.size()) + " (0 to " +
                                      std::to_string(units[0].options.size() - 1) +
                                      ", as units()[0].options lists them).");
}

TEST(Auto, UNetWithSkipsAcrossNestedStagesBitwiseAndWithinBudget) {
  check_workload(
      [](bool set_to_none) {
        auto net = UNet(8);
        auto opt = std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(1e-3));
        return classifier(net, opt, batches(kSteps, {4, 3, 32, 32}), batches(kSteps, {4, 32, 32}, true, 2),
                          set_to_none);
      },
      "U-Net");
}

/** A GAN step: the discriminator's (two forwards, one backward), then the
 *  generator's through the discriminator again. g_inputs_only: the
 *  generator's backward computes the generator's gradients only
 *  (backward's inputs), as a step that updates in backward must: the
 *  discriminator's gradients of the generator's loss are not a step of
 *  its own. */
Make gan_workload(bool g_inputs_only) {
  return [g_inputs_only](bool set_to_none) {
    auto gan = Gan(128);
    auto opt_g = std::make_shared<torch::optim::AdamW>(gan->g_parameters(), torch::optim::AdamWOptions(1e-4));
    auto opt_d = std::make_shared<torch::optim::AdamW>(gan->d_parameters(), torch::optim::AdamWOptions(1e-4));
    auto zs = batches(kSteps, {256, 16});
    auto reals = batches(kSteps, {256, 128});
    Workload w;
    w.model = gan.ptr();
    w.optimizers = {opt_g.get(), opt_d.get()};
    w.step = [gan, opt_g, opt_d, zs, reals, set_to_none, g_inputs_only](int k) mutable {
      auto fake = gan->generate(zs[k]);
      auto d_fake = gan->discriminate(fake.detach());
      auto d_real = gan->discriminate(reals[k]);
      auto loss_d = torch::softplus(d_fake).mean() + torch::softplus(-d_real).mean();
      opt_d->zero_grad(set_to_none);
      loss_d.backward();
      opt_d->step();
      auto loss_g = torch::softplus(-gan->discriminate(fake)).mean();
      opt_g->zero_grad(set_to_none);
      if (g_inputs_only) {
        torch::autograd::backward({loss_g}, {}, std::nullopt, false, gan->g_parameters());
      } else {
        loss_g.backward();
      }
      opt_g->step();
    };
    return w;
  };
}

TEST(Auto, GanStepWithTheDiscriminatorTwiceBitwiseAndWithinBudget) { check_workload(gan_workload(false), "GAN"); }

// The model-state levers: each optimizer updates inside backward and its
// param groups' state may live in a disk store, planned with the units
// under the same budget; bitwise the plain step, within budget, no files
// left, at three budgets and both zero_grad styles.
TEST(AutoModelState, GptBitwiseWithinBudgetStateInTheStoreAtTheLeanest) {
  check_workload(gpt_workload(), "GPT, model state", remat::AutoOptions(), false, "",
                 remat_test::fresh_dir("auto_state_gpt"), true);
}
TEST(AutoModelState, ResNetBitwiseWithinBudget) {
  check_workload(resnet_workload(), "ResNet, model state", remat::AutoOptions(), false, "",
                 remat_test::fresh_dir("auto_state_resnet"));
}
TEST(AutoModelState, UNetBitwiseWithinBudget) {
  check_workload(
      [](bool set_to_none) {
        auto net = UNet(8);
        auto opt = std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(1e-3));
        return classifier(net, opt, batches(kSteps, {4, 3, 32, 32}), batches(kSteps, {4, 32, 32}, true, 2),
                          set_to_none);
      },
      "U-Net, model state", remat::AutoOptions(), false, "", remat_test::fresh_dir("auto_state_unet"));
}
TEST(AutoModelState, GanWithTwoOptimizersBitwiseWithinBudgetStateInTheStoreAtTheLeanest) {
  check_workload(gan_workload(true), "GAN, model state", remat::AutoOptions(), false, "",
                 remat_test::fresh_dir("auto_state_gan"), true);
}

/** Four ConvBlocks on 16 x 3 x 32 x 32 images, then a wide layer
 *  (16384 -> 256, 16 MiB of weight) and a 10-class head: the wide layer is
 *  updated first in backward, while the blocks' activations live, and
 *  AdamW's update holds two of its sizes there; at the backward's end the
 *  activations are gone. */
struct WideHeadNetImpl : torch::nn::Module {
  WideHeadNetImpl()
      : b1(register_module("b1", ConvBlock(3, 16))),
        b2(register_module("b2", ConvBlock(16, 16))),
        b3(register_module("b3", ConvBlock(16, 16))),
        b4(register_module("b4", ConvBlock(16, 16))),
        wide(register_module("wide", torch::nn::Linear(16 * 32 * 32, 256))),
        head(register_module("head", torch::nn::Linear(256, 10))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = b4->forward(b3->forward(b2->forward(b1->forward(x))));
    return head(torch::relu(wide(h.flatten(1))));
  }
  ConvBlock b1, b2, b3, b4;
  torch::nn::Linear wide, head;
};
TORCH_MODULE(WideHeadNet);

Make wide_head_workload() {
  return [](bool set_to_none) {
    auto net = WideHeadNet();
    auto opt = std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(1e-3));
    return classifier(net, opt, batches(kSteps, {16, 3, 32, 32}), batches(kSteps, {16}, true, 10), set_to_none);
  };
}

// NOTE [updates placed]: where the updates run is part of the plan. On a
// net whose wide layer is updated while every activation lives, the plans
// update at the backward's end, and say by how much that holds less where
// they peak; bitwise the plain step and within budget at three budgets,
// both zero_grad styles (the state store offered too).
TEST(AutoModelState, UpdatesAtTheBackwardsEndWhereThatPeaksLowerBitwiseWithinBudget) {
  check_workload(wide_head_workload(), "wide head, model state", remat::AutoOptions(), false, "",
                 remat_test::fresh_dir("auto_state_wide"));
  for (double f : {0.05, 0.9}) {
    const Result got =
        run(wide_head_workload(), true, remat::AutoOptions(), remat_test::fresh_dir("auto_state_wide_end"), f);
    const std::string e = got.explain;
    EXPECT_NE(e.find("updating every parameter at the end of backward"), std::string::npos) << f << "\n" << e;
    const std::string said =
        "updating inside backward, the updates' temporaries meet the activations, this plan's options would peak ";
    const size_t at = e.find(said);
    ASSERT_NE(at, std::string::npos) << e;
    EXPECT_EQ(e.substr(e.find(' ', e.find(' ', at + said.size()) + 1), 7), " higher") << e;
  }
}

/** A planner of w's step with its optimizers updating in backward and a
 *  disk state store in dir, at the plain peak until replanned. */
remat::AutoCheckpoint state_store_planner(Workload& w, const std::string& dir, remat::AutoOptions o) {
  return remat::auto_checkpoint(
      *w.model, o.memory_budget_fraction(1.0)
                    .profile_repeats(1)
                    .optimizers(w.optimizers)
                    .optimizer_state_store(remat::OffloadOptions(remat::OffloadTarget::kDisk).directory(dir)));
}

/** "for +X ms per step" of explain(): what the plan in force charges for
 *  the state store (-1, and a failure, when it says none). */
double store_charge(const remat::AutoCheckpoint& planner) {
  const std::string e = planner.explain();
  const size_t at = e.find("for +");
  EXPECT_NE(at, std::string::npos) << e;
  return at == std::string::npos ? -1.0 : std::stod(e.substr(at + 5));
}

/** Warm-up and profiled steps, then the leanest plan (the state in the
 *  store) and its first step, which prices nothing; step(extra) runs one. */
template <class Step>
void store_the_state(remat::AutoCheckpoint& planner, Step&& step) {
  step(0);
  step(0);  // warm-up, profiled
  planner.replan(planner.leanest_peak_bytes());
  ASSERT_GT(planner.optimizer_state_in_store_bytes(), 0) << planner.explain();
  step(0);  // the placement's first step: it prices nothing
}

// NOTE [state priced by the step]: the state store is priced by what it
// cost planned steps (from a placement's second step, the mean of the last
// two: the step's time over its plan's prediction without the store, or
// what backward waited for it if more), not by one state written and read
// back as if backward waited for every byte. Two steps whose store writers
// are held wait that long, and the plan prices the store so; two steps
// that wait little bring the price down again.
TEST(AutoModelState, TheStateStoreIsPricedByWhatItCostsThePlannedSteps) {
  const std::string dir = remat_test::fresh_dir("auto_state_price");
  torch::manual_seed(0);
  Workload w = gpt_workload()(true);
  {
    auto planner = state_store_planner(w, dir, remat::AutoOptions());
    int k = 0;
    auto step = [&](double hold_ms) {
      // The store's writers held for hold_ms from the step's start; let go
      // and joined however the step ends.
      struct Hold {
        std::thread release;
        ~Hold() {
          if (release.joinable()) release.join();
          remat::detail::pause_offload_writers(false);
        }
      } hold;
      if (hold_ms > 0) {
        remat::detail::pause_offload_writers(true);
        hold.release = std::thread([hold_ms] {
          std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(hold_ms));
          remat::detail::pause_offload_writers(false);
        });
      }
      planner.step([&] { w.step(k++ % kSteps); });
    };
    auto charged = [&] { return store_charge(planner); };
    ASSERT_NO_FATAL_FAILURE(store_the_state(planner, step));
    EXPECT_NE(planner.explain().find("until planned steps measure what it costs them"), std::string::npos)
        << planner.explain();
    const double step_ms = planner.measured_time_ms();
    const double hold_ms = 10 * step_ms + 200;  // far longer than a step
    for (int i = 0; i < 2; ++i) {
      step(hold_ms);
      EXPECT_GE(planner.optimizer_state_wait_ms(), hold_ms - 2 * step_ms) << planner.explain();
    }
    EXPECT_NE(planner.explain().find("priced by its last planned steps (2 so far;"), std::string::npos)
        << planner.explain();
    ASSERT_GT(planner.optimizer_state_in_store_bytes(), 0) << planner.explain();
    const double slow = charged();
    EXPECT_GE(slow, hold_ms - 2 * step_ms) << planner.explain();
    EXPECT_GE(planner.plan().prediction.time_ms, planner.plain_time_ms() + slow - 1) << planner.explain();
    step(0);
    step(0);
    EXPECT_NE(planner.explain().find("priced by its last planned steps (4 so far;"), std::string::npos)
        << planner.explain();
    EXPECT_LT(charged(), slow / 4) << planner.explain();
  }
  EXPECT_EQ(remat_test::files_in(dir), 0u);
}

// The same with what the store costs a step beside backward's waits (its
// threads share the disk and the cores): two steps that run long while
// backward waits little price the store at what they ran over their
// plan's prediction without it; two ordinary steps bring it down again.
TEST(AutoModelState, AStepThatRunsOverItsPredictionWithTheStateStoredPricesTheStore) {
  const std::string dir = remat_test::fresh_dir("auto_state_over");
  torch::manual_seed(0);
  Workload w = gpt_workload()(true);
  {
    auto planner = state_store_planner(w, dir, remat::AutoOptions().replan_on_overrun(false));
    int k = 0;
    auto step = [&](double extra_ms) {
      planner.step([&] {
        w.step(k++ % kSteps);
        std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(extra_ms));
      });
    };
    auto charged = [&] { return store_charge(planner); };
    ASSERT_NO_FATAL_FAILURE(store_the_state(planner, step));
    const double step_ms = planner.measured_time_ms();
    const double extra_ms = 10 * step_ms + 200;
    double waited = 0;
    for (int i = 0; i < 2; ++i) {
      step(extra_ms);
      waited = std::max(waited, planner.optimizer_state_wait_ms());
    }
    ASSERT_GT(planner.optimizer_state_in_store_bytes(), 0) << planner.explain();
    const double slow = charged();
    EXPECT_LT(waited, extra_ms / 4) << "backward should have waited little: " << planner.explain();
    EXPECT_GE(slow, extra_ms - 2 * step_ms) << planner.explain();
    step(0);
    step(0);
    EXPECT_LT(charged(), slow / 4) << planner.explain();
  }
  EXPECT_EQ(remat_test::files_in(dir), 0u);
}

TEST(Auto, OffloadOptionsJoinTheMenuBitwiseWithinBudgetAndLeaveNoFiles) {
  // Disk and compressed memory beside recompute and the selective levels:
  // on the GPT, and on the U-Net whose in-place ReLUs write tensors that
  // the store holds.
  const std::string dir = remat_test::fresh_dir("auto_offload");
  const auto base = remat::AutoOptions().offload(
      {remat::OffloadOptions(remat::OffloadTarget::kDisk).directory(dir).min_bytes(0).max_inflight_bytes(64 << 10),
       remat::OffloadOptions(remat::OffloadTarget::kMemory).codec(remat::Codec::kLz4).min_bytes(0)});
  const Make make = gpt_workload();
  check_workload(make, "GPT with offload options", base);
  EXPECT_EQ(remat_test::files_in(dir), 0u) << "the offload files outlive the steps";
  // Offload reaches a leaner step than recompute alone (the stores' bytes
  // in flight included); a plan at that peak must offload.
  torch::manual_seed(0);
  Workload w = make(true);
  auto planner = remat::auto_checkpoint(*w.model, remat::AutoOptions(base).memory_budget_fraction(1.0));
  int k = 0;
  for (; k < 2; ++k) planner.step([&] { w.step(k); });
  ASSERT_TRUE(planner.planned());
  const int64_t leanest = planner.leanest_peak_bytes();
  auto sends = [](const std::string& option) {
    return option.rfind("offload", 0) == 0 || option.rfind("recompute, inputs to ", 0) == 0;
  };
  auto offload_ms = [&] {  // the offload options' time over every unit and call
    double t = 0;
    for (const auto& u : planner.step_model().units) {
      for (size_t o = 0; o < u.options.size(); ++o) {
        for (const auto& c : u.calls) t += sends(u.options[o]) ? c.costs[o].time_ms : 0;
      }
    }
    return t;
  };
  const double isolated = offload_ms();  // as the isolated runs priced them: nothing offloaded yet
  // The leanest of three tiers, each with its margin for writes in flight
  // (max_inflight_bytes, 64 KiB, or the largest tensor sent, which the
  // store lets go alone): no option that sends (no margin); recompute with
  // the inputs sent, no plain offload (a block's input, 8 x 64 x 64 floats:
  // 128 KiB); every option (the attention scores, 8 x 4 x 64 x 64 floats,
  // and the MLP's hidden activations, 8 x 64 x 256: 512 KiB).
  auto without = [&](bool inputs_too) {
    remat::plan::StepModel m = planner.step_model();
    for (size_t j = 0; j < m.units.size(); ++j) {
      const auto& o = m.units[j].options;
      size_t n = o.size();
      while (n > 1 &&
             (o[n - 1].rfind("offload", 0) == 0 || (inputs_too && o[n - 1].rfind("recompute, inputs to ", 0) == 0))) {
        --n;
      }
      remat::plan::truncate_options(m, j, n);
    }
    return remat::plan::min_peak_step(m).prediction.peak_bytes;
  };
  const int64_t tiers =
      std::min({without(true), without(false) + (128 << 10),
                remat::plan::min_peak_step(planner.step_model()).prediction.peak_bytes + (512 << 10)});
  EXPECT_EQ(leanest, tiers);
  // Blocks run at the top: they also offer recompute with their input sent
  // to each store, whose input (8 x 64 x 64 floats, 128 KiB) is credited
  // once the next block starts; attn and mlp run inside blocks: no such option.
  for (const auto& u : planner.step_model().units) {
    const bool top = u.parent < 0;
    const auto at = std::find(u.options.begin(), u.options.end(), "recompute, inputs to disk");
    ASSERT_EQ(at != u.options.end(), top) << u.name;
    if (!top) continue;
    const auto& c = u.calls[0];
    EXPECT_GE(c.release_begin, c.forward_end) << u.name;
    // Free before the block's backward starts: the last block's input from
    // the head's backward on (a backward op outside every unit is an event).
    EXPECT_LT(c.release_begin, c.backward_begin) << u.name;
    EXPECT_EQ(c.costs[static_cast<size_t>(at - u.options.begin())].released_bytes, 128 << 10) << u.name;
    EXPECT_EQ(c.costs[0].released_bytes, 0) << u.name;
  }
  planner.replan(leanest);
  std::printf("%s", planner.explain().c_str());
  bool offloaded = false;
  for (const auto& u : planner.units()) offloaded |= sends(u.options[u.choice]);
  EXPECT_TRUE(offloaded) << planner.explain();
  for (; k < 4; ++k) {
    planner.step([&] { w.step(k); });
    EXPECT_LE(static_cast<double>(planner.measured_peak_bytes()), 1.01 * static_cast<double>(leanest))
        << planner.explain();
  }
  EXPECT_EQ(remat_test::files_in(dir), 0u) << "the offload files outlive the steps";
  // Two steps in a row that offload and run well over their prediction
  // (here slowed by a sleep) reprice the offload options and solve again;
  // the first alone charges nothing. (A real step's disk may run slower
  // than the isolated run's: the steps above may have started a streak;
  // solving again at the same budget starts a new one, with the same plan.)
  planner.replan(planner.budget_bytes());
  const std::vector<remat::AutoUnit> in_force = planner.units();
  ASSERT_TRUE(std::any_of(in_force.begin(), in_force.end(), [&](const remat::AutoUnit& u) {
    return sends(u.options[u.choice]);
  })) << planner.explain();
  const double before = offload_ms();
  for (int slow = 0; slow < 2; ++slow) {
    const double predicted = planner.plan().prediction.time_ms;
    planner.step([&] {
      w.step(slow == 0 ? k++ : 3);  // batches seen before: kSteps + 1 exist
      std::this_thread::sleep_for(std::chrono::microseconds(static_cast<int64_t>(2000 * predicted)));
    });
    if (slow == 0) {
      EXPECT_EQ(offload_ms(), before) << "one slow step charged\n" << planner.explain();
    }
  }
  const double after = offload_ms();
  EXPECT_GT(after, before);
  // (The earlier planned steps may have repriced already: a real step's disk is slower than an isolated run's.)
  EXPECT_NE(planner.explain().find("x from measured steps: +"), std::string::npos) << planner.explain();
  EXPECT_LE(planner.plan().prediction.peak_bytes, planner.budget_bytes());
  // The stall is over: one step well under the repriced prediction gives
  // nothing back, two in a row give back what the second measured, never
  // below the isolated runs' prices.
  planner.step([&] { w.step(0); });  // batches seen before: kSteps + 1 exist
  EXPECT_EQ(offload_ms(), after) << planner.explain();
  planner.step([&] { w.step(1); });
  EXPECT_LT(offload_ms(), after) << planner.explain();
  EXPECT_GE(offload_ms(), isolated * (1 - 1e-9)) << planner.explain();
  EXPECT_LE(static_cast<double>(planner.measured_peak_bytes()), 1.01 * static_cast<double>(leanest))
      << planner.explain();
}

TEST(Auto, ExplainAndTraceDescribeThePlan) {
  const Make make = gpt_workload();
  torch::manual_seed(0);
  Workload w = make(true);
  auto planner = remat::auto_checkpoint(*w.model, remat::AutoOptions().memory_budget_fraction(0.7).profile_repeats(1));
  EXPECT_EQ(planner.explain(), "remat::auto_checkpoint: not profiled yet\n");
  for (int k = 0; k < 3; ++k) planner.step([&] { w.step(k); });
  ASSERT_TRUE(planner.planned());
  const std::string e = planner.explain();
  std::printf("%s", e.c_str());
  EXPECT_NE(e.find("remat::auto_checkpoint: budget "), std::string::npos) << e;
  EXPECT_NE(e.find("solver: chain DP, optimal"), std::string::npos) << e;  // blocks with inner units: a chain
  EXPECT_NE(e.find("last step: measured peak "), std::string::npos) << e;
  // The four blocks are units, and so are their attn and mlp, inside them.
  const auto units = planner.units();
  ASSERT_EQ(units.size(), 12u);
  const auto& model = planner.step_model();
  for (size_t i = 0; i < units.size(); ++i) {
    const size_t block = i / 3;
    const std::string name = "blocks." + std::to_string(block) +
                             std::string(i % 3 == 0   ? ""
                                         : i % 3 == 1 ? ".attn"
                                                      : ".mlp");
    EXPECT_EQ(units[i].name, name);
    EXPECT_EQ(model.units[i].parent, i % 3 == 0 ? -1 : static_cast<int64_t>(3 * block)) << name;
    EXPECT_EQ(units[i].calls, 1);
    EXPECT_EQ(units[i].options[0], "keep");
    EXPECT_EQ(units[i].options[1], "recompute");
    if (i % 3 == 0) {
      EXPECT_EQ(units[i].options[2], "recompute, inner units too");
    }
    EXPECT_GE(units[i].options.size(), 3u) << "no selective level";
  }
  // Without inner units: the four blocks form a chain, their attn and mlp run as part of them.
  {
    torch::manual_seed(0);
    Workload w2 = make(true);
    auto p2 = remat::auto_checkpoint(
        *w2.model, remat::AutoOptions().memory_budget_fraction(0.7).profile_repeats(1).inner_units(false));
    for (int k = 0; k < 3; ++k) p2.step([&] { w2.step(k); });
    const std::string e2 = p2.explain();
    EXPECT_NE(e2.find("solver: chain DP, optimal"), std::string::npos) << e2;
    ASSERT_EQ(p2.units().size(), 4u);
    for (const auto& u : p2.units()) EXPECT_EQ(u.options[2].rfind("save ", 0), 0u) << u.name;
    EXPECT_NE(e2.find("blocks.0.attn: not called with grad enabled in the profiled step outside another unit: off"),
              std::string::npos)
        << e2;
  }
  // A policy given in AutoOptions().policies is an option of every unit.
  {
    torch::manual_seed(0);
    Workload w2 = make(true);
    auto p2 =
        remat::auto_checkpoint(*w2.model, remat::AutoOptions().memory_budget_fraction(0.7).profile_repeats(1).policies(
                                              {remat::models::megatron_policy()}));
    for (int k = 0; k < 3; ++k) p2.step([&] { w2.step(k); });
    for (const auto& u : p2.units()) {
      EXPECT_EQ(u.options.back(), remat::models::megatron_policy().description()) << u.name;
    }
  }
  EXPECT_LE(planner.plan().prediction.peak_bytes, planner.budget_bytes());
  const std::string path = ::testing::TempDir() + "/auto_trace.json";
  planner.write_trace(path);
  std::ifstream f(path);
  std::stringstream text;
  text << f.rdbuf();
  EXPECT_NE(text.str().find("\"name\":\"forward blocks.3\""), std::string::npos);
  EXPECT_NE(text.str().find("\"name\":\"planned peak per segment\""), std::string::npos);
  std::remove(path.c_str());
}

TEST(Auto, ErrorsNameTheValueAndTheRemedy) {
  auto gpt = remat::models::Gpt(remat::models::GptConfig{});
  auto message = [&](const remat::AutoOptions& o) -> std::string {
    try {
      remat::auto_checkpoint(*gpt, o);
    } catch (const remat::Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_EQ(message(remat::AutoOptions()),
            "[remat::auto] no budget: memory_budget_bytes is 0 and memory_budget_fraction is 0.000000; give "
            "AutoOptions().memory_budget_bytes(b) or memory_budget_fraction(f) with f in (0, 1].");
  EXPECT_EQ(message(remat::AutoOptions().memory_budget_fraction(1.5)),
            "[remat::auto] no budget: memory_budget_bytes is 0 and memory_budget_fraction is 1.500000; give "
            "AutoOptions().memory_budget_bytes(b) or memory_budget_fraction(f) with f in (0, 1].");
  EXPECT_EQ(message(remat::AutoOptions().memory_budget_bytes(-1)),
            "[remat::auto] memory_budget_bytes is -1; give a positive number of bytes, or 0 to use "
            "memory_budget_fraction.");
  EXPECT_EQ(message(remat::AutoOptions().memory_budget_bytes(1 << 20).profile_repeats(0)),
            "[remat::auto] selective_levels 3, warmup_steps 1, profile_repeats 0, solver_time_limit_s 30.000000: the "
            "first two must be >= 0, profile_repeats >= 1 and the time limit > 0.");
  const auto budget = remat::AutoOptions().memory_budget_bytes(1 << 20);
  EXPECT_EQ(message(remat::AutoOptions(budget).compression_margin(-0.1)),
            "[remat::auto] compression_margin -0.100000 must be a finite number >= 0 (the share added to what a "
            "compressing store held in the profiled step; default 0.5).");
  EXPECT_EQ(message(remat::AutoOptions(budget).offload({remat::OffloadOptions(remat::OffloadTarget::kHost)})),
            "[remat::auto] offload option 0 (kHost, codec kNone): kHost moves accelerator tensors to pinned host "
            "memory and keeps CPU tensors where they are, so it saves nothing here; use kDisk with a directory, or "
            "kMemory with a codec.");
  EXPECT_EQ(message(remat::AutoOptions(budget).offload(
                {remat::OffloadOptions(remat::OffloadTarget::kMemory).codec(remat::Codec::kZstd),
                 remat::OffloadOptions(remat::OffloadTarget::kMemory)})),
            "[remat::auto] offload option 1 (kMemory, codec kNone): kMemory without a codec keeps every byte in "
            "memory; give it a codec (kZstd, kLz4), or use kDisk with a directory.");
  EXPECT_EQ(message(remat::AutoOptions(budget).recompute(false)),
            "[remat::auto] recompute(false) leaves every unit only keep: nothing to plan. Give the units an offload "
            "store (AutoOptions().offload({remat::OffloadOptions(remat::OffloadTarget::kDisk).directory(dir)})), "
            "chunk_counts for the loss head, or an optimizer_state_store; or leave recompute on.");
  const std::string missing = ::testing::TempDir() + "/no_such_dir_for_auto";
  const std::string e = message(
      remat::AutoOptions(budget).offload({remat::OffloadOptions(remat::OffloadTarget::kDisk).directory(missing)}));
  EXPECT_EQ(e.rfind("[remat::auto] offload option 0 (kDisk, codec kNone): ", 0), 0u) << e;
  EXPECT_NE(e.find(missing), std::string::npos) << e;
  torch::nn::Sequential plain(torch::nn::Linear(4, 4));
  try {
    remat::auto_checkpoint(*plain, remat::AutoOptions().memory_budget_bytes(1 << 20));
    FAIL();
  } catch (const remat::Error& e) {
    EXPECT_STREQ(
        e.what(),
        "[remat::auto] the model (torch::nn::SequentialImpl) has no Checkpointable module and no "
        "CheckpointedSequential: the planner's units are modules deriving from remat::Checkpointable whose forward "
        "calls checkpointed(), and chains.");
  }
}

TEST(Auto, AStepThatCallsNoUnitIsRefused) {
  auto gpt = remat::models::Gpt(remat::models::GptConfig{});
  auto planner = remat::auto_checkpoint(gpt, remat::AutoOptions().memory_budget_fraction(0.5).warmup_steps(0));
  try {
    planner.step([] {});
    FAIL();
  } catch (const remat::Error& e) {
    EXPECT_STREQ(e.what(),
                 "[remat::auto] the profiled step called none of the model's 24 units (Checkpointable modules and "
                 "chains) with grad enabled (first: 'blocks.0'); run the step function that trains this model, with "
                 "its Checkpointable modules' forward routed through checkpointed().");
  }
}

TEST(Auto, InfeasibleBudgetSaysTheSmallestPeakAndLosesNothing) {
  const Make make = gpt_workload();
  torch::manual_seed(0);
  Workload w = make(true);
  auto planner = remat::auto_checkpoint(
      *w.model, remat::AutoOptions().memory_budget_bytes(64 << 10).warmup_steps(0).profile_repeats(1));
  try {
    planner.step([&] { w.step(0); });
    FAIL();
  } catch (const remat::Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.rfind("[remat::auto] no plan of the step fits in 64.00 KiB; the smallest feasible peak is ", 0), 0u)
        << m;
    EXPECT_NE(m.find(". Raise the memory budget to at least that, or make what runs there smaller (fewer tokens or "
                     "images per step)."),
              std::string::npos)
        << m;
  }
  // The profiled step ran plainly and whole: one plain step's update, and
  // every switch is off.
  EXPECT_FALSE(planner.planned());
  EXPECT_NE(remat::describe_checkpointing(*w.model).find("0 of 12 checkpointable modules on"), std::string::npos)
      << remat::describe_checkpointing(*w.model);
}

// A step that is not a chain (two forwards before one backward: GLPK's program) whose
// solver gets no time at all: no budget is said to be infeasible on a floor
// the solver did not prove, and the remedy names the time limit.
TEST(Auto, ASolverOutOfTimeSaysItsFloorIsOnlyTheLeastFound) {
  torch::manual_seed(0);
  Workload w = gpt_micro_batches_workload(/*one_backward=*/true)(true);
  auto planner = remat::auto_checkpoint(
      *w.model,
      remat::AutoOptions().memory_budget_bytes(64 << 10).warmup_steps(0).profile_repeats(1).solver_time_limit_s(1e-6));
  try {
    planner.step([&] { w.step(0); });
    FAIL();
  } catch (const remat::Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.rfind("[remat::auto] no plan of the step fits in 64.00 KiB; the smallest peak found is ", 0), 0u) << m;
    EXPECT_NE(
        m.find("; the solver stopped at its time limit of 1e-06 s: a longer solver_time_limit_s may find a leaner "
               "plan. Raise the memory budget to at least that, or make what runs there smaller (fewer tokens "
               "or images per step)."),
        std::string::npos)
        << m;
  }
}

TEST(Auto, ReplanSweepsBudgetsWithoutProfilingAgain) {
  const Make make = gpt_workload();
  torch::manual_seed(0);
  Workload w = make(true);
  auto planner = remat::auto_checkpoint(*w.model, remat::AutoOptions().memory_budget_fraction(1.0).profile_repeats(1));
  try {
    planner.replan(1 << 20);
    FAIL();
  } catch (const remat::Error& e) {
    EXPECT_STREQ(e.what(),
                 "[remat::auto] replan(1048576) before a profiled step; run step() (or profile_step()) first.");
  }
  try {
    planner.apply();
    FAIL();
  } catch (const remat::Error& e) {
    EXPECT_STREQ(e.what(), "[remat::auto] apply() before a plan exists; run step() until planned().");
  }
  try {
    planner.apply_choice({0});
    FAIL();
  } catch (const remat::Error& e) {
    EXPECT_STREQ(e.what(), "[remat::auto] apply_choice before a profiled step; run step() (or profile_step()) first.");
  }
  int k = 0;
  for (; k < 2; ++k) planner.step([&] { w.step(k); });
  ASSERT_TRUE(planner.planned());
  const int64_t low = remat::plan::min_peak_step(planner.step_model()).prediction.peak_bytes;
  const int64_t high = planner.profiled_peak_bytes();
  double last_ms = 0;
  std::vector<int> at_half;
  std::string half_switches;
  for (double f : {1.0, 0.5, 0.0}) {
    const int64_t budget = low + static_cast<int64_t>(f * static_cast<double>(high - low));
    planner.replan(budget);
    EXPECT_EQ(planner.budget_bytes(), budget);
    EXPECT_LE(planner.plan().prediction.peak_bytes, budget);
    EXPECT_GE(planner.plan().prediction.time_ms, last_ms);  // less memory never costs less time
    last_ms = planner.plan().prediction.time_ms;
    if (f == 0.5) {
      at_half = planner.plan().prediction.choice;
      half_switches = remat::describe_checkpointing(*w.model);
    }
    planner.step([&] { w.step(k++); });
    EXPECT_LE(static_cast<double>(planner.measured_peak_bytes()), 1.01 * static_cast<double>(budget));
  }
  // A plan found before, given back under a budget it fits: the same
  // switches and prediction, and it stays.
  const int64_t half_peak = remat::plan::simulate_step(planner.step_model(), at_half).peak_bytes;
  planner.replan(high);
  planner.apply_choice(at_half);
  EXPECT_EQ(planner.budget_bytes(), high);
  EXPECT_EQ(planner.plan().prediction.choice, at_half);
  EXPECT_EQ(planner.plan().prediction.peak_bytes, half_peak);
  EXPECT_EQ(planner.plan().solver, "given");
  EXPECT_FALSE(planner.plan().optimal);
  EXPECT_EQ(remat::describe_checkpointing(*w.model), half_switches);
  planner.step([&] { w.step(0); });  // the workload has a batch per step above: any will do
  EXPECT_EQ(planner.plan().prediction.choice, at_half);
  // An option inside a unit that does not keep is refused.
  const remat::plan::StepModel& sm = planner.step_model();
  bool nested = false;
  for (size_t j = 0; j < sm.units.size() && !nested; ++j) {
    const int64_t a = sm.units[j].parent;
    if (a < 0) continue;
    nested = true;
    std::vector<int> c(sm.units.size(), 0);
    c[j] = 1;
    c[static_cast<size_t>(a)] = 1;
    try {
      planner.apply_choice(c);
      FAIL();
    } catch (const remat::Error& e) {
      EXPECT_EQ(std::string(e.what()),
                "[remat::auto] apply_choice: unit '" + sm.units[j].name + "' runs inside '" +
                    sm.units[static_cast<size_t>(a)].name +
                    "', which takes option 1 (not keep): it runs as part of it, so give it option 0, or give the "
                    "outer unit option 0.");
    }
    EXPECT_EQ(planner.plan().prediction.choice, at_half);
  }
  EXPECT_TRUE(nested) << "the GPT's blocks have inner units";
  // apply() puts the plan back after other code switched the units.
  const std::string planned = remat::describe_checkpointing(*w.model);
  remat::disable_checkpointing(*w.model);
  EXPECT_NE(remat::describe_checkpointing(*w.model), planned);
  planner.apply();
  EXPECT_EQ(remat::describe_checkpointing(*w.model), planned);
  try {
    planner.replan(0);
    FAIL();
  } catch (const remat::Error& e) {
    EXPECT_STREQ(e.what(), "[remat::auto] replan(0): give a positive budget in bytes.");
  }
}

/** Doubles its input: a unit that runs on any device. */
struct ScaleImpl : torch::nn::Module, remat::Checkpointable {
  torch::Tensor forward(const torch::Tensor& x) {
    return checkpointed([](const torch::Tensor& h) { return h * 2; }, x);
  }
};
TORCH_MODULE(Scale);

TEST(Auto, AUnitOffTheCpuIsRefusedByName) {
  // The planner measures CPU memory: a unit whose inputs live elsewhere (a
  // CUDA device; here the meta device, which every build has) is refused.
  torch::nn::Sequential net;
  net->push_back("scale", Scale());
  auto planner = remat::auto_checkpoint(*net, remat::AutoOptions().memory_budget_fraction(0.5).warmup_steps(0));
  try {
    planner.step([&] {
      auto x = torch::ones({4}, torch::TensorOptions().device(torch::kMeta).requires_grad(true));
      net->forward(x);
    });
    FAIL();
  } catch (const remat::Error& e) {
    EXPECT_STREQ(e.what(),
                 "[remat::auto] unit 'scale' runs on meta; the whole-step planner measures CPU memory only. On a CUDA "
                 "device, use CheckpointedSequential's memory budget or the per-module switch (enable_checkpointing).");
  }
  EXPECT_FALSE(planner.planned());
}
TEST(Auto, AChainOffTheCpuIsRefusedByName) {
  // (No parameters: a module cannot be moved to the meta device.)
  remat::CheckpointedSequential chain{torch::nn::Sequential(torch::nn::ReLU(), torch::nn::Tanh())};
  auto planner = remat::auto_checkpoint(*chain, remat::AutoOptions().memory_budget_fraction(0.5).warmup_steps(0));
  try {
    planner.step([&] {
      chain->forward(torch::ones({2, 4}, torch::TensorOptions().device(torch::kMeta).requires_grad(true)));
    });
    FAIL();
  } catch (const remat::Error& e) {
    EXPECT_STREQ(e.what(),
                 "[remat::auto] unit '(root)' runs on meta; the whole-step planner measures CPU memory only. On a "
                 "CUDA device, use the chain's own memory budget (SequentialOptions) without auto_checkpoint.");
  }
  EXPECT_FALSE(planner.planned());
}

TEST(Auto, AChainWithAnInfeasibleBudgetOfItsOwnRunsThePlannersSchedule) {
  // Alone, the chain refuses a budget under its leanest peak at its first
  // forward; under a planner its options' plan is not used, so nothing is
  // refused, and the step is the plain one, bitwise.
  auto step_of = [](ChainNet net) {
    auto opt = std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(1e-3));
    return classifier(net, opt, batches(kSteps, {256, 16}), batches(kSteps, {256}, true, 4), true);
  };
  torch::manual_seed(0);
  Workload plain = step_of(ChainNet(64, 6, std::make_shared<std::atomic<int64_t>>(0)));
  torch::manual_seed(0);
  Workload tight = step_of(ChainNet(64, 6, std::make_shared<std::atomic<int64_t>>(0),
                                    remat::SequentialOptions().memory_budget_fraction(0.01)));
  auto planner = remat::auto_checkpoint(*tight.model, remat::AutoOptions().memory_budget_fraction(0.85));
  torch::manual_seed(1);
  for (int k = 0; k < kSteps; ++k) plain.step(k);
  torch::manual_seed(1);
  for (int k = 0; k < kSteps; ++k) planner.step([&] { tight.step(k); });
  ASSERT_TRUE(planner.planned());
  EXPECT_TRUE(state_of(*plain.model) == state_of(*tight.model));
  EXPECT_LE(static_cast<double>(planner.measured_peak_bytes()), 1.01 * static_cast<double>(planner.budget_bytes()));
  // Without the planner's schedule, the options' plan is solved, and refused.
  torch::manual_seed(0);
  auto alone = ChainNet(64, 6, std::make_shared<std::atomic<int64_t>>(0),
                        remat::SequentialOptions().memory_budget_fraction(0.01));
  try {
    alone->forward(torch::randn({256, 16}));
    FAIL();
  } catch (const remat::Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("[remat::CheckpointedSequential] no schedule fits in memory_budget_fraction "
                                          "0.01",
                                          0),
              0u)
        << e.what();
  }
}

TEST(Auto, AChainCalledWithTwoShapesKeepsWhereItsSchedulesDoNotFit) {
  // One step runs the chain on a batch of 256 and on a batch of 2: the
  // schedules from the first call's stage menus (selective levels) name
  // options the second call's chain lacks. The chain keeps; nothing throws.
  const auto levers = remat::SequentialOptions().profile(remat::ProfileOptions().selective_levels(2));
  auto make = [&] {
    torch::manual_seed(0);
    auto net = ChainNet(64, 6, std::make_shared<std::atomic<int64_t>>(0), levers);
    auto opt = std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(1e-3));
    auto xs = batches(kSteps, {256, 16});
    auto small = batches(kSteps, {2, 16});
    Workload w;
    w.model = net.ptr();
    w.step = [net, opt, xs, small](int k) mutable {
      opt->zero_grad();
      // Two micro-batches, a full one first (the menu comes from its call), then a ragged one.
      net->forward(xs[k]).square().mean().backward();
      net->forward(small[k]).square().mean().backward();
      opt->step();
    };
    return w;
  };
  Workload plain = make(), planned = make();
  auto planner = remat::auto_checkpoint(*planned.model, remat::AutoOptions().memory_budget_fraction(1.0));
  torch::manual_seed(1);
  for (int k = 0; k < kSteps; ++k) plain.step(k);
  torch::manual_seed(1);
  for (int k = 0; k < kSteps; ++k) planner.step([&] { planned.step(k); });
  ASSERT_TRUE(planner.planned());
  for (const auto& u : planner.units()) {
    if (u.name == "body") {
      EXPECT_EQ(u.options.size(), 1u) << planner.explain();
    }
  }
  EXPECT_TRUE(state_of(*plain.model) == state_of(*planned.model));
}

TEST(Auto, APlannedModelLeavesNoTensorBehind) {
  // The menu's op-timing runs of inner units run forwards never run
  // backward, inside the enclosing unit's hooks: nothing of them may stay.
  remat::memory::enable_tracking();
  (void)run(gpt_workload(2), true, remat::AutoOptions().memory_budget_fraction(1.0));  // warms the caches
  const int64_t before = remat::memory::current_bytes();
  (void)run(gpt_workload(2), true, remat::AutoOptions().memory_budget_fraction(1.0));
  EXPECT_EQ(remat::memory::current_bytes(), before);
}

// --- state the planner touches and gives back ---------------------------------

/** A residual block normalised by a BatchNorm that its model owns: the
 *  block holds it without registering it, so its buffers are not the
 *  unit's (a block calling `owner->bn`). */
struct BorrowedNormBlockImpl : torch::nn::Module, remat::Checkpointable {
  BorrowedNormBlockImpl(int64_t d, torch::nn::BatchNorm1d norm)
      : fc(register_module("fc", torch::nn::Linear(d, d))), norm(std::move(norm)) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return checkpointed([this](const torch::Tensor& h) { return h + torch::relu(norm(fc(h))); }, x);
  }
  torch::nn::Linear fc;
  torch::nn::BatchNorm1d norm;  // the model's
};
TORCH_MODULE(BorrowedNormBlock);

/** Three BorrowedNormBlocks sharing the model's one BatchNorm. */
struct SharedNormNetImpl : torch::nn::Module {
  explicit SharedNormNetImpl(int64_t d) {
    in = register_module("in", torch::nn::Linear(16, d));
    norm = register_module("norm", torch::nn::BatchNorm1d(d));
    for (int i = 0; i < 3; ++i) {
      blocks.push_back(register_module("block" + std::to_string(i), BorrowedNormBlock(d, norm)));
    }
    out = register_module("out", torch::nn::Linear(d, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = in(x);  // (B, d)
    for (auto& b : blocks) h = b->forward(h);
    return out(h);  // (B, 4)
  }
  torch::nn::Linear in{nullptr}, out{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
  std::vector<BorrowedNormBlock> blocks;
};
TORCH_MODULE(SharedNormNet);

TEST(Auto, ABatchNormTheModelOwnsMovesAsInAPlainRun) {
  // The profiled step runs each block again under every option: those runs
  // must leave the model's BatchNorm as they found it, like the block's own
  // buffers. Then the leanest plan (recompute) runs the blocks again in
  // backward. Statistics, step counts and parameters bitwise as plain.
  auto make = [](bool set_to_none) {
    auto net = SharedNormNet(64);
    auto opt = std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
    return classifier(net, opt, batches(kSteps, {128, 16}), batches(kSteps, {128}, true, 4), set_to_none);
  };
  const Result plain = run(make, true, std::nullopt);
  torch::manual_seed(0);
  Workload w = make(true);
  torch::manual_seed(1);
  auto planner = remat::auto_checkpoint(*w.model, remat::AutoOptions().memory_budget_fraction(1.0).profile_repeats(1));
  for (int k = 0; k < kSteps; ++k) {
    if (k == 2) {
      ASSERT_TRUE(planner.planned());
      planner.replan(planner.leanest_peak_bytes());
      int recomputed = 0;
      for (const auto& u : planner.units()) recomputed += u.choice != 0;
      EXPECT_GT(recomputed, 0) << planner.explain();
    }
    planner.step([&] { w.step(k); });
    const std::vector<Bytes> got = state_of(*w.model);
    ASSERT_EQ(got.size(), plain.states[k].size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(got[i] == plain.states[k][i]) << "tensor " << i << " differs after step " << k;
    }
  }
  auto* net = dynamic_cast<SharedNormNetImpl*>(w.model.get());
  ASSERT_NE(net, nullptr);
  // Three blocks call it per step, in plain steps and planned ones alike.
  EXPECT_EQ(net->norm->num_batches_tracked.item<int64_t>(), 3 * kSteps);
}

/** A block whose forward takes a gradient of its own (a gradient penalty,
 *  forces = -dE/dx): autograd::grad runs inside the unit's forward. */
struct PenaltyBlockImpl : torch::nn::Module, remat::Checkpointable {
  PenaltyBlockImpl() : a(register_module("a", torch::nn::Linear(16, 16))) {}
  at::Tensor forward(const at::Tensor& x) {
    return checkpointed(
        [this](const at::Tensor& h) {
          auto hi = h.detach().requires_grad_(true);
          auto g = torch::autograd::grad({torch::tanh(a->forward(hi)).sum()}, {hi}, {}, true, true)[0];
          return h + torch::tanh(a->forward(h)) + 0.1 * g;
        },
        x);
  }
  torch::nn::Linear a;
};
TORCH_MODULE(PenaltyBlock);

// The unpacks of a unit's own autograd::grad inside its forward were taken
// for its backward's start (before its forward's end): the step model
// refused the windows ("[remat::plan] unit 0 ('b1') call 0 has windows [1,
// 3, 2, 8]; they must be ordered") and every step threw. Planned at the
// plain peak and at the leanest, bitwise the plain loop.
TEST(Auto, AUnitWhoseForwardTakesAGradientPlansAndTrainsAsPlain) {
  auto train = [](bool planned) {
    torch::manual_seed(0);
    auto root = std::make_shared<torch::nn::Module>();
    auto b1 = root->register_module("b1", PenaltyBlock());
    auto b2 = root->register_module("b2", PenaltyBlock());
    torch::optim::SGD opt(root->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    const auto x = torch::randn({64, 16});
    auto step = [&] {
      opt.zero_grad();
      b2->forward(b1->forward(x)).square().mean().backward();
      opt.step();
    };
    std::optional<remat::AutoCheckpoint> planner;
    if (planned) planner.emplace(remat::auto_checkpoint(*root, remat::AutoOptions().memory_budget_fraction(1.0)));
    for (int k = 0; k < 5; ++k) {
      if (planner && k == 3) {
        EXPECT_TRUE(planner->planned());
        planner->replan(planner->leanest_peak_bytes());
        int recomputed = 0;
        for (const auto& u : planner->units()) recomputed += u.choice != 0;
        EXPECT_GT(recomputed, 0) << planner->explain();
      }
      planner ? planner->step(step) : step();
    }
    std::vector<at::Tensor> out;
    for (const auto& p : root->parameters()) out.push_back(p.detach().clone());
    return out;
  };
  remat::memory::enable_tracking();
  const auto plain = train(false);
  const auto planned = train(true);
  ASSERT_EQ(plain.size(), planned.size());
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(torch::equal(plain[i], planned[i])) << i;
}

TEST(Auto, DestroyingThePlannerGivesBackTheSwitchesAndSchedulesItSet) {
  // A chain with a budget of its own (half its plain peak) and a unit the
  // user switched on: the planner sets both while it lives, and gives them
  // back when it goes, once (a moved-from planner gives back nothing).
  torch::manual_seed(0);
  auto net = ChainNet(64, 6, std::make_shared<std::atomic<int64_t>>(0),
                      remat::SequentialOptions().memory_budget_fraction(0.5));
  net->head->set_checkpointing(remat::CheckpointOptions());
  const torch::Tensor x = torch::randn({256, 16});
  auto step = [&] {
    net->zero_grad();
    net->forward(x).square().mean().backward();
  };
  auto peak = [&] {  // of a step's forward and backward, above what lives before it
    net->zero_grad();
    remat::memory::Probe p;
    net->forward(x).square().mean().backward();
    return p.peak_bytes();
  };
  step();  // the chain profiles itself and plans under its own budget
  const int64_t own = peak();
  const std::string switches = remat::describe_checkpointing(*net);
  std::optional<remat::AutoCheckpoint> holder;
  int64_t forced = 0;
  bool head_kept = false;
  {
    auto planner = remat::auto_checkpoint(*net, remat::AutoOptions().memory_budget_fraction(1.0).profile_repeats(1));
    for (int k = 0; k < 2; ++k) planner.step(step);
    ASSERT_TRUE(planner.planned());
    forced = peak();
    // Where the plan keeps the chain (the fastest, bar noise), it stores every stage.
    for (const auto& u : planner.units()) {
      if (u.name == "body" && u.choice == 0) {
        EXPECT_GT(static_cast<double>(forced), 1.5 * static_cast<double>(own));
      }
      // The head's switch is the plan's: off where it keeps (the fastest,
      // bar noise: a loaded machine can time recompute as fast, which is
      // the user's own setting).
      if (u.name == "head") head_kept = u.options[u.choice] == "keep";
    }
    if (head_kept) {
      EXPECT_NE(remat::describe_checkpointing(*net), switches);
    }
    holder.emplace(std::move(planner));
  }
  // The moved-from planner is gone; the plan is still in force.
  EXPECT_EQ(peak(), forced);
  if (head_kept) {
    EXPECT_NE(remat::describe_checkpointing(*net), switches);
  }
  holder.reset();
  EXPECT_EQ(remat::describe_checkpointing(*net), switches);
  EXPECT_TRUE(net->head->checkpointing());
  const int64_t after = peak();
  std::printf("chain's own plan: peak %lld B; forced store-all %lld B (%.2fx); after the planner %lld B\n",
              static_cast<long long>(own), static_cast<long long>(forced), static_cast<double>(forced) / own,
              static_cast<long long>(after));
  EXPECT_EQ(after, own);
}

TEST(Auto, WithoutAWarmUpTheStateTheProfiledStepCreatesIsCounted) {
  // warmup_steps(0) with AdamW: the profiled step is the first, and it
  // creates the optimizer's state (and the gradients) that every later step
  // holds from its start. The planned steps must still fit the budget.
  const Make make = gpt_workload(2);
  int64_t budget = 0;
  {  // a warmed-up planner's range (gone before the next one starts: both count the same tensors)
    torch::manual_seed(0);
    Workload ref = make(true);
    torch::manual_seed(1);
    auto warm = remat::auto_checkpoint(*ref.model, remat::AutoOptions().memory_budget_fraction(1.0).profile_repeats(1));
    for (int k = 0; k < 2; ++k) warm.step([&] { ref.step(k); });
    ASSERT_TRUE(warm.planned());
    const int64_t low = warm.leanest_peak_bytes(), high = warm.profiled_peak_bytes();
    budget = low + (high - low) / 4;
  }
  torch::manual_seed(0);
  Workload w = make(true);
  torch::manual_seed(1);
  auto planner = remat::auto_checkpoint(
      *w.model, remat::AutoOptions().memory_budget_bytes(budget).warmup_steps(0).profile_repeats(1));
  planner.step([&] { w.step(0); });
  ASSERT_TRUE(planner.planned());
  const std::string e = planner.explain();
  EXPECT_NE(e.find(" more at its end than at its start (the optimizer's state, gradients): counted at every point "
                   "of the step\n"),
            std::string::npos)
      << e;
  for (int k = 1; k < kSteps; ++k) {
    planner.step([&] { w.step(k); });
    std::printf("warmup_steps(0): step %d measured %lld B, %.3fx the budget of %lld B\n", k,
                static_cast<long long>(planner.measured_peak_bytes()),
                static_cast<double>(planner.measured_peak_bytes()) / static_cast<double>(budget),
                static_cast<long long>(budget));
    EXPECT_LE(static_cast<double>(planner.measured_peak_bytes()), 1.01 * static_cast<double>(budget))
        << planner.explain();
  }
  EXPECT_EQ(planner.replans(), 0) << planner.explain();
}

TEST(Auto, AnOverrunNoPlanCanFixIsReported) {
  // At the leanest plan, a step that holds 4 MiB more than the profiled one
  // (memory outside the units that grew after profiling) overruns, and no
  // plan fits the budget lowered by the excess: step() says so.
  const Make make = gpt_workload(2);
  torch::manual_seed(0);
  Workload w = make(true);
  // By default a warning (and overruns()): training goes on.
  {
    auto planner =
        remat::auto_checkpoint(*w.model, remat::AutoOptions().memory_budget_fraction(1.0).profile_repeats(1));
    for (int k = 0; k < 2; ++k) planner.step([&] { w.step(k); });
    ASSERT_TRUE(planner.planned());
    planner.replan(planner.leanest_peak_bytes());
    struct Capture : c10::WarningHandler {
      std::vector<std::string> got;
      void process(const c10::Warning& warning) override { got.push_back(warning.msg()); }
    } capture;
    {
      c10::WarningUtils::WarningHandlerGuard guard(&capture);
      planner.step([&] {
        const torch::Tensor ballast = torch::ones({1 << 20});  // 4 MiB
        w.step(2);
      });
    }
    ASSERT_EQ(capture.got.size(), 1u) << planner.explain();
    ASSERT_EQ(planner.overruns().size(), 1u);
    EXPECT_EQ(capture.got[0], planner.overruns()[0]);
    EXPECT_EQ(capture.got[0].rfind("[remat::auto] the planned step's measured peak was ", 0), 0u) << capture.got[0];
  }
  // overrun_throws: step() throws it.
  auto planner = remat::auto_checkpoint(
      *w.model, remat::AutoOptions().memory_budget_fraction(1.0).profile_repeats(1).overrun_throws(true));
  for (int k = 0; k < 2; ++k) planner.step([&] { w.step(k); });
  ASSERT_TRUE(planner.planned());
  planner.replan(planner.leanest_peak_bytes());
  const std::string in_force = remat::describe_checkpointing(*w.model);
  try {
    planner.step([&] {
      const torch::Tensor ballast = torch::ones({1 << 20});  // 4 MiB
      w.step(2);
    });
    FAIL() << "an overrun no plan fixes was swallowed: " << planner.explain();
  } catch (const remat::Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.rfind("[remat::auto] the planned step's measured peak was ", 0), 0u) << m;
    EXPECT_NE(m.find(" over the budget of "), std::string::npos) << m;
    EXPECT_NE(m.find(", and no plan of the profiled step fits the budget lowered by that ("), std::string::npos) << m;
    EXPECT_NE(m.find("; the smallest feasible peak is "), std::string::npos) << m;
    EXPECT_NE(m.find("). The step ran and its update stands; the plan in force stays. Give replan() a budget of at "
                     "least "),
              std::string::npos)
        << m;
    EXPECT_NE(m.find(", or profile a step that holds what every later step holds (profile_step(), "
                     "AutoOptions::warmup_steps)."),
              std::string::npos)
        << m;
  }
  EXPECT_EQ(remat::describe_checkpointing(*w.model), in_force);
  EXPECT_GT(planner.measured_peak_bytes(), planner.budget_bytes());
}

// --- profiling again ------------------------------------------------------------

/** The tests' GPT (2 blocks) and its AdamW step on (batch, 65) token rows. */
struct GptRun {
  remat::models::Gpt gpt{nullptr};
  std::shared_ptr<torch::optim::AdamW> opt;
  std::vector<torch::Tensor> idx;
  void step(int k) {
    auto x = idx[k].slice(1, 0, 64), y = idx[k].slice(1, 1, 65);
    opt->zero_grad();
    gpt->loss(gpt->blocks->forward(gpt->embed(x)), y).backward();
    opt->step();
  }
};
GptRun gpt_run(int64_t batch, int steps) {
  torch::manual_seed(0);
  GptRun r;
  r.gpt = remat::models::Gpt(small_gpt(2));
  r.opt = std::make_shared<torch::optim::AdamW>(r.gpt->parameters(), torch::optim::AdamWOptions(1e-3));
  r.idx = batches(steps, {batch, 65}, true, 256);
  return r;
}

TEST(Auto, ProfilingAgainAfterUnfreezingPlansEveryUnit) {
  // Head-only fine-tune (only the final norm trains: the blocks have no
  // backward), then the whole model: profile_step() must offer every unit
  // its options again and plan where a fresh planner plans.
  auto freeze = [](remat::models::Gpt& gpt, bool frozen) {
    for (auto& p : gpt->parameters()) p.requires_grad_(!frozen);
    for (auto& p : gpt->ln_f->parameters()) p.requires_grad_(true);
  };
  constexpr int kAll = 5;  // 2 frozen, then 3
  GptRun plain = gpt_run(8, kAll);
  freeze(plain.gpt, true);
  torch::manual_seed(1);
  std::vector<std::vector<Bytes>> states;
  for (int k = 0; k < kAll; ++k) {
    if (k == 2) freeze(plain.gpt, false);
    plain.step(k);
    states.push_back(state_of(*plain.gpt));
  }
  // A fresh planner of the whole model (gone before the next one starts,
  // so that both count the same tensors): a budget it meets.
  int64_t budget = 0;
  {
    GptRun fresh = gpt_run(8, kAll);
    auto fresh_planner =
        remat::auto_checkpoint(fresh.gpt, remat::AutoOptions().memory_budget_fraction(1.0).profile_repeats(1));
    for (int k = 0; k < 2; ++k) fresh_planner.step([&] { fresh.step(k); });
    ASSERT_TRUE(fresh_planner.planned());
    const int64_t low = fresh_planner.leanest_peak_bytes(), high = fresh_planner.profiled_peak_bytes();
    budget = low + (high - low) / 4;
    fresh_planner.replan(budget);
  }

  GptRun r = gpt_run(8, kAll);
  freeze(r.gpt, true);
  torch::manual_seed(1);
  auto planner = remat::auto_checkpoint(r.gpt, remat::AutoOptions().memory_budget_fraction(1.0).profile_repeats(1));
  for (int k = 0; k < 2; ++k) {
    planner.step([&] { r.step(k); });
    EXPECT_TRUE(state_of(*r.gpt) == states[k]) << "step " << k;
  }
  ASSERT_TRUE(planner.planned());
  freeze(r.gpt, false);
  planner.profile_step([&] { r.step(2); });
  EXPECT_TRUE(state_of(*r.gpt) == states[2]);
  for (const auto& u : planner.units()) EXPECT_GT(u.options.size(), 1u) << u.name << "\n" << planner.explain();
  planner.replan(budget);
  std::printf("%s", planner.explain().c_str());
  for (int k = 3; k < kAll; ++k) {
    planner.step([&] { r.step(k); });
    EXPECT_TRUE(state_of(*r.gpt) == states[k]) << "step " << k;
    EXPECT_LE(static_cast<double>(planner.measured_peak_bytes()), 1.01 * static_cast<double>(budget))
        << planner.explain();
  }
}

TEST(Auto, ProfilingAgainAtAnotherBatchSizeRebuildsTheMenus) {
  // Planned at batch 4, profiled again at batch 8: each unit's menu is a
  // fresh planner's at 8: the same options but the selective levels (which
  // ops a level keeps depends on their measured times), the same bytes
  // kept by each, and every level keeps ops of the new shapes.
  GptRun a = gpt_run(4, 3), b = gpt_run(8, 3);
  for (int k = 0; k < 3; ++k) a.idx[k] = b.idx[k].slice(0, 0, 4).clone();
  auto pa = remat::auto_checkpoint(a.gpt, remat::AutoOptions().memory_budget_fraction(1.0).profile_repeats(1));
  for (int k = 0; k < 2; ++k) pa.step([&] { a.step(k); });
  ASSERT_TRUE(pa.planned());
  a.idx[2] = b.idx[2];
  pa.profile_step([&] { a.step(2); });
  auto pb = remat::auto_checkpoint(b.gpt, remat::AutoOptions().memory_budget_fraction(1.0).profile_repeats(1));
  for (int k = 0; k < 2; ++k) pb.step([&] { b.step(k); });
  ASSERT_TRUE(pb.planned());
  const auto& ma = pa.step_model();
  const auto& mb = pb.step_model();
  ASSERT_EQ(ma.units.size(), mb.units.size());
  int levels = 0;
  for (size_t j = 0; j < ma.units.size(); ++j) {
    const auto& ua = ma.units[j];
    const auto& ub = mb.units[j];
    ASSERT_EQ(ua.options.size(), ub.options.size()) << ua.name;
    ASSERT_EQ(ua.calls.size(), 1u);
    ASSERT_EQ(ub.calls.size(), 1u);
    const auto& ca = ua.calls[0].costs;
    const auto& cb = ub.calls[0].costs;
    for (size_t k = 0; k < ua.options.size(); ++k) {
      if (ua.options[k].rfind("save ", 0) == 0) {
        ++levels;
        EXPECT_EQ(ub.options[k].rfind("save ", 0), 0u) << ub.name << ": " << ub.options[k];
        // A level keeps more than recompute does: it holds the ops it names.
        EXPECT_GT(ca[k].kept_bytes, ca[1].kept_bytes) << ua.name << ": " << ua.options[k];
        continue;
      }
      EXPECT_EQ(ua.options[k], ub.options[k]) << ua.name;
      EXPECT_EQ(ca[k].kept_bytes, cb[k].kept_bytes) << ua.name << ": " << ua.options[k];
      EXPECT_EQ(ca[k].backward_peak_bytes, cb[k].backward_peak_bytes) << ua.name << ": " << ua.options[k];
    }
  }
  EXPECT_GT(levels, 0);
}

// --- offload's bytes in flight -----------------------------------------------------

/** A 512-wide Linear layer (a 1 MiB weight, its stack's: shared by every
 *  block), then elementwise ops: four activations of 512 KiB at 256 rows.
 *  The weight is the largest tensor it saves; the store keeps it (a
 *  parameter), so only activations go in flight. */
struct WideImpl : torch::nn::Module, remat::Checkpointable {
  explicit WideImpl(torch::nn::Linear fc) : fc(std::move(fc)) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return checkpointed(
        [this](const torch::Tensor& h) {
          auto y = torch::gelu(fc(h));  // (B, 512)
          return torch::tanh(y) * y;
        },
        x);
  }
  torch::nn::Linear fc;  // the stack's
};
TORCH_MODULE(Wide);

/** Eight Wide blocks in a unit of their own: the blocks are inner units,
 *  whose menus have no "recompute, inputs to" option. */
struct WideStackImpl : torch::nn::Module, remat::Checkpointable {
  WideStackImpl() : fc(register_module("fc", torch::nn::Linear(512, 512))) {
    for (int i = 0; i < 8; ++i) blocks.push_back(register_module("b" + std::to_string(i), Wide(fc)));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return checkpointed(
        [this](const torch::Tensor& h) {
          torch::Tensor y = h;
          for (auto& b : blocks) y = b->forward(y);
          return y;
        },
        x);
  }
  torch::nn::Linear fc;
  std::vector<Wide> blocks;
};
TORCH_MODULE(WideStack);

TEST(Auto, TheOffloadMarginIsWhatTheStoreHeldInFlight) {
  const std::string dir = remat_test::fresh_dir("auto_margin");
  const auto store =
      remat::OffloadOptions(remat::OffloadTarget::kDisk).directory(dir).min_bytes(0).max_inflight_bytes(4096);
  // What a store holds in flight for one block, measured by the store: a
  // tensor at a time (max_inflight_bytes 1), the weights kept.
  int64_t measured = 0;
  {
    torch::manual_seed(3);
    Wide block(torch::nn::Linear(512, 512));
    const torch::Tensor x = torch::randn({256, 512}, torch::requires_grad());
    remat::OffloadScope scope(remat::OffloadOptions(store).max_inflight_bytes(1));
    block->forward(x * 1).sum().backward();
    measured = scope.stats().peak_inflight_bytes;
  }
  EXPECT_EQ(measured, 256 * 512 * 4);  // one activation, half the weight
  const Make make = [](bool set_to_none) {
    torch::manual_seed(5);
    torch::nn::Sequential net(WideStack(), torch::nn::Linear(512, 10));
    auto opt = std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.01));
    return classifier(net, opt, batches(kSteps, {256, 512}), batches(kSteps, {256}, true, 10), set_to_none);
  };
  const Result plain = run(make, true, std::nullopt);
  torch::manual_seed(0);
  Workload w = make(true);
  torch::manual_seed(1);
  auto planner = remat::auto_checkpoint(
      *w.model, remat::AutoOptions().selective_levels(0).offload({store}).memory_budget_fraction(1.0));
  for (int k = 0; k < 2; ++k) planner.step([&] { w.step(k); });
  ASSERT_TRUE(planner.planned());
  const int64_t leanest = planner.leanest_peak_bytes();
  planner.replan(leanest);
  std::printf("%s", planner.explain().c_str());
  int offloaded = 0;
  for (const auto& u : planner.units()) offloaded += u.options[u.choice] == "offload disk";
  EXPECT_GT(offloaded, 0) << planner.explain();
  // The margin is the measured bytes in flight, not the largest tensor a
  // block saves (its 1 MiB weight).
  std::printf("in flight measured by the store: %lld B; the plan's margin: %lld B\n", static_cast<long long>(measured),
              static_cast<long long>(planner.inflight_bytes()));
  EXPECT_EQ(planner.inflight_bytes(), measured) << planner.explain();
  EXPECT_EQ(leanest, remat::plan::min_peak_step(planner.step_model()).prediction.peak_bytes + measured);
  for (int k = 2; k < kSteps; ++k) {
    planner.step([&] { w.step(k); });
    std::printf("step %d: measured %lld B, %.3fx the budget of %lld B (prediction %lld B + margin)\n", k,
                static_cast<long long>(planner.measured_peak_bytes()),
                static_cast<double>(planner.measured_peak_bytes()) / static_cast<double>(leanest),
                static_cast<long long>(leanest), static_cast<long long>(planner.plan().prediction.peak_bytes));
    EXPECT_LE(static_cast<double>(planner.measured_peak_bytes()), 1.01 * static_cast<double>(leanest))
        << planner.explain();
  }
  const std::vector<Bytes> got = state_of(*w.model);
  ASSERT_EQ(got.size(), plain.states.back().size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(got[i] == plain.states.back()[i]) << "tensor " << i;
  EXPECT_EQ(remat_test::files_in(dir), 0u) << "the offload files outlive the steps";
}

// --- on a CUDA device (skipped without one) ------------------------------------
// The planner reads the device of the model's parameters through its memory
// source (NOTE [memory sources], src/core/memory_source.h): on CUDA the
// caching allocator's allocated bytes, and times units with CUDA events.
TEST(CudaAuto, GptBlocksPlannedOnTheDeviceWithinBudget) {
  if (!remat::memory::built_with_cuda()) GTEST_SKIP() << "CPU build";
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const c10::Device d(c10::kCUDA, 0);
  torch::manual_seed(0);
  torch::nn::Sequential net;
  for (int i = 0; i < 4; ++i) net->push_back(remat::models::GptBlock(256, 4, 0.0, /*sdpa=*/true));
  net->to(d);
  const auto x = torch::randn({4, 256, 256}, torch::TensorOptions().device(d)).requires_grad_(true);
  auto run = [&] {
    net->zero_grad();
    net->forward(x).sum().backward();
  };
  run();
  std::vector<torch::Tensor> plain;
  for (const auto& p : net->parameters()) plain.push_back(p.grad().clone());
  {
    auto planner = remat::auto_checkpoint(*net, remat::AutoOptions().memory_budget_fraction(0.5).warmup_steps(1));
    for (int i = 0; i < 4; ++i) planner.step(run);
    ASSERT_TRUE(planner.planned());
    EXPECT_LE(static_cast<double>(planner.measured_peak_bytes()), 1.01 * static_cast<double>(planner.budget_bytes()))
        << planner.explain();
    const auto params = net->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(torch::allclose(params[i].grad(), plain[i], 1e-4, 1e-5)) << "parameter " << i;
    }
  }
  // A unit whose input is on the CPU is refused by name.
  auto cpu_x = torch::randn({4, 256, 256}).requires_grad_(true);
  auto other = remat::auto_checkpoint(*net, remat::AutoOptions().memory_budget_fraction(0.5).warmup_steps(0));
  EXPECT_NE(remat_test::error_of([&] {
              other.step([&] { net->forward(cpu_x).sum().backward(); });
            }).find("the whole-step planner measures cuda:0 (the device of the model's parameters)"),
            std::string::npos);
}
