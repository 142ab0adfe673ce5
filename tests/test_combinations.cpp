// Levers used together, as real programs combine them: nested regions with
// policies or the debug mode, policies under autocast and InferenceMode,
// retained graphs through list outputs, in-place activations on a region's
// input, inspection that must change nothing. Each case is compared with a
// plain run, bitwise on CPU (the arithmetic is the same), and counts how
// often the functions ran where that matters.
#include "common.h"

#include <ATen/autocast_mode.h>
#include <c10/core/InferenceMode.h>

#include <atomic>
#include <chrono>
#include <future>
#include <thread>

using namespace remat_test;
namespace pol = remat::policy;

namespace {

/** Every tensor of the list, cloned (gradients and buffers to compare). */
std::vector<torch::Tensor> cloned(const std::vector<torch::Tensor>& v) {
  std::vector<torch::Tensor> out;
  for (const auto& t : v) out.push_back(t.defined() ? t.detach().clone() : t);
  return out;
}

/** An outer region (default options) whose function runs an inner region
 *  and writes in place into the inner region's output, in every variant of
 *  the inner options that pushes an op interceptor. */
struct NestedWrite {
  torch::Tensor w = torch::randn({16, 16}).requires_grad_();
  int inner_runs = 0;

  torch::Tensor inner(const torch::Tensor& h) {
    ++inner_runs;
    return torch::mm(h, w) + 0.5;  // (16, 16); the add saves neither input
  }
  torch::Tensor body(const torch::Tensor& x, const std::optional<remat::CheckpointOptions>& inner_opts) {
    auto y = inner_opts ? remat::checkpoint(
                              *inner_opts, [this](const torch::Tensor& h) { return inner(h); }, x * 1.5)
                        : inner(x * 1.5);
    y.sigmoid_();  // saves its result: the inner region's output, written
    return y * 2;
  }
  std::vector<torch::Tensor> grads(const std::optional<remat::CheckpointOptions>& inner_opts, bool outer) {
    auto x = torch::linspace(-2, 2, 256).reshape({16, 16}).requires_grad_();
    w.mutable_grad() = torch::Tensor();
    auto out =
        outer ? remat::checkpoint([&](const torch::Tensor& h) { return body(h, inner_opts); }, x) : body(x, inner_opts);
    out.square().sum().backward();
    return {w.grad().clone(), x.grad().clone()};
  }
};

}  // namespace

// An inner region that intercepts ops (a policy, the debug mode, the global
// debug switch) used to replace the outer re-run's write guard: the guard
// never saw the inner ops' outputs, took the written output for a tensor
// that outlives the re-run and "restored" it under autograd's feet.
TEST(Combinations, NestedPolicyOrDebugRegionKeepsTheOuterWriteGuard) {
  torch::manual_seed(0);
  NestedWrite m;
  const auto plain = m.grads(std::nullopt, false);
  const std::vector<std::pair<std::string, remat::CheckpointOptions>> variants = {
      {"save_nothing", remat::CheckpointOptions().policy(pol::save_nothing())},
      {"save_matmuls", remat::CheckpointOptions().policy(pol::save_matmuls())},
      {"debug", remat::CheckpointOptions().debug(true)},
      {"plain inner", remat::CheckpointOptions()},
  };
  for (const auto& [name, opts] : variants) {
    SCOPED_TRACE(name);
    m.inner_runs = 0;
    expect_bitwise_equal(plain, m.grads(opts, true));
    // forward 1, the outer re-run 1, the inner region's own re-run 1 (its
    // own first run inside the outer re-run is a new region)
    EXPECT_GE(m.inner_runs, 2);
    EXPECT_LE(m.inner_runs, 3);
  }
  remat::set_checkpoint_debug(true);
  {
    SCOPED_TRACE("set_checkpoint_debug(true)");
    expect_bitwise_equal(plain, m.grads(remat::CheckpointOptions(), true));
  }
  remat::set_checkpoint_debug(false);
}

