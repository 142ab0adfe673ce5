// Selective checkpointing: op policies through the dispatcher, names, and
// saved-residual inspection. Gradients against plain runs (bitwise on CPU),
// kernel executions counted by a custom op's own kernel (independent of
// remat's counters), memory measured by remat::memory, errors pinned.
#include "common.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <atomic>
#include <filesystem>

#include <unistd.h>

using namespace remat_test;
namespace pol = remat::policy;

namespace {

// remat_test::counted_mm: an mm whose CPU kernel counts its executions, with
// its own autograd formula, so a test can see whether a recompute ran it.
std::atomic<int> g_counted_runs{0};

at::Tensor counted_mm_cpu(const at::Tensor& a, const at::Tensor& b) {
  g_counted_runs.fetch_add(1);
  return at::mm(a, b);
}

class CountedMm : public torch::autograd::Function<CountedMm> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b) {
    ctx->save_for_backward({a, b});
    at::AutoDispatchBelowADInplaceOrView below;
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("remat_test::counted_mm", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
    return op.call(a, b);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    auto s = ctx->get_saved_variables();
    return {g[0].mm(s[1].t()), s[0].t().mm(g[0])};
  }
};

TORCH_LIBRARY(remat_test, m) { m.def("counted_mm(Tensor a, Tensor b) -> Tensor"); }
TORCH_LIBRARY_IMPL(remat_test, CPU, m) { m.impl("counted_mm", counted_mm_cpu); }
TORCH_LIBRARY_IMPL(remat_test, Autograd, m) {
  m.impl("counted_mm", [](const at::Tensor& a, const at::Tensor& b) { return CountedMm::apply(a, b); });
}

at::Tensor counted_mm(const at::Tensor& a, const at::Tensor& b) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("remat_test::counted_mm", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return op.call(a, b);
}

bool fake_key_included() { return c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::Fake); }

struct TwoMm {
  torch::Tensor w1 = torch::randn({32, 32}, torch::requires_grad());
  torch::Tensor w2 = torch::randn({32, 32}, torch::requires_grad());
  torch::Tensor operator()(const torch::Tensor& x) const { return counted_mm(counted_mm(x, w1).tanh(), w2).tanh(); }
};

/** Kernel runs of counted_mm in the forward and in the backward of one
 *  checkpointed step, and the gradients. */
struct Runs {
  int forward = 0, backward = 0;
  std::vector<torch::Tensor> grads;
};

Runs run_two_mm(const TwoMm& f, const torch::Tensor& x, const std::optional<remat::Policy>& p) {
  for (auto* t : {&f.w1, &f.w2}) const_cast<torch::Tensor*>(t)->mutable_grad() = torch::Tensor();
  Runs r;
  g_counted_runs = 0;
  torch::Tensor y;
  if (p) {
    y = remat::checkpoint(remat::CheckpointOptions().policy(*p), f, x);
  } else {
    y = f(x);
  }
  r.forward = g_counted_runs.exchange(0);
  y.square().sum().backward();
  r.backward = g_counted_runs.exchange(0);
  r.grads = {f.w1.grad().clone(), f.w2.grad().clone()};
  return r;
}

TEST(Selective, SavedOpsAreNotRerunAndMustRecomputeOpsAre) {
  torch::manual_seed(0);
  TwoMm f;
  auto x = torch::randn({16, 32});
  const Runs plain = run_two_mm(f, x, std::nullopt);
  EXPECT_EQ(plain.forward, 2);
  EXPECT_EQ(plain.backward, 0);

  remat::reset_checkpoint_stats();
  const Runs saved = run_two_mm(f, x, pol::save_ops({"remat_test::counted_mm"}));
  EXPECT_EQ(saved.forward, 2);
  EXPECT_EQ(saved.backward, 0) << "a saved op ran again in the recompute";
  expect_bitwise_equal(plain.grads, saved.grads);
  const auto stats = remat::op_stats();
  ASSERT_EQ(stats.count("remat_test::counted_mm"), 1u);
  EXPECT_EQ(stats.at("remat_test::counted_mm").saved, 2);
  EXPECT_EQ(stats.at("remat_test::counted_mm").replayed, 2);
  EXPECT_EQ(stats.at("remat_test::counted_mm").recomputed, 0);
  EXPECT_EQ(stats.at("aten::tanh").recomputed, 2);
  EXPECT_EQ(remat::checkpoint_stats().ops_replayed, 2);

  for (const auto& p :
       {pol::save_nothing(), pol::recompute_ops({"remat_test::counted_mm"}),
        pol::any_of({pol::save_ops({"remat_test::counted_mm"}), pol::recompute_ops({"remat_test::counted_mm"})})}) {
    const Runs r = run_two_mm(f, x, p);
    EXPECT_EQ(r.backward, 2) << p.description() << ": every counted_mm must run again";
    expect_bitwise_equal(plain.grads, r.grads);
  }
}

