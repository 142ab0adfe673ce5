// remat::StepInBackward: the optimizer step inside backward, against the
// plain step (backward, then optimizer.step()). Parameters, optimizer state
// and buffers are compared bitwise after every step, for LibTorch's SGD,
// Adam, AdamW, RMSprop and Adagrad, on the reference GPT's shape (tied
// embedding and head, a block called twice, a frozen and a sometimes-unused
// parameter) under every way remat runs backward; then the state in a store
// (lossless, files, failures), memory, and what is refused.
#include <chrono>
#include <filesystem>
#include <future>
#include <optional>

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>

#include <remat/models/gpt.h>
#include <remat/optim.h>

#include "../src/offload/offload_internal.h"
#include "common.h"

namespace {

using namespace remat_test;
namespace F = torch::nn::functional;

constexpr int kSteps = 4;

/** The state tensors of LibTorch's optimizers (and Adam's step counts as a
 *  tensor), for comparison. */
std::vector<torch::Tensor> state_tensors(torch::optim::Optimizer& opt) {
  using namespace torch::optim;
  std::vector<torch::Tensor> out;
  for (auto& g : opt.param_groups()) {
    for (auto& p : g.params()) {
      auto it = opt.state().find(p.unsafeGetTensorImpl());
      if (it == opt.state().end()) {
        out.push_back(torch::Tensor());
        continue;
      }
      auto* s = it->second.get();
      if (auto* a = dynamic_cast<AdamParamState*>(s)) {
        out.insert(out.end(), {a->exp_avg(), a->exp_avg_sq(), a->max_exp_avg_sq(), torch::tensor(a->step())});
      } else if (auto* w = dynamic_cast<AdamWParamState*>(s)) {
        out.insert(out.end(), {w->exp_avg(), w->exp_avg_sq(), w->max_exp_avg_sq(), torch::tensor(w->step())});
      } else if (auto* m = dynamic_cast<SGDParamState*>(s)) {
        out.push_back(m->momentum_buffer());
      } else if (auto* r = dynamic_cast<RMSpropParamState*>(s)) {
        out.insert(out.end(), {r->square_avg(), r->momentum_buffer(), r->grad_avg(), torch::tensor(r->step())});
      } else if (auto* a2 = dynamic_cast<AdagradParamState*>(s)) {
        out.insert(out.end(), {a2->sum(), torch::tensor(a2->step())});
      }
    }
  }
  return out;
}

std::vector<torch::Tensor> snapshot(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (auto& p : m.parameters()) out.push_back(p.detach().clone());
  for (auto& b : m.buffers()) out.push_back(b.clone());
  return out;
}
std::vector<torch::Tensor> cloned(const std::vector<torch::Tensor>& v) {
  std::vector<torch::Tensor> out;
  for (const auto& t : v) out.push_back(t.defined() ? t.clone() : t);
  return out;
}

enum class Opt { kSgd, kAdam, kAdamW, kRmsprop, kAdagrad };
std::string name_of(Opt o) {
  switch (o) {
    case Opt::kSgd: return "SGD";
    case Opt::kAdam: return "Adam";
    case Opt::kAdamW: return "AdamW";
    case Opt::kRmsprop: return "RMSprop";
    case Opt::kAdagrad: return "Adagrad";
  }
  return "";
}

/** Two groups (weights with weight decay, the rest without), as training
 *  scripts do; every option that changes the math is on. */
std::unique_ptr<torch::optim::Optimizer> make_opt(Opt o, torch::nn::Module& m) {
  using namespace torch::optim;
  std::vector<torch::Tensor> decay, rest;
  for (auto& p : m.parameters()) (p.dim() >= 2 ? decay : rest).push_back(p);
  switch (o) {
    case Opt::kSgd: {
      auto opt = std::make_unique<SGD>(std::vector<OptimizerParamGroup>{OptimizerParamGroup(decay)},
                                       SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(0.01));
      opt->add_param_group(OptimizerParamGroup(rest, std::make_unique<SGDOptions>(SGDOptions(0.1).momentum(0.5))));
      return opt;
    }
    case Opt::kAdam: {
      auto opt = std::make_unique<Adam>(std::vector<OptimizerParamGroup>{OptimizerParamGroup(decay)},
                                        AdamOptions(1e-3).amsgrad(true).weight_decay(0.01));
      opt->add_param_group(OptimizerParamGroup(rest, std::make_unique<AdamOptions>(AdamOptions(2e-3))));
      return opt;
    }
    case Opt::kAdamW: {
      auto opt = std::make_unique<AdamW>(std::vector<OptimizerParamGroup>{OptimizerParamGroup(decay)},
                                         AdamWOptions(1e-3).weight_decay(0.1));
      opt->add_param_group(
          OptimizerParamGroup(rest, std::make_unique<AdamWOptions>(AdamWOptions(1e-3).weight_decay(0.0))));
      return opt;
    }
    case Opt::kRmsprop: {
      auto opt = std::make_unique<RMSprop>(std::vector<OptimizerParamGroup>{OptimizerParamGroup(decay)},
                                           RMSpropOptions(1e-3).momentum(0.9).centered(true).weight_decay(0.01));
      opt->add_param_group(OptimizerParamGroup(rest, std::make_unique<RMSpropOptions>(RMSpropOptions(1e-3))));
      return opt;
    }
    case Opt::kAdagrad: {
      // Adagrad makes its state at construction, so both groups go in there.
      std::vector<OptimizerParamGroup> groups;
      groups.emplace_back(decay);
      groups.emplace_back(rest, std::make_unique<AdagradOptions>(AdagradOptions(2e-2)));
      return std::make_unique<Adagrad>(groups, AdagradOptions(1e-2).lr_decay(0.01).weight_decay(0.01));
    }
  }
  return nullptr;
}

/** How a step runs backward. */
enum class Mode { kPlain, kPerBlock, kSelective, kDiskOffload, kChain, kAccumulate2, kAuto, kAutocast };
std::string name_of(Mode m) {
  switch (m) {
    case Mode::kPlain: return "plain";
    case Mode::kPerBlock: return "per-block checkpoint";
    case Mode::kSelective: return "Megatron policy";
    case Mode::kDiskOffload: return "disk offload";
    case Mode::kChain: return "CheckpointedSequential";
    case Mode::kAccumulate2: return "2 micro-batches";
    case Mode::kAuto: return "auto at its leanest";
    case Mode::kAutocast: return "bf16 autocast";
  }
  return "";
}

/** The reference GPT's shape at a test size: tied embedding and head; block
 *  1 called twice per forward; block 0's first LayerNorm frozen; an
 *  auxiliary projection used on even steps only. */
struct Net {
  remat::models::Gpt gpt{nullptr};
  torch::nn::Linear aux{nullptr};
  std::shared_ptr<torch::nn::Module> root;
  std::optional<remat::CheckpointedSequential> chain;

  explicit Net(Mode mode) {
    torch::manual_seed(7);
    remat::models::GptConfig c;
    c.vocab = 96;
    c.seq_len = 16;
    c.d_model = 32;
    c.heads = 4;
    c.layers = 3;
    root = std::make_shared<torch::nn::Module>();
    gpt = root->register_module("gpt", remat::models::Gpt(c));
    aux = root->register_module("aux", torch::nn::Linear(32, 32));
    for (auto& p : gpt->blocks[0]->named_parameters()) {
      if (p.key().rfind("ln1", 0) == 0) p.value().requires_grad_(false);
    }
    if (mode == Mode::kPerBlock) {
      remat::enable_checkpointing(*gpt, remat::select::type<remat::models::GptBlockImpl>());
    } else if (mode == Mode::kSelective) {
      remat::enable_checkpointing(*gpt, remat::select::type<remat::models::GptBlockImpl>(),
                                  remat::CheckpointOptions().policy(remat::models::megatron_policy()));
    } else if (mode == Mode::kChain) {
      chain.emplace(gpt->blocks, remat::SequentialOptions().memory_budget_fraction(0.8));
    }
  }