// The same nesting with a BatchNorm inside the inner region (called through
// a lambda, so no module buffers are restored by the replay): its running
// statistics and counter move once per step, as in a plain run.
TEST(Combinations, NestedPolicyRegionMovesBatchNormStatisticsOnce) {
  auto run = [](int mode) {
    torch::manual_seed(1);
    torch::nn::BatchNorm2d bn(4);
    torch::nn::Conv2d conv(torch::nn::Conv2dOptions(4, 4, 3).padding(1));
    auto block = [&](const torch::Tensor& h) { return torch::relu(bn(conv(h))); };
    auto inner_opts =
        mode == 2 ? remat::CheckpointOptions().debug(true) : remat::CheckpointOptions().policy(pol::save_matmuls());
    std::vector<torch::Tensor> grads;
    for (int step = 0; step < 3; ++step) {
      auto x = torch::randn({2, 4, 6, 6}).requires_grad_();
      auto outer = [&](const torch::Tensor& h) {
        auto y = remat::checkpoint(inner_opts, block, h * 2);
        return y * y;
      };
      auto y = mode == 0 ? outer(x) : remat::checkpoint(outer, x);
      y.sum().backward();
      grads.push_back(x.grad().clone());
    }
    for (auto& p : conv->parameters()) grads.push_back(p.grad().clone());
    grads.push_back(bn->running_mean.clone());
    grads.push_back(bn->running_var.clone());
    grads.push_back(bn->num_batches_tracked.clone());
    return grads;
  };
  const auto plain = run(0);
  EXPECT_EQ(plain.back().item<int64_t>(), 3);
  {
    SCOPED_TRACE("inner policy");
    expect_bitwise_equal(plain, run(1));
  }
  {
    SCOPED_TRACE("inner debug");
    expect_bitwise_equal(plain, run(2));
  }
}

// checkpoint_name inside an inner region reaches an outer region's policy
// too: an inner interceptor does not hide names from the outer one.
TEST(Combinations, NamesInsideAnInnerRegionReachTheOuterPolicy) {
  torch::manual_seed(2);
  auto w = torch::randn({8, 8}).requires_grad_();
  auto inner = [&](const torch::Tensor& h) { return remat::checkpoint_name(torch::mm(h, w).tanh(), "t") * 3; };
  auto body = [&](const torch::Tensor& x, bool nested) {
    auto y = nested ? remat::checkpoint(remat::CheckpointOptions().policy(pol::save_nothing()), inner, x) : inner(x);
    return y.sin();
  };
  auto x = torch::randn({8, 8}).requires_grad_();
  body(x, false).sum().backward();
  const auto plain = cloned({w.grad(), x.grad()});
  w.mutable_grad() = torch::Tensor();
  x.mutable_grad() = torch::Tensor();
  remat::reset_checkpoint_stats();
  auto y = remat::checkpoint(
      remat::CheckpointOptions().policy(pol::save_names({"t"})), [&](const torch::Tensor& h) { return body(h, true); },
      x);
  EXPECT_EQ(remat::checkpoint_stats().ops_saved, 1) << "the outer policy saves the tanh named inside the inner region";
  y.sum().backward();
  expect_bitwise_equal(plain, {w.grad(), x.grad()});
}

