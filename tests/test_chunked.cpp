// remat::chunked and remat::chunked_cross_entropy against the unchunked
// computation: outputs and gradients (bitwise where the arithmetic is the
// same, else within the stated float32 bound), how often the function ran,
// the memory they hold, and every error a user can hit.
#include "common.h"

#include <ATen/autocast_mode.h>

using namespace remat_test;

namespace {

// Relative bound on float32 results that differ from the unchunked run only
// by the order of sums over slices (weights' gradients, the loss's sum).
constexpr double kRel = 1e-5;

/** max |a - b| / max(max |b|, tiny). */
double rel_err(const torch::Tensor& a, const torch::Tensor& b) {
  auto d = (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
  auto s = b.to(torch::kDouble).abs().max().item<double>();
  return d / std::max(s, 1e-30);
}

std::string thrown(const std::function<void()>& f) {
  try {
    f();
  } catch (const remat::Error& e) {
    return e.what();
  }
  return "(no remat::Error)";
}

/** A row-wise MLP with GELU: (B, T, C) -> (B, T, C); counts its calls. */
struct RowMlp {
  torch::Tensor w1, b1, w2;
  int calls = 0;
  explicit RowMlp(int64_t c, uint64_t seed = 3) {
    torch::manual_seed(seed);
    w1 = (torch::randn({4 * c, c}) / std::sqrt(static_cast<double>(c))).requires_grad_();
    b1 = torch::randn({4 * c}).mul_(0.1).requires_grad_();
    w2 = (torch::randn({c, 4 * c}) / std::sqrt(4.0 * c)).requires_grad_();
  }
  torch::Tensor operator()(const torch::Tensor& x) {
    ++calls;
    return torch::linear(torch::gelu(torch::linear(x, w1, b1)), w2);
  }
  std::vector<torch::Tensor> grads() const { return {w1.grad().clone(), b1.grad().clone(), w2.grad().clone()}; }
  void zero() {
    for (auto* t : {&w1, &b1, &w2}) t->mutable_grad() = torch::Tensor();
  }
};

}  // namespace

TEST(Chunked, MlpMatchesUnchunkedWithUnevenSlicesAndRunsEachSliceTwice) {
  RowMlp mlp(16);
  auto x = torch::randn({3, 13, 16}).requires_grad_();  // T = 13: 4 slices of 4, 3, 3, 3
  auto y_ref = mlp(x);
  auto gy = torch::randn_like(y_ref);
  y_ref.backward(gy);
  auto gx_ref = x.grad().clone();
  auto g_ref = mlp.grads();
  x.mutable_grad() = torch::Tensor();
  mlp.zero();
  mlp.calls = 0;

  auto y =
      remat::chunked([&](const std::vector<torch::Tensor>& in) { return mlp(in[0]); }, {x}, remat::ChunkOptions(1, 4));
  EXPECT_EQ(mlp.calls, 4);
  EXPECT_EQ(y.sizes(), y_ref.sizes());
  y.backward(gy);
  EXPECT_EQ(mlp.calls, 8) << "each slice recomputed once in backward";
  EXPECT_LE(rel_err(y, y_ref), kRel);
  EXPECT_LE(rel_err(x.grad(), gx_ref), kRel);
  auto g = mlp.grads();
  for (size_t i = 0; i < g.size(); ++i) EXPECT_LE(rel_err(g[i], g_ref[i]), kRel) << "weight " << i;
}

TEST(Chunked, ElementwiseFunctionIsBitwiseEqual) {
  // Per-element arithmetic is the same chunked or not: equal bit for bit,
  // inputs' gradients too; negative dim; more chunks than positions. Only
  // correctly rounded ops (+, -, *): a transcendental's vectorized and
  // scalar kernels may round differently on a slice than on the whole.
  auto w = torch::randn({5}).requires_grad_();
  auto f = [&](const torch::Tensor& x) { return x * w + x * x - 0.5 * x; };
  auto x = torch::randn({2, 7, 5}).requires_grad_();
  auto y_ref = f(x);
  y_ref.sum().backward();
  auto gx_ref = x.grad().clone();
  x.mutable_grad() = torch::Tensor();
  for (int64_t chunks : {1, 3, 7, 50}) {
    auto y = remat::chunked([&](const std::vector<torch::Tensor>& in) { return f(in[0]); }, {x},
                            remat::ChunkOptions(-2, chunks));
    EXPECT_TRUE(torch::equal(y, y_ref)) << chunks;
    w.mutable_grad() = torch::Tensor();
    y.sum().backward();
    EXPECT_TRUE(torch::equal(x.grad(), gx_ref)) << chunks;
    x.mutable_grad() = torch::Tensor();
  }
}

TEST(Chunked, SumAndMeanWeightSlicesByLength) {
  auto x = torch::randn({10, 4}).requires_grad_();
  auto w = torch::randn({4}).requires_grad_();
  auto per_row = [&](const torch::Tensor& t) { return (t * w).sum(1); };  // (n)
  auto mean = remat::chunked([&](const std::vector<torch::Tensor>& in) { return per_row(in[0]).mean(); }, {x},
                             remat::ChunkOptions(0, 3).reduce(remat::ChunkReduce::kMean));  // slices 4, 3, 3
  auto sum = remat::chunked([&](const std::vector<torch::Tensor>& in) { return per_row(in[0]).sum(); }, {x},
                            remat::ChunkOptions(0, 3).reduce(remat::ChunkReduce::kSum));
  EXPECT_LE(rel_err(mean, per_row(x).mean()), kRel);
  EXPECT_LE(rel_err(sum, per_row(x).sum()), kRel);
  mean.backward();
  auto gx = x.grad().clone();
  x.mutable_grad() = torch::Tensor();
  per_row(x).mean().backward();
  EXPECT_LE(rel_err(gx, x.grad()), kRel);
}

TEST(Chunked, SeveralInputsAndNoCheckpoint) {
  auto a = torch::randn({2, 9, 3}).requires_grad_();
  auto b = torch::randn({2, 9, 3}).requires_grad_();
  int calls = 0;
  auto f = [&](const std::vector<torch::Tensor>& in) {
    ++calls;
    return (in[0] + 1.0) * in[1] * in[1];  // correctly rounded ops: bitwise equal to the whole
  };
  auto y = remat::chunked(f, {a, b}, remat::ChunkOptions(1, 2).checkpoint(false));
  y.sum().backward();
  EXPECT_EQ(calls, 2) << "no recompute without checkpoint";
  auto ga = a.grad().clone(), gb = b.grad().clone();
  a.mutable_grad() = torch::Tensor();
  b.mutable_grad() = torch::Tensor();
  ((a + 1.0) * b * b).sum().backward();
  EXPECT_TRUE(torch::equal(ga, a.grad()));
  EXPECT_TRUE(torch::equal(gb, b.grad()));
}

TEST(Chunked, HoldsOneSlicesIntermediatesAtATime) {
  // (1, 512, 64) through a 4x MLP: unchunked, forward keeps the (512, 256)
  // pre-activation and GELU output (1 MiB, float32); 8 checkpointed slices
  // keep none and recompute 64 rows at a time.
  remat::memory::enable_tracking();
  RowMlp mlp(64);
  auto x = torch::randn({1, 512, 64}).requires_grad_();
  auto peak_of = [&](const std::function<torch::Tensor()>& run) {
    remat::memory::reset_peak();
    const int64_t base = remat::memory::current_bytes();
    run().sum().backward();
    x.mutable_grad() = torch::Tensor();
    mlp.zero();
    return remat::memory::peak_bytes() - base;
  };
  const int64_t plain = peak_of([&] { return mlp(x); });
  const int64_t sliced = peak_of([&] {
    return remat::chunked([&](const std::vector<torch::Tensor>& in) { return mlp(in[0]); }, {x},
                          remat::ChunkOptions(1, 8));
  });
  const int64_t hidden_bytes = 512 * 256 * 4;  // one (T, 4C) float32 intermediate
  EXPECT_LT(sliced, plain - hidden_bytes) << "plain " << plain << " B, sliced " << sliced << " B";
}

TEST(Chunked, InsideACheckpointedRegionAndUnderAutocast) {
  // chunked nested in an outer checkpoint, under CPU bf16 autocast: equal
  // bit for bit to the same chunked call without the outer region (the
  // outer re-run replays the same slices).
  RowMlp mlp(16);
  auto x = torch::randn({2, 10, 16}).requires_grad_();
  auto run = [&](bool outer) {
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    auto body = [&](const torch::Tensor& h) {
      return remat::chunked([&](const std::vector<torch::Tensor>& in) { return mlp(in[0]); }, {h},
                            remat::ChunkOptions(1, 3));
    };
    auto y = outer ? remat::checkpoint(body, x) : body(x);
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
    y.to(torch::kFloat).pow(2).sum().backward();
    auto out = mlp.grads();
    out.push_back(x.grad().clone());
    x.mutable_grad() = torch::Tensor();
    mlp.zero();
    return out;
  };
  auto a = run(false), b = run(true);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << i;
}

TEST(Chunked, ErrorsNameTheValue) {
  auto x = torch::randn({2, 3});
  auto id = [](const std::vector<torch::Tensor>& in) { return in[0]; };
  EXPECT_EQ(thrown([&] { remat::chunked(id, {x}, remat::ChunkOptions(1, 0)); }),
            "[remat::chunked] chunks must be >= 1, got 0. Pass the number of slices, e.g. 8 (1 runs unchunked).");
  EXPECT_EQ(thrown([&] { remat::chunked(id, {x}, remat::ChunkOptions(2, 2)); }),
            "[remat::chunked] dim 2 does not exist in input 0 of shape (2, 3) (2 dimensions). Pass a dim in [-2, 1].");
  EXPECT_EQ(thrown([&] { remat::chunked(id, {x}, remat::ChunkOptions(-3, 2)); }),
            "[remat::chunked] dim -3 does not exist in input 0 of shape (2, 3) (2 dimensions). Pass a dim in [-2, 1].");
  EXPECT_EQ(thrown([&] {
              remat::chunked(id, {x, torch::randn({2, 4})}, remat::ChunkOptions(1, 2));
            }),
            "[remat::chunked] input 1 has length 4 along dim 1, input 0 has 3. Every input is sliced along dim: pass "
            "tensors of one length there, and capture the others in fn.");
  EXPECT_EQ(thrown([&] { remat::chunked(id, {}, remat::ChunkOptions(1, 2)); }),
            "[remat::chunked] no inputs to slice. Pass the tensors to slice (e.g. {x}); capture the others in fn.");
  EXPECT_EQ(thrown([&] { remat::chunked(id, {torch::Tensor()}, remat::ChunkOptions(1, 2)); }),
            "[remat::chunked] input 0 is an undefined tensor. Pass defined tensors only; capture optional ones in fn.");
  EXPECT_EQ(thrown([&] {
              remat::chunked([](const std::vector<torch::Tensor>& in) { return in[0].sum(); }, {x},
                             remat::ChunkOptions(1, 2));
            }),
            "[remat::chunked] fn returned a tensor of shape () without dim 1 to concatenate along. Return "
            "per-position outputs, or use ChunkReduce::kSum or kMean.");
}

// --- chunked cross-entropy ---------------------------------------------------

namespace {

struct CeCase {
  torch::Tensor h, w, b, t;  // (B, T, C), (V, C), (V), (B, T)
  CeCase(int64_t B, int64_t T, int64_t C, int64_t V, bool with_ignored, uint64_t seed = 7) {
    torch::manual_seed(seed);
    h = torch::randn({B, T, C}).requires_grad_();
    w = (torch::randn({V, C}) / std::sqrt(static_cast<double>(C))).requires_grad_();
    b = torch::randn({V}).mul_(0.1).requires_grad_();
    t = torch::randint(V, {B, T}, torch::kLong);
    if (with_ignored) t.masked_fill_(torch::rand({B, T}) < 0.3, -100);
  }
  void zero() {
    for (auto* x : {&h, &w, &b}) x->mutable_grad() = torch::Tensor();
  }
  /** loss, then the gradients of h, w, b. */
  std::vector<torch::Tensor> run(const std::function<torch::Tensor()>& loss_fn) {
    zero();
    auto l = loss_fn();
    l.backward();
    std::vector<torch::Tensor> out{l.detach().clone()};
    for (auto* x : {&h, &w, &b}) out.push_back(x->grad().defined() ? x->grad().clone() : torch::Tensor());
    zero();
    return out;
  }
};

torch::Tensor reference_ce(const CeCase& c, double smoothing, bool sum) {
  auto logits = torch::linear(c.h, c.w, c.b);  // (B, T, V)
  return torch::nn::functional::cross_entropy(
      logits.reshape({-1, logits.size(-1)}).to(torch::kFloat), c.t.reshape({-1}),
      torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100).label_smoothing(smoothing).reduction(
          sum ? torch::nn::functional::CrossEntropyFuncOptions::reduction_t(torch::kSum)
              : torch::nn::functional::CrossEntropyFuncOptions::reduction_t(torch::kMean)));
}

}  // namespace