// Every region's first run intercepts ops (it copies an input before fn
// first writes into it, NOTE [inputs written by the region]); outside
// regions nothing is intercepted, and interception ends with the region.
TEST(Selective, InterceptionOnlyInsideRegions) {
  TwoMm f;
  auto x = torch::randn({4, 32});
  EXPECT_FALSE(fake_key_included());
  bool inside = true;
  auto y = remat::checkpoint(
      [&](const torch::Tensor& h) {
        inside = fake_key_included();
        return f(h);
      },
      x);
  EXPECT_TRUE(inside) << "a region's first run sees the writes into its inputs";
  EXPECT_FALSE(fake_key_included()) << "interception must end with the region";
  auto z = remat::checkpoint(
      remat::CheckpointOptions().policy(pol::save_matmuls()),
      [&](const torch::Tensor& h) {
        inside = fake_key_included();
        return f(h);
      },
      x);
  EXPECT_TRUE(inside);
  EXPECT_FALSE(fake_key_included()) << "interception must end with the region";
  (y.sum() + z.sum()).backward();
  EXPECT_FALSE(fake_key_included());
}

/** Gradients (parameters, x) of net on x, plain and under each policy. */
void expect_policies_bitwise(torch::nn::Module& net, const std::function<torch::Tensor(torch::Tensor)>& fwd,
                             const torch::Tensor& x, const std::vector<remat::Policy>& policies, uint64_t seed) {
  torch::manual_seed(seed);
  auto plain = step_grads(net, x, fwd);
  for (const auto& p : policies) {
    for (bool early : {true, false}) {
      torch::manual_seed(seed);
      auto opts = remat::CheckpointOptions().policy(p).early_stop(early);
      auto got = step_grads(net, x, [&](torch::Tensor h) { return remat::checkpoint(opts, fwd, h); });
      SCOPED_TRACE(p.description() + (early ? " early stop" : " no early stop"));
      expect_bitwise_equal(plain, got);
    }
  }
}

std::vector<remat::Policy> builtin_policies() {
  return {pol::save_matmuls(),
          pol::save_nothing(),
          pol::save_ops({"aten::addmm", "aten::_softmax", "aten::native_layer_norm"}),
          pol::save_names({"scores"}),
          pol::save_names_except({"scores"}),
          pol::any_of({pol::save_matmuls(), pol::recompute_names({"scores"})})};
}

TEST(Selective, GptBlockBitwiseUnderEveryPolicyWithDropout) {
  torch::manual_seed(3);
  GptBlock block(32, 4, 0.1);
  auto x = torch::randn({2, 16, 32}, torch::requires_grad());
  auto fwd = [&](torch::Tensor h) { return block->forward(h); };
  expect_policies_bitwise(*block, fwd, x, builtin_policies(), 11);

  // save_matmuls: no matmul-class op runs again; softmax and GELU do.
  remat::reset_checkpoint_stats();
  auto y = remat::checkpoint(remat::CheckpointOptions().policy(pol::save_matmuls()), fwd, x);
  y.sum().backward();
  const auto s = remat::op_stats();
  // Linear on (B, T, C) runs mm, then add_ of the bias into it (saved as a
  // copy before the write, NOTE [selective op cache]).
  EXPECT_EQ(s.at("aten::mm").saved, 4);
  EXPECT_EQ(s.at("aten::mm").recomputed, 0);
  EXPECT_EQ(s.at("aten::bmm").saved, 2);
  EXPECT_EQ(s.at("aten::bmm").recomputed, 0);
  EXPECT_GE(s.at("aten::_softmax").recomputed, 1);
  EXPECT_GE(s.at("aten::gelu").recomputed, 1);
}

