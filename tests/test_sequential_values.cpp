// CheckpointedSequential beyond one Sequential of tensor-to-tensor modules:
// a chain over several Sequentials (a ResNet's layers)
// that stay registered in their model, and stages that take and return a
// vector or tuple of tensors (hidden state and a mask, a skip tensor).
// Gradients are compared bitwise against the plain run under every kind of
// schedule; the profiler's byte counts against the tensors at each boundary.
#include "common.h"

#include <optional>
#include <tuple>

#include <remat/plan/plan.h>
#include <remat/sequential.h>

using namespace remat_test;
using torch::Tensor;

namespace {

/** Fixed schedules, and the optimal one at a budget a quarter of the way
 *  from the smallest feasible peak to the plain one (of `chain`). */
std::vector<remat::SequentialOptions> schedules(const remat::plan::Chain& chain) {
  const int64_t top = remat::plan::store_all(chain).prediction.peak_bytes;
  const int64_t low = remat::plan::min_feasible_peak_bytes(chain);
  return {remat::SequentialOptions().algorithm("store-all"), remat::SequentialOptions().algorithm("sqrt"),
          remat::SequentialOptions().segments(3), remat::SequentialOptions().algorithm("revolve:2"),
          activations_only().memory_budget_bytes(low + (top - low) / 4)};
}

// ---- several Sequentials ----

/** A ResNet-like model whose body is three registered Sequentials. */
struct LayeredImpl : torch::nn::Module {
  explicit LayeredImpl(uint64_t seed) {
    torch::manual_seed(seed);
    layer1 = register_module("layer1", torch::nn::Sequential(ResBlock(8), ResBlock(8)));
    layer2 = register_module(
        "layer2", torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 16, 3).stride(2).padding(1)),
                                        ResBlock(16)));
    layer3 = register_module("layer3", torch::nn::Sequential(ResBlock(16), ResBlock(16)));
    head = register_module("head", torch::nn::Linear(16, 10));
  }
  Tensor forward(const Tensor& x) {
    Tensor h = ck.is_empty() ? layer3->forward(layer2->forward(layer1->forward(x))) : ck->forward(x);
    return head(h.mean({2, 3}));
  }
  torch::nn::Sequential layer1{nullptr}, layer2{nullptr}, layer3{nullptr};
  torch::nn::Linear head{nullptr};
  remat::CheckpointedSequential ck{nullptr};  // not registered: the layers are
};
TORCH_MODULE(Layered);

std::vector<Tensor> model_grads(torch::nn::Module& m, Tensor x, const std::function<Tensor(Tensor)>& run) {
  zero_grads(m, x);
  run(x).square().mean().backward();
  return grads_of(m, x);
}

TEST(CheckpointedSequentialParts, SeveralSequentialsPlanAsOneChainBitwise) {
  auto x = torch::randn({4, 8, 12, 12}, torch::requires_grad());
  const auto chain =
      remat::profile(torch::nn::Sequential(ResBlock(8), ResBlock(8),
                                           torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 16, 3).stride(2).padding(1)),
                                           ResBlock(16), ResBlock(16), ResBlock(16)),
                     x);
  for (auto& opts : schedules(chain)) {
    Layered plain(1), ck(1);
    const auto names = ck->named_parameters().keys();
    ck->ck = remat::CheckpointedSequential({ck->layer1, ck->layer2, ck->layer3}, opts);
    auto want = model_grads(*plain, x, [&](Tensor h) { return plain->forward(h); });
    auto got = model_grads(*ck, x, [&](Tensor h) { return ck->forward(h); });
    SCOPED_TRACE(ck->ck->plan().algorithm);
    expect_bitwise_equal(want, got);
    // BatchNorm statistics moved once, as in the plain step.
    auto bp = plain->buffers(), bc = ck->buffers();
    ASSERT_EQ(bp.size(), bc.size());
    for (size_t i = 0; i < bp.size(); ++i) EXPECT_TRUE(torch::equal(bp[i], bc[i])) << "buffer " << i;
    // One chain of 6 stages: the layers' modules, in order.
    EXPECT_EQ(ck->ck->chain().stages.size(), 6u);
    EXPECT_EQ(ck->ck->last_step().forwards_per_stage, ck->ck->plan().prediction.forwards_per_stage);
    // The layers keep their registration and names; the chain adds none.
    EXPECT_EQ(ck->named_parameters().keys(), names);
    EXPECT_TRUE(ck->ck->parameters().empty());
  }
}

