// remat::checkpoint and checkpoint_sequential: gradients against plain runs
// (bitwise on CPU), recompute counts, RNG/autocast replay, nesting, autograd
// entry points, threads, and every user-facing error by its message.
#include "common.h"

#include <ATen/autocast_mode.h>

#include <atomic>
#include <chrono>
#include <filesystem>

#include <unistd.h>
#include <thread>

using namespace remat_test;
namespace F = torch::nn::functional;

namespace {

TEST(Checkpoint, MlpPerLayerBitwise) {
  auto seq = make_mlp(6, 32);
  auto x = torch::randn({8, 32}, torch::requires_grad());
  auto plain = step_grads(*seq, x, [&](torch::Tensor h) { return seq->forward(h); });
  auto ckpt = step_grads(*seq, x, [&](torch::Tensor h) {
    for (auto& m : *seq) {
      h = remat::checkpoint([m](torch::Tensor in) mutable { return m.forward(in); }, h);
    }
    return h;
  });
  expect_bitwise_equal(plain, ckpt);
}

TEST(Checkpoint, ResidualCnnWithBatchNormBitwiseAndStatsOnce) {
  torch::manual_seed(1);
  ResBlock a(8), b(8);
  torch::nn::Sequential net(a, b);
  auto x = torch::randn({4, 8, 10, 10}, torch::requires_grad());
  auto buffers_before = net->buffers();
  std::vector<torch::Tensor> start;
  for (auto& t : buffers_before) start.push_back(t.clone());

  auto plain = step_grads(*net, x, [&](torch::Tensor h) { return net->forward(h); });
  std::vector<torch::Tensor> after_plain;
  for (auto& t : net->buffers()) after_plain.push_back(t.clone());
  // Reset statistics, then the same step checkpointed per block.
  {
    torch::NoGradGuard g;
    auto bufs = net->buffers();
    for (size_t i = 0; i < bufs.size(); ++i) bufs[i].copy_(start[i]);
  }
  auto ckpt = step_grads(*net, x, [&](torch::Tensor h) { return remat::checkpoint(b, remat::checkpoint(a, h)); });
  expect_bitwise_equal(plain, ckpt);
  auto bufs = net->buffers();
  for (size_t i = 0; i < bufs.size(); ++i) {
    EXPECT_TRUE(torch::equal(bufs[i], after_plain[i])) << "buffer " << i << " updated a different number of times";
  }
}

TEST(Checkpoint, GptBlockBitwiseWithDropout) {
  torch::manual_seed(2);
  GptBlock b1(32, 4, 0.1), b2(32, 4, 0.1);
  torch::nn::Sequential net(b1, b2);
  auto x = torch::randn({2, 16, 32}, torch::requires_grad());
  torch::manual_seed(7);
  auto plain = step_grads(*net, x, [&](torch::Tensor h) { return net->forward(h); });
  torch::manual_seed(7);
  auto ckpt = step_grads(*net, x, [&](torch::Tensor h) { return remat::checkpoint(b2, remat::checkpoint(b1, h)); });
  expect_bitwise_equal(plain, ckpt);
}

// A replay swaps the generators' states in and back out. It used to copy
// the CPU generator's state into a 5056-byte tensor on every replay, bytes
// no plan counts (a planned chain at a tight budget went over by them);
// now it copies the engine and its cached normal samples, allocating
// nothing, and the stream goes on exactly where the forward left it.
TEST(Checkpoint, ReplayPutsTheRngBackAndAllocatesNothingForIt) {
  auto fn = [](torch::Tensor h) { return h * torch::randn({1}); };  // one scalar draw: Box-Muller's cached pair
  auto x = torch::randn({4}, torch::requires_grad());
  torch::manual_seed(5);
  torch::randn({1});  // leaves the pair's second sample cached
  auto y = remat::checkpoint(fn, x).sum();
  int64_t peak = 0;
  {
    remat::memory::Probe probe;
    y.backward();
    peak = probe.peak_bytes();
  }
  EXPECT_LT(peak, 1024) << "16-byte tensors only; the state copy alone was 5056 bytes";
  const auto after = torch::randn({3});
  torch::manual_seed(5);
  torch::randn({1});
  torch::randn({1});  // the forward's draw
  EXPECT_TRUE(torch::equal(after, torch::randn({3}))) << "the replay left the generator elsewhere";
}

TEST(Checkpoint, DropoutWithoutRngPreservationDiffers) {
  torch::manual_seed(3);
  torch::nn::Linear lin(64, 64);
  auto x = torch::randn({16, 64}, torch::requires_grad());
  auto fn = [lin](torch::Tensor in) mutable {
    return F::dropout(lin(in), F::DropoutFuncOptions().p(0.5).training(true)).tanh();
  };
  torch::manual_seed(11);
  auto plain = step_grads(*lin, x, fn);
  torch::manual_seed(11);
  auto kept = step_grads(*lin, x, [&](torch::Tensor in) { return remat::checkpoint(fn, in); });
  expect_bitwise_equal(plain, kept);
  torch::manual_seed(11);
  auto lost = step_grads(*lin, x, [&](torch::Tensor in) {
    return remat::checkpoint(remat::CheckpointOptions().preserve_rng_state(false), fn, in);
  });
  EXPECT_FALSE(torch::equal(plain[0], lost[0])) << "a fresh dropout mask in recompute must change the weight gradient";
}

TEST(Checkpoint, RunsTwicePerBackwardOnceIfUnreached) {
  int runs = 0;
  auto w = torch::randn({16, 16}, torch::requires_grad());
  auto fn = [&runs, w](torch::Tensor in) {
    ++runs;
    return torch::matmul(in, w).exp().sin();
  };
  auto x = torch::randn({4, 16}, torch::requires_grad());
  auto y = remat::checkpoint(fn, x);
  EXPECT_EQ(runs, 1);
  y.sum().backward();
  EXPECT_EQ(runs, 2);

  // Backward that never reaches the region: only the forward run.
  runs = 0;
  auto z = torch::randn({4, 16}, torch::requires_grad());
  auto y2 = remat::checkpoint(fn, x.detach());
  (y2.detach() * z).sum().backward();
  EXPECT_EQ(runs, 1);
  // And a region whose saved tensors are all parameters or inputs needs no re-run.
  runs = 0;
  auto y3 = remat::checkpoint(
      [&runs, w](torch::Tensor in) {
        ++runs;
        return torch::matmul(in, w);
      },
      x);
  y3.sum().backward();
  EXPECT_EQ(runs, 1);
}

TEST(Checkpoint, EarlyStopSkipsTheTail) {
  for (bool early : {true, false}) {
    int heads = 0, tails = 0;
    auto fn = [&](torch::Tensor in) {
      ++heads;
      auto a = in.exp();  // saves its result: the only tensor backward needs
      ++tails;
      return a + 1;  // saves nothing
    };
    auto x = torch::randn({8}, torch::requires_grad());
    auto y = remat::checkpoint(remat::CheckpointOptions().early_stop(early), fn, x);
    y.sum().backward();
    EXPECT_EQ(heads, 2);
    EXPECT_EQ(tails, early ? 1 : 2) << "early_stop=" << early;
  }
}

TEST(Checkpoint, NestedRegionsBitwiseAndCounts) {
  torch::manual_seed(4);
  auto seq = make_mlp(4, 24);
  auto x = torch::randn({5, 24}, torch::requires_grad());
  auto plain = step_grads(*seq, x, [&](torch::Tensor h) { return seq->forward(h); });
  int outer_runs = 0, inner_runs = 0;
  auto inner = [&inner_runs, seq](torch::Tensor h) mutable {
    ++inner_runs;
    for (int i = 2; i < 6; ++i) h = (seq->begin() + i)->forward<torch::Tensor>(h);
    return h;
  };
  auto outer = [&outer_runs, &inner, seq](torch::Tensor h) mutable {
    ++outer_runs;
    h = (seq->begin() + 0)->forward<torch::Tensor>(h);
    h = (seq->begin() + 1)->forward<torch::Tensor>(h);
    h = remat::checkpoint(inner, h);
    for (int i = 6; i < 8; ++i) h = (seq->begin() + i)->forward<torch::Tensor>(h);
    return h;
  };
  auto ckpt = step_grads(*seq, x, [&](torch::Tensor h) { return remat::checkpoint(outer, h); });
  expect_bitwise_equal(plain, ckpt);
  EXPECT_EQ(outer_runs, 2);
  // Forward, inside the outer recompute, and its own recompute.
  EXPECT_EQ(inner_runs, 3);
}

TEST(Checkpoint, AutogradGradAndBackwardInputs) {
  torch::manual_seed(5);
  torch::nn::Linear lin(12, 12);
  auto x = torch::randn({3, 12}, torch::requires_grad());
  auto fn = [lin](torch::Tensor in) mutable { return lin(in).tanh().square(); };
  auto gp = torch::autograd::grad({fn(x).sum()}, std::vector<torch::Tensor>{x, lin->weight});
  auto gc = torch::autograd::grad({remat::checkpoint(fn, x).sum()}, std::vector<torch::Tensor>{x, lin->weight});
  expect_bitwise_equal(gp, gc);
  EXPECT_FALSE(lin->weight.grad().defined()) << "autograd::grad must not accumulate";
  // backward(inputs=...): only x gets a gradient.
  remat::checkpoint(fn, x).sum().backward({}, false, false, {x});
  EXPECT_TRUE(torch::equal(x.grad(), gp[0]));
  EXPECT_FALSE(lin->weight.grad().defined());
}

TEST(Checkpoint, NonTensorArgumentsAndTensorLists) {
  auto x = torch::randn({6}, torch::requires_grad());
  auto y = torch::randn({6}, torch::requires_grad());
  int runs = 0;
  auto fn = [&runs](const torch::Tensor& a, double scale, int64_t power, const std::string& op,
                    std::vector<torch::Tensor> more) {
    ++runs;
    auto h = (a * scale).pow(power);
    if (op == "sin") h = h.sin();
    return h * more[0].exp();
  };
  auto plain = torch::autograd::grad({fn(x, 1.5, 3, "sin", {y}).sum()}, std::vector<torch::Tensor>{x, y});
  runs = 0;
  auto out = remat::checkpoint(fn, x, 1.5, int64_t{3}, std::string("sin"), std::vector<torch::Tensor>{y});
  auto ckpt = torch::autograd::grad({out.sum()}, std::vector<torch::Tensor>{x, y});
  expect_bitwise_equal(plain, ckpt);
  EXPECT_EQ(runs, 2);
}

TEST(Checkpoint, FrozenInputsStillGiveParameterGradients) {
  torch::manual_seed(6);
  auto seq = make_mlp(3, 16);
  auto x = torch::randn({4, 16});  // no requires_grad
  auto plain = step_grads(*seq, x, [&](torch::Tensor h) { return seq->forward(h); });
  auto ckpt = step_grads(*seq, x, [&](torch::Tensor h) { return remat::checkpoint(seq, h); });
  for (size_t i = 0; i + 1 < plain.size(); ++i) ASSERT_TRUE(ckpt[i].defined()) << "parameter " << i;
  expect_bitwise_equal(plain, ckpt);
}

TEST(Checkpoint, ReturnTypesAndUndefinedTensors) {
  auto x = torch::randn({4}, torch::requires_grad());
  auto tup = remat::checkpoint(
      [](torch::Tensor a, torch::Tensor maybe) {
        EXPECT_FALSE(maybe.defined());
        return std::make_tuple(a.exp(), a.detach() * 2);  // second output needs no grad
      },
      x, torch::Tensor());
  static_assert(std::is_same_v<decltype(tup), std::tuple<torch::Tensor, torch::Tensor>>);
  EXPECT_FALSE(std::get<1>(tup).requires_grad());
  auto vec = remat::checkpoint([](torch::Tensor a) { return std::vector<torch::Tensor>{a.sin(), a.cos()}; }, x);
  static_assert(std::is_same_v<decltype(vec), std::vector<torch::Tensor>>);
  (std::get<0>(tup).sum() + vec[0].sum() + vec[1].sum()).backward();
  auto expect = x.detach().exp() + x.detach().cos() - x.detach().sin();
  EXPECT_TRUE(torch::allclose(x.grad(), expect));
}

TEST(Checkpoint, RetainGraphTwiceRecomputesAgain) {
  torch::manual_seed(8);
  torch::nn::Linear lin(10, 10);
  int runs = 0;
  auto fn = [&runs, lin](torch::Tensor in) mutable {
    ++runs;
    return lin(in).sigmoid();
  };
  auto x = torch::randn({3, 10}, torch::requires_grad());
  auto loss = remat::checkpoint(fn, x).square().sum();
  loss.backward({}, /*retain_graph=*/true);
  auto g1 = x.grad().clone();
  x.mutable_grad() = torch::Tensor();
  loss.backward();
  EXPECT_TRUE(torch::equal(g1, x.grad()));
  EXPECT_EQ(runs, 3);
}

TEST(Checkpoint, NoGradModeJustCalls) {
  int runs = 0;
  torch::NoGradGuard g;
  auto y = remat::checkpoint(
      [&runs](torch::Tensor a) {
        ++runs;
        return a * 2;
      },
      torch::ones({2}));
  EXPECT_EQ(runs, 1);
  EXPECT_TRUE(torch::equal(y, torch::full({2}, 2.0)));
}

TEST(Checkpoint, TwoThreadsTrainTheirOwnModels) {
  // Models are built here: make_mlp seeds the global generator, which two
  // threads must not race on. Each thread draws data from its own generator.
  auto train = [](torch::nn::Sequential seq, uint64_t seed, bool ckpt, std::vector<torch::Tensor>* out) {
    torch::optim::SGD opt(seq->parameters(), 0.1);
    auto gen = torch::make_generator<torch::CPUGeneratorImpl>(seed);
    for (int s = 0; s < 5; ++s) {
      auto x = torch::randn({8, 32}, gen);
      opt.zero_grad();
      auto y = ckpt ? remat::checkpoint_sequential(seq, 2, x) : seq->forward(x);
      y.square().mean().backward();
      opt.step();
    }
    for (auto& p : seq->parameters()) out->push_back(p.detach().clone());
  };
  auto m1 = make_mlp(4, 32, 1), m2 = make_mlp(4, 32, 2), r1 = make_mlp(4, 32, 1), r2 = make_mlp(4, 32, 2);
  std::vector<torch::Tensor> a, b, ra, rb;
  std::thread t1(train, m1, 1, true, &a), t2(train, m2, 2, true, &b);
  t1.join();
  t2.join();
  train(r1, 1, false, &ra);
  train(r2, 2, false, &rb);
  expect_bitwise_equal(a, ra);
  expect_bitwise_equal(b, rb);
}

// The default CPU generator is shared by all threads: without remat's RNG
// region lock a replayed dropout mask would differ from the first run's
// whenever another thread drew in between (NOTE [RNG regions and threads]).
// kValues compares every recomputed tensor bitwise with the first run.
TEST(Checkpoint, ThreadsReplayDropoutMasksExactly) {
  constexpr int kThreads = 4, kSteps = 15;
  std::vector<torch::nn::Sequential> models;
  for (int t = 0; t < kThreads; ++t) {
    torch::manual_seed(t);
    torch::nn::Sequential s;
    for (int i = 0; i < 4; ++i) {
      s->push_back(torch::nn::Linear(64, 64));
      s->push_back(torch::nn::Dropout(0.5));
    }
    models.push_back(s);
  }
  std::vector<std::string> errors(kThreads);
  std::vector<int> steps(kThreads, 0);
  auto opts = remat::CheckpointOptions().determinism_check(remat::DeterminismCheck::kValues);
  auto train = [&](int t) {
    try {
      auto seq = models[t];
      auto gen = torch::make_generator<torch::CPUGeneratorImpl>(100 + t);
      for (int s = 0; s < kSteps; ++s) {
        auto x = torch::randn({32, 64}, gen).requires_grad_();
        torch::Tensor h = x;
        for (size_t i = 0; i < seq->size(); i += 2) {
          torch::nn::Sequential pair;
          pair->push_back(*(seq->begin() + i));
          pair->push_back(*(seq->begin() + i + 1));
          h = remat::checkpoint(opts, pair, h);
        }
        h.square().mean().backward();
        ++steps[t];
      }
    } catch (const std::exception& e) {
      errors[t] = e.what();
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(train, t);
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(errors[t], "") << "thread " << t;
    EXPECT_EQ(steps[t], kSteps) << "thread " << t;
  }
}

// BatchNorm saves its running statistics; a re-run must
// start from the values the first run saw, or kValues reports a difference.
TEST(Checkpoint, ValuesCheckWithBatchNormRewindsBuffers) {
  torch::manual_seed(4);
  torch::nn::Sequential block;
  block->push_back(torch::nn::Linear(16, 32));
  block->push_back(torch::nn::BatchNorm1d(32));
  block->push_back(torch::nn::GELU());
  auto x = torch::randn({8, 16}, torch::requires_grad());
  std::vector<torch::Tensor> start;
  for (auto& b : block->buffers()) start.push_back(b.clone());
  auto plain = step_grads(*block, x, [&](torch::Tensor h) { return block->forward(h); });
  std::vector<torch::Tensor> after_plain;
  for (auto& b : block->buffers()) after_plain.push_back(b.clone());
  {
    torch::NoGradGuard g;
    auto bufs = block->buffers();
    for (size_t i = 0; i < bufs.size(); ++i) bufs[i].copy_(start[i]);
  }
  auto opts = remat::CheckpointOptions().determinism_check(remat::DeterminismCheck::kValues);
  std::vector<torch::Tensor> got;
  ASSERT_NO_THROW(got = step_grads(*block, x, [&](torch::Tensor h) { return remat::checkpoint(opts, block, h); }));
  expect_bitwise_equal(plain, got);
  auto bufs = block->buffers();
  for (size_t i = 0; i < bufs.size(); ++i) EXPECT_TRUE(torch::equal(bufs[i], after_plain[i])) << "buffer " << i;
}

// The inner region saves its input (pow) and a value it
// must recompute (tanh); one unpack takes the input slot, which fetches the
// inputs through the outer frame, and the recompute must not fetch them
// again. The outer function runs exactly twice (forward + one recompute);
// before the fix it ran 3 times with this order of ops.
TEST(Checkpoint, NestedInputFirstUnpackRerunsOuterOnce) {
  auto x = torch::randn({64}, torch::requires_grad());
  int outer_runs = 0, inner_runs = 0;
  auto inner = [&inner_runs](torch::Tensor h) {
    ++inner_runs;
    return h.pow(2) + h.tanh();
  };
  auto outer = [&](torch::Tensor a) {
    ++outer_runs;
    auto h = a.exp();
    return remat::checkpoint(inner, h).sin();
  };
  auto y = remat::checkpoint(outer, x).sum();
  ASSERT_EQ(outer_runs, 1);
  y.backward();
  EXPECT_EQ(outer_runs, 2) << "the outer region is re-run once, not once per inner fetch";
  EXPECT_EQ(inner_runs, 3) << "inner: forward, within the outer recompute, and its own recompute";
  auto h = x.detach().exp();
  auto z = h.tanh() + h.pow(2);
  auto want = z.cos() * ((1 - h.tanh().square()) + 2 * h) * h;
  EXPECT_TRUE(torch::allclose(x.grad(), want, 1e-5, 1e-6));
}

TEST(Checkpoint, AutocastStateReplayed) {
  torch::manual_seed(9);
  torch::nn::Linear lin(16, 16);
  auto x = torch::randn({4, 16}, torch::requires_grad());
  auto fn = [lin](torch::Tensor in) mutable { return lin(in).relu(); };
  auto run = [&](bool ckpt) {
    zero_grads(*lin, x);
    torch::Tensor y;
    {
      at::autocast::set_autocast_enabled(at::kCPU, true);
      at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
      y = ckpt ? remat::checkpoint(fn, x) : fn(x);
      at::autocast::set_autocast_enabled(at::kCPU, false);
      at::autocast::clear_cache();
    }
    EXPECT_EQ(y.scalar_type(), at::kBFloat16);
    y.to(torch::kFloat).square().sum().backward();  // outside autocast
    return grads_of(*lin, x);
  };
  auto plain = run(false);
  auto ckpt = run(true);
  expect_bitwise_equal(plain, ckpt);
}

namespace {
struct SwapImpl : torch::nn::Module {
  SwapImpl()
      : fc(register_module("fc", torch::nn::Linear(16, 16))), drop(register_module("drop", torch::nn::Dropout(0.3))) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::tanh(drop(fc(x))); }
  torch::nn::Linear fc;
  torch::nn::Dropout drop;
};
TORCH_MODULE(Swap);
}  // namespace

// A child replaced (replace_module) between forward and backward is freed:
// the recompute's replay of the train/eval flags skips it, and the new
// child, reached from its parent, runs with the parent's flag of the
// forward. It wrote to the freed module (ASan: heap-use-after-free).
TEST(Checkpoint, AChildReplacedBeforeBackwardIsSkippedByTheFlagReplay) {
  const auto x = torch::randn({8, 16});
  auto run = [&](bool ckpt) {
    torch::manual_seed(0);
    Swap m;
    torch::manual_seed(1);
    auto loss = (ckpt ? remat::checkpoint(m, x) : m->forward(x)).square().mean();
    std::weak_ptr<torch::nn::Module> old = m->drop.ptr();
    m->eval();
    torch::nn::Dropout fresh(0.3);
    fresh->eval();
    m->drop = m->replace_module("drop", fresh);
    EXPECT_TRUE(old.expired());
    loss.backward();
    EXPECT_FALSE(m->is_training());
    EXPECT_FALSE(fresh->is_training());
    return std::vector<torch::Tensor>{m->fc->weight.grad().clone(), m->fc->bias.grad().clone()};
  };
  expect_bitwise_equal(run(false), run(true));
}

TEST(CheckpointSequential, MatchesPlainForEverySegmentCount) {
  auto seq = make_mlp(4, 16);  // 8 modules
  auto x = torch::randn({3, 16}, torch::requires_grad());
  auto plain = step_grads(*seq, x, [&](torch::Tensor h) { return seq->forward(h); });
  for (int64_t k = 1; k <= 8; ++k) {
    remat::reset_checkpoint_stats();
    auto ckpt = step_grads(*seq, x, [&](torch::Tensor h) { return remat::checkpoint_sequential(seq, k, h); });
    expect_bitwise_equal(plain, ckpt);
    // All segments but the last are checkpointed; each is re-run once if it
    // holds a Tanh (a lone Linear saves only its input and weight).
    const int64_t size = 8 / k;
    int64_t with_tanh = 0;
    for (int64_t s = 0; s < k - 1; ++s) with_tanh += size > 1 || s % 2 == 1;
    EXPECT_EQ(remat::checkpoint_stats().regions, k - 1) << "k=" << k;
    EXPECT_EQ(remat::checkpoint_stats().recomputations, with_tanh) << "k=" << k;
  }
}

// ---- errors a user can hit, pinned by message ----

TEST(CheckpointErrors, BadSegments) {
  auto seq = make_mlp(2, 4);  // 4 modules
  auto x = torch::randn({1, 4});
  for (int64_t bad : {0, 5, -1}) {
    try {
      remat::checkpoint_sequential(seq, bad, x);
      FAIL() << "segments=" << bad << " accepted";
    } catch (const remat::Error& e) {
      EXPECT_EQ(std::string(e.what()),
                "[remat::checkpoint_sequential] segments must be in [1, 4] (the number of modules), got " +
                    std::to_string(bad) +
                    ". Pass a value in that range; 1 runs the whole Sequential without checkpoints.");
    }
  }
}

TEST(CheckpointErrors, ShapeChangesInRecompute) {
  int calls = 0;
  auto fn = [&calls](torch::Tensor a) {
    ++calls;
    auto h = calls == 1 ? a.exp() : torch::cat({a, a}).exp();
    return h.sum();
  };
  auto x = torch::randn({3}, torch::requires_grad());
  auto y = remat::checkpoint(fn, x);
  try {
    y.backward();
    FAIL() << "no determinism error";
  } catch (const remat::Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "[remat::checkpoint] saved tensor #0 differs between the forward and the recomputation: "
              "shape [3] in forward vs [6] in recompute. The checkpointed function must run as in its forward "
              "(keep preserve_rng_state(true) for dropout; a lambda's recompute sees its modules' train/eval flags "
              "as they are at backward: keep the mode until backward, or checkpoint the module itself); set "
              "determinism_check(kNone) to skip this check only where the difference is intended.");
  }
}