TEST(Selective, ConvBlockWithBatchNormBitwiseAndStatsOnce) {
  torch::manual_seed(4);
  ResBlock block(8);
  auto x = torch::randn({4, 8, 10, 10}, torch::requires_grad());
  std::vector<torch::Tensor> start;
  for (auto& b : block->buffers()) start.push_back(b.clone());
  auto plain = step_grads(*block, x, [&](torch::Tensor h) { return block->forward(h); });
  std::vector<torch::Tensor> after_plain;
  for (auto& b : block->buffers()) after_plain.push_back(b.clone());
  auto policies = builtin_policies();
  policies.push_back(pol::save_ops({"aten::native_batch_norm"}));
  for (const auto& p : policies) {
    {
      torch::NoGradGuard g;
      auto bufs = block->buffers();
      for (size_t i = 0; i < bufs.size(); ++i) bufs[i].copy_(start[i]);
    }
    remat::reset_checkpoint_stats();
    auto got = step_grads(
        *block, x, [&](torch::Tensor h) { return remat::checkpoint(remat::CheckpointOptions().policy(p), block, h); });
    SCOPED_TRACE(p.description());
    expect_bitwise_equal(plain, got);
    auto bufs = block->buffers();
    for (size_t i = 0; i < bufs.size(); ++i) EXPECT_TRUE(torch::equal(bufs[i], after_plain[i])) << "buffer " << i;
    if (p.description() == "save_matmuls") {
      EXPECT_EQ(remat::op_stats().at("aten::convolution").recomputed, 0);
    }
  }
  EXPECT_EQ(remat::op_stats().at("aten::native_batch_norm").recomputed, 0);
}

/** A user's module tree that remat does not ship: an encoder of two
 *  branches with a shared projection, tanh and a named gate. */
struct GatedImpl : torch::nn::Module {
  GatedImpl()
      : a(register_module("a", torch::nn::Linear(24, 48))), b(register_module("b", torch::nn::Linear(24, 48))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto gate = remat::checkpoint_name(torch::sigmoid(b(x)), "gate");
    return torch::tanh(a(x)) * gate;
  }
  torch::nn::Linear a, b;
};
TORCH_MODULE(Gated);

TEST(Selective, UserModuleTreeAndNames) {
  torch::manual_seed(5);
  Gated g;
  torch::nn::Linear out(48, 24);
  torch::nn::Sequential net(g, out);
  auto x = torch::randn({8, 24}, torch::requires_grad());
  auto fwd = [&](torch::Tensor h) { return net->forward(h); };
  expect_policies_bitwise(*net, fwd, x, {pol::save_names({"gate"}), pol::save_names_except({"other"})}, 1);
  remat::reset_checkpoint_stats();
  auto y = remat::checkpoint(remat::CheckpointOptions().policy(pol::save_names({"gate"})), fwd, x);
  y.sum().backward();
  const auto s = remat::op_stats();
  EXPECT_EQ(s.at("aten::sigmoid").saved, 1) << "the named tensor's producer is saved";
  EXPECT_EQ(s.at("aten::sigmoid").recomputed, 0);
  EXPECT_EQ(s.at("aten::tanh").recomputed, 1);
  // Outside a region a name is the identity.
  auto t = torch::randn({3});
  EXPECT_TRUE(remat::checkpoint_name(t, "x").is_same(t));
}

TEST(Selective, NamesThroughViewsSaveTheProducer) {
  // matmul on 4-d tensors returns a view of a bmm: the name reaches the bmm.
  auto q = torch::randn({2, 3, 8, 4}, torch::requires_grad());
  auto k = torch::randn({2, 3, 8, 4}, torch::requires_grad());
  auto f = [](const torch::Tensor& a, const torch::Tensor& b) {
    auto s = remat::checkpoint_name(torch::matmul(a, b.transpose(-2, -1)), "scores");
    return torch::matmul(s.softmax(-1), b);
  };
  auto plain = f(q, k);
  plain.sum().backward();
  auto gq = q.grad().clone(), gk = k.grad().clone();
  q.mutable_grad() = torch::Tensor();
  k.mutable_grad() = torch::Tensor();
  remat::reset_checkpoint_stats();
  auto y = remat::checkpoint(remat::CheckpointOptions().policy(pol::save_names({"scores"})), f, q, k);
  y.sum().backward();
  EXPECT_TRUE(torch::equal(gq, q.grad()));
  EXPECT_TRUE(torch::equal(gk, k.grad()));
  const auto s = remat::op_stats();
  EXPECT_EQ(s.at("aten::bmm").saved, 1);
  EXPECT_EQ(s.at("aten::bmm").replayed, 1);
  EXPECT_EQ(s.at("aten::bmm").recomputed, 0) << "early stop: the second matmul's inputs are saved before it runs";
}