  torch::Tensor loss(const torch::Tensor& idx, const torch::Tensor& targets, int step, Mode mode) {
    auto h = gpt->embed(idx);
    if (chain) {
      h = (*chain)->forward(h);
    } else {
      h = gpt->blocks->forward(h);
    }
    h = gpt->blocks[1]->as<remat::models::GptBlock>()->forward(h);  // block 1 again: a second use
    // auto plans the step it profiled: a step that also runs aux would
    // be another step (auto warns of that overrun), so under auto aux runs
    // every step.
    if (step % 2 == 0 || mode == Mode::kAuto) h = h + aux(h);
    return gpt->loss(h, targets);
  }
};

struct Batch {
  torch::Tensor idx, targets;
};
std::vector<Batch> batches(int n) {
  torch::manual_seed(11);
  std::vector<Batch> out;
  for (int k = 0; k < n; ++k) out.push_back({torch::randint(96, {4, 16}), torch::randint(96, {4, 16})});
  return out;
}

/** A tensor's bytes outside LibTorch's allocator: the snapshots of earlier
 *  steps must not count in the peaks that auto measures. */
struct Blob {
  bool defined = false;
  std::vector<int64_t> shape;
  std::vector<char> bytes;
  bool operator==(const Blob&) const = default;
};
std::vector<Blob> blobs(const std::vector<torch::Tensor>& ts) {
  std::vector<Blob> out;
  for (const auto& t : ts) {
    Blob b;
    b.defined = t.defined();
    if (b.defined) {
      const auto c = t.contiguous();
      b.shape = c.sizes().vec();
      const auto* p = static_cast<const char*>(c.data_ptr());
      b.bytes.assign(p, p + c.nbytes());
    }
    out.push_back(std::move(b));
  }
  return out;
}

struct Trained {
  std::vector<std::vector<Blob>> model, state;  // after each step
  remat::StepInBackwardStats stats;
  int64_t auto_peak = 0, auto_budget = 0;  // Mode::kAuto: the last planned step
  // Updates heard inside a node of the graph (a hook) and outside any (the
  // backward's final callback: updates at its end).
  int64_t updates_in_nodes = 0, updates_after_nodes = 0;
};

/** kSteps steps of Net under mode; in_backward: StepInBackward with
 *  options; the optimizer's own step() and zero_grad() follow every
 *  backward either way, as a user's loop keeps them. */
Trained train(Opt o, Mode mode, std::optional<remat::StepInBackwardOptions> in_backward, bool scheduler = false,
              bool set_to_none = true, bool at_end = false) {
  Net net(mode);
  auto opt = make_opt(o, *net.root);
  std::optional<torch::optim::StepLR> sched;
  if (scheduler) sched.emplace(*opt, 1, 0.5);
  std::optional<remat::StepInBackward> sib;
  if (in_backward) sib.emplace(*opt, *in_backward);
  if (sib) sib->update_at_backward_end(at_end);
  auto in_nodes = std::make_shared<std::pair<int64_t, int64_t>>();
  if (sib) {
    sib->on_update([in_nodes](const remat::StepInBackward::UpdateEvent&) {
      (torch::autograd::get_current_node() != nullptr ? in_nodes->first : in_nodes->second)++;
    });
  }
  const auto data = batches(2 * kSteps);
  // auto: step 1 warms up, step 2 is profiled, steps 3 and 4 run its
  // leanest plan (the most recompute).
  std::optional<remat::AutoCheckpoint> planner;
  if (mode == Mode::kAuto) {
    planner.emplace(
        remat::auto_checkpoint(*net.root, remat::AutoOptions().memory_budget_fraction(1.0).profile_repeats(1)));
  }
  Trained r;
  for (int k = 0; k < kSteps; ++k) {
    if (planner && k == 2) planner->replan(planner->leanest_peak_bytes());
    torch::manual_seed(100 + k);
    // aux_step: the step whose parity says whether aux runs (under
    // accumulation: in the first micro-batch only, so that its gradient is
    // left over for the optimizer's step()).
    auto one = [&](const Batch& b, int aux_step) {
      if (mode == Mode::kDiskOffload) {
        torch::Tensor loss;
        {
          remat::OffloadScope scope(remat::OffloadOptions(remat::OffloadTarget::kDisk)
                                        .directory(fresh_dir("optim-activations"))
                                        .min_bytes(0));
          loss = net.loss(b.idx, b.targets, aux_step, mode);
        }
        loss.backward();
      } else if (mode == Mode::kAutocast) {
        torch::Tensor loss;
        {
          at::autocast::set_autocast_enabled(at::kCPU, true);
          at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
          loss = net.loss(b.idx, b.targets, aux_step, mode);
          at::autocast::set_autocast_enabled(at::kCPU, false);
          at::autocast::clear_cache();
        }
        loss.backward();
      } else if (planner) {
        planner->step([&] { net.loss(b.idx, b.targets, aux_step, mode).backward(); });
      } else {
        net.loss(b.idx, b.targets, aux_step, mode).backward();
      }
    };
    if (mode == Mode::kAccumulate2) {
      {
        std::optional<remat::StepInBackward::Accumulating> acc;
        if (sib) acc.emplace(sib->accumulate());
        one(data[2 * k], 0);
      }
      one(data[2 * k + 1], 1);
    } else {
      one(data[k], k);
    }
    opt->step();
    opt->zero_grad(set_to_none);
    if (sched) sched->step();
    r.model.push_back(blobs(snapshot(*net.root)));
    // The state is compared after every step when it stays with the
    // optimizer; from a store, after the last (fetch_state() brings it back,
    // so the steps before run with it in the store throughout).
    const bool stored = in_backward && in_backward->state_offload();
    if (sib && stored && k + 1 == kSteps) sib->fetch_state();
    r.state.push_back(!stored || k + 1 == kSteps ? blobs(state_tensors(*opt)) : std::vector<Blob>());
  }
  if (sib) r.stats = sib->stats();
  r.updates_in_nodes = in_nodes->first;
  r.updates_after_nodes = in_nodes->second;
  if (planner) {
    EXPECT_TRUE(planner->planned());
    // A state store of the user's own is not auto's to bound: what it holds
    // in flight depends on the disk's pace (AutoOptions::optimizer_state_store
    // is the way to plan it; AutoModelState.* test that).
    if (!(in_backward && in_backward->state_offload())) {
      EXPECT_LE(planner->measured_peak_bytes(), planner->budget_bytes() + planner->budget_bytes() / 100)
          << planner->explain();
    }
    r.auto_peak = planner->measured_peak_bytes();
    r.auto_budget = planner->budget_bytes();
  }
  return r;
}

void expect_same(const Trained& a, const Trained& b, const std::string& what) {
  ASSERT_EQ(a.model.size(), b.model.size());
  for (size_t k = 0; k < a.model.size(); ++k) {
    SCOPED_TRACE(what + ", step " + std::to_string(k));
    ASSERT_EQ(a.model[k].size(), b.model[k].size());
    for (size_t i = 0; i < a.model[k].size(); ++i) EXPECT_TRUE(a.model[k][i] == b.model[k][i]) << "tensor " << i;
    if (a.state[k].empty() || b.state[k].empty()) continue;  // a run whose state was in its store then
    ASSERT_EQ(a.state[k].size(), b.state[k].size());
    for (size_t i = 0; i < a.state[k].size(); ++i) EXPECT_TRUE(a.state[k][i] == b.state[k][i]) << "state " << i;
  }
}

class EachOptimizer : public ::testing::TestWithParam<Opt> {};

TEST_P(EachOptimizer, BitwiseThePlainStepWithTiedFrozenTwiceCalledAndSometimesUnusedParameters) {
  const Trained plain = train(GetParam(), Mode::kPlain, std::nullopt);
  const Trained ib = train(GetParam(), Mode::kPlain, remat::StepInBackwardOptions());
  expect_same(plain, ib, name_of(GetParam()));
  // Every trainable parameter each step, aux every other step: the frozen
  // LayerNorm never; tied wte once per step.
  Net probe(Mode::kPlain);
  int64_t trainable = 0;
  for (auto& p : probe.root->parameters()) trainable += p.requires_grad();
  EXPECT_EQ(ib.stats.updates, kSteps * (trainable - 2) + (kSteps / 2) * 2) << "aux (weight, bias) on even steps";
}

TEST_P(EachOptimizer, BitwiseUnderALearningRateScheduler) {
  expect_same(train(GetParam(), Mode::kPlain, std::nullopt, true),
              train(GetParam(), Mode::kPlain, remat::StepInBackwardOptions(), true), name_of(GetParam()));
}

// NOTE [updates at the backward's end]: the same updates, all at the end
// of each backward: bitwise the plain step for each optimizer, with tied,
// frozen, twice-called and sometimes-unused parameters, under a scheduler,
// and with zero_grad(false) and the state on disk.
TEST_P(EachOptimizer, UpdatesAtTheBackwardsEndAreBitwiseThePlainStep) {
  const Trained plain = train(GetParam(), Mode::kPlain, std::nullopt, true);
  const Trained end = train(GetParam(), Mode::kPlain, remat::StepInBackwardOptions(), true, true, /*at_end=*/true);
  expect_same(plain, end, name_of(GetParam()));
  const Trained within = train(GetParam(), Mode::kPlain, remat::StepInBackwardOptions(), true);
  EXPECT_EQ(end.stats.updates, within.stats.updates) << "every update in backward, none left to step()";
  // Where they ran: in each parameter's hook, or after the graph's nodes.
  EXPECT_EQ(within.updates_after_nodes, 0);
  EXPECT_EQ(within.updates_in_nodes, within.stats.updates);
  EXPECT_EQ(end.updates_in_nodes, 0);
  EXPECT_EQ(end.updates_after_nodes, end.stats.updates);
  const std::string dir = fresh_dir("optim-at-end");
  const Trained stored = train(GetParam(), Mode::kPlain,
                               remat::StepInBackwardOptions().zero_grad_set_to_none(false).state_offload(
                                   remat::OffloadOptions(remat::OffloadTarget::kDisk).directory(dir).min_bytes(0)),
                               false, false, true);
  expect_same(train(GetParam(), Mode::kPlain, std::nullopt, false, false), stored,
              name_of(GetParam()) + ", zero_grad(false), state on disk");
  EXPECT_GT(stored.stats.peak_state_offloaded_bytes, 0);
  EXPECT_EQ(files_in(dir), 0u);
}

// NOTE [unreached parameters]: in a loop that calls zero_grad(false), aux
// (used on even steps only) keeps a zeroed gradient on odd steps and step()
// still moves it (momentum, moments, weight decay). With
// zero_grad_set_to_none(false) the step in backward does the same: bitwise.
// It was not updated at all, without a word (Adam: the step-2 loss 49.56
// plain against 22.97 in a new user's run).
TEST_P(EachOptimizer, AZeroGradFalseLoopUpdatesAParameterABackwardDidNotReach) {
  const Trained plain = train(GetParam(), Mode::kPlain, std::nullopt, false, /*set_to_none=*/false);
  const Trained ib =
      train(GetParam(), Mode::kPlain, remat::StepInBackwardOptions().zero_grad_set_to_none(false), false, false);
  expect_same(plain, ib, name_of(GetParam()));
  // With the state in a store: the zeroed gradient's state comes back for step().
  const std::string dir = fresh_dir("optim-unreached");
  const Trained stored = train(GetParam(), Mode::kPlain,
                               remat::StepInBackwardOptions().zero_grad_set_to_none(false).state_offload(
                                   remat::OffloadOptions(remat::OffloadTarget::kDisk).directory(dir).min_bytes(0)),
                               false, false);
  expect_same(plain, stored, name_of(GetParam()) + ", state on disk");
  EXPECT_EQ(files_in(dir), 0u);
}

// The same under accumulation (aux in the first micro-batch on even steps,
// in neither on odd ones) and with auto_checkpoint's own step in backward
// (AutoOptions::zero_grad_set_to_none), aux on even steps only there too.
TEST(StepInBackward, AZeroGradFalseLoopUnderAccumulationAndAutoUpdatesAnUnreachedParameter) {
  expect_same(
      train(Opt::kAdamW, Mode::kAccumulate2, std::nullopt, false, false),
      train(Opt::kAdamW, Mode::kAccumulate2, remat::StepInBackwardOptions().zero_grad_set_to_none(false), false, false),
      "2 micro-batches");
  auto run = [](bool planned) {
    Net net(Mode::kPlain);
    auto opt = make_opt(Opt::kAdam, *net.root);
    std::optional<remat::AutoCheckpoint> planner;
    if (planned) {
      planner.emplace(remat::auto_checkpoint(*net.root, remat::AutoOptions()
                                                            .memory_budget_fraction(1.0)
                                                            .profile_repeats(1)
                                                            .optimizers({opt.get()})
                                                            .zero_grad_set_to_none(false)));
    }
    const auto data = batches(6);
    std::vector<std::vector<Blob>> out;
    for (int k = 0; k < 6; ++k) {
      torch::manual_seed(100 + k);
      auto body = [&] { net.loss(data[k].idx, data[k].targets, k, Mode::kPlain).backward(); };
      if (planner) {
        if (k == 3) planner->replan(planner->leanest_peak_bytes());
        planner->step(body);
      } else {
        body();
      }
      opt->step();
      opt->zero_grad(false);
      out.push_back(blobs(snapshot(*net.root)));
      out.push_back(blobs(state_tensors(*opt)));
    }
    return out;
  };
  const auto plain = run(false), planned = run(true);
  ASSERT_EQ(plain.size(), planned.size());
  for (size_t k = 0; k < plain.size(); ++k) {
    ASSERT_EQ(plain[k].size(), planned[k].size()) << k;
    for (size_t i = 0; i < plain[k].size(); ++i) EXPECT_TRUE(plain[k][i] == planned[k][i]) << k << " " << i;
  }
}

// A CheckpointedSequential hands a stage's parameters a gradient they
// already hold (kept by accumulate(), or a zeroed one) through a nested
// graph task of its own: the end of that task is not the backward's, and
// the parameters updated before it are not unreached (they got a second,
// zero-gradient update). A frozen stage parameter (requires_grad off after
// step 1) keeps its zeroed gradient and moves, as plainly.
TEST(StepInBackward, AChainsNestedDeliveriesAndAFrozenParameterUpdateAsPlainWithZeroGradFalse) {
  auto run = [](bool in_backward, bool at_end) {
    torch::manual_seed(4);
    auto seq = torch::nn::Sequential(torch::nn::Linear(16, 16), torch::nn::Tanh(), torch::nn::Linear(16, 16),
                                     torch::nn::Tanh(), torch::nn::Linear(16, 4));
    torch::optim::Adam opt(seq->parameters(), torch::optim::AdamOptions(1e-2).weight_decay(0.1));
    remat::CheckpointedSequential chain(seq, remat::SequentialOptions().algorithm("sqrt"));
    std::optional<remat::StepInBackward> sib;
    if (in_backward) sib.emplace(opt, remat::StepInBackwardOptions().zero_grad_set_to_none(false));
    if (sib) sib->update_at_backward_end(at_end);
    torch::manual_seed(9);
    std::vector<std::vector<Blob>> out;
    for (int k = 0; k < 4; ++k) {
      if (k == 1) seq[2]->as<torch::nn::Linear>()->weight.requires_grad_(false);  // frozen from step 2
      {
        std::optional<remat::StepInBackward::Accumulating> acc;
        if (sib) acc.emplace(sib->accumulate());
        chain->forward(torch::randn({8, 16})).square().mean().backward();
      }
      chain->forward(torch::randn({8, 16})).square().mean().backward();
      opt.step();
      opt.zero_grad(false);
      out.push_back(blobs(snapshot(*seq)));
      out.push_back(blobs(state_tensors(opt)));
    }
    return out;
  };
  const auto plain = run(false, false);
  for (const bool at_end : {false, true}) {
    SCOPED_TRACE(at_end ? "updates at the backward's end" : "updates as each gradient is final");
    const auto ib = run(true, at_end);
    ASSERT_EQ(plain.size(), ib.size());
    for (size_t k = 0; k < plain.size(); ++k) {
      ASSERT_EQ(plain[k].size(), ib[k].size()) << k;
      for (size_t i = 0; i < plain[k].size(); ++i)
        EXPECT_TRUE(plain[k][i] == ib[k][i]) << "snapshot " << k << " tensor " << i;
    }
  }
}

// Unset, the step in backward acts as zero_grad() (set to none), and the
// first parameter trained before that a backward does not reach says which
// option covers the other style; set either way, it says nothing.
TEST(StepInBackward, AnUnreachedParameterWarnsOnceUnlessTheLoopsStyleIsGiven) {
  struct Capture : c10::WarningHandler {
    std::vector<std::string> got;
    void process(const c10::Warning& warning) override { got.push_back(warning.msg()); }
  };
  for (const std::optional<bool> style : {std::optional<bool>(), std::optional<bool>(true)}) {
    Capture capture;
    Trained ib;
    {
      c10::WarningUtils::WarningHandlerGuard guard(&capture);
      remat::StepInBackwardOptions o;
      if (style) o.zero_grad_set_to_none(*style);
      ib = train(Opt::kSgd, Mode::kPlain, o);
    }
    expect_same(train(Opt::kSgd, Mode::kPlain, std::nullopt), ib, "set to none");
    if (style) {
      EXPECT_TRUE(capture.got.empty()) << capture.got[0];
      continue;
    }
    ASSERT_EQ(capture.got.size(), 1u);
    EXPECT_EQ(capture.got[0],
              "[remat::StepInBackward] parameter #14 (shape [32, 32]) was trained before, and this backward, which "
              "updated others, did not reach it: unless an earlier backward of this step did, it is not updated, as "
              "in a loop that calls zero_grad() (set_to_none). A loop that calls zero_grad(false) keeps its zeroed "
              "gradient and updates it (momentum, weight decay): say which in "
              "StepInBackwardOptions::zero_grad_set_to_none(true or false) (AutoOptions too), which also silences "
              "this.")
        << "aux.weight, on the first odd step";
  }
}

INSTANTIATE_TEST_SUITE_P(Optimizers, EachOptimizer,
                         ::testing::Values(Opt::kSgd, Opt::kAdam, Opt::kAdamW, Opt::kRmsprop, Opt::kAdagrad),
                         [](const auto& info) { return name_of(info.param); });

class EachMode : public ::testing::TestWithParam<Mode> {};

TEST_P(EachMode, AdamWInBackwardIsBitwiseThePlainStep) {
  // The plain reference runs the same mode (checkpointing does not change
  // the math), so each comparison isolates the step in backward.
  const Trained plain = train(Opt::kAdamW, GetParam(), std::nullopt);
  const Trained ib = train(Opt::kAdamW, GetParam(), remat::StepInBackwardOptions());
  expect_same(plain, ib, name_of(GetParam()));
  EXPECT_GT(ib.stats.updates, 0);
  if (GetParam() == Mode::kAuto) {
    // Its profile measured the step with the updates in backward: the
    // gradients it plans around are the ones that live then.
    std::printf(
        "auto at its leanest: plain steps' budget %lld B, peak %lld B; in backward: budget %lld B, peak %lld B\n",
        static_cast<long long>(plain.auto_budget), static_cast<long long>(plain.auto_peak),
        static_cast<long long>(ib.auto_budget), static_cast<long long>(ib.auto_peak));
  }
  if (GetParam() == Mode::kAccumulate2) {
    EXPECT_GT(ib.stats.accumulated, 0);
  }
}

TEST_P(EachMode, AdamWUpdatedAtTheBackwardsEndIsBitwiseThePlainStep) {
  const Trained plain = train(Opt::kAdamW, GetParam(), std::nullopt);
  const Trained end = train(Opt::kAdamW, GetParam(), remat::StepInBackwardOptions(), false, true, /*at_end=*/true);
  expect_same(plain, end, name_of(GetParam()));
  EXPECT_GT(end.stats.updates, 0);
}

TEST_P(EachMode, StateInADiskStoreIsBitwiseKeepingIt) {
  const std::string dir = fresh_dir("optim-state");
  const Trained plain = train(Opt::kAdam, GetParam(), std::nullopt);
  const Trained ib = train(Opt::kAdam, GetParam(),
                           remat::StepInBackwardOptions().state_offload(
                               remat::OffloadOptions(remat::OffloadTarget::kDisk).directory(dir).min_bytes(0)));
  expect_same(plain, ib, name_of(GetParam()));
  EXPECT_GT(ib.stats.peak_state_offloaded_bytes, 0);
  EXPECT_EQ(files_in(dir), 0u) << "the state came back and its files went";
}

INSTANTIATE_TEST_SUITE_P(Modes, EachMode,
                         ::testing::Values(Mode::kPlain, Mode::kPerBlock, Mode::kSelective, Mode::kDiskOffload,
                                           Mode::kChain, Mode::kAccumulate2, Mode::kAuto, Mode::kAutocast),
                         [](const auto& info) {
                           std::string n = name_of(info.param);
                           std::string out;
                           for (char ch : n) out += std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
                           return out;
                         });

/** 8 x Linear(512, 512): 1 MiB of weight gradient each. */
torch::nn::Sequential wide_mlp() {
  torch::manual_seed(3);
  torch::nn::Sequential s;
  for (int i = 0; i < 8; ++i) {
    s->push_back(torch::nn::Linear(512, 512));
    s->push_back(torch::nn::Tanh());
  }
  return s;
}

TEST(StepInBackward, GradientsNeverAllLiveAtOnce) {
  // Counted by remat's allocator counter: the plain step's peak holds all 8
  // MiB of gradients at the end of backward; in backward at most ~2 live.
  remat::memory::enable_tracking();
  auto peak_of = [](bool in_backward, bool at_end = false) {
    auto m = wide_mlp();
    torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.01));
    std::optional<remat::StepInBackward> sib;
    if (in_backward) sib.emplace(opt);
    if (sib) sib->update_at_backward_end(at_end);
    const auto x = torch::randn({8, 512});
    int64_t peak = 0;
    for (int k = 0; k < 2; ++k) {
      remat::memory::reset_peak();
      const int64_t start = remat::memory::current_bytes();
      m->forward(x).square().mean().backward();
      opt.step();
      opt.zero_grad();
      peak = remat::memory::peak_bytes() - start;
    }
    return peak;
  };
  const int64_t plain = peak_of(false), ib = peak_of(true);
  std::printf("peak above the step's start: plain %lld B, in backward %lld B\n", static_cast<long long>(plain),
              static_cast<long long>(ib));
  EXPECT_LE(ib, plain - 5 * (int64_t{1} << 20));
  // Updated at the backward's end, every gradient lives then, as plainly.
  const int64_t end = peak_of(true, true);
  std::printf("updated at the backward's end: %lld B\n", static_cast<long long>(end));
  EXPECT_GE(end, plain - (int64_t{1} << 20));
  EXPECT_LE(end, plain + (int64_t{1} << 20));
}