TEST(CheckpointErrors, ValuesCheckCatchesNondeterminism) {
  auto fn = [](torch::Tensor a) { return (a * torch::rand({4})).exp(); };
  auto x = torch::randn({4}, torch::requires_grad());
  auto opts = remat::CheckpointOptions().preserve_rng_state(false).determinism_check(remat::DeterminismCheck::kValues);
  auto y = remat::checkpoint(opts, fn, x);
  try {
    y.sum().backward();
    FAIL() << "no determinism error";
  } catch (const remat::Error& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "differs between the forward and the recomputation: values differ bitwise (shape [4])"),
              std::string::npos)
        << e.what();
  }
  // The default metadata check cannot see it; with the RNG replayed it is deterministic.
  auto y2 = remat::checkpoint(remat::CheckpointOptions().determinism_check(remat::DeterminismCheck::kValues), fn, x);
  EXPECT_NO_THROW(y2.sum().backward());
}

TEST(CheckpointErrors, FewerSavesInRecompute) {
  int calls = 0;
  auto fn = [&calls](torch::Tensor a) {
    ++calls;
    auto h = a.exp();
    if (calls == 1) h = h.exp();
    return h;
  };
  auto x = torch::randn({3}, torch::requires_grad());
  auto y = remat::checkpoint(remat::CheckpointOptions().determinism_check(remat::DeterminismCheck::kNone), fn, x);
  try {
    y.sum().backward();
    FAIL();
  } catch (const remat::Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "[remat::checkpoint] the recomputation saved 1 tensors but the forward saved 2; the checkpointed "
              "function must run the same ops each time (no data-dependent control flow or state that changes "
              "between calls).");
  }
}