TEST(Selective, RetainGraphKeepsTheCacheForASecondBackward) {
  TwoMm f;
  auto x = torch::randn({8, 32});
  auto y = remat::checkpoint(remat::CheckpointOptions().policy(pol::save_ops({"remat_test::counted_mm"})), f, x);
  g_counted_runs = 0;
  y.sum().backward({}, /*retain_graph=*/true);
  auto g1 = f.w1.grad().clone();
  f.w1.mutable_grad() = torch::Tensor();
  y.sum().backward();
  EXPECT_TRUE(torch::equal(g1, f.w1.grad()));
  EXPECT_EQ(g_counted_runs.load(), 0);
}

TEST(Selective, InPlaceWriteToASavedOutputInsideTheRegion) {
  // Linear's bias add_ on a view of its mm (non-contiguous input), and a
  // dropout writing into a saved empty_like: the cache keeps the values the
  // op produced, and the recompute's own in-place ops run again on them.
  torch::manual_seed(8);
  torch::nn::Linear lin(16, 16);
  auto x = torch::randn({4, 16, 6}, torch::requires_grad());
  auto f = [&](const torch::Tensor& h) { return torch::dropout(lin(h.transpose(1, 2)), 0.3, true).tanh(); };
  auto plain = step_grads(*lin, x, [&](torch::Tensor h) {
    torch::manual_seed(9);
    return f(h);
  });
  auto save_all = remat::Policy("save_all", [](const remat::OpCall&) { return remat::OpDecision::kPreferSave; });
  for (const auto& p : {pol::save_ops({"aten::mm"}), save_all}) {
    for (bool retain : {false, true}) {
      remat::reset_checkpoint_stats();
      auto got = step_grads(*lin, x, [&](torch::Tensor h) {
        torch::manual_seed(9);
        return remat::checkpoint(remat::CheckpointOptions().policy(p), f, h);
      });
      SCOPED_TRACE(p.description());
      expect_bitwise_equal(plain, got);
      EXPECT_EQ(remat::op_stats().at("aten::mm").replayed, 1);
      if (retain) {
        zero_grads(*lin, x);
        torch::manual_seed(9);
        auto y = remat::checkpoint(remat::CheckpointOptions().policy(p), f, x);
        auto loss = y.square().mean();
        loss.backward({}, /*retain_graph=*/true);
        auto first = grads_of(*lin, x);
        zero_grads(*lin, x);
        loss.backward();
        expect_bitwise_equal(first, grads_of(*lin, x));
        expect_bitwise_equal(plain, first);
      }
    }
  }
}

TEST(SelectiveErrors, SavedOutputModifiedInPlaceAfterTheRegion) {
  auto w = torch::randn({8, 8}, torch::requires_grad());
  auto x = torch::randn({4, 8});
  auto [m, t] = remat::checkpoint(
      remat::CheckpointOptions().policy(pol::save_ops({"aten::mm"})),
      [&](const torch::Tensor& h) {
        auto mm = at::mm(h, w);
        return std::make_tuple(mm, mm.tanh());
      },
      x);
  {
    torch::NoGradGuard g;
    m.mul_(2.0);  // autograd saved nothing of m; the policy did
  }
  EXPECT_EQ(error_of([&] { t.sum().backward(); }),
            "[remat::checkpoint] the output of aten::mm (call 1 of it in the region) was saved by the selective "
            "policy 'save_ops(aten::mm)' and then modified in place outside the region (version 0 -> 1), so it "
            "no longer holds the op's result. Use an out-of-place op on it, or let the policy recompute aten::mm "
            "(policy::recompute_ops({\"aten::mm\"})).");
  EXPECT_FALSE(w.grad().defined()) << "no gradient may be written after the error";
}