// Autocast's cast cache serves a parameter's cast in one run and not in the
// other; the op cache, keyed by occurrence of each op, must not hand one
// cast's saved output to another cast of the same shape.
TEST(Combinations, PolicyUnderAutocastHandsBackTheRightCast) {
  torch::manual_seed(3);
  auto w = torch::randn({16, 16}).requires_grad_();
  auto fn = [&](const torch::Tensor& x) {
    auto a = torch::mm(x, w);        // casts x, then w (cached by autocast)
    auto b = torch::mm(x.cos(), w);  // casts x.cos() (16, 16); w from the cache
    return (a.to(torch::kFloat) * b.to(torch::kFloat)).sin();
  };
  auto all = remat::Policy("save_all", [](const remat::OpCall&) { return remat::OpDecision::kPreferSave; });
  auto run = [&](const std::optional<remat::Policy>& p) {
    at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    auto x = torch::randn({16, 16}, torch::TensorOptions().dtype(torch::kFloat)).mul(0.5).requires_grad_();
    w.mutable_grad() = torch::Tensor();
    auto y = p ? remat::checkpoint(remat::CheckpointOptions().policy(*p), fn, x) : fn(x);
    auto loss = y.sum();
    loss.backward();  // under autocast, as a training loop's scope would be
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
    return cloned({w.grad(), x.grad()});
  };
  torch::manual_seed(30);
  const auto plain = run(std::nullopt);
  for (const auto& p : {pol::save_ops({"aten::_to_copy"}), all, pol::save_matmuls()}) {
    SCOPED_TRACE(p.description());
    torch::manual_seed(30);
    expect_bitwise_equal(plain, run(p));
  }
  EXPECT_TRUE(at::autocast::is_autocast_cache_enabled()) << "the region puts autocast's cache flag back";
}

// A saved op that runs inside an InferenceMode block in the region: its
// outputs are inference tensors, which have no version counter.
TEST(Combinations, PolicyWithAnInferenceModeBlockInTheRegion) {
  torch::manual_seed(5);
  auto w = torch::randn({8, 8}).requires_grad_();
  auto fn = [&](const torch::Tensor& x) {
    torch::Tensor k;
    {
      c10::InferenceMode guard;
      k = torch::mm(w.detach(), w.detach().t());  // an inference tensor, saved by the policy
    }
    return torch::mm(x, w).tanh() + k;
  };
  auto x = torch::randn({8, 8}).requires_grad_();
  fn(x).sum().backward();
  const auto plain = cloned({w.grad(), x.grad()});
  w.mutable_grad() = torch::Tensor();
  x.mutable_grad() = torch::Tensor();
  remat::reset_checkpoint_stats();
  auto y = remat::checkpoint(remat::CheckpointOptions().policy(pol::save_matmuls()).early_stop(false), fn, x);
  y.sum().backward();
  expect_bitwise_equal(plain, {w.grad(), x.grad()});
  EXPECT_EQ(remat::checkpoint_stats().ops_saved, 2);
  EXPECT_EQ(remat::checkpoint_stats().ops_replayed, 2);
}

// unsafe_chunk returns a list; an in-place op on one chunk in the re-run
// must not write into the saved list kept for a second (retained) backward.
TEST(Combinations, ListOutputsWrittenInTheRerunSurviveRetainGraph) {
  auto all = remat::Policy("save_all", [](const remat::OpCall&) { return remat::OpDecision::kPreferSave; });
  auto fn = [](const torch::Tensor& x) {
    auto parts = (x * 2).unsafe_chunk(2, 0);
    parts[0].sigmoid_();
    return parts[0] * parts[1];
  };
  torch::manual_seed(6);
  auto x = torch::randn({8, 4}).requires_grad_();
  auto y = fn(x);
  y.sum().backward({}, /*retain_graph=*/true);
  y.sum().backward();
  const auto plain = x.grad().clone();
  x.mutable_grad() = torch::Tensor();
  for (bool early : {true, false}) {
    SCOPED_TRACE(early ? "early stop" : "no early stop");
    auto z = remat::checkpoint(remat::CheckpointOptions().policy(all).early_stop(early), fn, x);
    z.sum().backward({}, /*retain_graph=*/true);
    z.sum().backward();
    expect_bitwise_equal({plain}, {x.grad()});
    x.mutable_grad() = torch::Tensor();
  }
}