TEST(CheckpointErrors, BackwardThroughFreedGraph) {
  auto x = torch::randn({3}, torch::requires_grad());
  auto y = remat::checkpoint([](torch::Tensor a) { return a.exp().sin(); }, x).sum();
  y.backward();
  try {
    y.backward();
    FAIL();
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("Trying to backward through the graph a second time"), std::string::npos)
        << e.what();
  }
}

TEST(CheckpointErrors, InputModifiedInPlace) {
  auto w = torch::randn({3}, torch::requires_grad());
  auto x = torch::randn({3});
  auto y = remat::checkpoint([w](torch::Tensor a) { return (a * w).exp(); }, x).sum();
  x.add_(1);
  try {
    y.backward();
    FAIL();
  } catch (const remat::Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "[remat::checkpoint] input 0 of a checkpointed function was modified in place after the forward "
              "(version 0 -> 1); recomputing from it would give wrong gradients. Modify a clone instead, or keep "
              "the input unchanged until backward has run.");
  }
}

TEST(CheckpointErrors, ParameterModifiedBeforeBackward) {
  // w is saved (a requires grad): the saved reference is version-checked.
  auto w = torch::randn({3}, torch::requires_grad());
  auto a = torch::randn({3}, torch::requires_grad());
  auto y = remat::checkpoint([w](torch::Tensor in) { return (in * w).exp(); }, a).sum();
  {
    torch::NoGradGuard g;
    w.add_(1);
  }
  try {
    y.backward();
    FAIL();
  } catch (const remat::Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "[remat::checkpoint] a parameter saved for backward inside a checkpoint was modified in place "
              "before backward (version 0 -> 1); run optimizer.step() after backward, not between forward and "
              "backward.");
  }
}