TEST(SelectiveErrors, MustSaveAViewOrRandomOp) {
  auto x = torch::randn({4, 8}, torch::requires_grad());
  auto must_save_all =
      remat::Policy("must_save_all", [](const remat::OpCall&) { return remat::OpDecision::kMustSave; });
  EXPECT_EQ(error_of([&] {
              remat::checkpoint(
                  remat::CheckpointOptions().policy(must_save_all), [](const torch::Tensor& h) { return h.t().tanh(); },
                  x);
            }),
            "[remat::checkpoint] the selective policy returned kMustSave for aten::t, which cannot be saved: it "
            "returns a view. In-place, view and random ops are always recomputed; return kPreferSave (recomputed "
            "silently) or save the op that produces its input.");
  EXPECT_FALSE(fake_key_included());
  // kPreferSave on the same ops is fine: they are recomputed.
  auto prefer = remat::Policy("prefer_all", [](const remat::OpCall&) { return remat::OpDecision::kPreferSave; });
  torch::manual_seed(1);
  auto y = remat::checkpoint(
      remat::CheckpointOptions().policy(prefer),
      [](const torch::Tensor& h) { return torch::dropout(h.t().tanh(), 0.5, true); }, x);
  y.sum().backward();
  auto g = x.grad().clone();
  x.mutable_grad() = torch::Tensor();
  torch::manual_seed(1);
  torch::dropout(x.t().tanh(), 0.5, true).sum().backward();
  EXPECT_TRUE(torch::equal(g, x.grad())) << "random ops must be recomputed with the replayed RNG";
}

TEST(SelectiveErrors, NameOfARegionInput) {
  auto x = torch::randn({4, 8}, torch::requires_grad());
  EXPECT_EQ(error_of([&] {
              remat::checkpoint(
                  remat::CheckpointOptions().policy(pol::save_names({"x"})),
                  [](const torch::Tensor& h) { return remat::checkpoint_name(h, "x").tanh(); }, x);
            }),
            "[remat::checkpoint_name] the policy 'save_names(x)' saves 'x', but that tensor was not produced by an "
            "op inside this region (it is a region input, or made outside the region): it cannot be saved as an op "
            "output. Name a tensor the region computes.");
  EXPECT_EQ(error_of([] { pol::save_ops({"mm"}); }),
            "[remat::policy::save_ops] operator 'mm' has no namespace; write it as the dispatcher names it, e.g. "
            "'aten::mm'.");
  EXPECT_EQ(error_of([] { pol::any_of({}); }), "[remat::policy::any_of] needs at least one policy.");
}

TEST(Selective, PolicyKeepsMemoryBetweenNothingAndEverything) {
  torch::manual_seed(6);
  GptBlock block(64, 4);
  auto x = torch::randn({4, 64, 64}, torch::requires_grad());
  remat::memory::enable_tracking();
  auto held = [&](const std::function<torch::Tensor(torch::Tensor)>& run) {
    torch::randn({1});  // a fresh RNG state: every region then holds its own copy (5056 bytes)
    const int64_t before = remat::memory::current_bytes();
    auto y = run(x);
    const int64_t after = remat::memory::current_bytes() - before;
    y.sum().backward();
    return after;
  };
  held([&](torch::Tensor h) { return remat::checkpoint(block, h); });  // first-use allocations
  const int64_t plain = held([&](torch::Tensor h) { return block->forward(h); });
  const int64_t full = held([&](torch::Tensor h) { return remat::checkpoint(block, h); });
  const int64_t matmuls = held([&](torch::Tensor h) {
    return remat::checkpoint(remat::CheckpointOptions().policy(pol::save_matmuls()), block, h);
  });
  const int64_t nothing = held([&](torch::Tensor h) {
    return remat::checkpoint(remat::CheckpointOptions().policy(pol::save_nothing()), block, h);
  });
  EXPECT_EQ(nothing, full) << "save_nothing keeps what a plain checkpoint keeps";
  EXPECT_LT(full, matmuls);
  EXPECT_LT(matmuls, plain * 3 / 4) << "save_matmuls drops the softmax and the pointwise outputs";
  // The matmul outputs it keeps: 4 linear layers and 2 bmm, plus the output.
  const int64_t f = 4;
  const int64_t btc = 4 * 64 * 64 * f, bhtt = 4 * 4 * 64 * 64 * f;
  EXPECT_EQ(matmuls - full, (3 + 1 + 4 + 1) * btc + bhtt + btc) << "plain " << plain << " full " << full;
}