TEST(ChunkedCrossEntropy, MatchesLibTorchWithIgnoreIndexSmoothingAndBothReductions) {
  CeCase c(2, 37, 24, 101, /*with_ignored=*/true);
  for (double smoothing : {0.0, 0.1}) {
    for (bool sum : {false, true}) {
      auto ref = c.run([&] { return reference_ce(c, smoothing, sum); });
      for (int64_t chunks : {1, 5, 74, 500}) {  // 5 does not divide 74 rows; 500 > rows
        auto got = c.run([&] {
          return remat::chunked_cross_entropy(
              c.h, c.w, c.t,
              remat::ChunkedCrossEntropyOptions(chunks).label_smoothing(smoothing).reduction(
                  sum ? remat::LossReduction::kSum : remat::LossReduction::kMean),
              c.b);
        });
        const std::string what =
            "smoothing " + std::to_string(smoothing) + (sum ? " sum" : " mean") + " chunks " + std::to_string(chunks);
        EXPECT_LE(rel_err(got[0], ref[0]), kRel) << what << ": loss " << got[0] << " vs " << ref[0];
        for (size_t i = 1; i < got.size(); ++i) EXPECT_LE(rel_err(got[i], ref[i]), kRel) << what << " grad " << i;
      }
    }
  }
}

