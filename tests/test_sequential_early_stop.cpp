// CheckpointedSequential's early stop (NOTE [early stop in planned
// recomputes], src/chain/early_stop.h): a recompute right before its backward runs
// only the ops whose results backward reads; gradients stay bitwise those
// of a plain run; stages it cannot see into are never cut; a stage whose op
// sequence changes falls back to a full run.
#include "common.h"

#include <atomic>

#include <remat/plan/plan.h>
#include <remat/sequential.h>

using namespace remat_test;

namespace {

remat::StepReport run(remat::CheckpointedSequential& net, torch::nn::Sequential& seq, torch::Tensor x,
                      uint64_t rng_seed, std::vector<torch::Tensor>* grads) {
  torch::manual_seed(rng_seed);
  *grads = step_grads(*seq, x, [&](torch::Tensor h) { return net->forward(h); });
  return net->last_step();
}

// A GPT block's last ops (the MLP's second matmul, its bias and the residual
// add) leave nothing that backward reads: from the second step on, each
// recompute produces them without running them; gradients are bitwise the
// plain run's, with dropout (RNG replayed) and without.
TEST(CheckpointedSequentialEarlyStop, GptBlocksSkipTheirLastOpsBitwise) {
  for (double p : {0.0, 0.1}) {
    auto seq = six_gpt_blocks(3, p);
    auto x = torch::randn({2, 16, 64}, torch::requires_grad());
    auto plain = plain_step_grads(seq, x, 5);
    remat::CheckpointedSequential net(seq, remat::SequentialOptions().segments(6));
    std::vector<torch::Tensor> got;
    auto first = run(net, seq, x, 5, &got);
    expect_bitwise_equal(plain, got);
    EXPECT_EQ(first.recompute_ops_skipped, 0) << "the first recompute of each stage runs in full and records";
    for (int s = 0; s < 2; ++s) {
      auto r = run(net, seq, x, 5, &got);
      expect_bitwise_equal(plain, got);
      // 5 recomputed stages (the last one is kept), at least the final
      // addmm and the residual add of each.
      EXPECT_GE(r.recompute_ops_skipped, 5 * 2) << "p " << p;
      EXPECT_EQ(r.forwards_per_stage, (std::vector<int>{2, 2, 2, 2, 2, 1}));
    }
    remat::CheckpointedSequential off(seq, remat::SequentialOptions().segments(6).early_stop(false));
    for (int s = 0; s < 2; ++s) EXPECT_EQ(run(off, seq, x, 5, &got).recompute_ops_skipped, 0);
    expect_bitwise_equal(plain, got);
  }
}

struct LinearReluImpl : torch::nn::Module {
  LinearReluImpl() : lin(register_module("lin", torch::nn::Linear(32, 32))) {}
  torch::Tensor forward(torch::Tensor x) { return torch::relu(lin(x)); }
  torch::nn::Linear lin;
};
TORCH_MODULE(LinearRelu);

// A stage ending in an op that saves its own result (ReLU) has nothing to
// skip after the last save.
TEST(CheckpointedSequentialEarlyStop, StageEndingInASavingOpSkipsNothing) {
  torch::manual_seed(0);
  torch::nn::Sequential seq;
  for (int i = 0; i < 4; ++i) seq->push_back(LinearRelu());
  auto x = torch::randn({8, 32}, torch::requires_grad());
  auto plain = plain_step_grads(seq, x, 1);
  remat::CheckpointedSequential net(seq, remat::SequentialOptions().segments(4));
  std::vector<torch::Tensor> got;
  for (int s = 0; s < 3; ++s) {
    EXPECT_EQ(run(net, seq, x, 1, &got).recompute_ops_skipped, 0);
    expect_bitwise_equal(plain, got);
  }
}

// Linear and GELU as stages of their own: each one's backward reads only
// its input and weight, so their recomputes run no kernel at all.
TEST(CheckpointedSequentialEarlyStop, SingleOpStagesRunNoKernel) {
  auto seq = make_mlp(6, 48, 2, /*gelu=*/true);
  auto x = torch::randn({16, 48}, torch::requires_grad());
  auto plain = plain_step_grads(seq, x, 1);
  remat::CheckpointedSequential net(seq, remat::SequentialOptions().segments(static_cast<int>(seq->size())));
  std::vector<torch::Tensor> got;
  run(net, seq, x, 1, &got);
  auto r = run(net, seq, x, 1, &got);
  expect_bitwise_equal(plain, got);
  EXPECT_GT(r.recompute_ops_skipped, 0);
}

/** y = 2x through a custom Function that keeps x in saved_data (unseen by
 *  saved-tensor hooks), then tanh: never cut. */
struct KeepsInSavedData : torch::autograd::Function<KeepsInSavedData> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x) {
    ctx->saved_data["x"] = x;
    return x * 2;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    // Reads x: wrong if x had been produced without running.
    auto x = ctx->saved_data["x"].toTensor();
    return {g[0] * 2 + 0 * x.sum()};
  }
};