TEST(Selective, AutocastAndInferenceMode) {
  // Autocast sits above autograd: its casts reach the policy as _to_copy
  // ops, in the first run and again in the recompute (its cache is cleared).
  torch::manual_seed(9);
  GptBlock block(32, 4);
  auto x = torch::randn({2, 16, 32}, torch::requires_grad());
  auto run = [&](std::optional<remat::Policy> p) {
    zero_grads(*block, x);
    torch::Tensor y;
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    y = p ? remat::checkpoint(remat::CheckpointOptions().policy(*p), block, x) : block->forward(x);
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
    y.to(torch::kFloat).square().sum().backward();
    return grads_of(*block, x);
  };
  auto plain = run(std::nullopt);
  remat::reset_checkpoint_stats();
  expect_bitwise_equal(plain, run(pol::save_matmuls()));
  EXPECT_EQ(remat::op_stats().at("aten::mm").recomputed, 0);
  EXPECT_GT(remat::op_stats().at("aten::_to_copy").recomputed, 0);
  expect_bitwise_equal(plain, run(pol::save_ops({"aten::_to_copy"})));

  // Inference mode: nothing is saved, so the region is a plain call.
  c10::InferenceMode guard;
  bool inside = true;
  auto y = remat::checkpoint(
      remat::CheckpointOptions().policy(pol::save_matmuls()),
      [&](const torch::Tensor& h) {
        inside = fake_key_included();
        return block->forward(h);
      },
      torch::randn({2, 16, 32}));
  EXPECT_FALSE(inside);
  EXPECT_TRUE(y.is_inference());
}

TEST(SavedResiduals, TotalsEqualMeasuredBytes) {
  torch::manual_seed(7);
  torch::nn::Sequential mlp(torch::nn::Linear(64, 256), torch::nn::GELU(), torch::nn::Linear(256, 64));
  auto x = torch::randn({32, 64}, torch::requires_grad());
  remat::memory::enable_tracking();
  const int64_t before = remat::memory::current_bytes();
  auto y = mlp->forward(x);
  const int64_t delta = remat::memory::current_bytes() - before;
  const int64_t out_bytes = static_cast<int64_t>(y.storage().nbytes());
  y = torch::Tensor();
  auto r = remat::saved_residuals(mlp, x);
  EXPECT_EQ(r.recomputable_bytes + out_bytes, delta) << r.to_string();
  EXPECT_EQ(r.input_bytes, 32 * 64 * 4);
  int inputs = 0, params = 0, recomputable = 0;
  for (const auto& s : r.residuals) {
    inputs += s.kind == remat::ResidualKind::kInput;
    params += s.kind == remat::ResidualKind::kParameter;
    recomputable += s.kind == remat::ResidualKind::kRecomputable;
  }
  EXPECT_EQ(inputs, 1);
  EXPECT_EQ(params, 2);        // the two weights (transposed views)
  EXPECT_EQ(recomputable, 2);  // fc output (GELU's input), GELU output (the second addmm's input)
  EXPECT_EQ(r.residuals[2].op, "aten::addmm");
  EXPECT_EQ(r.residuals[3].op, "aten::gelu");
  auto rs = remat::saved_residuals(pol::save_matmuls(), mlp, x);
  EXPECT_TRUE(rs.residuals[2].kept_by_policy);
  EXPECT_FALSE(rs.residuals[3].kept_by_policy);
  EXPECT_EQ(rs.policy_bytes, 32 * 256 * 4 + 32 * 64 * 4) << "both addmm outputs" << rs.to_string();
  EXPECT_NE(rs.to_string().find("saved"), std::string::npos);

  // The GPT block: every recomputable byte is what a plain forward holds.
  GptBlock block(32, 4);
  auto h = torch::randn({2, 16, 32}, torch::requires_grad());
  const int64_t b0 = remat::memory::current_bytes();
  auto o = block->forward(h);
  const int64_t held = remat::memory::current_bytes() - b0;
  const int64_t o_bytes = static_cast<int64_t>(o.storage().nbytes());
  o = torch::Tensor();
  auto rb = remat::saved_residuals(block, h);
  EXPECT_EQ(rb.recomputable_bytes + o_bytes, held) << rb.to_string();
  // With a policy: what it keeps is listed and totalled.
  auto rp = remat::saved_residuals(pol::save_names({"scores"}), block, h);
  EXPECT_EQ(rp.policy, "save_names(scores)");
  EXPECT_EQ(rp.policy_bytes, 0) << "the test block names nothing";
  auto rm = remat::saved_residuals(pol::save_matmuls(), block, h);
  EXPECT_GT(rm.policy_bytes, 0);
}

}  // namespace