// NOTE [tensors the first run writes]: a running average that regions do
// not own (held by the caller), updated in place by each region's forward
// and then read. A re-run read the value the later regions left (gradients
// 3.5e-3 off in a planned step); it now starts from the value before its
// forward, as a module's own buffer does. Bitwise the plain run, with and
// without early stop, and the average ends as in the plain run.
TEST(Checkpoint, ATensorTheRegionDoesNotOwnWrittenThenReadIsReplayed) {
  for (bool early_stop : {true, false}) {
    auto run = [&](bool checkpointed) {
      torch::manual_seed(4);
      auto w = torch::randn({8, 8}, torch::requires_grad());
      auto avg = torch::zeros({8});
      auto block = [&](const at::Tensor& h) {
        {
          torch::NoGradGuard no_grad;
          avg.mul_(0.9).add_(h.mean(0), 0.1);
        }
        return torch::tanh((h - avg).matmul(w)) + h;
      };
      auto x = torch::randn({4, 8}, torch::requires_grad());
      auto h = x;
      for (int k = 0; k < 3; ++k) {
        h = checkpointed ? remat::checkpoint(remat::CheckpointOptions().early_stop(early_stop), block, h) : block(h);
      }
      h.square().sum().backward();
      return std::vector<at::Tensor>{w.grad(), x.grad(), avg};
    };
    SCOPED_TRACE(early_stop ? "early stop" : "no early stop");
    expect_bitwise_equal(run(false), run(true));
  }
}

