// Higher-order autograd inside checkpointed regions: a
// region whose function itself calls autograd::grad or backward (gradient
// penalty, forces = -dE/dx), the nesting patterns of PyTorch's
// test_nested_checkpoint, early stop firing inside an inner backward, a
// selective policy over such a region, and what the forward keeps. Every
// gradient is compared bitwise with the plain run (same math on CPU), with
// early stop on and off.
#include "common.h"

#include <remat/memory.h>

namespace {

using remat_test::error_of;
using Fn = std::function<torch::Tensor(const torch::Tensor&)>;

remat::CheckpointOptions opts(bool early_stop) { return remat::CheckpointOptions().early_stop(early_stop); }

/** d sum(fn(x)) / dx, with a graph (create_graph), as PyTorch's tests write it. */
Fn grad_of(Fn fn) {
  return [fn](const torch::Tensor& x) {
    return torch::autograd::grad({fn(x).sum()}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true)[0];
  };
}

/** fn checkpointed (or plain when `on` is false: the reference). */
Fn ck(Fn fn, bool on, bool early_stop) {
  if (!on) return fn;
  return [fn, early_stop](const torch::Tensor& x) { return remat::checkpoint(opts(early_stop), fn, x); };
}

Fn sin_exp_sin() {
  return [](const torch::Tensor& x) { return x.sin().exp().sin(); };
}

Fn cos_mul() {
  return [](const torch::Tensor& x) { return x.cos() * x.sigmoid(); };
}

/** x.grad after backward of sum(build(checkpointing)(x)). */
torch::Tensor input_grad(const std::function<Fn(bool)>& build, bool checkpointing) {
  torch::manual_seed(3);
  auto x = torch::randn({7}, torch::dtype(torch::kDouble).requires_grad(true));
  build(checkpointing)(x).sum().backward();
  return x.grad();
}

void expect_same_as_plain(const std::function<Fn(bool)>& build, const char* what) {
  const auto plain = input_grad(build, false);
  const auto ckpt = input_grad(build, true);
  ASSERT_TRUE(ckpt.defined()) << what;
  EXPECT_TRUE(torch::equal(plain, ckpt)) << what << ": max diff " << (plain - ckpt).abs().max().item<double>();
}

// The compositions of PyTorch's test_nested_checkpoint and deeper, with c =
// checkpoint and g = grad (create_graph): every one bitwise as plain.
TEST(GradInside, NestedCompositionsMatchPlain) {
  for (bool es : {true, false}) {
    SCOPED_TRACE(es ? "early stop" : "no early stop");
    const Fn f = sin_exp_sin(), h = cos_mul();
    auto c = [es](Fn fn, bool on) { return ck(std::move(fn), on, es); };
    expect_same_as_plain([&](bool on) { return grad_of(c(f, on)); }, "g(c(f))");
    expect_same_as_plain([&](bool on) { return c(grad_of(f), on); }, "c(g(f))");
    expect_same_as_plain([&](bool on) { return grad_of(c(grad_of(f), on)); }, "g(c(g(f)))");
    expect_same_as_plain([&](bool on) { return grad_of(grad_of(c(f, on))); }, "g(g(c(f)))");
    expect_same_as_plain([&](bool on) { return c(grad_of(c(f, on)), on); }, "c(g(c(f)))");
    expect_same_as_plain([&](bool on) { return grad_of(c(grad_of(c(f, on)), on)); }, "g(c(g(c(f))))");
    expect_same_as_plain([&](bool on) { return c(grad_of(c(grad_of(c(f, on)), on)), on); }, "c(g(c(g(c(f)))))");
    expect_same_as_plain([&](bool on) { return grad_of(c(grad_of(grad_of(c(f, on))), on)); }, "g(c(g(g(c(f)))))");
    // Two checkpointed children under one grad, itself checkpointed.
    expect_same_as_plain(
        [&](bool on) {
          Fn both = [=](const torch::Tensor& x) { return c(f, on)(x) * c(h, on)(x); };
          return c(grad_of(both), on);
        },
        "c(g(c(f) * c(h)))");
  }
}

/** A small MLP: the energy of a "molecule" of 16 atoms in 3-D. */
struct Energy : torch::nn::Module {
  torch::nn::Linear l1{nullptr}, l2{nullptr}, l3{nullptr};
  Energy() {
    l1 = register_module("l1", torch::nn::Linear(3, 64));
    l2 = register_module("l2", torch::nn::Linear(64, 64));
    l3 = register_module("l3", torch::nn::Linear(64, 1));
  }
  torch::Tensor forward(const torch::Tensor& pos) {
    return l3(torch::tanh(l2(torch::tanh(l1(pos))))).sum();  // scalar energy
  }
};

/** One step of force matching: forces = -dE/dpos (create_graph), loss =
 *  |forces - target|^2 + energy; returns every parameter's grad and the
 *  positions' grad. The region holds the whole force computation. */
std::vector<torch::Tensor> force_step(bool checkpointing, bool early_stop, int64_t* recomputes = nullptr) {
  torch::manual_seed(5);
  auto model = std::make_shared<Energy>();
  auto pos = torch::randn({16, 3}, torch::requires_grad());
  auto target = torch::randn({16, 3});
  auto forces_and_energy = [&model](const torch::Tensor& p) {
    auto e = model->forward(p);
    auto forces = -torch::autograd::grad({e}, {p}, {}, /*retain_graph=*/true, /*create_graph=*/true)[0];
    return std::make_tuple(forces, e);
  };
  remat::reset_checkpoint_stats();
  auto [forces, e] =
      checkpointing ? remat::checkpoint(opts(early_stop), forces_and_energy, pos) : forces_and_energy(pos);
  ((forces - target).pow(2).sum() + e).backward();
  if (recomputes) *recomputes = remat::checkpoint_stats().recomputations;
  std::vector<torch::Tensor> grads{pos.grad()};
  for (auto& p : model->parameters()) grads.push_back(p.grad());
  return grads;
}

TEST(GradInside, ForceMatchingMatchesPlain) {
  const auto plain = force_step(false, true);
  for (bool es : {true, false}) {
    SCOPED_TRACE(es ? "early stop" : "no early stop");
    int64_t recomputes = 0;
    const auto ckpt = force_step(true, es, &recomputes);
    ASSERT_EQ(plain.size(), ckpt.size());
    for (size_t i = 0; i < plain.size(); ++i) {
      ASSERT_TRUE(ckpt[i].defined()) << "grad " << i;
      EXPECT_TRUE(torch::equal(plain[i], ckpt[i])) << "grad " << i;
    }
    // One re-run inside the forward (the inner grad unpacks what the first
    // run dropped), one in backward.
    EXPECT_EQ(recomputes, 2);
  }
}

// The GPT block with a gradient penalty on its input (WGAN-GP style),
// dropout on: RNG replayed in both re-runs.
TEST(GradInside, GradientPenaltyOnGptBlockMatchesPlain) {
  auto run = [](bool checkpointing, bool early_stop) {
    torch::manual_seed(11);
    remat_test::GptBlock block(32, 4, /*dropout=*/0.1);
    auto x = torch::randn({2, 8, 32}, torch::requires_grad());
    auto fn = [block](const torch::Tensor& in) mutable {
      auto y = block->forward(in);
      auto g = torch::autograd::grad({y.pow(2).sum()}, {in}, {}, true, true)[0];
      return y.mean() + 0.1 * (g.flatten(1).norm(2, 1) - 1).pow(2).mean();
    };
    torch::manual_seed(12);
    auto loss = checkpointing ? remat::checkpoint(opts(early_stop), fn, x) : fn(x);
    loss.backward();
    std::vector<torch::Tensor> grads{x.grad()};
    for (auto& p : block->parameters()) grads.push_back(p.grad());
    return grads;
  };
  const auto plain = run(false, true);
  for (bool es : {true, false}) {
    const auto ckpt = run(true, es);
    for (size_t i = 0; i < plain.size(); ++i) {
      ASSERT_TRUE(ckpt[i].defined()) << "grad " << i;
      EXPECT_TRUE(torch::equal(plain[i], ckpt[i])) << "grad " << i << (es ? " (early stop)" : "");
    }
  }
}

// fn = g o exp with the last saved tensors made by the inner backward: in
// the backward's re-run, early stop fires inside the re-run's own grad,
// i.e. inside the autograd engine, and must come out as a clean stop.
TEST(GradInside, EarlyStopInsideInnerBackward) {
  auto fn = [](const torch::Tensor& x) {
    auto y = x.exp();
    return torch::autograd::grad({y.sum()}, {x}, {}, true, true)[0];
  };
  torch::manual_seed(2);
  auto x = torch::randn({9}, torch::dtype(torch::kDouble).requires_grad(true));
  fn(x).pow(3).sum().backward();
  const auto plain = x.grad().clone();
  // The autograd engine counts reentrant depth per thread: a stop that
  // unwound past its bookkeeping would leak a level each time, and past its
  // limit (60) inner backwards would move to a pool thread without remat's
  // hooks. 80 steps find that.
  for (int step = 0; step < 80; ++step) {
    x.mutable_grad() = torch::Tensor();
    remat::reset_checkpoint_stats();
    remat::checkpoint(opts(true), fn, x).pow(3).sum().backward();
    ASSERT_TRUE(torch::equal(plain, x.grad())) << "step " << step;
    const auto s = remat::checkpoint_stats();
    ASSERT_EQ(s.recomputations, 2);
    ASSERT_EQ(s.early_stops, 2) << "the backward's re-run stops inside its inner grad";
  }
}

/** y = tanh(lin(x)); fn calls backward() on a side loss (accumulating into
 *  the weight's .grad) and returns 2y. */
struct SideLoss {
  torch::nn::Linear lin;
  torch::Tensor operator()(const torch::Tensor& x) {
    auto y = torch::tanh(lin->forward(x));
    torch::autograd::backward(std::vector<torch::Tensor>{y.pow(2).sum()}, {}, /*retain_graph=*/true,
                              /*create_graph=*/false, std::vector<torch::Tensor>{lin->weight});
    return 2 * y;
  }
};

// backward() inside the region accumulates once per step, as in the plain
// run: the re-run's own backward() leaves .grad as it found it, both when
// .grad was undefined (set) and defined (accumulated in place).
TEST(GradInside, BackwardInsideRegionAccumulatesOnce) {
  for (bool es : {true, false}) {
    torch::manual_seed(4);
    torch::nn::Linear lin(12, 12);
    SideLoss fn{lin};
    auto x = torch::randn({5, 12}, torch::requires_grad());
    std::vector<torch::Tensor> plain, ckpt;
    for (int step = 0; step < 2; ++step) {  // no zero_grad: the second step accumulates
      fn(x).sum().backward();
      plain.push_back(lin->weight.grad().clone());
    }
    lin->weight.mutable_grad() = torch::Tensor();
    lin->bias.mutable_grad() = torch::Tensor();
    x.mutable_grad() = torch::Tensor();
    for (int step = 0; step < 2; ++step) {
      remat::checkpoint(opts(es), fn, x).sum().backward();
      ckpt.push_back(lin->weight.grad().clone());
    }
    for (int step = 0; step < 2; ++step) {
      EXPECT_TRUE(torch::equal(plain[step], ckpt[step])) << "step " << step << (es ? " (early stop)" : "");
    }
  }
}

// A selective policy over a region that runs grad: matmuls saved in the
// first run (including those of the inner backward) are handed back.
TEST(GradInside, SelectivePolicyWithInnerGrad) {
  auto run = [](std::optional<remat::Policy> policy) {
    torch::manual_seed(8);
    torch::nn::Linear a(16, 32), b(32, 16);
    auto x = torch::randn({6, 16}, torch::requires_grad());
    auto fn = [a, b](const torch::Tensor& in) mutable {
      auto y = b(torch::gelu(a(in)));
      auto g = torch::autograd::grad({y.pow(2).sum()}, {in}, {}, true, true)[0];
      return y.sum() + g.pow(2).sum();
    };
    remat::reset_checkpoint_stats();
    auto loss = policy ? remat::checkpoint(remat::CheckpointOptions().policy(*policy), fn, x) : fn(x);
    loss.backward();
    return std::make_tuple(x.grad(), a->weight.grad(), b->weight.grad(), remat::checkpoint_stats());
  };
  auto [gx, ga, gb, s0] = run(std::nullopt);
  auto [cx, ca, cb, s] = run(remat::policy::save_matmuls());
  EXPECT_TRUE(torch::equal(gx, cx));
  EXPECT_TRUE(torch::equal(ga, ca));
  EXPECT_TRUE(torch::equal(gb, cb));
  EXPECT_GT(s.ops_replayed, 0) << "saved matmuls are handed back in the re-runs";
}

// What a re-run inside the forward refilled is not kept past the forward:
// after it, the region holds no more than a region without an inner grad
// would, and far less than the plain run.
TEST(GradInside, ForwardKeepsNoRecomputedTensors) {
  remat::memory::enable_tracking();
  torch::manual_seed(6);
  auto w1 = torch::randn({256, 256}, torch::requires_grad());
  auto w2 = torch::randn({256, 256}, torch::requires_grad());
  auto x = torch::randn({512, 256}, torch::requires_grad());
  auto fn = [w1, w2](const torch::Tensor& in) {
    auto y = torch::tanh(torch::tanh(in.mm(w1)).mm(w2));
    // Only w2's grad: the inner backward consumes part of the slots.
    auto g = torch::autograd::grad({y.sum()}, {w2}, {}, true, true)[0];
    return y.sum() + g.pow(2).sum();
  };
  auto held_after_forward = [&](bool checkpointing) {
    const int64_t before = remat::memory::current_bytes();
    auto loss = checkpointing ? remat::checkpoint(fn, x) : fn(x);
    const int64_t held = remat::memory::current_bytes() - before;
    loss.backward();
    return held;
  };
  const int64_t plain = held_after_forward(false);
  const int64_t ckpt = held_after_forward(true);
  const int64_t act = 512 * 256 * 4;  // one (512, 256) float activation, bytes
  EXPECT_GE(plain, 2 * act) << "plain keeps the tanh outputs";
  EXPECT_LE(ckpt, act / 4) << "checkpointed: " << ckpt << " bytes kept after the forward";
}

}  // namespace