TEST(ChunkedCrossEntropy, ZeroChunksIsLibTorchsCrossEntropyBitwise) {
  CeCase c(2, 37, 24, 101, /*with_ignored=*/true);
  for (double smoothing : {0.0, 0.1}) {
    for (bool sum : {false, true}) {
      auto ref = c.run([&] { return reference_ce(c, smoothing, sum); });
      auto got = c.run([&] {
        return remat::chunked_cross_entropy(c.h, c.w, c.t,
                                            remat::ChunkedCrossEntropyOptions(0).label_smoothing(smoothing).reduction(
                                                sum ? remat::LossReduction::kSum : remat::LossReduction::kMean),
                                            c.b);
      });
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_TRUE(torch::equal(got[i], ref[i])) << "smoothing " << smoothing << (sum ? " sum" : " mean") << " " << i;
      }
    }
  }
}

// float64 inputs are computed in float64 (they were rounded to float32:
// the loss came back float32 and the gradients 1e-7 off a float64 loss).
TEST(ChunkedCrossEntropy, Float64InputsKeepFloat64) {
  CeCase c(2, 37, 24, 101, /*with_ignored=*/true);
  for (auto* x : {&c.h, &c.w, &c.b}) *x = x->detach().to(torch::kDouble).requires_grad_();
  auto ref = c.run([&] {
    auto logits = torch::linear(c.h, c.w, c.b);
    return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), c.t.reshape({-1}));
  });
  ASSERT_EQ(ref[0].scalar_type(), torch::kDouble);
  for (int64_t chunks : {0, 1, 5}) {
    auto got = c.run(
        [&] { return remat::chunked_cross_entropy(c.h, c.w, c.t, remat::ChunkedCrossEntropyOptions(chunks), c.b); });
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].scalar_type(), torch::kDouble) << "chunks " << chunks << " " << i;
      EXPECT_LE(rel_err(got[i], ref[i]), 1e-12) << "chunks " << chunks << " " << i;
    }
    if (chunks == 0) {
      for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(torch::equal(got[i], ref[i])) << i;
    }
  }
}