TEST(StepInBackward, StateOffloadedBetweenStepsLeavesOnlyWhatIsReadAhead) {
  remat::memory::enable_tracking();
  const std::string dir = fresh_dir("optim-state-mem");
  auto resident_after = [&](bool offload) {
    auto m = wide_mlp();
    torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(1e-3));
    remat::StepInBackwardOptions o;
    if (offload) o.state_offload(remat::OffloadOptions(remat::OffloadTarget::kDisk).directory(dir)).state_prefetch(1);
    std::optional<remat::StepInBackward> sib;
    sib.emplace(opt, o);
    const auto x = torch::randn({8, 512});
    for (int k = 0; k < 3; ++k) {
      m->forward(x).square().mean().backward();
      opt.step();
      opt.zero_grad();
    }
    // What the optimizer holds between steps (its state), with the model.
    return remat::memory::current_bytes();
  };
  const int64_t kept = resident_after(false), off = resident_after(true);
  std::printf("between steps: state kept %lld B, offloaded %lld B\n", static_cast<long long>(kept),
              static_cast<long long>(off));
  // Adam's two moments of 8 MiB of weights are 16 MiB; read ahead: at most
  // one parameter's (2 MiB). No write is left: a backward that sent states
  // ends once their writes are done.
  EXPECT_LE(off, kept - 14 * (int64_t{1} << 20));
  EXPECT_EQ(files_in(dir), 0u);
}