TEST(CheckpointErrors, ModuleParameterModifiedBeforeBackward) {
  // The weight is never saved (the input needs no grad), but the recompute
  // would read it: a module fn's parameters are version-checked too.
  torch::nn::Linear lin(3, 3);
  auto x = torch::randn({2, 3});
  auto y = remat::checkpoint(lin, x).exp().sum();
  auto z = remat::checkpoint(torch::nn::Sequential(lin, torch::nn::Tanh()), x).sum();
  {
    torch::NoGradGuard g;
    lin->bias.add_(1);
  }
  EXPECT_NO_THROW(y.backward()) << "nothing to recompute in a lone Linear";
  try {
    z.backward();
    FAIL();
  } catch (const remat::Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "[remat::checkpoint] parameter 1 of the checkpointed module was modified in place after the "
              "forward began (version 1 -> 2): by an optimizer step between forward and backward, or by the "
              "forward itself (a clamp of its own weight); recomputing with it would give wrong gradients. Run "
              "optimizer.step() after backward, and write parameters outside the checkpointed forward.");
  }
}

// A callable that reaches its module through operator-> only (no operator*,
// as remat-train's per-block entries): its parameters are still checked.
TEST(CheckpointErrors, AModuleReachedThroughArrowOnlyIsCheckedToo) {
  struct Entry {
    torch::nn::Sequential m;
    torch::nn::SequentialImpl* operator->() { return m.get(); }
    torch::Tensor operator()(const torch::Tensor& x) { return m->forward(x); }
  };
  torch::nn::Linear lin(3, 3);
  Entry entry{torch::nn::Sequential(lin, torch::nn::Tanh())};
  auto z = remat::checkpoint(entry, torch::randn({2, 3})).sum();
  {
    torch::NoGradGuard g;
    lin->bias.add_(1);
  }
  try {
    z.backward();
    FAIL();
  } catch (const remat::Error& e) {
    EXPECT_NE(std::string(e.what()).find("was modified in place after the forward"), std::string::npos) << e.what();
  }
}

}  // namespace