struct CustomStageImpl : torch::nn::Module {
  CustomStageImpl() : lin(register_module("lin", torch::nn::Linear(16, 16))) {}
  torch::Tensor forward(torch::Tensor x) { return KeepsInSavedData::apply(lin(x)) + 1; }
  torch::nn::Linear lin;
};
TORCH_MODULE(CustomStage);

TEST(CheckpointedSequentialEarlyStop, StagesWithCustomFunctionsAreNeverCut) {
  torch::manual_seed(0);
  torch::nn::Sequential seq;
  for (int i = 0; i < 4; ++i) seq->push_back(CustomStage());
  auto x = torch::randn({4, 16}, torch::requires_grad());
  auto plain = plain_step_grads(seq, x, 1);
  remat::CheckpointedSequential net(seq, remat::SequentialOptions().segments(4));
  std::vector<torch::Tensor> got;
  for (int s = 0; s < 3; ++s) {
    EXPECT_EQ(run(net, seq, x, 1, &got).recompute_ops_skipped, 0);
    expect_bitwise_equal(plain, got);
  }
}

/** Linear then tanh, plus one extra op at the end on some calls: its op
 *  sequence changes between runs (control flow on outside state). */
std::atomic<int> g_calls{0};
std::atomic<int> g_extra_every{0};
struct ChangingImpl : torch::nn::Module {
  ChangingImpl() : lin(register_module("lin", torch::nn::Linear(16, 16))) {}
  torch::Tensor forward(torch::Tensor x) {
    auto y = torch::tanh(lin(x)) * 3;  // tanh saves its result; the mul can be skipped
    const int n = g_extra_every.load();
    if (n > 0 && ++g_calls % n == 0) y = y + 0;  // an op the record does not have (after the cut)
    return y;
  }
  torch::nn::Linear lin;
};
TORCH_MODULE(Changing);

TEST(CheckpointedSequentialEarlyStop, AStageWhoseOpsChangeRunsInFullAndStaysCorrect) {
  torch::manual_seed(0);
  torch::nn::Sequential seq;
  for (int i = 0; i < 3; ++i) seq->push_back(Changing());
  auto x = torch::randn({4, 16}, torch::requires_grad());
  g_extra_every = 0;
  auto plain = plain_step_grads(seq, x, 1);
  remat::CheckpointedSequential net(seq, remat::SequentialOptions().segments(3));
  std::vector<torch::Tensor> got;
  run(net, seq, x, 1, &got);  // records
  EXPECT_GT(run(net, seq, x, 1, &got).recompute_ops_skipped, 0);
  expect_bitwise_equal(plain, got);
  // Now every call adds an op: the recomputes diverge after the cut point,
  // are run again in full, and their stages are never cut again.
  g_extra_every = 1;
  g_calls = 0;
  auto plain_extra = plain_step_grads(seq, x, 1);
  EXPECT_EQ(run(net, seq, x, 1, &got).recompute_ops_skipped, 0);
  expect_bitwise_equal(plain_extra, got);
  g_extra_every = 0;
  EXPECT_EQ(run(net, seq, x, 1, &got).recompute_ops_skipped, 0);
  expect_bitwise_equal(plain, got);
}

// Early stop never raises the peak: the planned runtime with it peaks no
// higher than checkpoint_sequential on the same placement (also pinned,
// for every strategy, in test_sequential).
TEST(CheckpointedSequentialEarlyStop, PeakUnchanged) {
  remat::memory::enable_tracking();
  auto seq = six_gpt_blocks(4);
  auto x = torch::randn({4, 32, 64}, torch::requires_grad());
  seq->forward(x).sum().backward();
  remat::CheckpointedSequential on(seq, remat::SequentialOptions().segments(6));
  remat::CheckpointedSequential off(seq, remat::SequentialOptions().segments(6).early_stop(false));
  for (int s = 0; s < 2; ++s) {
    on->forward(x).sum().backward();
    off->forward(x).sum().backward();
  }
  EXPECT_GT(on->last_step().recompute_ops_skipped, 0);
  EXPECT_LE(on->last_step().chain_peak_bytes, off->last_step().chain_peak_bytes);
}

}  // namespace