// A backward that sent states ends once their writes are done, so the next
// forward holds none of them in flight (auto_checkpoint's plan counts on
// it): with the writers held, the backward does not return until they go.
TEST(StepInBackward, ABackwardThatSentStatesEndsOnceTheirWritesAreDone) {
  const std::string dir = fresh_dir("optim-state-drain");
  auto m = wide_mlp();
  torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(1e-3));
  remat::StepInBackward sib(opt, remat::StepInBackwardOptions()
                                     .state_offload(remat::OffloadOptions(remat::OffloadTarget::kDisk)
                                                        .directory(dir)
                                                        .min_bytes(0)
                                                        .max_inflight_bytes(int64_t{1} << 30))
                                     .state_prefetch(1));
  const auto x = torch::randn({8, 512});
  for (int k = 0; k < 2; ++k) m->forward(x).square().mean().backward();  // the states exist and are stored
  remat::detail::pause_offload_writers(true);
  auto backward = std::async(std::launch::async, [&] { m->forward(x).square().mean().backward(); });
  const bool returned = backward.wait_for(std::chrono::milliseconds(1500)) == std::future_status::ready;
  remat::detail::pause_offload_writers(false);
  backward.get();
  EXPECT_FALSE(returned) << "the backward returned with its state writes pending";
  EXPECT_EQ(sib.stats().updates, 3 * 16);
  EXPECT_EQ(sib.stats().state_write_failures, 0);
  // What the store cost is what backward waited: here at least the 1.5 s
  // the writers were held (less the forward and backward before the wait).
  EXPECT_GE(sib.stats().state_wait_ms, 1000.0);
  // Reading every state back between steps is not a backward's wait.
  const double waited = sib.stats().state_wait_ms;
  sib.fetch_state();
  EXPECT_EQ(sib.stats().state_wait_ms, waited);
}