namespace {

TEST(CheckpointSequential, ModuleListVectorAndCallables) {
  // Any module, not only torch::nn::Sequential.
  torch::manual_seed(12);
  auto seq = make_mlp(6, 16);
  auto x = torch::randn({4, 16}, torch::requires_grad());
  auto plain = step_grads(*seq, x, [&](torch::Tensor h) { return seq->forward(h); });
  std::vector<torch::nn::Linear> linears;
  std::vector<std::function<torch::Tensor(const torch::Tensor&)>> fns;
  torch::nn::ModuleList list;
  for (size_t i = 0; i < seq->size(); ++i) {
    auto m = seq->ptr(i);
    fns.push_back([m](const torch::Tensor& h) {
      if (auto* l = m->as<torch::nn::LinearImpl>()) return l->forward(h);
      return m->as<torch::nn::TanhImpl>()->forward(h);
    });
    if (auto l = std::dynamic_pointer_cast<torch::nn::LinearImpl>(m)) {
      linears.emplace_back(l);
      list->push_back(l);
    }
  }
  for (int64_t segments : {1, 2, 4}) {
    remat::reset_checkpoint_stats();
    auto got = step_grads(*seq, x, [&](torch::Tensor h) { return remat::checkpoint_sequential(fns, segments, h); });
    expect_bitwise_equal(plain, got);
  }
  // Linear-only lists: compare against the same chain run plainly.
  auto chain = [&](torch::Tensor h) {
    for (auto& l : linears) h = l(h);
    return h;
  };
  auto plain_lin = step_grads(*seq, x, chain);
  expect_bitwise_equal(
      plain_lin, step_grads(*seq, x, [&](torch::Tensor h) { return remat::checkpoint_sequential(linears, 3, h); }));
  expect_bitwise_equal(plain_lin, step_grads(*seq, x, [&](torch::Tensor h) {
                         return remat::checkpoint_sequential<torch::nn::LinearImpl>(list, 2, h);
                       }));
  EXPECT_GT(remat::checkpoint_stats().recomputations, 0);
  list->push_back(torch::nn::Tanh());
  try {
    remat::checkpoint_sequential<torch::nn::LinearImpl>(list, 2, x);
    ADD_FAILURE() << "a Tanh in a list of Linear must throw";
  } catch (const remat::Error& e) {
    EXPECT_STREQ(e.what(),
                 "[remat::checkpoint_sequential] module 6 of the ModuleList is a torch::nn::TanhImpl, not a "
                 "torch::nn::LinearImpl; pass the modules' common type, or a std::vector of callables.");
  }
  try {
    remat::checkpoint_sequential(fns, 13, x);
    ADD_FAILURE();
  } catch (const remat::Error& e) {
    EXPECT_STREQ(e.what(),
                 "[remat::checkpoint_sequential] segments must be in [1, 12] (the number of functions), got 13. Pass "
                 "a value in that range; 1 runs the whole list without checkpoints.");
  }
}

TEST(Checkpoint, ProcessWideEarlyStopDefault) {
  auto x = torch::randn({4, 8}, torch::requires_grad());
  auto f = [](const torch::Tensor& h) { return h.sin().cos().tanh().sum(); };
  EXPECT_TRUE(remat::checkpoint_early_stop());
  remat::set_checkpoint_early_stop(false);
  EXPECT_FALSE(remat::CheckpointOptions().early_stop());
  remat::reset_checkpoint_stats();
  remat::checkpoint(f, x).backward();
  EXPECT_EQ(remat::checkpoint_stats().early_stops, 0);
  remat::checkpoint(remat::CheckpointOptions().early_stop(true), f, x).backward();  // per call wins
  EXPECT_EQ(remat::checkpoint_stats().early_stops, 1);
  remat::set_checkpoint_early_stop(true);
  remat::checkpoint(f, x).backward();
  EXPECT_EQ(remat::checkpoint_stats().early_stops, 2);
}

struct ReadsSavedTwice : torch::autograd::Function<ReadsSavedTwice> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& h) {
    ctx->save_for_backward({h});
    return h * h;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    auto a = ctx->get_saved_variables();
    auto b = ctx->get_saved_variables();
    return {g[0] * (a[0] + b[0])};
  }
};

