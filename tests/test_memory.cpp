// remat::memory (counting CPU allocator, probes, timeline) and the memory
// that checkpointing actually saves, measured with it.
#include "common.h"

#include <cstdio>
#include <fstream>
#include <thread>

using namespace remat_test;

namespace {

constexpr int64_t kFloat = 4;

TEST(Memory, CountsExactBytesAndPeak) {
  remat::memory::enable_tracking();
  remat::memory::enable_tracking();  // idempotent
  ASSERT_TRUE(remat::memory::tracking_enabled());
  const int64_t base = remat::memory::current_bytes();
  remat::memory::reset_peak();
  {
    auto a = torch::empty({1000}, torch::kFloat);
    EXPECT_EQ(remat::memory::current_bytes() - base, 1000 * kFloat);
    {
      auto b = torch::empty({250}, torch::kDouble);
      EXPECT_EQ(remat::memory::current_bytes() - base, 1000 * kFloat + 250 * 8);
    }
    EXPECT_EQ(remat::memory::current_bytes() - base, 1000 * kFloat);
  }
  EXPECT_EQ(remat::memory::current_bytes(), base);
  EXPECT_EQ(remat::memory::peak_bytes() - base, 1000 * kFloat + 250 * 8);
  remat::memory::reset_peak();
  EXPECT_EQ(remat::memory::peak_bytes(), base);
}

TEST(Memory, NestedProbesAreIndependent) {
  remat::memory::Probe outer;
  auto a = torch::empty({4096}, torch::kFloat);
  {
    remat::memory::Probe inner;
    EXPECT_EQ(inner.peak_bytes(), 0);
    { auto b = torch::empty({1024}, torch::kFloat); }
    EXPECT_EQ(inner.peak_bytes(), 1024 * kFloat);
    EXPECT_EQ(inner.delta_bytes(), 0);
  }
  EXPECT_EQ(outer.peak_bytes(), (4096 + 1024) * kFloat);
  EXPECT_EQ(outer.delta_bytes(), 4096 * kFloat);
}

TEST(Memory, ThreadSafeCounting) {
  remat::memory::enable_tracking();
  const int64_t base = remat::memory::current_bytes();
  auto work = [] {
    for (int i = 0; i < 2000; ++i) {
      auto t = torch::empty({64 + i % 7}, torch::kFloat);
      t.fill_(1);
    }
  };
  std::thread t1(work), t2(work);
  t1.join();
  t2.join();
  EXPECT_EQ(remat::memory::current_bytes(), base) << "every tracked byte freed must be subtracted once";
}

TEST(Memory, TimelineWritesChromeTrace) {
  const std::string path = ::testing::TempDir() + "remat_timeline.json";
  {
    remat::memory::Timeline tl;
    double t0 = tl.now_us();
    { auto a = torch::empty({1 << 16}, torch::kFloat); }
    tl.add_span("alloc", t0, tl.now_us());
    tl.stop();
    auto s = tl.samples();
    ASSERT_GE(s.size(), 3u);
    int64_t top = 0;
    for (auto& x : s) top = std::max(top, x.bytes - s.front().bytes);
    EXPECT_EQ(top, (1 << 16) * kFloat);
    tl.write_chrome_trace(path);
  }
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("\"traceEvents\""), std::string::npos);
  EXPECT_NE(text.find("\"ph\":\"C\""), std::string::npos);
  EXPECT_NE(text.find("\"name\":\"alloc\""), std::string::npos);
  std::remove(path.c_str());
  // Only one at a time.
  remat::memory::Timeline a;
  try {
    remat::memory::Timeline b;
    FAIL();
  } catch (const remat::Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "[remat::memory] a Timeline is already recording; stop or destroy it before starting another.");
  }
}

TEST(Memory, TimelineRefusesUnwritablePathAndLeavesNothing) {
  remat::memory::Timeline tl;
  tl.stop();
  try {
    tl.write_chrome_trace("/nonexistent-dir/trace.json");
    FAIL();
  } catch (const remat::Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "[remat::memory] cannot write the trace to '/nonexistent-dir/trace.json'; check the directory exists.");
  }
}