// saved_residuals runs the function once to look: BatchNorm statistics and
// anything else it writes are as they were afterwards.
TEST(Combinations, SavedResidualsLeavesBatchNormStatisticsUnchanged) {
  torch::manual_seed(7);
  torch::nn::BatchNorm1d bn(8);
  bn->running_mean.uniform_();
  const auto mean = bn->running_mean.clone(), var = bn->running_var.clone();
  const auto count = bn->num_batches_tracked.clone();
  auto fn = [&](const torch::Tensor& x) { return torch::relu(bn(x)); };
  auto x = torch::randn({16, 8}).requires_grad_();
  auto r = remat::saved_residuals(fn, x);
  EXPECT_GT(r.residuals.size(), 0u);
  auto r2 = remat::saved_residuals(pol::save_matmuls(), fn, x);
  EXPECT_GT(r2.residuals.size(), 0u);
  EXPECT_TRUE(torch::equal(bn->running_mean, mean));
  EXPECT_TRUE(torch::equal(bn->running_var, var));
  EXPECT_TRUE(torch::equal(bn->num_batches_tracked, count));
}

namespace {

/** A CNN block as U-Nets write it: an in-place LeakyReLU on the block's
 *  input, then a convolution and a skip that reads the activated input. */
struct InplaceBlockImpl : torch::nn::Module, remat::Checkpointable {
  explicit InplaceBlockImpl(int64_t c)
      : act(register_module("act",
                            torch::nn::LeakyReLU(torch::nn::LeakyReLUOptions().negative_slope(0.2).inplace(true)))),
        conv(register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(c, c, 3).padding(1)))) {}
  torch::Tensor body(torch::Tensor x) {
    ++runs;
    x = act(x);
    return conv(x) + x;
  }
  torch::Tensor forward(torch::Tensor x) {
    return checkpointed([this](const torch::Tensor& h) { return body(h); }, x);
  }
  torch::nn::LeakyReLU act;
  torch::nn::Conv2d conv;
  int runs = 0;
};
TORCH_MODULE(InplaceBlock);

struct InplaceNetImpl : torch::nn::Module {
  InplaceNetImpl() : stem(register_module("stem", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 4, 3).padding(1)))) {
    for (int i = 0; i < 3; ++i) blocks.push_back(register_module("b" + std::to_string(i), InplaceBlock(4)));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = stem(x);
    for (auto& b : blocks) x = b(x);
    return x;
  }
  torch::nn::Conv2d stem;
  std::vector<InplaceBlock> blocks;
};
TORCH_MODULE(InplaceNet);

}  // namespace

// In-place activation on the region's input: the write happens inside the
// region, during its forward, and the re-run starts from the values the
// forward started from.
TEST(Combinations, InplaceActivationOnTheRegionInputUnderCheckpoint) {
  torch::manual_seed(8);
  InplaceNet net;
  auto x = torch::randn({2, 3, 8, 8});
  auto grads_with = [&](const std::function<torch::Tensor(torch::Tensor)>& run) {
    for (auto& p : net->parameters()) p.mutable_grad() = torch::Tensor();
    run(x.clone()).square().mean().backward();
    std::vector<torch::Tensor> g;
    for (auto& p : net->parameters()) g.push_back(p.grad().clone());
    return g;
  };
  const auto plain = grads_with([&](torch::Tensor h) { return net(h); });
  {
    SCOPED_TRACE("remat::checkpoint on each block");
    auto got = grads_with([&](torch::Tensor h) {
      h = net->stem(h);
      for (auto& b : net->blocks) {
        h = remat::checkpoint([&](const torch::Tensor& v) { return b->body(v); }, h);
      }
      return h;
    });
    expect_bitwise_equal(plain, got);
  }
  for (bool early : {true, false}) {
    SCOPED_TRACE(early ? "enable_checkpointing, early stop" : "enable_checkpointing, no early stop");
    EXPECT_EQ(remat::enable_checkpointing(*net, remat::select::type<InplaceBlockImpl>(),
                                          remat::CheckpointOptions().early_stop(early)),
              3);
    for (auto& b : net->blocks) b->runs = 0;
    auto got = grads_with([&](torch::Tensor h) { return net(h); });
    expect_bitwise_equal(plain, got);
    for (auto& b : net->blocks) EXPECT_EQ(b->runs, 2) << "forward once, recomputed once";
    // A second backward through a retained graph recomputes from the same copy.
    remat::disable_checkpointing(*net);
  }
  {
    SCOPED_TRACE("with a policy, retain_graph");
    remat::enable_checkpointing(*net, remat::select::type<InplaceBlockImpl>(),
                                remat::CheckpointOptions().policy(pol::save_matmuls()));
    for (auto& p : net->parameters()) p.mutable_grad() = torch::Tensor();
    auto loss = net(x.clone()).square().mean();
    loss.backward({}, /*retain_graph=*/true);
    loss.backward();
    remat::disable_checkpointing(*net);
    std::vector<torch::Tensor> twice;
    for (auto& p : net->parameters()) twice.push_back(p.grad().clone());
    for (auto& p : net->parameters()) p.mutable_grad() = torch::Tensor();
    auto l2 = net(x.clone()).square().mean();
    l2.backward({}, /*retain_graph=*/true);
    l2.backward();
    std::vector<torch::Tensor> plain_twice;
    for (auto& p : net->parameters()) plain_twice.push_back(p.grad().clone());
    expect_bitwise_equal(plain_twice, twice);
  }
}