TEST(ChunkedCrossEntropy, ScaledRetainedAndNoGradUses) {
  CeCase c(2, 16, 8, 33, true);
  auto opts = remat::ChunkedCrossEntropyOptions(3);
  auto ref = c.run([&] { return reference_ce(c, 0.0, false) * 3.0; });
  auto got = c.run([&] { return remat::chunked_cross_entropy(c.h, c.w, c.t, opts, c.b) * 3.0; });
  for (size_t i = 0; i < got.size(); ++i) EXPECT_LE(rel_err(got[i], ref[i]), kRel) << i;
  // Two backward passes through a retained graph accumulate twice.
  c.zero();
  auto l = remat::chunked_cross_entropy(c.h, c.w, c.t, opts, c.b);
  l.backward({}, /*retain_graph=*/true);
  auto once = c.w.grad().clone();
  l.backward();
  EXPECT_TRUE(torch::allclose(c.w.grad(), once * 2));
  // No gradient wanted: the loss alone, no graph.
  torch::NoGradGuard no_grad;
  auto v = remat::chunked_cross_entropy(c.h, c.w, c.t, opts, c.b);
  EXPECT_FALSE(v.requires_grad());
  EXPECT_LE(rel_err(v, reference_ce(c, 0.0, false)), kRel);
}