TEST(CheckpointedSequentialParts, RegisteringTheChainDuplicatesNothingAndTheOptimizerSteps) {
  Layered plain(2), ck(2);
  const auto names = ck->named_parameters().keys();
  torch::optim::Adam opt_plain(plain->parameters(), 1e-2), opt_ck(ck->parameters(), 1e-2);
  ck->ck = ck->register_module("ck", remat::CheckpointedSequential({ck->layer1, ck->layer2, ck->layer3},
                                                                   remat::SequentialOptions().segments(2)));
  EXPECT_EQ(ck->named_parameters().keys(), names) << "registered or not, each parameter once";
  torch::manual_seed(3);
  auto x = torch::randn({4, 8, 12, 12});
  for (int step = 0; step < 2; ++step) {
    for (auto* m : {plain.get(), ck.get()}) {
      auto& opt = m == plain.get() ? opt_plain : opt_ck;
      opt.zero_grad();
      m->forward(x).square().mean().backward();
      opt.step();
    }
  }
  auto ps = plain->parameters(), cs = ck->parameters();
  ASSERT_EQ(ps.size(), cs.size());
  for (size_t i = 0; i < ps.size(); ++i) EXPECT_TRUE(torch::equal(ps[i], cs[i])) << names[i];
  // eval() on the model reaches the layers; the plan follows their mode.
  ck->eval();
  for (auto& m : ck->layer2->modules(false)) EXPECT_FALSE(m->is_training());
}

TEST(CheckpointedSequentialParts, Errors) {
  Layered m(4);
  EXPECT_EQ(error_of([] { remat::CheckpointedSequential(std::vector<torch::nn::Sequential>{}, {}); }),
            "[remat::CheckpointedSequential] no modules given; pass the Sequentials of the chain in order.");
  EXPECT_EQ(error_of([&] {
              remat::CheckpointedSequential({m->layer1, torch::nn::Sequential(nullptr)}, {});
            }),
            "[remat::CheckpointedSequential] part 1 is a null Sequential; construct it before building the chain.");
  EXPECT_EQ(error_of([] {
              remat::CheckpointedSequential({torch::nn::Sequential(), torch::nn::Sequential()}, {});
            }),
            "[remat::CheckpointedSequential] the Sequential is empty; add modules before wrapping it.");
  remat::CheckpointedSequential ck({m->layer1, m->layer2}, remat::SequentialOptions());
  EXPECT_EQ(error_of([&] { ck->clone(); }),
            "[remat::CheckpointedSequential] a chain over several modules does not own them and cannot be cloned; "
            "clone the model that registers them, then build a new CheckpointedSequential over the clone's "
            "modules.");
}

// ---- several tensors at a boundary ----

/** {x, mask} -> (h, mask): a projection that zeroes padded positions. */
struct EmbedImpl : torch::nn::Module {
  explicit EmbedImpl(int64_t d) : lin(register_module("lin", torch::nn::Linear(d, d))) {}
  std::tuple<Tensor, Tensor> forward(std::vector<Tensor> in) {
    return {lin(in[0]).masked_fill(in[1].logical_not().unsqueeze(-1), 0.0), in[1]};
  }
  torch::nn::Linear lin;
};
TORCH_MODULE(Embed);

/** (h, mask) -> (h + mask * drop(mlp(ln(h))), mask). */
struct MaskedBlockImpl : torch::nn::Module {
  MaskedBlockImpl(int64_t d, double p)
      : ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        fc(register_module("fc", torch::nn::Linear(d, 2 * d))),
        out(register_module("out", torch::nn::Linear(2 * d, d))),
        drop(register_module("drop", torch::nn::Dropout(p))) {}
  std::tuple<Tensor, Tensor> forward(std::tuple<Tensor, Tensor> in) {
    auto [h, mask] = in;
    auto y = drop(out(torch::gelu(fc(ln(h))))) * mask.unsqueeze(-1);
    return {h + y, mask};
  }
  torch::nn::LayerNorm ln;
  torch::nn::Linear fc, out;
  torch::nn::Dropout drop;
};
TORCH_MODULE(MaskedBlock);