TEST(StepInBackward, StateReadAheadInTheOrderOfTheLastBackward) {
  const std::string dir = fresh_dir("optim-state-order");
  auto m = wide_mlp();
  torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(1e-3));
  remat::StepInBackward sib(
      opt, remat::StepInBackwardOptions()
               .state_offload(remat::OffloadOptions(remat::OffloadTarget::kDisk).directory(dir).min_bytes(0))
               .state_prefetch(2));
  // Batch 512: each layer's backward (~0.3 GFLOP) outlasts reading the
  // next states (2 MiB each), so a state read ahead is there when needed.
  const auto x = torch::randn({512, 512});
  for (int k = 0; k < 4; ++k) {
    m->forward(x).square().mean().backward();
    // Let the writes and the reads ahead finish, as a forward would.
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  const auto s = sib.stats();
  // Step 1 has no order yet: its 16 states were never stored. Step 2 learns
  // the order (each read when needed); steps 3 and 4 read ahead.
  EXPECT_EQ(s.updates, 4 * 16);
  EXPECT_LE(s.state_misses, 16 + 4) << sib.describe();
}

TEST(StepInBackward, AStateWriteThatFailsKeepsTheStateAndTheStepIsApplied) {
  const std::string dir = fresh_dir("optim-state-wfail");
  const Trained plain = train(Opt::kAdam, Mode::kPlain, std::nullopt);
  remat::detail::inject_offload_write_failure(5);
  const Trained ib = train(Opt::kAdam, Mode::kPlain,
                           remat::StepInBackwardOptions().state_offload(
                               remat::OffloadOptions(remat::OffloadTarget::kDisk).directory(dir).min_bytes(0)));
  remat::detail::inject_offload_write_failure(0);
  expect_same(plain, ib, "a write failed");
  EXPECT_EQ(ib.stats.state_write_failures, 1);
  EXPECT_NE(ib.stats.last_state_error.find("failed"), std::string::npos) << ib.stats.last_state_error;
  EXPECT_EQ(files_in(dir), 0u);
}

TEST(StepInBackward, AStateReadThatFailsStopsBeforeThatParameterAndEachParameterMatchesItsState) {
  // Step 2 reads states back; the 3rd read fails. Every parameter is then
  // either stepped with its state (as plain's step 2) or neither (as plain's
  // step 1), the one whose read failed among the latter; the file is kept,
  // so fetch_state() brings everything back and nothing is lost.
  // With the updates at the backward's end too: the failure stops them
  // there, and the parameters after it keep their gradients for step().
  for (const bool at_end : {false, true}) {
    SCOPED_TRACE(at_end ? "updates at the backward's end" : "updates as each gradient is final");
    const std::string dir = fresh_dir("optim-state-rfail");
    auto m = wide_mlp();
    auto m_ref = wide_mlp();
    torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(1e-3));
    torch::optim::Adam ref(m_ref->parameters(), torch::optim::AdamOptions(1e-3));
    remat::StepInBackward sib(
        opt, remat::StepInBackwardOptions()
                 .state_offload(remat::OffloadOptions(remat::OffloadTarget::kDisk).directory(dir).min_bytes(0))
                 .state_prefetch(0));
    sib.update_at_backward_end(at_end);
    const auto x = torch::randn({8, 512});
    auto step = [&](torch::nn::Sequential& net, torch::optim::Optimizer& o) {
      net->forward(x).square().mean().backward();
      o.step();
      o.zero_grad();
    };
    step(m, opt);
    step(m_ref, ref);
    const auto p1 = snapshot(*m_ref);
    const auto s1 = cloned(state_tensors(ref));
    step(m_ref, ref);
    const auto p2 = snapshot(*m_ref);
    const auto s2 = cloned(state_tensors(ref));

    sib.wait();  // the writes are done: step 2 reads files
    remat::detail::inject_offload_read_failure(3);
    const std::string err = error_of([&] { m->forward(x).square().mean().backward(); });
    remat::detail::inject_offload_read_failure(0);
    // Reads 1 and 2 are the first updated parameter's two moments (no
    // amsgrad); read 3 is the next one's first moment.
    EXPECT_NE(err.find("[remat::StepInBackward] the optimizer state of parameter #"), std::string::npos) << err;
    EXPECT_NE(err.find("cannot be read back from its store"), std::string::npos) << err;
    EXPECT_NE(err.find("Its stored state stays where it is (a file that still exists is kept for another try); 17 "
                       "parameter updates were applied so far, each with its own state."),
              std::string::npos)
        << err;
    sib.fetch_state();
    const auto p_now = snapshot(*m);
    const auto s_now = state_tensors(opt);
    int stepped = 0, not_stepped = 0;
    for (size_t i = 0; i < p_now.size(); ++i) {
      auto same = [&](const std::vector<torch::Tensor>& p, const std::vector<torch::Tensor>& s) {
        if (!torch::equal(p_now[i], p[i])) return false;
        for (size_t k = 4 * i; k < 4 * i + 4; ++k) {
          if (s_now[k].defined() != s[k].defined() || (s[k].defined() && !torch::equal(s_now[k], s[k]))) return false;
        }
        return true;
      };
      if (same(p2, s2)) {
        ++stepped;
      } else if (same(p1, s1)) {
        ++not_stepped;
      } else {
        ADD_FAILURE() << "parameter " << i << " matches neither its step-1 nor its step-2 value with its state";
      }
    }
    EXPECT_EQ(stepped, 1);
    EXPECT_EQ(not_stepped, 15);
    if (at_end) {
      // Every gradient was there and is kept: step() applies the rest of step 2.
      opt.step();
      const auto p_after = snapshot(*m);
      for (size_t i = 0; i < p_after.size(); ++i) EXPECT_TRUE(torch::equal(p_after[i], p2[i])) << i;
    }
    EXPECT_EQ(files_in(dir), 0u);
  }
}