// checkpoint_sequential over a Sequential whose segments start with an
// in-place activation on the segment's input.
TEST(Combinations, InplaceActivationAtSegmentStartsUnderCheckpointSequential) {
  torch::manual_seed(9);
  torch::nn::Sequential seq;
  for (int i = 0; i < 4; ++i) {
    seq->push_back(torch::nn::LeakyReLU(torch::nn::LeakyReLUOptions().negative_slope(0.1).inplace(true)));
    seq->push_back(torch::nn::Conv2d(torch::nn::Conv2dOptions(4, 4, 3).padding(1)));
  }
  auto x = torch::randn({2, 4, 6, 6});
  auto grads = [&](bool ck) {
    for (auto& p : seq->parameters()) p.mutable_grad() = torch::Tensor();
    auto leaf = x.clone().requires_grad_();
    auto h = leaf * 1.0;  // a non-leaf, as a previous layer's output would be
    auto y = ck ? remat::checkpoint_sequential(seq, 4, h) : seq->forward(h);
    y.square().mean().backward();
    std::vector<torch::Tensor> g;
    for (auto& p : seq->parameters()) g.push_back(p.grad().clone());
    g.push_back(leaf.grad().clone());
    return g;
  };
  const auto plain = grads(false);
  expect_bitwise_equal(plain, grads(true));
}

// A write into the region's input after its forward (outside the region)
// is still refused: recomputing from it would be wrong.
TEST(Combinations, InputWrittenAfterTheForwardIsStillRefused) {
  auto w = torch::randn({4, 4}).requires_grad_();
  auto x = torch::randn({4, 4});
  auto y = remat::checkpoint([&](const torch::Tensor& h) { return torch::mm(h, w).tanh(); }, x);
  x.add_(1);
  const std::string err = error_of([&] { y.sum().backward(); });
  EXPECT_NE(err.find("input 0 of a checkpointed function was modified in place after the forward"), std::string::npos)
      << err;
}