/** (h, mask) -> {tanh(lin(h)), skip = h, mask}: opens a skip connection. */
struct SkipOpenImpl : torch::nn::Module {
  explicit SkipOpenImpl(int64_t d) : lin(register_module("lin", torch::nn::Linear(d, d))) {}
  std::vector<Tensor> forward(std::tuple<Tensor, Tensor> in) {
    auto [h, mask] = in;
    return {torch::tanh(lin(h)), h, mask};
  }
  torch::nn::Linear lin;
};
TORCH_MODULE(SkipOpen);

/** {h, skip, mask} -> {h', skip, mask}: passes the skip and mask on as they are. */
struct SkipBlockImpl : torch::nn::Module {
  explicit SkipBlockImpl(int64_t d) : lin(register_module("lin", torch::nn::Linear(d, d))) {}
  std::vector<Tensor> forward(std::vector<Tensor> in) { return {torch::gelu(lin(in[0])) + in[0], in[1], in[2]}; }
  torch::nn::Linear lin;
};
TORCH_MODULE(SkipBlock);

/** {h, skip, mask} -> (h + skip) * mask. */
struct SkipCloseImpl : torch::nn::Module {
  Tensor forward(std::vector<Tensor> in) { return (in[0] + in[1]) * in[2].unsqueeze(-1); }
};
TORCH_MODULE(SkipClose);

/** vector -> tuple -> tuple -> tuple -> vector of 3 -> vector of 3 -> vector
 *  of 3 -> tensor, with dropout, a bool mask all along and a skip tensor
 *  passed through two stages unchanged. */
torch::nn::Sequential masked_chain(int64_t d, double p, uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(Embed(d), MaskedBlock(d, p), MaskedBlock(d, p), SkipOpen(d), SkipBlock(d), SkipBlock(d),
                               SkipClose());
}

struct Batch {
  Tensor x, mask;
};

Batch batch(int64_t b, int64_t t, int64_t d) {
  torch::manual_seed(11);
  Batch out{torch::randn({b, t, d}, torch::requires_grad()), torch::rand({b, t}) > 0.3};
  return out;
}

std::vector<Tensor> chain_grads(torch::nn::Sequential& seq, Batch& in, uint64_t rng_seed,
                                const std::function<Tensor(const std::vector<Tensor>&)>& run) {
  torch::manual_seed(rng_seed);
  return step_grads(*seq, in.x, [&](Tensor x) { return run({x, in.mask}); });
}

Tensor plain_run(torch::nn::Sequential& seq, const std::vector<Tensor>& xs) {
  return seq->forward<Tensor>(std::vector<Tensor>(xs));
}

TEST(CheckpointedSequentialValues, TupleAndVectorStagesBitwiseUnderEverySchedule) {
  auto seq = masked_chain(32, 0.2, 5);
  auto in = batch(4, 16, 32);
  auto want = chain_grads(seq, in, 7, [&](const std::vector<Tensor>& xs) { return plain_run(seq, xs); });
  bool recomputed = false;
  for (auto& opts : schedules(remat::profile(seq, std::vector<Tensor>{in.x, in.mask}))) {
    remat::CheckpointedSequential net(seq, opts);
    auto got = chain_grads(seq, in, 7, [&](const std::vector<Tensor>& xs) {
      auto ys = net->forward_values(xs);
      EXPECT_EQ(ys.size(), 1u);
      return ys[0];
    });
    SCOPED_TRACE(net->plan().algorithm);
    expect_bitwise_equal(want, got);
    EXPECT_EQ(net->last_step().forwards_per_stage, net->plan().prediction.forwards_per_stage);
    for (int f : net->plan().prediction.forwards_per_stage) recomputed |= f > 1;
  }
  EXPECT_TRUE(recomputed) << "some schedule must recompute a stage with tuple inputs";
}