// Activation bytes live after a forward of an n-layer MLP (Linear + GELU per
// layer; plain keeps both the Linear's and the GELU's input), checkpointed
// per layer: the n - 1 inter-layer values and the output remain.
TEST(MemorySavings, PerLayerCheckpointKeepsLayerInputs) {
  const int64_t n = 32, B = 64, d = 64, act = B * d * kFloat;
  auto seq = make_mlp(n, d, 0, /*gelu=*/true);
  auto x = torch::randn({B, d}, torch::requires_grad());
  std::vector<torch::nn::Sequential> layers;
  for (int64_t i = 0; i < n; ++i) {
    torch::nn::Sequential layer;
    layer->push_back(*(seq->begin() + 2 * i));
    layer->push_back(*(seq->begin() + 2 * i + 1));
    layers.push_back(layer);
  }
  int64_t plain_bytes, ckpt_bytes;
  {
    remat::memory::Probe p;
    auto y = seq->forward(x);
    plain_bytes = p.delta_bytes();
  }
  {
    remat::memory::Probe p;
    torch::Tensor h = x;
    for (auto& l : layers) h = remat::checkpoint(l, h);
    ckpt_bytes = p.delta_bytes();
    // Backward still works and frees everything it recomputed.
    h.sum().backward();
  }
  std::printf("  after forward, n=%lld: plain %lld activations, per-layer checkpoint %lld (unit %lld B)\n",
              (long long)n, (long long)(plain_bytes / act), (long long)(ckpt_bytes / act), (long long)act);
  // Plain: per layer the GELU input and the GELU output (the next Linear's
  // input): 2n. Checkpointed: n values, plus one shared RNG state (~5 KiB).
  EXPECT_EQ(plain_bytes, 2 * n * act);
  EXPECT_GE(ckpt_bytes, n * act);
  EXPECT_LE(ckpt_bytes, n * act + 8 * 1024);
}

// Peak activation memory over forward + backward with checkpoint_sequential
// and k = sqrt(n) segments grows like sqrt(n), plain like n.
TEST(MemorySavings, SqrtSegmentsGrowLikeSqrtN) {
  const int64_t B = 32, d = 32, act = B * d * kFloat;
  std::vector<double> plain, ckpt;
  for (int64_t n : {16, 64, 256}) {
    auto seq = make_mlp(n, d);
    auto x = torch::randn({B, d}, torch::requires_grad());
    auto step = [&](bool c) {
      for (auto& p : seq->parameters()) {
        if (p.grad().defined()) p.mutable_grad().zero_();  // allocated once: not activations
      }
      remat::memory::Probe p;
      auto y = c ? remat::checkpoint_sequential(seq, std::llround(std::sqrt(2.0 * n)), x) : seq->forward(x);
      y.sum().backward();
      return static_cast<double>(p.peak_bytes()) / act;
    };
    step(false);  // allocate parameter gradients outside the measurement
    plain.push_back(step(false));
    ckpt.push_back(step(true));
    std::printf("  n=%lld layers: peak plain %.1f, sqrt segments %.1f activations\n", (long long)n, plain.back(),
                ckpt.back());
  }
  // Absolute, in activations: plain keeps every layer's output plus the
  // input and two gradients (n + 3, plus a few scalars); sqrt segments keep k
  // segment inputs plus one segment's n/k layers live in its recompute, with
  // the final segment plain (at most 3n/k) and the same few extras.
  const int64_t ns[] = {16, 64, 256};
  for (int i = 0; i < 3; ++i) {
    const double k = static_cast<double>(std::llround(std::sqrt(2.0 * ns[i])));
    EXPECT_NEAR(plain[i], static_cast<double>(ns[i] + 3), 0.1) << "n=" << ns[i];  // + scalars (136 B)
    EXPECT_GE(ckpt[i], k) << "n=" << ns[i];
    EXPECT_LE(ckpt[i], k + 3.0 * ns[i] / k + 4) << "n=" << ns[i];
  }
  // n grows 16x: plain ~16x, sqrt ~4x.
  EXPECT_GT(plain[2] / plain[0], 12.0);
  EXPECT_LT(ckpt[2] / ckpt[0], 6.0);
  EXPECT_GT(ckpt[2] / ckpt[0], 2.5);
  EXPECT_LT(ckpt[2], plain[2] / 3);
}

// Recomputed tensors are freed as autograd uses them: after a backward with
// retain_graph the region holds nothing but its input.
TEST(MemorySavings, RecomputedTensorsFreedOnUnpack) {
  const int64_t n = 4096;
  auto x = torch::randn({n}, torch::requires_grad());
  auto fn = [](torch::Tensor a) {
    for (int i = 0; i < 8; ++i) a = a.exp().sin();  // 8 exp results kept (sin saves the same)
    return a;
  };
  remat::memory::Probe p;
  auto y = remat::checkpoint(fn, x).sum();
  const int64_t after_forward = p.delta_bytes();
  y.backward({}, /*retain_graph=*/true);
  x.mutable_grad() = torch::Tensor();
  EXPECT_EQ(p.delta_bytes(), after_forward) << "recomputed values must not outlive their use";
  // Plain autograd with retain_graph keeps all 16.
  EXPECT_GE(p.peak_bytes() - after_forward, 8 * n * kFloat) << "the recompute did materialize them";
}

TEST(MemorySavings, ParametersAndInputsNeverDuplicated) {
  torch::nn::Linear lin(256, 256);
  auto x = torch::randn({8, 256}, torch::requires_grad());
  remat::checkpoint(lin, x);  // the RNG state is then shared with the previous region
  remat::memory::Probe p;
  auto y = remat::checkpoint(lin, x);
  EXPECT_EQ(p.delta_bytes(), 8 * 256 * kFloat) << "only the output is new";
  remat::reset_checkpoint_stats();
  y.sum().backward();
  EXPECT_EQ(remat::checkpoint_stats().recomputations, 0) << "input and weight are referenced, not recomputed";
}

}  // namespace