namespace {

// The profiler times each stage's cut recompute (Stage::recompute_ms) where
// early stop applies, and the planner counts it for recomputes right before
// a backward; no time where the stage is never cut or early stop is off.
TEST(CheckpointedSequentialEarlyStop, ProfilerTimesTheCutRecompute) {
  auto seq = six_gpt_blocks(5);
  auto x = torch::randn({2, 16, 64}, torch::requires_grad());
  const auto chain = remat::profile(seq, x);
  for (const auto& s : chain.stages) EXPECT_GE(s.recompute_ms, 0) << s.name;
  for (const auto& s : remat::profile(seq, x, remat::ProfileOptions().recompute(false)).stages) {
    EXPECT_LT(s.recompute_ms, 0) << s.name;
  }
  torch::manual_seed(0);
  torch::nn::Sequential custom;
  for (int i = 0; i < 2; ++i) custom->push_back(CustomStage());
  for (const auto& s : remat::profile(custom, torch::randn({4, 16})).stages) EXPECT_LT(s.recompute_ms, 0) << s.name;

  remat::CheckpointedSequential on(seq, remat::SequentialOptions().segments(6));
  remat::CheckpointedSequential off(seq, remat::SequentialOptions().segments(6).early_stop(false));
  const auto& plan_on = on->plan(x);
  off->plan(x);  // profiles with early stop off: no cut to time
  for (const auto& s : off->chain().stages) EXPECT_LT(s.recompute_ms, 0);
  // The prediction is the simulator's on the profiled chain, cut recomputes included.
  EXPECT_DOUBLE_EQ(plan_on.prediction.time_ms, remat::plan::simulate(on->chain(), plan_on.schedule).time_ms);
  remat::plan::Chain full = on->chain();
  for (auto& s : full.stages) s.recompute_ms = -1;
  double cut = 0;
  for (int i = 0; i + 1 < full.size(); ++i) cut += full.stages[i].forward_ms - on->chain().stages[i].recompute_ms;
  EXPECT_NEAR(remat::plan::simulate(full, plan_on.schedule).time_ms - plan_on.prediction.time_ms, cut, 1e-9);
}

}  // namespace

namespace {

/** A block that keeps its output in a member (a feature tap, a memory
 *  carried to the next step): x + fc2(tanh(fc1(x))), whose last matmul and
 *  add leave nothing that backward reads (early stop produces them). */
struct TapImpl : torch::nn::Module {
  TapImpl()
      : fc1(register_module("fc1", torch::nn::Linear(16, 16))),
        fc2(register_module("fc2", torch::nn::Linear(16, 16))) {}
  torch::Tensor forward(torch::Tensor x) {
    auto y = x + fc2(torch::tanh(fc1(x)));
    last = y.detach();
    return y;
  }
  torch::nn::Linear fc1, fc2;
  torch::Tensor last;
};
TORCH_MODULE(Tap);

/** Keeps its output only once g_keep is set (after the recording run). */
bool g_keep = false;
struct LateTapImpl : TapImpl {
  torch::Tensor forward(torch::Tensor x) {
    auto y = x + fc2(torch::tanh(fc1(x)));
    if (g_keep) last = y.detach();
    return y;
  }
};
TORCH_MODULE(LateTap);

template <class M>
void expect_taps_as_plain(uint64_t seed, const remat::SequentialOptions& opts, int64_t* skipped) {
  auto make = [&] {
    torch::manual_seed(seed);
    torch::nn::Sequential s;
    std::vector<std::shared_ptr<TapImpl>> taps;
    for (int i = 0; i < 4; ++i) {
      M m;
      taps.push_back(m.ptr());
      s->push_back(m);
    }
    return std::make_pair(s, taps);
  };
  g_keep = false;
  auto [plain_seq, plain_taps] = make();
  auto [seq, taps] = make();
  remat::CheckpointedSequential net(seq, opts);
  *skipped = 0;
  for (int step = 0; step < 4; ++step) {
    g_keep = step >= 2;
    auto x = torch::randn({4, 16}, torch::requires_grad());
    plain_seq->forward(x).square().sum().backward();
    net->forward(x).square().sum().backward();
    *skipped += net->last_step().recompute_ops_skipped;
    for (size_t i = 0; i < taps.size(); ++i) {
      ASSERT_EQ(taps[i]->last.defined(), plain_taps[i]->last.defined()) << "step " << step << " stage " << i;
      if (!taps[i]->last.defined()) continue;
      EXPECT_TRUE(torch::equal(taps[i]->last, plain_taps[i]->last))
          << "step " << step << " stage " << i << ": max abs diff "
          << (taps[i]->last - plain_taps[i]->last).abs().max().template item<double>();
    }
    auto pg = plain_seq->parameters(), g = seq->parameters();
    for (size_t k = 0; k < g.size(); ++k) EXPECT_TRUE(torch::equal(g[k].grad(), pg[k].grad())) << k;
  }
}

// Issue item 3: a stage that keeps its output in a member got early stop's
// uninitialized tensors (2.9e35) from the second step on. The recording
// run sees the kept storage outlive the backward: the stage is never cut,
// and every member equals the plain run's bitwise after each step.
TEST(CheckpointedSequentialEarlyStop, AStageThatKeepsItsOutputIsNeverCut) {
  int64_t skipped = -1;
  expect_taps_as_plain<Tap>(7, remat::SequentialOptions().segments(4), &skipped);
  EXPECT_EQ(skipped, 0);
  expect_taps_as_plain<Tap>(7, activations_only().memory_budget_fraction(0.8), &skipped);
  EXPECT_EQ(skipped, 0);
}

// One that starts keeping it only after its recorded recompute: the cut
// run's produced storage outlives the backward, the stage is run once more
// in full (its member then holds a full run's values) and never cut again.
TEST(CheckpointedSequentialEarlyStop, AStageThatStartsKeepingItsOutputLaterGetsAFullRunsValues) {
  int64_t skipped = -1;
  expect_taps_as_plain<LateTap>(8, remat::SequentialOptions().segments(4), &skipped);
  EXPECT_GT(skipped, 0) << "cut before it kept anything";
}

}  // namespace