TEST(CheckpointedSequentialValues, PlannerCountsEveryTensorAtABoundary) {
  const int64_t b = 4, t = 16, d = 32;
  auto seq = masked_chain(d, 0.0, 5);
  auto in = batch(b, t, d);
  auto chain = remat::profile(seq, std::vector<Tensor>{in.x, in.mask});
  ASSERT_EQ(chain.stages.size(), 7u);
  const int64_t h = b * t * d * 4;  // one float32 hidden state, bytes
  EXPECT_EQ(chain.input_bytes, h + b * t) << "x and the bool mask";
  // The mask comes from the input (counted there, once); the skip tensor is
  // the hidden state SkipOpen received: kept alive by every boundary after.
  EXPECT_EQ(chain.stages[0].output_bytes, h);
  EXPECT_EQ(chain.stages[2].output_bytes, h);
  EXPECT_EQ(chain.stages[3].output_bytes, 2 * h) << "new hidden state and the skip";
  EXPECT_EQ(chain.stages[4].output_bytes, 2 * h);
  EXPECT_EQ(chain.stages[6].output_bytes, h);
  // The same through the wrapper, which also measures the step.
  remat::CheckpointedSequential net(seq, activations_only().algorithm("store-all"));
  auto loss = net->forward_values({in.x, in.mask})[0].square().mean();  // the output dies here, as modeled
  loss.backward();
  EXPECT_EQ(net->chain().stages[3].output_bytes, 2 * h);
  // The skip SkipOpen passes on is its input's storage (shared_input_bytes),
  // and so on through both SkipBlocks: counted once while two boundaries
  // holding it are live. The mask is the chain input's. The gradient at
  // each boundary: the hidden state's and the skip's, not the mask's.
  for (int i : {0, 1, 2, 6}) EXPECT_EQ(net->chain().stages[i].shared_input_bytes, 0) << i;
  for (int i : {3, 4, 5}) EXPECT_EQ(net->chain().stages[i].shared_input_bytes, h) << i;
  for (int i : {0, 1, 2, 6}) EXPECT_EQ(net->chain().stages[i].grad_bytes(), h) << i;
  for (int i : {3, 4, 5}) EXPECT_EQ(net->chain().stages[i].grad_bytes(), 2 * h) << i;
  // The forward phase op by op, exact (the skip was counted in every
  // boundary holding it: 24 KiB high by the last forward_save).
  const auto& ops = net->plan().schedule.ops;
  for (size_t k = 0; k < ops.size() && ops[k].kind == remat::plan::OpKind::kForwardSave; ++k)
    EXPECT_EQ(net->last_step().op_peak_bytes[k], net->plan().prediction.op_bytes[k]) << k;
  // The chain's own peak (the head outside it is not in the budget): 0.935
  // of the prediction, low on the safe side: a backward that passes the
  // skip's gradient on unchanged is priced as if it wrote a new one (one h
  // at backward(5), the peak op). Never more than 2% above it.
  const double ratio =
      static_cast<double>(net->last_step().chain_peak_bytes) / static_cast<double>(net->plan().prediction.peak_bytes);
  EXPECT_GT(ratio, 0.9) << net->explain();
  EXPECT_LT(ratio, 1.02) << net->explain();
}

TEST(CheckpointedSequentialValues, AutogradGradRetainGraphAndCreateGraph) {
  auto seq = masked_chain(16, 0.0, 6);
  auto in = batch(2, 8, 16);
  remat::CheckpointedSequential net(seq, remat::SequentialOptions().algorithm("revolve:2"));
  auto p = seq->parameters()[0];  // Embed's weight
  // autograd::grad for x and one parameter only: nothing accumulates.
  auto plain_loss = plain_run(seq, {in.x, in.mask}).square().sum();
  auto want = torch::autograd::grad({plain_loss}, {in.x, p});
  auto loss = net->forward_values({in.x, in.mask})[0].square().sum();
  auto got = torch::autograd::grad({loss}, {in.x, p}, {}, /*retain_graph=*/true);
  expect_bitwise_equal(want, got);
  for (auto& q : seq->parameters()) EXPECT_FALSE(q.grad().defined());
  // The kept graph answers a second time, the same.
  auto again = torch::autograd::grad({loss}, {in.x, p});
  expect_bitwise_equal(want, again);
  // create_graph: a gradient penalty through the tuple chain.
  auto penalty = [&](const Tensor& out) {
    auto gx = torch::autograd::grad({out.square().sum()}, {in.x}, {}, true, /*create_graph=*/true)[0];
    return gx.square().sum();
  };
  zero_grads(*seq, in.x);
  penalty(plain_run(seq, {in.x, in.mask})).backward();
  auto want2 = grads_of(*seq, in.x);
  zero_grads(*seq, in.x);
  penalty(net->forward_values({in.x, in.mask})[0]).backward();
  auto got2 = grads_of(*seq, in.x);
  // Second-order terms are summed in another order (the chain is
  // recomputed as a whole): equal up to rounding, as in test_sequential.
  ASSERT_EQ(want2.size(), got2.size());
  for (size_t i = 0; i < want2.size(); ++i) {
    ASSERT_TRUE(got2[i].defined()) << i;
    EXPECT_TRUE(torch::allclose(want2[i], got2[i], 1e-4, 1e-6))
        << "gradient " << i << " max diff " << (want2[i] - got2[i]).abs().max().item<double>() << " of "
        << want2[i].abs().max().item<double>();
  }
}