TEST(ChunkedCrossEntropy, AllTargetsIgnoredGivesNanLossAsLibTorch) {
  CeCase c(1, 4, 8, 10, false);
  c.t.fill_(-100);
  auto ref = c.run([&] { return reference_ce(c, 0.0, false); });
  auto got = c.run([&] { return remat::chunked_cross_entropy(c.h, c.w, c.t, remat::ChunkedCrossEntropyOptions(2)); });
  EXPECT_TRUE(std::isnan(ref[0].item<double>()));
  EXPECT_TRUE(std::isnan(got[0].item<double>()));
  EXPECT_TRUE(torch::equal(got[1], torch::zeros_like(got[1]))) << "no target, no gradient";
  EXPECT_TRUE(torch::equal(got[1], ref[1])) << ref[1];
}

TEST(ChunkedCrossEntropy, PeaksBelowTheLogitsBytes) {
  // 4096 tokens x 8192 classes: the logits alone are 128 MiB in float32,
  // and an unchunked loss holds them, their log-softmax and their gradient.
  remat::memory::enable_tracking();
  torch::manual_seed(1);
  const int64_t N = 4096, C = 64, V = 8192;
  auto h = torch::randn({N, C}).requires_grad_();
  auto w = (torch::randn({V, C}) * 0.1).requires_grad_();
  auto t = torch::randint(V, {N}, torch::kLong);
  const int64_t logits_bytes = N * V * 4;
  remat::memory::reset_peak();
  const int64_t base = remat::memory::current_bytes();
  auto l = remat::chunked_cross_entropy(h, w, t, remat::ChunkedCrossEntropyOptions(32));
  l.backward();
  const int64_t peak = remat::memory::peak_bytes() - base;
  // What it may hold: grads of h and w (twice: its own and the accumulated
  // one), one slice's logits (N / 32 x V) a few times.
  EXPECT_LT(peak, logits_bytes / 8) << "peak " << peak << " B, logits " << logits_bytes << " B";
  EXPECT_GT(peak, 0);
}

TEST(ChunkedCrossEntropy, UnderAutocastCloseToTheUnchunkedBf16Loss) {
  CeCase c(2, 32, 32, 64, true);
  auto under_autocast = [&](const std::function<torch::Tensor()>& f) {
    return c.run([&] {
      at::autocast::set_autocast_enabled(at::kCPU, true);
      at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
      auto l = f();
      at::autocast::set_autocast_enabled(at::kCPU, false);
      at::autocast::clear_cache();
      return l;
    });
  };
  auto ref = under_autocast([&] { return reference_ce(c, 0.0, false); });
  auto got = under_autocast(
      [&] { return remat::chunked_cross_entropy(c.h, c.w, c.t, remat::ChunkedCrossEntropyOptions(4), c.b); });
  EXPECT_EQ(got[0].scalar_type(), torch::kFloat);
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].scalar_type(), ref[i].scalar_type()) << i;
    // bf16 products (8 bits of mantissa): both sides round differently.
    EXPECT_LE(rel_err(got[i], ref[i]), 2e-2) << i;
  }
}