namespace {

TEST(RecomputeSideEffects, BatchNormThroughALambdaUpdatesStatisticsOnce) {
  // A lambda (not a module holder) around BatchNorm; the
  // recompute's writes to the running statistics are undone.
  torch::manual_seed(10);
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(4, 4, 3).padding(1));
  torch::nn::BatchNorm2d bn(4);
  auto f = [conv, bn](const torch::Tensor& h) mutable { return torch::relu(bn(conv(h))); };
  auto x = torch::randn({2, 4, 8, 8}, torch::requires_grad());
  auto stats = [&] { return std::vector<torch::Tensor>{bn->running_mean.clone(), bn->running_var.clone()}; };
  auto start = stats();
  auto reset = [&] {
    torch::NoGradGuard g;
    bn->running_mean.copy_(start[0]);
    bn->running_var.copy_(start[1]);
  };
  f(x).square().mean().backward();
  auto plain = stats();
  for (const auto& opts : {remat::CheckpointOptions(), remat::CheckpointOptions().early_stop(false),
                           remat::CheckpointOptions().policy(pol::save_matmuls())}) {
    reset();
    remat::reset_checkpoint_stats();
    remat::checkpoint(opts, f, x).square().mean().backward();
    EXPECT_EQ(remat::checkpoint_stats().recomputations, 1);
    EXPECT_GE(remat::checkpoint_stats().writes_undone, 2);
    auto got = stats();
    EXPECT_TRUE(torch::equal(got[0], plain[0])) << "running_mean updated twice";
    EXPECT_TRUE(torch::equal(got[1], plain[1])) << "running_var updated twice";
  }
  // A user's counter, and an in-place write to a slice of it.
  auto counter = torch::zeros({4});
  auto g = [counter](const torch::Tensor& h) mutable {
    counter.add_(1);
    counter.narrow(0, 0, 2).mul_(2);
    return h.tanh();
  };
  remat::checkpoint(g, x).sum().backward();
  EXPECT_TRUE(torch::equal(counter, torch::tensor({2.f, 2.f, 1.f, 1.f}))) << counter;
}

}  // namespace