TEST(CheckpointedSequentialValues, TensorChainWithTupleBoundariesThroughForward) {
  // forward(x) serves a chain that starts and ends with one tensor and
  // passes a tuple in between.
  struct Split : torch::nn::Module {
    std::tuple<Tensor, Tensor> forward(Tensor x) { return {torch::tanh(x), x * 2}; }
  };
  struct Join : torch::nn::Module {
    torch::nn::Linear lin{nullptr};
    Join() : lin(register_module("lin", torch::nn::Linear(16, 16))) {}
    Tensor forward(std::tuple<Tensor, Tensor> in) { return lin(std::get<0>(in)) * std::get<1>(in); }
  };
  torch::manual_seed(2);
  torch::nn::Sequential seq(torch::nn::Linear(16, 16), Split(), Join(), torch::nn::Linear(16, 16));
  auto x = torch::randn({8, 16}, torch::requires_grad());
  auto want = step_grads(*seq, x, [&](Tensor h) { return seq->forward(h); });
  for (auto& opts : schedules(remat::profile(seq, x))) {
    remat::CheckpointedSequential net(seq, opts);
    auto got = step_grads(*seq, x, [&](Tensor h) { return net->forward(h); });
    SCOPED_TRACE(net->plan().algorithm);
    expect_bitwise_equal(want, got);
  }
}

struct PairImpl : torch::nn::Module {
  std::tuple<Tensor, Tensor> forward(Tensor x) { return {x, x}; }
};
TORCH_MODULE(Pair);

struct CountImpl : torch::nn::Module {
  int64_t forward(Tensor x) { return x.size(0); }
};
TORCH_MODULE(Count);

/** Asserts the message contains every piece, in order. */
void expect_message(const std::string& got, const std::vector<std::string>& pieces) {
  size_t at = 0;
  for (const auto& piece : pieces) {
    const size_t hit = got.find(piece, at);
    ASSERT_NE(hit, std::string::npos) << "missing \"" << piece << "\" in: " << got;
    at = hit + piece.size();
  }
}

TEST(CheckpointedSequentialValues, TypeErrors) {
  auto seq = masked_chain(8, 0.0, 1);
  auto in = batch(2, 4, 8);
  remat::CheckpointedSequential net(seq);
  // The first stage takes a vector: forward(tensor) fails in its first call.
  expect_message(error_of([&] { net->forward(in.x); }),
                 {"[remat::profile] stage 0:",
                  "EmbedImpl does not take a Tensor (the previous stage's result, or the "
                  "chain's input): Expected argument #0 to be of type std::vector"});
  // A chain that ends in a tuple must use forward_values; forward() says so
  // before running anything (no parameter, buffer or RNG state moves).
  torch::manual_seed(3);
  torch::nn::Sequential pair(torch::nn::Linear(8, 8), Pair());
  remat::CheckpointedSequential pair_net(pair);
  auto x = torch::randn({2, 8}, torch::requires_grad());
  EXPECT_EQ(error_of([&] { pair_net->forward(x); }),
            "[remat::CheckpointedSequential] the last stage returns a tuple of 2 tensors; call forward_values() for "
            "a chain whose result is not one tensor.");
  // A stage that returns something else.
  torch::nn::Sequential bad(torch::nn::Linear(8, 8), Count());
  expect_message(error_of([&] { remat::CheckpointedSequential(bad)->forward(x); }),
                 {"[remat::profile] stage 1:",
                  "CountImpl returned a long; a planned stage must return at::Tensor, "
                  "std::vector<at::Tensor> or a std::tuple of 2 to 4 tensors (wrap the "
                  "module in one that returns one of those)."});
  EXPECT_EQ(error_of([&] { net->forward_values({}); }),
            "[remat::CheckpointedSequential] forward_values got no tensors; pass the first module's inputs.");
}