// A leaf that chain stages use without registering it (closures) and that
// the head after the chain uses too: the chain delivers its gradient in
// parts, one per stage, and the head's part comes first. Each part must
// not be taken for the whole: the leaf is left to the optimizer's step(),
// and every other parameter is updated once, bitwise as plain.
TEST(StepInBackward, ALeafChainStagesUseWithoutRegisteringItIsUpdatedOnceWithItsWholeGradient) {
  auto run = [](bool in_backward) {
    torch::manual_seed(5);
    auto w = torch::randn({32, 32}).mul_(0.1).requires_grad_();
    torch::nn::Sequential seq;
    for (int i = 0; i < 2; ++i) {
      seq->push_back(torch::nn::Linear(32, 32));
      seq->push_back(torch::nn::Functional([w](const torch::Tensor& x) { return torch::tanh(x.matmul(w)); }));
    }
    remat::CheckpointedSequential chain(seq, remat::SequentialOptions().segments(2));
    std::vector<torch::Tensor> params = seq->parameters();
    params.push_back(w);
    torch::optim::Adam opt(params, torch::optim::AdamOptions(1e-2));
    std::optional<remat::StepInBackward> sib;
    if (in_backward) sib.emplace(opt);
    for (int k = 0; k < 3; ++k) {
      const auto x = torch::randn({8, 32});
      chain->forward(x).matmul(w).square().mean().backward();
      opt.step();
      opt.zero_grad();
    }
    auto out = cloned(params);
    if (sib) {
      EXPECT_EQ(sib->stats().updates, 3 * 4) << sib->describe();  // the Linear layers' weights and biases
      // w's hook: the head's part, then one part per stage, each kept.
      EXPECT_EQ(sib->stats().deferred, 3 * 3) << sib->describe();
    }
    return out;
  };
  expect_bitwise_equal(run(false), run(true));
}

/** Hands a gradient to `shard` from a final callback queued by its backward,
 *  and calls step_in_backward_now, as FullyShard's end of backward does. */
struct HandOff : torch::autograd::Function<HandOff> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x, const torch::Tensor* shard) {
    ctx->saved_data["shard"] = *shard;  // not an input: no AccumulateGrad of its own
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    torch::Tensor shard = ctx->saved_data["shard"].toTensor();
    torch::Tensor part = torch::ones_like(shard) * g[0].detach().sum();
    torch::autograd::Engine::get_default_engine().queue_callback([shard, part]() mutable {
      torch::NoGradGuard no_grad;
      torch::Tensor& grad = shard.mutable_grad();
      grad = grad.defined() ? grad + part : part;
      remat::detail::step_in_backward_now(shard);
    });
    return {g[0], torch::Tensor()};  // x's, and none for the pointer
  }
};

// NOTE [after the end]: a parameter handed over by a final callback that runs
// after the backward's end (FullyShard's, queued after an ordinary
// parameter's update queued the end) queued a second end, which took every
// parameter updated before it for unreached: with zero_grad(false) they got
// a zero gradient and step() updated them again (Adam's step count 6 after 3
// steps). Bitwise the plain loop, in both zero_grad styles and both places
// of the updates.
TEST(StepInBackward, AGradientHandedOverAfterTheBackwardsEndIsPartOfThatBackward) {
  for (bool set_to_none : {true, false}) {
    for (bool at_end : {false, true}) {
      auto run = [&](bool in_backward) {
        torch::manual_seed(3);
        auto w = torch::randn({6, 6}).requires_grad_();
        auto shard = torch::randn({6}).requires_grad_();
        torch::optim::Adam opt(std::vector<torch::Tensor>{w, shard}, torch::optim::AdamOptions(1e-2));
        std::optional<remat::StepInBackward> sib;
        if (in_backward) {
          sib.emplace(opt, remat::StepInBackwardOptions().zero_grad_set_to_none(set_to_none));
          sib->update_at_backward_end(at_end);
        }
        const auto x = torch::randn({3, 6}).requires_grad_();  // so that HandOff's backward runs
        for (int k = 0; k < 3; ++k) {
          torch::tanh(HandOff::apply(x, &shard).mm(w)).pow(2).sum().backward();
          opt.step();
          opt.zero_grad(set_to_none);
        }
        if (sib) EXPECT_EQ(sib->stats().updates, 6) << sib->describe();
        std::vector<torch::Tensor> out = cloned({w, shard});
        for (const auto& t : state_tensors(opt)) out.push_back(t);
        return out;
      };
      SCOPED_TRACE(std::string(set_to_none ? "zero_grad()" : "zero_grad(false)") + (at_end ? ", at the end" : ""));
      expect_bitwise_equal(run(false), run(true));
    }
  }
}

/** A reentrant region of a user's own: its forward runs without a graph;
 *  its backward runs it again and calls backward inside the node, so the
 *  weight's gradient accumulates in a nested graph task. */
struct Reentrant : torch::autograd::Function<Reentrant> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x, torch::Tensor w) {
    ctx->save_for_backward({x, w});
    torch::NoGradGuard no_grad;
    return torch::tanh(x.mm(w));
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    auto saved = ctx->get_saved_variables();
    auto x = saved[0].detach().requires_grad_();
    torch::Tensor y;
    {
      torch::AutoGradMode on(true);
      y = torch::tanh(x.mm(saved[1]));
    }
    torch::autograd::backward({y}, {g[0]});
    return {x.grad(), torch::Tensor()};
  }
};