// The nested cases above on two threads at once (each its own model), as
// the thread and sanitizer runs see them: interceptor stacks are per thread.
TEST(Combinations, NestedPoliciesAndInplaceInputsOnTwoThreads) {
  struct Models {
    NestedWrite m;
    InplaceNet net;
  };
  auto make = [](uint64_t seed) {
    torch::manual_seed(seed);  // on the main thread: the generator is process-wide
    return std::make_unique<Models>();
  };
  auto work = [](Models& mo, bool ck) {
    std::vector<torch::Tensor> out;
    if (ck) {
      remat::enable_checkpointing(*mo.net, remat::select::type<InplaceBlockImpl>(),
                                  remat::CheckpointOptions().policy(pol::save_nothing()));
    }
    for (int step = 0; step < 3; ++step) {
      auto g = mo.m.grads(
          ck ? std::optional<remat::CheckpointOptions>(remat::CheckpointOptions().policy(pol::save_matmuls()))
             : std::nullopt,
          ck);
      out.insert(out.end(), g.begin(), g.end());
      for (auto& p : mo.net->parameters()) p.mutable_grad() = torch::Tensor();
      mo.net(torch::ones({1, 3, 6, 6}) * (step + 1)).square().mean().backward();
      for (auto& p : mo.net->parameters()) out.push_back(p.grad().clone());
    }
    return out;
  };
  auto p1 = make(11), p2 = make(12), c1 = make(11), c2 = make(12);
  const auto plain1 = work(*p1, false), plain2 = work(*p2, false);
  std::vector<torch::Tensor> got1, got2;
  std::thread t1([&] { got1 = work(*c1, true); });
  std::thread t2([&] { got2 = work(*c2, true); });
  t1.join();
  t2.join();
  expect_bitwise_equal(plain1, got1);
  expect_bitwise_equal(plain2, got2);
}

// A region whose function runs a checkpointed branch with dropout on
// another thread and waits for it (std::async + get()): the branch borrows
// the RNG lock the waiting region holds, in the forward and again in the
// re-run, and every mask equals the plain run's.
TEST(Combinations, RegionAwaitingACheckpointedBranchOnAnotherThread) {
  torch::manual_seed(13);
  torch::nn::Linear a(16, 16), b(16, 16);
  torch::nn::Dropout drop(0.3);
  auto branch = [&](const torch::Tensor& h) { return drop(torch::tanh(b(h))); };
  auto body = [&](const torch::Tensor& x, bool ck) {
    auto h = drop(a(x));
    auto z = std::async(std::launch::async, [&] { return ck ? remat::checkpoint(branch, h) : branch(h); }).get();
    return drop(z * h);
  };
  auto x = torch::randn({8, 16});
  auto grads = [&](bool ck) {
    for (auto* m : {a.ptr().get(), b.ptr().get()}) {
      for (auto& p : m->parameters()) p.mutable_grad() = torch::Tensor();
    }
    torch::manual_seed(14);
    auto y = ck ? remat::checkpoint([&](const torch::Tensor& v) { return body(v, true); }, x) : body(x, false);
    y.square().sum().backward();
    std::vector<torch::Tensor> g;
    for (auto* m : {a.ptr().get(), b.ptr().get()}) {
      for (auto& p : m->parameters()) g.push_back(p.grad().clone());
    }
    return g;
  };
  const auto plain = grads(false);
  remat::reset_checkpoint_stats();
  // A watchdog: a regression deadlocks, so run the step on a thread and end
  // the process after a minute instead of stalling the suite.
  std::promise<std::vector<torch::Tensor>> done;
  auto got = done.get_future();
  std::thread([&] { done.set_value(grads(true)); }).detach();
  if (got.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    std::fprintf(stderr, "deadlock: the branch never got the RNG lock\n");
    std::abort();
  }
  expect_bitwise_equal(plain, got.get());
  EXPECT_GE(remat::checkpoint_stats().recomputations, 2) << "the outer region and the branch were both recomputed";
}