TEST(CheckpointedSequentialValues, TupleResultAndAMaskWithoutGradient) {
  torch::manual_seed(4);
  torch::nn::Sequential open(Embed(8), MaskedBlock(8, 0.0), MaskedBlock(8, 0.0));
  auto in = batch(2, 4, 8);
  remat::CheckpointedSequential net(open, remat::SequentialOptions().segments(2));
  auto ys = net->forward_values({in.x, in.mask});
  ASSERT_EQ(ys.size(), 2u);
  EXPECT_TRUE(ys[0].requires_grad());
  EXPECT_FALSE(ys[1].requires_grad()) << "the mask carries no gradient";
  EXPECT_TRUE(torch::equal(ys[1], in.mask));
  zero_grads(*open, in.x);
  ys[0].sum().backward();
  auto got = grads_of(*open, in.x);
  zero_grads(*open, in.x);
  auto plain = open->forward<std::tuple<Tensor, Tensor>>(std::vector<Tensor>{in.x, in.mask});
  std::get<0>(plain).sum().backward();
  expect_bitwise_equal(grads_of(*open, in.x), got);
}

// ---- whole-step budgets ----

/** A small GPT: embedding, a chain of blocks, final LayerNorm and a head,
 *  cross-entropy loss. */
struct TinyGptImpl : torch::nn::Module {
  TinyGptImpl(int64_t vocab, int64_t d, int64_t layers, uint64_t seed) {
    torch::manual_seed(seed);
    wte = register_module("wte", torch::nn::Embedding(vocab, d));
    torch::nn::Sequential b;
    for (int64_t i = 0; i < layers; ++i) b->push_back(GptBlock(d, 4));
    blocks = register_module("blocks", b);
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    head = register_module("head", torch::nn::Linear(d, vocab));
  }
  Tensor loss(const Tensor& idx, const Tensor& target) {
    Tensor h = wte(idx);
    h = ck.is_empty() ? blocks->forward(h) : ck->forward(h);
    auto logits = head(ln(h));
    return torch::nn::functional::cross_entropy(logits.flatten(0, 1), target.flatten());
  }
  torch::nn::Embedding wte{nullptr};
  torch::nn::Sequential blocks{nullptr};
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear head{nullptr};
  remat::CheckpointedSequential ck{nullptr};  // over blocks, not registered
};
TORCH_MODULE(TinyGpt);

TEST(CheckpointedSequentialStepBudget, TheWholeStepWithItsHeadStaysUnderTheBudget) {
  remat::memory::enable_tracking();
  const int64_t vocab = 512, d = 64, T = 64, B = 8;
  torch::manual_seed(1);
  auto idx = torch::randint(vocab, {B, T});
  auto target = torch::randint(vocab, {B, T});
  auto run_steps = [&](TinyGpt& m, int n, const std::function<void(int, int64_t)>& after) {
    torch::optim::Adam opt(m->parameters(), 1e-3);
    for (int s = 0; s < n; ++s) {
      int64_t peak;
      {
        std::optional<remat::StepScope> step;
        if (!m->ck.is_empty()) step.emplace(m->ck->begin_step());
        remat::memory::Probe probe;
        opt.zero_grad();
        m->loss(idx, target).backward();
        opt.step();
        peak = probe.peak_bytes();
      }
      after(s, peak);
    }
  };
  TinyGpt plain(vocab, d, 6, 3);
  std::vector<int64_t> plain_peaks;
  run_steps(plain, 3, [&](int, int64_t p) { plain_peaks.push_back(p); });
  const int64_t plain_step = plain_peaks.back();  // steady state: optimizer state exists
  const int64_t budget = plain_step * 6 / 10;
  TinyGpt ck(vocab, d, 6, 3);
  ck->ck = remat::CheckpointedSequential(ck->blocks, remat::SequentialOptions().step_memory_budget_bytes(budget));
  run_steps(ck, 5, [&](int s, int64_t peak) {
    const auto report = ck->ck->last_step();
    std::printf("  step %d: step peak %s (budget %s, plain %s), chain's own %s, outside %s, prediction %s\n", s,
                remat::format_bytes(peak).c_str(), remat::format_bytes(budget).c_str(),
                remat::format_bytes(plain_step).c_str(), remat::format_bytes(report.chain_peak_bytes).c_str(),
                remat::format_bytes(report.outside_bytes).c_str(),
                remat::format_bytes(ck->ck->plan().prediction.peak_bytes).c_str());
    EXPECT_EQ(report.step_peak_bytes, peak) << "the scope sees what the probe sees";
    // After the two warm-up steps (the first runs the leanest schedule and
    // allocates the optimizer's state), the step holds the budget.
    if (s >= 2) {
      EXPECT_LE(peak, budget * 1.02) << "step " << s << "\n" << ck->ck->explain();
    }
  });
  // It used the room: the chain's plan is not the leanest one any more.
  const int64_t leanest = remat::plan::min_feasible_peak_bytes(ck->ck->chain());
  EXPECT_GT(ck->ck->plan().prediction.peak_bytes, leanest * 1.2) << remat::format_bytes(leanest);
  const std::string text = ck->ck->explain();
  EXPECT_NE(text.find("of which the chain's own: "), std::string::npos) << text;
  EXPECT_NE(text.find("step peak (last begin_step scope): "), std::string::npos) << text;
  EXPECT_NE(text.find(", outside the chain "), std::string::npos) << text;
  // And the parameters followed the plain run's curve.
  auto pp = plain->parameters(), cp = ck->parameters();
  TinyGpt again(vocab, d, 6, 3);
  run_steps(again, 5, [](int, int64_t) {});
  auto ap = again->parameters();
  for (size_t i = 0; i < cp.size(); ++i) EXPECT_TRUE(torch::equal(cp[i], ap[i])) << i;
}