TEST(CheckpointErrors, SavedTensorReadTwiceIsAlreadyFreed) {
  auto x = torch::randn({4}, torch::requires_grad());
  auto f = [](const torch::Tensor& h) { return ReadsSavedTwice::apply(h.sin()); };
  f(x).sum().backward();  // plain autograd allows it
  remat::reset_checkpoint_stats();
  auto y = remat::checkpoint(f, x);
  try {
    y.sum().backward();
    ADD_FAILURE() << "must throw";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "[remat::checkpoint] a tensor saved inside a checkpointed region was unpacked a second time in the "
                  "same backward: it was already handed out and freed (PyTorch: \"Trying to backward through the "
                  "graph a second time (or directly access saved tensors after they have already been freed)\"). If "
                  "a custom autograd function calls ctx->get_saved_variables() in backward, call it once and keep "
                  "the result."),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(remat::checkpoint_stats().recomputations, 1) << "the function must not be re-run for the second read";
}

// CheckpointOptions().offload(...): each region's inputs (the checkpoints)
// go to disk while the rest is recomputed: gradients bitwise as plain, less
// held after the forward than checkpointing alone, files gone after
// backward. One store serves every region and step.
TEST(Checkpoint, OffloadOptionSendsTheCheckpointsToDisk) {
  remat::memory::enable_tracking();
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("remat_ck_offload_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  torch::manual_seed(3);
  std::vector<torch::nn::Linear> blocks;
  for (int i = 0; i < 6; ++i) blocks.emplace_back(256, 256);
  auto x = torch::randn({512, 256}, torch::requires_grad());
  auto run = [&](std::optional<remat::CheckpointOptions> o, int64_t* held, int64_t settle_below = 0) {
    for (auto& b : blocks) b->zero_grad();
    x.mutable_grad() = torch::Tensor();
    const int64_t before = remat::memory::current_bytes();
    torch::Tensor h = x;
    for (auto& b : blocks) {
      auto f = [b](const torch::Tensor& in) mutable { return torch::tanh(b->forward(in)) * 1.5; };
      h = o ? remat::checkpoint(*o, f, h) : f(h);
    }
    auto loss = h.pow(2).mean();
    h = torch::Tensor();
    *held = remat::memory::current_bytes() - before;
    // Disk writes run behind the forward: on a loaded machine a write may
    // still hold its tensor here. Up to 5 s for them to land.
    for (int k = 0; k < 250 && settle_below > 0 && *held > settle_below; ++k) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      *held = remat::memory::current_bytes() - before;
    }
    loss.backward();
    std::vector<torch::Tensor> g{x.grad().clone()};
    for (auto& b : blocks) g.push_back(b->weight.grad().clone());
    return g;
  };
  const int64_t act = 512 * 256 * 4;  // one block's output, bytes
  int64_t held_plain = 0, held_ck = 0, held_off = 0;
  const auto plain = run(std::nullopt, &held_plain);
  const auto ck = run(remat::CheckpointOptions(), &held_ck);
  const auto opts = remat::CheckpointOptions().offload(
      remat::OffloadOptions(remat::OffloadTarget::kDisk).directory(dir.string()).min_bytes(0));
  for (int step = 0; step < 2; ++step) {
    const auto off = run(opts, &held_off, std::min(held_ck - 4 * act, held_plain / 4 - 1));
    for (size_t i = 0; i < plain.size(); ++i) {
      EXPECT_TRUE(torch::equal(plain[i], ck[i])) << i;
      EXPECT_TRUE(torch::equal(plain[i], off[i])) << "step " << step << " grad " << i;
    }
    EXPECT_TRUE(fs::is_empty(dir)) << "files left after backward";
  }
  std::printf("  held after forward: plain %s, checkpoint %s, checkpoint + disk offload %s\n",
              remat::format_bytes(held_plain).c_str(), remat::format_bytes(held_ck).c_str(),
              remat::format_bytes(held_off).c_str());
  EXPECT_GE(held_ck - held_off, 4 * act) << "checkpointing alone " << held_ck << ", with offload " << held_off;
  EXPECT_LT(held_off, held_plain / 4);
  fs::remove_all(dir);
  try {
    remat::checkpoint(
        remat::CheckpointOptions().offload(remat::OffloadOptions(remat::OffloadTarget::kDisk)),
        [](const torch::Tensor& in) { return in.exp(); }, x);
    ADD_FAILURE() << "no directory";
  } catch (const remat::Error& e) {
    EXPECT_STREQ(e.what(),
                 "[remat::offload] OffloadTarget::kDisk needs a directory; set OffloadOptions().directory(path) to an "
                 "existing, writable directory.");
  }
}

}  // namespace