namespace {

/** pix2pix's U-Net generator block, as its LibTorch ports write it: the
 *  down path opens with an in-place LeakyReLU on the block's input, which
 *  the skip then concatenates; each block nests the next one, so switching
 *  every block on nests regions (with policies) as deep as the U-Net. */
struct UnetBlockImpl : torch::nn::Module, remat::Checkpointable {
  UnetBlockImpl(int64_t outer_nc, int64_t inner_nc, std::shared_ptr<UnetBlockImpl> sub, bool outermost, bool innermost)
      : outermost_(outermost) {
    namespace nn = torch::nn;
    auto down_conv = nn::Conv2d(nn::Conv2dOptions(outer_nc, inner_nc, 4).stride(2).padding(1).bias(false));
    const int64_t up_in = innermost ? inner_nc : inner_nc * 2;
    auto up_conv = nn::ConvTranspose2d(nn::ConvTranspose2dOptions(up_in, outer_nc, 4).stride(2).padding(1));
    if (!outermost) model->push_back(nn::LeakyReLU(nn::LeakyReLUOptions().negative_slope(0.2).inplace(true)));
    model->push_back(down_conv);
    if (!outermost && !innermost) model->push_back(nn::BatchNorm2d(inner_nc));
    if (sub) model->push_back(sub);
    model->push_back(nn::ReLU(nn::ReLUOptions().inplace(true)));
    model->push_back(up_conv);
    if (outermost) {
      model->push_back(nn::Tanh());
    } else {
      model->push_back(nn::BatchNorm2d(outer_nc));
    }
    register_module("model", model);
  }
  torch::Tensor body(torch::Tensor x) {
    if (outermost_) return model->forward(x);
    auto y = model->forward(x);
    return torch::cat({x, y}, 1);
  }
  torch::Tensor forward(torch::Tensor x) {
    return checkpointed([this](const torch::Tensor& h) { return body(h); }, x);
  }
  bool outermost_;
  torch::nn::Sequential model;
};
TORCH_MODULE(UnetBlock);

/** The generator: `levels` blocks at the innermost width, then the three outer ones. */
UnetBlock unet(int64_t levels, int64_t ngf) {
  UnetBlock block = UnetBlock(ngf * 4, ngf * 4, nullptr, false, true);
  for (int64_t i = 0; i + 2 < levels; ++i) block = UnetBlock(ngf * 4, ngf * 4, block.ptr(), false, false);
  block = UnetBlock(ngf * 2, ngf * 4, block.ptr(), false, false);
  block = UnetBlock(ngf, ngf * 2, block.ptr(), false, false);
  return UnetBlock(3, ngf, block.ptr(), true, false);
}

}  // namespace

// The program the combination defects were found with: a pix2pix U-Net
// (BatchNorm, in-place LeakyReLU on each block's input, blocks nested in
// blocks) with every block switched on, under a selective policy or none,
// trained 4 SGD steps: parameters, gradients and BatchNorm statistics and
// counters bitwise equal to the plain run.
TEST(Combinations, Pix2PixUnetWithEveryBlockSwitchedOn) {
  auto train = [](const std::optional<remat::CheckpointOptions>& opts) {
    torch::manual_seed(21);
    UnetBlock net = unet(3, 4);
    if (opts) {
      EXPECT_EQ(remat::enable_checkpointing(*net, remat::select::type<UnetBlockImpl>(), *opts), 5);
    }
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.05));
    std::vector<torch::Tensor> out;
    torch::manual_seed(22);
    for (int step = 0; step < 4; ++step) {
      auto x = torch::randn({2, 3, 32, 32});
      auto target = torch::randn({2, 3, 32, 32});
      sgd.zero_grad();
      (net(x) - target).abs().mean().backward();
      for (auto& p : net->parameters()) out.push_back(p.grad().clone());
      sgd.step();
    }
    for (auto& p : net->parameters()) out.push_back(p.detach().clone());
    for (auto& b : net->buffers()) out.push_back(b.clone());
    return out;
  };
  const auto plain = train(std::nullopt);
  for (const auto& [name, opts] : std::vector<std::pair<std::string, remat::CheckpointOptions>>{
           {"full recompute", remat::CheckpointOptions()},
           {"save_matmuls", remat::CheckpointOptions().policy(pol::save_matmuls())},
           {"save_nothing, debug", remat::CheckpointOptions().policy(pol::save_nothing()).debug(true)},
           {"no early stop", remat::CheckpointOptions().early_stop(false).policy(pol::save_matmuls())}}) {
    SCOPED_TRACE(name);
    remat::reset_checkpoint_stats();
    expect_bitwise_equal(plain, train(opts));
    EXPECT_GT(remat::checkpoint_stats().recomputations, 0);
  }
}