// NOTE [backward inside a backward]: a weight used inside a reentrant region
// and outside it got two hook calls in one backward, each with part of its
// gradient, and was updated twice (Adam's step count 6 after 3 steps).
// Refused at the second, naming the remedy; with the updates at the
// backward's end it is bitwise the plain loop.
TEST(StepInBackward, AParameterUpdatedInsideAReentrantBackwardAndReachedAgainIsRefused) {
  auto run = [](int mode) {  // 0 plain, 1 in backward, 2 at the backward's end
    torch::manual_seed(0);
    auto w = torch::randn({6, 6}).mul_(0.5).requires_grad_();
    auto h = torch::randn({6, 6}).mul_(0.5).requires_grad_();
    torch::optim::Adam opt(std::vector<torch::Tensor>{w, h}, torch::optim::AdamOptions(1e-2));
    std::optional<remat::StepInBackward> sib;
    if (mode > 0) sib.emplace(opt);
    if (mode == 2) sib->update_at_backward_end(true);
    for (int k = 0; k < 3; ++k) {
      const auto x = torch::randn({3, 6});
      Reentrant::apply(torch::tanh(x.mm(w)).mm(h), w).pow(2).sum().backward();
      opt.step();
      opt.zero_grad();
    }
    std::vector<torch::Tensor> out = cloned({w, h});
    for (const auto& t : state_tensors(opt)) out.push_back(t);
    return out;
  };
  const std::string error = error_of([&] { run(1); });
  EXPECT_NE(error.find("[remat::StepInBackward] parameter #0 (shape [6, 6]) was updated in a backward run inside a "
                       "node of another backward (graph task "),
            std::string::npos)
      << error;
  EXPECT_NE(error.find("and the backward around it reached it again: that update used only part of its gradient. "
                       "Call update_at_backward_end(true), which updates once the outermost backward ends, or use "
                       "remat::checkpoint (non-reentrant) for that region."),
            std::string::npos)
      << error;
  expect_bitwise_equal(run(0), run(2));
}

// A tensor made without requires_grad has no autograd metadata (FullyShard's
// frozen flat shard, which FullyShard::parameters() lists): LibTorch's
// internal assert fired in the constructor. Now it is hooked like the others;
// frozen, it never moves, and given requires_grad later it is updated in
// backward; bitwise the plain loop.
TEST(StepInBackward, ATensorMadeWithoutRequiresGradIsHookedAndTrainsAsPlain) {
  auto run = [](bool in_backward) {
    torch::manual_seed(2);
    torch::nn::Linear lin(8, 3);
    torch::Tensor extra = torch::zeros({3});  // no autograd metadata
    std::vector<torch::Tensor> params = lin->parameters();
    params.push_back(extra);
    torch::optim::SGD opt(params, torch::optim::SGDOptions(0.1).momentum(0.9));
    std::optional<remat::StepInBackward> sib;
    if (in_backward) sib.emplace(opt);
    std::vector<torch::Tensor> out;
    for (int k = 0; k < 4; ++k) {
      if (k == 2) extra.requires_grad_(true);  // trained from step 3
      (lin(torch::randn({4, 8})) + extra).square().mean().backward();
      opt.step();
      opt.zero_grad();
      for (const auto& p : params) out.push_back(p.detach().clone());
    }
    if (sib) {
      EXPECT_EQ(sib->stats().updates, 2 * 2 + 2 * 3);
    }
    return out;
  };
  const auto plain = run(false), ib = run(true);
  ASSERT_EQ(plain.size(), ib.size());
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(torch::equal(plain[i], ib[i])) << i;
}

TEST(StepInBackward, RefusesWhatCannotWork) {
  auto m = wide_mlp();
  torch::optim::LBFGS lbfgs(m->parameters());
  EXPECT_EQ(error_of([&] { remat::StepInBackward s(lbfgs); }),
            "[remat::StepInBackward] LBFGS cannot step inside backward: its step re-evaluates the whole loss through "
            "a closure. Call its step(closure) after backward.");
  torch::optim::SGD sgd(m->parameters(), torch::optim::SGDOptions(0.1));
  EXPECT_EQ(error_of([&] { remat::StepInBackward s(sgd, remat::StepInBackwardOptions().state_prefetch(-1)); }),
            "[remat::StepInBackward] StepInBackwardOptions::state_prefetch is -1; it must be >= 0 (0 reads each "
            "state when needed).");
  {
    remat::StepInBackward first(sgd);
    torch::optim::SGD again(m->parameters(), torch::optim::SGDOptions(0.1));
    EXPECT_EQ(error_of([&] { remat::StepInBackward s(again); }),
              "[remat::StepInBackward] parameter #0 (shape [512, 512]) already has a post-accumulate-grad hook "
              "(another StepInBackward on the same parameters?); one StepInBackward per parameter.");
    EXPECT_TRUE(remat::StepInBackward::steps_in_backward(m->parameters()[0]));
  }
  EXPECT_FALSE(remat::StepInBackward::steps_in_backward(m->parameters()[0]));
  { remat::StepInBackward fine(sgd); }  // the first one gave its hooks back
  // A parameter listed twice (a tied weight, once per module that registers it).
  auto params = m->parameters();
  params.push_back(params[2]);
  torch::optim::SGD listed_twice(params, torch::optim::SGDOptions(0.1));
  EXPECT_EQ(error_of([&] { remat::StepInBackward s(listed_twice); }),
            "[remat::StepInBackward] parameter #" + std::to_string(params.size() - 1) +
                " (shape [512, 512]) is listed twice in the optimizer's param groups (model->parameters() lists a "
                "parameter that two modules register, such as a tied weight, once per module); give each parameter "
                "to the optimizer once.");
}

TEST(StepInBackward, StoresThatCannotHoldStateAreRefused) {
  auto m = wide_mlp();
  torch::optim::Adam opt(m->parameters());
  EXPECT_EQ(error_of([&] {
              remat::StepInBackward s(opt, remat::StepInBackwardOptions().state_offload(
                                               remat::OffloadOptions(remat::OffloadTarget::kMemory)));
            }),
            "[remat::StepInBackward] state_offload to OffloadTarget::kMemory without a codec keeps every byte where "
            "it was. Give a codec (Codec::kBFloat16 halves the state), or OffloadTarget::kDisk.");
  EXPECT_EQ(error_of([&] {
              remat::StepInBackward s(
                  opt, remat::StepInBackwardOptions().state_offload(
                           remat::OffloadOptions(remat::OffloadTarget::kMemory).codec(remat::Codec::kFloat8)));
            }),
            "[remat::StepInBackward] state_offload with Codec::kFloat8: one scale per tensor flushes the small values "
            "of Adam's second moment to zero and the updates blow up. Use Codec::kInt8Block (a scale per 256 values), "
            "Codec::kBFloat16, or a lossless store.");
}

TEST(StepInBackward, ACreateGraphBackwardIsRefusedBeforeAnythingChanges) {
  auto m = wide_mlp();
  torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.1));
  remat::StepInBackward sib(opt);
  const auto before = snapshot(*m);
  const auto x = torch::randn({8, 512});
  const std::string err = error_of([&] {
    auto loss = m->forward(x).square().mean();
    torch::autograd::backward({loss}, {}, /*retain_graph=*/true, /*create_graph=*/true);
  });
  EXPECT_NE(err.find("[remat::StepInBackward] a backward with create_graph (higher-order gradients) reached a "
                     "parameter that is updated in backward"),
            std::string::npos)
      << err;
  expect_bitwise_equal(before, snapshot(*m));
  EXPECT_EQ(sib.stats().updates, 0);
  // A create_graph gradient holds its graph, which holds the parameter: the
  // cycle LibTorch warns of, broken here.
  for (auto& p : m->parameters()) p.mutable_grad() = torch::Tensor();
}