TEST(ChunkedCrossEntropy, ErrorsNameTheValue) {
  CeCase c(1, 4, 8, 10, false);
  auto o = remat::ChunkedCrossEntropyOptions(2);
  EXPECT_EQ(thrown([&] { remat::chunked_cross_entropy(c.h, c.w, c.t, remat::ChunkedCrossEntropyOptions(-1)); }),
            "[remat::chunked_cross_entropy] chunks must be >= 0, got -1. Pass the number of slices, e.g. 8 (0 runs "
            "unchunked, through the whole logits).");
  EXPECT_EQ(thrown([&] {
              remat::chunked_cross_entropy(c.h, c.w, c.t, remat::ChunkedCrossEntropyOptions(2).label_smoothing(1.5));
            }),
            "[remat::chunked_cross_entropy] label_smoothing must be in [0, 1], got 1.500000. Pass e.g. 0.1, or 0 for "
            "none.");
  EXPECT_EQ(thrown([&] { remat::chunked_cross_entropy(c.h, c.w.t(), c.t, o); }),
            "[remat::chunked_cross_entropy] shapes do not match: hidden (1, 4, 8), weight (8, 10), targets (1, 4). "
            "Pass hidden (..., C), weight (vocab, C), targets (...) of int64 ids and bias (vocab).");
  // The same number of targets in another shape would pair rows with other
  // rows' ids: (4, 8, 16) hidden, (8, 4) targets.
  EXPECT_EQ(thrown([&] {
              remat::chunked_cross_entropy(torch::randn({4, 8, 16}), torch::randn({10, 16}),
                                           torch::randint(10, {8, 4}, torch::kLong), o);
            }),
            "[remat::chunked_cross_entropy] shapes do not match: hidden (4, 8, 16), weight (10, 16), targets (8, 4). "
            "Pass hidden (..., C), weight (vocab, C), targets (...) of int64 ids and bias (vocab).");
  EXPECT_EQ(thrown([&] { remat::chunked_cross_entropy(c.h, c.w, c.t, o, torch::zeros({3})); }),
            "[remat::chunked_cross_entropy] shapes do not match: hidden (1, 4, 8), weight (10, 8), targets (1, 4), "
            "bias (3). Pass hidden (..., C), weight (vocab, C), targets (...) of int64 ids and bias (vocab).");
  auto bad = c.t.clone();
  bad[0][2] = 10;
  EXPECT_EQ(thrown([&] { remat::chunked_cross_entropy(c.h, c.w, bad, o); }),
            "[remat::chunked_cross_entropy] target 10 is out of range for 10 classes (ignore_index -100). Pass ids "
            "in [0, vocab) or the ignore_index.");
  EXPECT_EQ(thrown([&] {
              remat::chunked_cross_entropy(c.h, c.w, torch::rand({1, 4}), o);
            }),
            "[remat::chunked_cross_entropy] targets are Float; class probabilities are not supported. Pass class "
            "ids (int64, e.g. targets.to(torch::kLong)).");
  EXPECT_EQ(c.h.grad().defined(), false) << "an error changes no gradient";
  auto l = remat::chunked_cross_entropy(c.h, c.w, c.t, o);
  EXPECT_EQ(thrown([&] { torch::autograd::grad({l}, {c.h}, {}, /*retain_graph=*/true, /*create_graph=*/true); }),
            "[remat::chunked_cross_entropy] its gradient is computed in forward and is not differentiable again (a "
            "backward with create_graph, e.g. a gradient penalty through the loss). Use the unchunked loss "
            "(torch::nn::functional::cross_entropy on the logits) where a second derivative is needed.");
}