namespace {

TEST(CheckpointDebug, DeterminismErrorShowsTheOpSequencesAligned) {
  // A function that runs an extra op when recomputed.
  auto x = torch::randn({4, 3}, torch::requires_grad());
  int calls = 0;
  auto f = [&calls](const torch::Tensor& h) {
    auto t = h.tanh();
    if (++calls > 1) t = torch::cat({t, t});
    return t.sin();
  };
  auto y = remat::checkpoint(remat::CheckpointOptions().debug(true), f, x);
  std::string what;
  try {
    y.sum().backward();
  } catch (const std::exception& e) {
    what = e.what();
  }
  EXPECT_EQ(what,
            "[remat::checkpoint] saved tensor #1 differs between the forward and the recomputation: shape [4, 3] in "
            "forward vs [8, 3] in recompute. The checkpointed function must run as in its forward (keep "
            "preserve_rng_state(true) for dropout; a lambda's recompute sees its modules' train/eval flags as they "
            "are at backward: keep the mode until backward, or checkpoint the module itself); set "
            "determinism_check(kNone) to skip this check only where the difference is intended.\n"
            "[debug] ops of the forward (2) and of the recomputation (2, up to the failure), first difference at "
            "op 1:\n"
            "     #  forward                         recompute\n"
            "     0  aten::tanh                      aten::tanh\n"
            "  >  1  aten::sin                       aten::cat");
  // Without debug: the same error, no op listing, and nothing recorded.
  calls = 0;
  auto y2 = remat::checkpoint(f, x);
  try {
    y2.sum().backward();
  } catch (const std::exception& e) {
    what = e.what();
  }
  EXPECT_EQ(what.find("[debug]"), std::string::npos);
}

TEST(CheckpointDebug, ProcessWideDefault) {
  auto x = torch::randn({4, 3}, torch::requires_grad());
  int calls = 0;
  auto f = [&calls](const torch::Tensor& h) {
    auto t = h.tanh();
    if (++calls % 2 == 0) t = torch::cat({t, t});  // every re-run differs
    return t.sin();
  };
  auto error_of_step = [&](const remat::CheckpointOptions& o) {
    calls = 0;
    auto y = remat::checkpoint(o, f, x);
    try {
      y.sum().backward();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_FALSE(remat::checkpoint_debug());
  remat::set_checkpoint_debug(true);
  EXPECT_TRUE(remat::CheckpointOptions().debug());
  const std::string on = error_of_step(remat::CheckpointOptions());
  const std::string off = error_of_step(remat::CheckpointOptions().debug(false));  // per call wins
  remat::set_checkpoint_debug(false);
  const std::string back = error_of_step(remat::CheckpointOptions());
  EXPECT_NE(on.find("[debug] ops of the forward (2)"), std::string::npos) << on;
  EXPECT_EQ(off.find("[debug]"), std::string::npos) << off;
  EXPECT_EQ(back.find("[debug]"), std::string::npos) << back;
  EXPECT_NE(back.find("differs between the forward and the recomputation"), std::string::npos) << back;
}

// kOffload: a policy's saved outputs go to the region's offload
// target when its forward ends and come back in the recompute: gradients
// bitwise as plain (dropout on), less held after the forward than keeping
// them, no file left, and an offload policy without a target is an error.
TEST(SelectiveOffload, OffloadedMatmulsComeBackBitwise) {
  remat::memory::enable_tracking();
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("remat_sel_offload_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  torch::manual_seed(21);
  remat_test::GptBlock block(64, 4, /*dropout=*/0.1);
  auto x = torch::randn({4, 32, 64}, torch::requires_grad());
  auto run = [&](std::optional<remat::CheckpointOptions> o, int64_t* held, remat::CheckpointStats* stats) {
    block->zero_grad();
    x.mutable_grad() = torch::Tensor();
    remat::reset_checkpoint_stats();
    torch::manual_seed(5);
    const int64_t before = remat::memory::current_bytes();
    auto y = o ? remat::checkpoint(*o, block, x) : block->forward(x);
    auto loss = y.pow(2).mean();
    y = torch::Tensor();
    remat::wait_checkpoint_offloads();  // pending writes still hold their tensors
    *held = remat::memory::current_bytes() - before;
    loss.backward();
    *stats = remat::checkpoint_stats();
    std::vector<torch::Tensor> g{x.grad().clone()};
    for (auto& p : block->parameters()) g.push_back(p.grad().clone());
    return g;
  };
  int64_t held_plain = 0, held_save = 0, held_off = 0;
  remat::CheckpointStats s_plain, s_save, s_off;
  const auto plain = run(std::nullopt, &held_plain, &s_plain);
  const auto saved = run(remat::CheckpointOptions().policy(remat::policy::save_matmuls()), &held_save, &s_save);
  const auto disk = remat::OffloadOptions(remat::OffloadTarget::kDisk).directory(dir.string()).min_bytes(0);
  const auto off =
      run(remat::CheckpointOptions().policy(remat::policy::offload_ops(remat::policy::matmul_ops())).offload(disk),
          &held_off, &s_off);
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_TRUE(torch::equal(plain[i], saved[i])) << i;
    EXPECT_TRUE(torch::equal(plain[i], off[i])) << "grad " << i;
  }
  EXPECT_GT(s_off.ops_replayed, 0);
  EXPECT_EQ(s_off.ops_replayed, s_save.ops_replayed) << "the same ops handed back, from disk";
  EXPECT_TRUE(fs::is_empty(dir)) << "files left after backward";
  std::printf("  held after forward: plain %s, save_matmuls %s, offload_ops(matmuls) to disk %s\n",
              remat::format_bytes(held_plain).c_str(), remat::format_bytes(held_save).c_str(),
              remat::format_bytes(held_off).c_str());
  EXPECT_LT(held_off, held_save / 2);
  fs::remove_all(dir);
  // Inspection needs no target: offloaded outputs count as what the policy keeps.
  const auto r = remat::saved_residuals(remat::policy::offload_ops(remat::policy::matmul_ops()), block, x);
  const auto r_save = remat::saved_residuals(remat::policy::save_matmuls(), block, x);
  EXPECT_GT(r.policy_bytes, 0);
  EXPECT_EQ(r.policy_bytes, r_save.policy_bytes);
  auto no_target = remat::CheckpointOptions().policy(remat::policy::offload_ops({"aten::mm"}));
  const std::string err = remat_test::error_of([&] {
    remat::checkpoint(
        no_target, [](const torch::Tensor& h) { return h.mm(h.t()).sum(); }, x[0]);
  });
  EXPECT_EQ(err,
            "[remat::checkpoint] the selective policy 'offload_ops(aten::mm)' returned kOffload for aten::mm, but the "
            "region has no offload target; set one with CheckpointOptions().offload(OffloadOptions(...)) or return "
            "kPreferSave.");
}

}  // namespace