TEST(CheckpointedSequentialStepBudget, Errors) {
  auto seq = make_mlp(4, 16);
  auto x = torch::randn({4, 16}, torch::requires_grad());
  EXPECT_EQ(
      error_of([&] { remat::CheckpointedSequential(seq, remat::SequentialOptions().step_memory_budget_bytes(0)); }),
      "[remat::CheckpointedSequential] step_memory_budget_bytes must be positive (or -1 for none), got 0.");
  EXPECT_EQ(error_of([&] {
              remat::CheckpointedSequential(
                  seq, remat::SequentialOptions().step_memory_budget_bytes(1 << 20).memory_budget_bytes(1 << 19));
            }),
            "[remat::CheckpointedSequential] step_memory_budget_bytes plans the chain itself (algorithm optimal); "
            "leave memory_budget_bytes, memory_budget_fraction, segments, schedule and algorithm unset with it.");
  EXPECT_EQ(error_of([&] {
              remat::CheckpointedSequential(
                  seq, remat::SequentialOptions().step_memory_budget_bytes(1 << 20).measure_memory(false));
            }),
            "[remat::CheckpointedSequential] step_memory_budget_bytes needs the steps measured; leave "
            "measure_memory on.");
  remat::CheckpointedSequential net(seq, remat::SequentialOptions().step_memory_budget_bytes(1 << 20));
  EXPECT_EQ(error_of([&] { net->forward(x); }),
            "[remat::CheckpointedSequential] step_memory_budget_bytes needs each training step measured: open "
            "`auto step = net->begin_step();` before the model's forward and keep it until the step ends (after "
            "the optimizer step).");
  // A budget that the bytes outside the chain already fill: the step after
  // the measured one says so, and runs nothing.
  remat::CheckpointedSequential tight(seq, remat::SequentialOptions().step_memory_budget_bytes(4096));
  {
    auto step = tight->begin_step();
    auto big = torch::ones({64, 1024});  // 256 KiB held outside the chain
    (tight->forward(x).sum() + big.sum()).backward();
  }
  std::string msg;
  {
    for (auto& p : seq->parameters()) p.mutable_grad() = Tensor();  // zero_grad(): as the measured step
    auto step = tight->begin_step();
    msg = error_of([&] { tight->forward(x); });
  }
  EXPECT_NE(msg.find("[remat::CheckpointedSequential] the step budget of 4.00 KiB cannot be met: outside the chain "
                     "the step holds "),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("; raise step_memory_budget_bytes, or shrink what is outside the chain (batch, head)."),
            std::string::npos)
      << msg;
}

}  // namespace