TEST(StepInBackward, AnUnknownOptimizersStateNeedsItsTensorsNamed) {
  struct Plain : torch::optim::Optimizer {
    explicit Plain(std::vector<torch::Tensor> p)
        : Optimizer(std::move(p), std::make_unique<torch::optim::SGDOptions>(0.1)) {}
    torch::Tensor step(LossClosure) override { return {}; }
  };
  auto m = wide_mlp();
  Plain opt(m->parameters());
  EXPECT_EQ(error_of([&] {
              remat::StepInBackward s(
                  opt, remat::StepInBackwardOptions().state_offload(
                           remat::OffloadOptions(remat::OffloadTarget::kMemory).codec(remat::Codec::kBFloat16)));
            }),
            "[remat::StepInBackward] state_offload: remat knows the state of LibTorch's SGD, Adam, AdamW, RMSprop "
            "and Adagrad, not of this optimizer. Pass StepInBackwardOptions::state_tensors(fn) returning the "
            "tensors of its per-parameter state.");
}

}  // namespace

// A kMemory codec keeps its encoding in memory: state_offloaded_bytes (and
// auto's optimizer_state_in_store_bytes) count only the bytes it saved, the
// drop in this process's memory when the state goes to the store. Counting
// the whole state moved remat-train's auto budget (the step's start counts
// the stored state as kept) by the encoding at every move, and its plans
// alternated step after step between the state kept and stored.
TEST(StepInBackward, ACompressedStoreCountsTheBytesItSaved) {
  for (auto codec : {remat::Codec::kInt8Block, remat::Codec::kBFloat16}) {
    auto m = wide_mlp();
    torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(1e-3));
    remat::StepInBackward sib(opt, remat::StepInBackwardOptions().state_offload(
                                       remat::OffloadOptions(remat::OffloadTarget::kMemory).codec(codec).min_bytes(0)));
    const auto x = torch::randn({8, 512});
    remat::memory::enable_tracking();
    for (int k = 0; k < 2; ++k) m->forward(x).square().mean().backward();
    sib.fetch_state();
    int64_t state = 0;
    for (auto& [key, s] : opt.state()) {
      auto& a = static_cast<torch::optim::AdamParamState&>(*s);
      state += static_cast<int64_t>(a.exp_avg().nbytes() + a.exp_avg_sq().nbytes());
    }
    const int64_t kept = remat::memory::current_bytes();
    m->forward(x).square().mean().backward();  // each state goes to the store after its update
    const int64_t stored = remat::memory::current_bytes();
    EXPECT_GT(kept - stored, state / 3) << "the store saved memory";
    EXPECT_EQ(sib.stats().state_offloaded_bytes, kept - stored);
    EXPECT_EQ(sib.state_bytes_per_group()[0], state) << "a group's state, wherever it lives";
    EXPECT_EQ(sib.stats().state_held_in_store_bytes, state - (kept - stored)) << "the encoding, in memory";
    EXPECT_LT(sib.stats().state_held_in_store_bytes, state * 2 / 3);
    sib.fetch_state();
    EXPECT_EQ(sib.stats().state_held_in_store_bytes, 0) << "every state back with the optimizer";
    EXPECT_EQ(sib.stats().state_offloaded_bytes, 0);
  }
}

// NOTE [saving stored state]: torch::save(optimizer) while the states are
// in the store writes them as they are there (it wrote None in their place,
// a checkpoint that cannot resume: "Expected a proper Tensor but got None"
// at the first step after loading); they stay in the store. For each of
// LibTorch's optimizers, what a fresh optimizer loads is bitwise the state
// fetch_state() brings back. A read that fails throws from torch::save,
// naming the parameter, and writes nothing.
TEST(StepInBackward, SavingTheOptimizerWritesTheStateInTheStore) {
  namespace fs = std::filesystem;
  for (Opt o : {Opt::kSgd, Opt::kAdam, Opt::kAdamW, Opt::kRmsprop, Opt::kAdagrad}) {
    SCOPED_TRACE(name_of(o));
    const std::string dir = fresh_dir("optim-save-" + name_of(o));
    const std::string path = dir + ".pt";  // beside the store's folder
    fs::remove(path);
    torch::manual_seed(0);
    auto m = wide_mlp();
    auto opt = make_opt(o, *m);
    remat::StepInBackward sib(*opt,
                              remat::StepInBackwardOptions().state_offload(
                                  remat::OffloadOptions(remat::OffloadTarget::kDisk).directory(dir).min_bytes(0)));
    const auto x = torch::randn({8, 512});
    for (int k = 0; k < 2; ++k) m->forward(x).square().mean().backward();
    const int64_t stored = sib.stats().state_offloaded_bytes;
    ASSERT_GT(stored, 0);
    torch::save(*opt, path);
    EXPECT_EQ(sib.stats().state_offloaded_bytes, stored) << "the state stays in the store";
    auto m2 = wide_mlp();
    auto loaded = make_opt(o, *m2);
    torch::load(*loaded, path);
    sib.fetch_state();
    const auto want = state_tensors(*opt), got = state_tensors(*loaded);
    ASSERT_EQ(want.size(), got.size());
    int compared = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_EQ(want[i].defined(), got[i].defined()) << "tensor " << i;
      if (!want[i].defined()) continue;
      EXPECT_TRUE(torch::equal(want[i], got[i])) << "tensor " << i;
      ++compared;
    }
    EXPECT_GT(compared, 0);
    fs::remove(path);
  }
  // A second StepInBackward on the same optimizer, after the first is
  // gone: the swapped state objects are its now (they pointed at the first
  // one, and the save wrote None again).
  {
    const std::string dir = fresh_dir("optim-save-second");
    const std::string path = dir + ".pt";
    torch::manual_seed(0);
    auto m = wide_mlp();
    torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(1e-3));
    const auto options = remat::StepInBackwardOptions().state_offload(
        remat::OffloadOptions(remat::OffloadTarget::kDisk).directory(dir).min_bytes(0));
    const auto x = torch::randn({8, 512});
    {
      remat::StepInBackward first(opt, options);
      for (int k = 0; k < 2; ++k) m->forward(x).square().mean().backward();
    }
    remat::StepInBackward second(opt, options);
    m->forward(x).square().mean().backward();
    ASSERT_GT(second.stats().state_offloaded_bytes, 0);
    torch::save(opt, path);
    auto m2 = wide_mlp();
    torch::optim::Adam loaded(m2->parameters(), torch::optim::AdamOptions(1e-3));
    torch::load(loaded, path);
    second.fetch_state();
    const auto want = state_tensors(opt), got = state_tensors(loaded);
    ASSERT_EQ(want.size(), got.size());
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_EQ(want[i].defined(), got[i].defined()) << "tensor " << i;
      if (want[i].defined()) {
        EXPECT_TRUE(torch::equal(want[i], got[i])) << "tensor " << i;
      }
    }
    std::filesystem::remove(path);
  }
  // The store's files gone (as a full disk or a cleaner would leave it).
  const std::string dir = fresh_dir("optim-save-failed");
  const std::string path = dir + ".pt";
  fs::remove(path);
  auto m = wide_mlp();
  torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(1e-3));
  {
    remat::StepInBackward sib(opt, remat::StepInBackwardOptions().state_offload(
                                       remat::OffloadOptions(remat::OffloadTarget::kDisk).directory(dir).min_bytes(0)));
    const auto x = torch::randn({8, 512});
    for (int k = 0; k < 2; ++k) m->forward(x).square().mean().backward();
    for (const auto& f : fs::directory_iterator(dir)) fs::remove(f.path());
    try {
      torch::save(opt, path);
      FAIL() << "expected an error";
    } catch (const remat::Error& e) {
      const std::string what = e.what();
      EXPECT_EQ(what.rfind("[remat::StepInBackward] saving the optimizer: the state of parameter #", 0), 0u) << what;
      EXPECT_NE(what.find("Nothing was written, and the state is left where it was."), std::string::npos) << what;
    }
    EXPECT_FALSE(fs::exists(path)) << "nothing written";
    try {
      sib.fetch_state();
    } catch (const remat::Error&) {  // the files are gone: the states cannot come back
    }
  }
}
