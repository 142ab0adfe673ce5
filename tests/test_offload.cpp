// remat::OffloadScope: disk, memory (codecs) and host targets give bitwise
// equal gradients (lossless) or a bounded error (lossy) against a plain run;
// prefetch depths, in-flight bounds, sharing, retain_graph; and the I/O faults
// (bad directory, failed writes, deleted or truncated files, failed
// reads), each with its error pinned and the directory listed afterwards;
// lossy codecs give one result whether writes are pending or done; graphs
// and threads sharing a store never deadlock (run under a watchdog).
#include "common.h"

#include <dirent.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <limits>
#include <memory>
#include <thread>

#include <remat/memory.h>

#include "../src/offload/offload_codec.h"
#include "../src/offload/offload_internal.h"

namespace {

using remat::Codec;
using remat::OffloadOptions;
using remat::OffloadScope;
using remat::OffloadTarget;
using remat_test::error_of;

/** A fresh directory under $TMPDIR (or /tmp), removed with its files. */
struct TempDir {
  std::string path;
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string templ = std::string(base && *base ? base : "/tmp") + "/remat-offload-test-XXXXXX";
    path = ::mkdtemp(templ.data()) ? templ : "";
    EXPECT_FALSE(path.empty()) << "mkdtemp failed";
  }
  ~TempDir() {
    for (const auto& f : files()) std::remove((path + "/" + f).c_str());
    ::rmdir(path.c_str());
  }
  std::vector<std::string> files() const {
    std::vector<std::string> out;
    if (DIR* d = ::opendir(path.c_str())) {
      while (dirent* ent = ::readdir(d)) {
        const std::string n = ent->d_name;
        if (n != "." && n != "..") out.push_back(n);
      }
      ::closedir(d);
    }
    return out;
  }
};

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += x + " ";
  return s;
}

/** A small GPT block stack (dropout 0) and its input. */
struct Gpt {
  torch::nn::Sequential seq;
  torch::Tensor x;
  explicit Gpt(int64_t blocks = 2, int64_t d = 32, int64_t heads = 4, int64_t B = 2, int64_t T = 16) {
    torch::manual_seed(3);
    for (int64_t i = 0; i < blocks; ++i) seq->push_back(remat_test::GptBlock(d, heads, 0.0));
    x = torch::randn({B, T, d}).requires_grad_(true);
  }
  torch::Tensor loss() { return seq->forward(x).square().mean(); }
  std::vector<torch::Tensor> plain() {
    remat_test::zero_grads(*seq, x);
    loss().backward();
    return remat_test::grads_of(*seq, x);
  }
  /** forward inside the scope, backward after it ends (the usual pattern). */
  std::vector<torch::Tensor> offloaded(const OffloadOptions& o, remat::OffloadStats* stats = nullptr,
                                       bool wait = false) {
    remat_test::zero_grads(*seq, x);
    torch::Tensor l;
    std::unique_ptr<OffloadScope> scope = std::make_unique<OffloadScope>(o);
    l = loss();
    if (wait) scope->wait();
    l.backward();
    if (stats) *stats = scope->stats();
    scope.reset();
    return remat_test::grads_of(*seq, x);
  }
};

OffloadOptions disk(const TempDir& d) { return OffloadOptions(OffloadTarget::kDisk).directory(d.path).min_bytes(0); }

TEST(Offload, DiskGivesBitwiseGradientsAndRemovesFiles) {
  TempDir dir;
  Gpt m;
  const auto ref = m.plain();
  remat::OffloadStats st;
  const auto got = m.offloaded(disk(dir), &st, /*wait=*/true);
  remat_test::expect_bitwise_equal(ref, got);
  EXPECT_GT(st.files_created, 10);
  EXPECT_EQ(st.files_live, 0);
  EXPECT_EQ(st.bytes_written, st.bytes_read) << "each file read back once";
  EXPECT_EQ(st.prefetch_hits + st.prefetch_misses, st.tensors_saved - st.tensors_kept);
  EXPECT_GT(st.tensors_kept, 0) << "parameters and their views stay";
  EXPECT_TRUE(dir.files().empty()) << joined(dir.files());
  std::printf("disk: %lld saved, %lld kept, %lld shared, %lld files, %lld hits, %lld misses\n",
              (long long)st.tensors_saved, (long long)st.tensors_kept, (long long)st.tensors_shared,
              (long long)st.files_created, (long long)st.prefetch_hits, (long long)st.prefetch_misses);
}

TEST(Offload, PrefetchDepthsAndWriterThreadsAllBitwise) {
  TempDir dir;
  Gpt m;
  const auto ref = m.plain();
  for (int64_t depth : {0, 1, 4}) {
    for (int writers : {1, 3}) {
      remat::OffloadStats st;
      const auto got = m.offloaded(disk(dir).prefetch_depth(depth).writer_threads(writers), &st, /*wait=*/true);
      remat_test::expect_bitwise_equal(ref, got);
      // Everything was on disk before backward (wait()): without prefetch
      // every unpack reads; with it, reads are handed to the prefetcher
      // (whether it is ahead, a hit, depends on scheduling: printed only).
      if (depth == 0) {  // hits: only the second handle of a shared region
        EXPECT_LE(st.prefetch_hits, st.tensors_shared);
        EXPECT_EQ(st.prefetches_issued, 0);
      } else {
        EXPECT_GT(st.prefetches_issued, 0) << "depth " << depth;
      }
      std::printf("depth %lld, %d writers: %lld hits, %lld misses, %lld prefetches issued\n", (long long)depth, writers,
                  (long long)st.prefetch_hits, (long long)st.prefetch_misses, (long long)st.prefetches_issued);
      EXPECT_EQ(st.files_live, 0);
      EXPECT_TRUE(dir.files().empty()) << joined(dir.files());
    }
  }
}

TEST(Offload, BackwardOnAnotherThread) {
  TempDir dir;
  Gpt m;
  const auto ref = m.plain();
  remat_test::zero_grads(*m.seq, m.x);
  torch::Tensor l;
  {
    OffloadScope scope(disk(dir));
    l = m.loss();
  }
  std::thread t([&] { l.backward(); });  // the hooks carry the store; no thread-local is read
  t.join();
  remat_test::expect_bitwise_equal(ref, remat_test::grads_of(*m.seq, m.x));
  l = torch::Tensor();
  EXPECT_TRUE(dir.files().empty()) << joined(dir.files());
}

TEST(Offload, MaxInflightBytesBoundsPendingWrites) {
  TempDir dir;
  Gpt m;
  const auto ref = m.plain();
  remat::OffloadStats st;
  const int64_t limit = 20 << 10;  // the block's largest saved tensors are 8 KiB (B, T, 4C) float32
  const auto got = m.offloaded(disk(dir).max_inflight_bytes(limit).prefetch_depth(8), &st);
  remat_test::expect_bitwise_equal(ref, got);
  EXPECT_LE(st.peak_inflight_bytes, limit);
  EXPECT_GT(st.peak_inflight_bytes, 0);
}

TEST(Offload, ParametersSmallTensorsAndSharedTensorsAreNotWritten) {
  TempDir dir;
  torch::manual_seed(0);
  torch::nn::Linear lin(64, 64);
  auto x = torch::randn({32, 64}, torch::requires_grad());
  torch::Tensor y;
  OffloadScope scope(disk(dir));
  // addmm saves x (a leaf that requires grad) and weight.t() (a view of a
  // parameter): both alive anyway. exp saves its output, which sin saves again.
  y = lin(x).exp().sin().sum();
  scope.wait();
  auto st = scope.stats();
  EXPECT_EQ(st.tensors_saved, 4);
  EXPECT_EQ(st.tensors_kept, 2);
  EXPECT_EQ(st.tensors_shared, 1);
  EXPECT_EQ(st.files_created, 1);
  EXPECT_EQ(dir.files().size(), 1u);
  y.backward();
  EXPECT_TRUE(dir.files().empty());
  auto e = (torch::addmm(lin->bias, x, lin->weight.t())).exp().detach();
  EXPECT_TRUE(torch::equal(x.grad(), torch::mm(e.cos() * e, lin->weight.detach())));

  OffloadScope small(OffloadOptions(OffloadTarget::kDisk).directory(dir.path).min_bytes(1 << 20));
  auto z = x.exp().sum();
  EXPECT_EQ(small.stats().tensors_kept, small.stats().tensors_saved);
  EXPECT_EQ(small.stats().files_created, 0);
}

TEST(Offload, ViewsOfOneBaseShareOneFileAndKeepTheirStrides) {
  TempDir dir;
  auto x = torch::randn({64, 96}, torch::requires_grad());
  auto run = [&] {
    auto base = x * 2;  // (64, 96), dense: what q and k are views of
    auto q = base.narrow(1, 0, 32), k = base.narrow(1, 32, 32);
    return torch::mm(q.t(), k).sum();  // mm saves q.t() and k: strided views of base
  };
  run().backward();
  const auto want = x.grad().clone();
  x.mutable_grad() = torch::Tensor();
  torch::Tensor l;
  remat::OffloadStats st;
  {
    OffloadScope scope(disk(dir));
    l = run();
    scope.wait();
    st = scope.stats();
  }
  EXPECT_EQ(st.tensors_saved, 2);
  EXPECT_EQ(st.tensors_shared, 1);
  EXPECT_EQ(st.files_created, 1);
  EXPECT_EQ(st.bytes_raw, 64 * 96 * 4) << "the base, once";
  l.backward();
  EXPECT_TRUE(torch::equal(x.grad(), want));
  EXPECT_TRUE(dir.files().empty());

  // The unpacked tensors have the strides of the saved ones.
  auto store = remat::detail::OffloadStore::create(disk(dir));
  auto base = torch::randn({64, 96});
  auto v = base.narrow(1, 32, 32).t();  // (32, 64), strides (1, 96)
  auto h = store->pack(v);
  store->wait();
  auto back = store->unpack(h);
  EXPECT_EQ(back.sizes(), v.sizes());
  EXPECT_EQ(back.strides(), v.strides());
  EXPECT_TRUE(torch::equal(back, v));
  h.reset();
  EXPECT_TRUE(dir.files().empty());
}

TEST(Offload, GraphFreedWithoutBackwardRemovesFiles) {
  TempDir dir;
  Gpt m;
  {
    torch::Tensor l;
    OffloadScope scope(disk(dir));
    l = m.loss();
    scope.wait();
    EXPECT_EQ(static_cast<int64_t>(dir.files().size()), scope.stats().files_live);
    EXPECT_GT(dir.files().size(), 10u);
  }  // the graph (and with it every hook) goes before the scope
  EXPECT_TRUE(dir.files().empty()) << joined(dir.files());
}

TEST(Offload, RetainGraphReadsTwice) {
  TempDir dir;
  Gpt m;
  remat_test::zero_grads(*m.seq, m.x);
  auto l = m.loss();
  l.backward({}, /*retain_graph=*/true);
  l.backward();
  const auto ref = remat_test::grads_of(*m.seq, m.x);
  remat_test::zero_grads(*m.seq, m.x);
  {
    OffloadScope scope(disk(dir));
    l = m.loss();
    scope.wait();
  }
  l.backward({}, /*retain_graph=*/true);
  EXPECT_FALSE(dir.files().empty()) << "kept for the second backward";
  l.backward();
  remat_test::expect_bitwise_equal(ref, remat_test::grads_of(*m.seq, m.x));
  l = torch::Tensor();
  EXPECT_TRUE(dir.files().empty()) << joined(dir.files());
}

TEST(Offload, InPlaceChangeAfterSaveIsAnError) {
  TempDir dir;
  auto x = torch::randn({64, 64}, torch::requires_grad());
  torch::Tensor y, h;
  {
    OffloadScope scope(disk(dir));
    h = x * 2;
    y = h.exp().sum();  // exp saves its output; h is not saved
    auto e = h.exp();
    y = (e * 3).sum() + e.sin().sum();  // sin saves e
    e.add_(1);
  }
  EXPECT_EQ(error_of([&] { y.backward(); }),
            "[remat::offload] a tensor saved for backward (#1, shape [64, 64]) was modified in place after it was "
            "saved (version 0 then, 1 now): its gradient would be wrong. Clone it before the in-place op.");
}

TEST(Offload, LosslessCodecsAreBitwiseInMemoryAndOnDisk) {
  TempDir dir;
  Gpt m;
  const auto ref = m.plain();
  for (Codec c : {Codec::kZstd, Codec::kLz4}) {
    remat::OffloadStats st;
    auto got = m.offloaded(OffloadOptions(OffloadTarget::kMemory).codec(c).min_bytes(0), &st);
    remat_test::expect_bitwise_equal(ref, got);
    EXPECT_EQ(st.files_created, 0);
    // The masked half of the attention scores (-1e9) and probabilities (0)
    // compresses; the rest barely does.
    EXPECT_GT(st.compression_ratio(), 1.05) << remat::to_string(c);
    std::printf("%s in memory: %.3fx\n", remat::to_string(c).c_str(), st.compression_ratio());
    got = m.offloaded(disk(dir).codec(c), &st, /*wait=*/true);
    remat_test::expect_bitwise_equal(ref, got);
    EXPECT_LT(st.bytes_written, st.bytes_raw);
    EXPECT_TRUE(dir.files().empty());
  }
}

/** max |a - b| / max |b| over all gradients. */
double relative_error(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!a[i].defined()) continue;
    num = std::max(num, (a[i] - b[i]).abs().max().item<double>());
    den = std::max(den, b[i].abs().max().item<double>());
  }
  return num / den;
}

TEST(Offload, LossyCodecsGiveBoundedNonZeroGradientError) {
  TempDir dir;
  Gpt m(2, 64, 4, 2, 32);
  const auto ref = m.plain();
  const auto bf16 = m.offloaded(OffloadOptions(OffloadTarget::kMemory).codec(Codec::kBFloat16).min_bytes(0));
  const auto f8 = m.offloaded(disk(dir).codec(Codec::kFloat8), nullptr, /*wait=*/true);
  const auto i8 = m.offloaded(OffloadOptions(OffloadTarget::kMemory).codec(Codec::kInt8Block).min_bytes(0));
  const double e_bf16 = relative_error(bf16, ref), e_f8 = relative_error(f8, ref), e_i8 = relative_error(i8, ref);
  std::printf(
      "gradient error vs lossless (max abs diff / max abs grad): bfloat16 %.2e, float8 e4m3 %.2e, int8 blocks %.2e\n",
      e_bf16, e_f8, e_i8);
  EXPECT_GT(e_bf16, 0);
  EXPECT_LT(e_bf16, 0.02);
  EXPECT_GT(e_f8, e_bf16);
  EXPECT_LT(e_f8, 0.25);
  EXPECT_GT(e_i8, e_bf16);
  EXPECT_LT(e_i8, 0.25);
  EXPECT_TRUE(dir.files().empty());

  // Lossy codecs leave non-float32 tensors alone: a float64 run is bitwise.
  torch::manual_seed(1);
  auto x = torch::randn({16, 64}, torch::dtype(torch::kFloat64).requires_grad(true));
  x.exp().tanh().sum().backward();
  const auto want = x.grad().clone();
  x.mutable_grad() = torch::Tensor();
  torch::Tensor l;
  {
    OffloadScope scope(OffloadOptions(OffloadTarget::kMemory).codec(Codec::kFloat8).min_bytes(0));
    l = x.exp().tanh().sum();
  }
  l.backward();
  EXPECT_TRUE(torch::equal(x.grad(), want));
}

// Codec::kInt8Block, encoded and decoded directly: a byte per value and a
// float32 per 256; zeros and each block's largest |x| exact; small values
// kept beside large ones elsewhere (a scale per block); any dense layout and
// a length that is not a multiple of 256 come back as they were; a tensor
// with inf goes raw.
TEST(Offload, Int8BlocksKeepEachBlocksRangeAndLayout) {
  using remat::detail::encode;
  using remat::detail::finish;
  using remat::detail::meta_of;
  torch::manual_seed(3);
  // 1000 values: blocks of 256 (the last 232 long) whose magnitudes differ by
  // up to 1e8 from block to block, as Adam's second moment does.
  auto x = torch::randn({1000}) * torch::pow(10.0, -(torch::arange(1000) / 256).to(torch::kFloat) * 2.5);
  x.index_put_({torch::arange(0, 1000, 7)}, 0.0);  // exact zeros
  const auto check = [&](const torch::Tensor& t, const std::string& what) {
    SCOPED_TRACE(what);
    const auto e = encode(t, Codec::kInt8Block, /*exact_size=*/true);
    EXPECT_TRUE(e.lossy);
    EXPECT_EQ(e.stored_bytes, t.numel() + 4 * ((t.numel() + 255) / 256));
    const auto back = finish(meta_of(t), e, e.data);
    ASSERT_EQ(back.sizes(), t.sizes());
    EXPECT_EQ(back.strides(), t.strides());
    const auto a = t.contiguous().view(-1), b = back.contiguous().view(-1);
    EXPECT_TRUE(torch::equal(b.index({a == 0}), a.index({a == 0}))) << "zeros stay zeros";
    // Per block: its largest |x| within 0.7% (exact when positive: the
    // levels hold 1, not -1); every value within 7.5% of itself or 0.15% of
    // the block's scale (half the levels' spacing: 0.45 / 2^e of each decade
    // 10^(e-6)); and values down to 1e-6 of it not flushed to zero.
    // Blocks run in memory order (the dense layout's).
    const auto order = t.as_strided({t.numel()}, {1}, t.storage_offset());
    const auto order_back = back.as_strided({back.numel()}, {1}, back.storage_offset());
    for (int64_t s = 0; s < t.numel(); s += 256) {
      const auto blk = order.slice(0, s, s + 256), got = order_back.slice(0, s, s + 256);
      const double amax = blk.abs().max().item<double>();
      EXPECT_NEAR(got.abs().max().item<double>(), amax, 0.0071 * amax) << "block at " << s;
      const auto err = (got - blk).abs();
      EXPECT_TRUE((err <= 0.075 * blk.abs() + 0.0015 * amax).all().item<bool>())
          << "block at " << s << ": worst " << ((err - 0.075 * blk.abs()) / amax).max().item<double>();
      const auto small = blk.abs() >= 1e-6 * amax;
      EXPECT_TRUE((got.index({small}) != 0).all().item<bool>()) << "block at " << s;
    }
  };
  check(x, "1-D, 1000 values");
  check(x.view({40, 25}).t(), "a transposed 25 x 40 (dense, not contiguous)");
  // inf or NaN: stored raw, bitwise.
  auto inf = x.clone();
  inf[5] = std::numeric_limits<float>::infinity();
  const auto e = encode(inf, Codec::kInt8Block, true);
  EXPECT_FALSE(e.lossy);
  EXPECT_TRUE(torch::equal(finish(meta_of(inf), e, e.data), inf));
}

// NOTE [int8 codec in place]: encoding a state tensor allocates its stage
// (a byte per value, a float32 per 256) and nothing else; decoding, the
// float32 result and nothing else. The whole-tensor form took 4x and 6x the
// tensor again, inside the update in backward, which auto's plan does not
// count (its first planned steps with int8 state ran up to 90% over their
// budgets). 1 Mi values: 4 MiB of float32.
TEST(Offload, Int8BlocksAllocateOnlyTheirResult) {
  using remat::detail::encode;
  using remat::detail::finish;
  using remat::detail::meta_of;
  torch::manual_seed(5);
  const auto t = torch::randn({1024, 1024});
  const int64_t n = t.numel(), stage_bytes = n + 4 * ((n + 255) / 256);
  remat::memory::enable_tracking();
  remat::memory::reset_peak();
  int64_t start = remat::memory::current_bytes();
  auto e = encode(t, Codec::kInt8Block, /*exact_size=*/true);
  EXPECT_LE(remat::memory::peak_bytes() - start, stage_bytes + 64 * 1024) << "encode";
  remat::memory::reset_peak();
  start = remat::memory::current_bytes();
  const auto back = finish(meta_of(t), e, e.data);
  EXPECT_LE(remat::memory::peak_bytes() - start, static_cast<int64_t>(t.nbytes()) + 64 * 1024) << "decode";
  EXPECT_TRUE(e.lossy);
  // Within the bound Int8BlocksKeepEachBlocksRangeAndLayout pins per block.
  EXPECT_TRUE(((back - t).abs() <= 0.075 * t.abs() + 0.0015 * t.abs().max()).all().item<bool>());
}

// The int8 codec's definition, written out in ATen ops here (the form it
// had before its per-block loops): levels 0, 1 and, per decade 1e-6 .. 1
// (e = 0 .. 6), 2^e levels of either sign at the middles of 2^e equal bins
// of [0.1 d, d]; a block's scale is its largest magnitude (1 for an all-zero
// block); a value's code is its nearest level (searchsorted on the
// midpoints). The codec's stage (scales, then codes) and its decoded values
// equal it bit for bit, on magnitudes over 10 decades, a transposed layout
// and a last block that is not full.
TEST(Offload, Int8BlocksEqualTheirDefinitionBitForBit) {
  std::vector<float> v{0.0F, 1.0F};
  for (int e = 0; e < 7; ++e) {
    const int n = 1 << e;
    const double decade = std::pow(10.0, e - 6);
    for (int i = 0; i < n; ++i) {
      const double lo = 0.1 + 0.9 * i / n, hi = 0.1 + 0.9 * (i + 1) / n;
      v.push_back(static_cast<float>(decade * (lo + hi) / 2));
      v.push_back(-static_cast<float>(decade * (lo + hi) / 2));
    }
  }
  std::sort(v.begin(), v.end());
  const auto levels = torch::tensor(v);
  ASSERT_EQ(levels.numel(), 256);
  const auto bounds = ((levels.narrow(0, 0, 255) + levels.narrow(0, 1, 255)) / 2).contiguous();
  torch::manual_seed(11);
  // 77 x 1000 values, stored transposed; magnitudes from 1e-8 to 1e2.
  auto base = torch::randn({1000, 77}) * torch::pow(10.0, torch::rand({1000, 77}) * 10 - 8);
  base.index_put_({torch::indexing::Slice(0, 8)}, 0.0);  // 616 zeros: block 1 is all zero (scale 1)
  // Blocks 3, 4, 5: a scale, then every midpoint times it (ties, and the
  // quotient's rounding, where the nearest level is decided).
  for (int64_t k = 0; k < 3; ++k) {
    const double s = std::vector<double>{1.0, 0.7, 3e-5}[k];
    auto block = base.view({-1}).narrow(0, (3 + k) * 256, 256);
    block[0] = s;
    block.narrow(0, 1, 255).copy_(bounds * s);
  }
  const auto t = base.t();
  ASSERT_FALSE(t.is_contiguous());
  const int64_t n = t.numel(), blocks = (n + 255) / 256;
  const auto memory_order = base.reshape({-1});  // t's elements in its memory order
  auto padded = torch::zeros({blocks * 256});
  padded.narrow(0, 0, n).copy_(memory_order);
  const auto values = padded.view({blocks, 256});
  const auto amax = values.abs().amax(1);
  const auto scale = torch::where(amax > 0, amax, torch::ones_like(amax));
  const auto codes =
      torch::searchsorted(bounds, (values / scale.unsqueeze(1)).reshape({-1})).narrow(0, 0, n).to(torch::kUInt8);
  const auto decoded = levels.index_select(0, codes.to(torch::kLong)) * scale.repeat_interleave(256).narrow(0, 0, n);

  const auto e = remat::detail::encode(t, Codec::kInt8Block, /*exact_size=*/true);
  ASSERT_EQ(e.block, 256);
  const auto stage = e.data.reshape({-1});
  ASSERT_EQ(stage.numel(), blocks * 4 + n);
  EXPECT_TRUE(torch::equal(stage.narrow(0, 0, blocks * 4).view(torch::kFloat), scale)) << "scales";
  EXPECT_TRUE(torch::equal(stage.narrow(0, blocks * 4, n), codes)) << "codes";
  const auto back = remat::detail::finish(remat::detail::meta_of(t), e, e.data);
  EXPECT_EQ(back.strides(), t.strides());
  EXPECT_TRUE(torch::equal(back.t().reshape({-1}), decoded)) << "decoded values";
}

TEST(Offload, HostOnCpuIsANoOpAndSaysSo) {
  Gpt m;
  const auto ref = m.plain();
  remat::OffloadStats st;
  const auto got = m.offloaded(OffloadOptions(OffloadTarget::kHost).min_bytes(0), &st);
  remat_test::expect_bitwise_equal(ref, got);
  EXPECT_EQ(st.tensors_kept, st.tensors_saved);
  OffloadScope scope(OffloadOptions(OffloadTarget::kHost));
  EXPECT_NE(scope.describe().find("CPU tensors stay where they are: a no-op for them"), std::string::npos)
      << scope.describe();
}

TEST(Offload, DescribeNamesTargetCodecAndCounters) {
  TempDir dir;
  torch::Tensor l;
  OffloadScope scope(disk(dir).codec(Codec::kZstd).prefetch_depth(0));
  auto x = torch::randn({128, 128}, torch::requires_grad());
  l = x.exp().sum();
  scope.wait();
  const std::string d = scope.describe();
  for (const std::string& want : std::vector<std::string>{
           "target kDisk (directory " + dir.path +
               ", 1 writer thread, prefetch depth 0 (off), at most 256.00 MiB in flight)",
           "codec kZstd", "saved 1 (kept 0, shared 0), 64.00 KiB offloaded as", "files 1 live of 1"}) {
    EXPECT_NE(d.find(want), std::string::npos) << want << "\n in: " << d;
  }
}

// ---- faults ----

TEST(OffloadFaults, BadOptionsAndDirectories) {
  TempDir dir;
  EXPECT_EQ(error_of([&] { OffloadScope s(OffloadOptions(OffloadTarget::kDisk)); }),
            "[remat::offload] OffloadTarget::kDisk needs a directory; set OffloadOptions().directory(path) to an "
            "existing, writable directory.");
  EXPECT_EQ(error_of([&] { OffloadScope s(OffloadOptions(OffloadTarget::kDisk).directory(dir.path + "/nope")); }),
            "[remat::offload] directory '" + dir.path +
                "/nope' cannot be used: No such file or directory. Create it (mkdir -p) or pass another one to "
                "OffloadOptions().directory().");
  const std::string file = dir.path + "/a-file";
  std::ofstream(file) << "x";
  EXPECT_EQ(error_of([&] { OffloadScope s(OffloadOptions(OffloadTarget::kDisk).directory(file)); }),
            "[remat::offload] directory '" + file +
                "' is not a directory. Pass a directory to OffloadOptions().directory().");
  std::remove(file.c_str());
  // Unwritable: root ignores permission bits, so use a read-only mount then.
  std::string ro = dir.path + "/ro";
  ::mkdir(ro.c_str(), 0500);
  if (::geteuid() == 0) ro = "/proc";
  const std::string err = error_of([&] { OffloadScope s(OffloadOptions(OffloadTarget::kDisk).directory(ro)); });
  EXPECT_EQ(err.rfind("[remat::offload] directory '" + ro + "' is not writable: creating a file in it failed (", 0), 0u)
      << err;
  EXPECT_NE(err.find("). Pass a writable directory to OffloadOptions().directory()."), std::string::npos) << err;
  ::rmdir((dir.path + "/ro").c_str());
  EXPECT_EQ(error_of([&] { OffloadScope s(OffloadOptions(OffloadTarget::kMemory).prefetch_depth(-1)); }),
            "[remat::offload] OffloadOptions::prefetch_depth is -1; it must be >= 0 (0 turns prefetching off).");
  EXPECT_EQ(error_of([&] { OffloadScope s(OffloadOptions(OffloadTarget::kMemory).max_inflight_bytes(0)); }),
            "[remat::offload] OffloadOptions::max_inflight_bytes is 0; it must be > 0.");
  EXPECT_EQ(error_of([&] { OffloadScope s(OffloadOptions(OffloadTarget::kHost).codec(Codec::kZstd)); }),
            "[remat::offload] codec kZstd does not apply to OffloadTarget::kHost (pinned copies stay raw); use "
            "kMemory or kDisk to compress, or codec(Codec::kNone).");
  EXPECT_TRUE(dir.files().empty()) << joined(dir.files());
}

/** The file name pattern of a write error, without the directory's random part. */
std::string write_error(const TempDir& dir, const std::string& err) {
  const auto at = err.find(dir.path + "/remat-offload-");
  return at == std::string::npos ? err : err.substr(0, at) + "<file>" + err.substr(err.find(" failed:", at));
}

TEST(OffloadFaults, FailedWriteIsReportedAndLeavesNoFiles) {
  TempDir dir;
  Gpt m;
  std::string err;
  remat::detail::inject_offload_write_failure(3);
  try {
    torch::Tensor l;
    OffloadScope scope(disk(dir));
    l = m.loss();  // may already throw at a later save
    scope.wait();  // or here, at the latest
    l.backward();
  } catch (const remat::Error& e) {
    err = e.what();
  }
  remat::detail::inject_offload_write_failure(0);
  EXPECT_EQ(write_error(dir, err).substr(0, 51), "[remat::offload] writing 4.00 KiB to <file> failed:") << err;
  EXPECT_NE(err.find(" failed: No space left on device (injected). Free space there or pass another directory to "
                     "OffloadOptions().directory()."),
            std::string::npos)
      << err;
  EXPECT_TRUE(dir.files().empty()) << joined(dir.files());
}

TEST(OffloadFaults, FailedWriteSurfacesAtBackwardAndDestructor) {
  TempDir dir;
  auto x = torch::randn({256, 256}, torch::requires_grad());
  torch::Tensor l;
  std::string at_scope_end;
  remat::detail::inject_offload_write_failure(1);
  try {
    OffloadScope scope(disk(dir));
    l = x.exp().sum();  // one save: the failure comes after it
    // let the writer fail before the scope ends
    for (int i = 0; i < 1000 && scope.stats().files_created == 0 && error_of([&] { scope.wait(); }).empty(); ++i) {
      ::usleep(1000);
    }
  } catch (const remat::Error& e) {
    at_scope_end = e.what();
  }
  remat::detail::inject_offload_write_failure(0);
  EXPECT_NE(at_scope_end.find("No space left on device (injected)"), std::string::npos) << at_scope_end;
  const std::string at_backward = error_of([&] { l.backward(); });
  EXPECT_EQ(at_backward, at_scope_end) << "the unpack that needs the tensor throws the same error";
  l = torch::Tensor();
  EXPECT_TRUE(dir.files().empty()) << joined(dir.files());
}

TEST(OffloadFaults, RealWriteFailureUnderAFileSizeLimit) {
  // A real failing write(2): the kernel refuses to grow a file past
  // RLIMIT_FSIZE with EFBIG (SIGXFSZ ignored), as it refuses ENOSPC on a full disk.
  TempDir dir;
  struct rlimit old;
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  auto prev = ::signal(SIGXFSZ, SIG_IGN);
  struct rlimit lim = old;
  lim.rlim_cur = 16 << 10;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &lim), 0);
  auto x = torch::randn({128, 256}, torch::requires_grad());  // 128 KiB
  torch::Tensor l;
  std::string err;
  try {
    OffloadScope scope(disk(dir));
    l = x.exp().sum();
    scope.wait();
  } catch (const remat::Error& e) {
    err = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &old);
  ::signal(SIGXFSZ, prev);
  EXPECT_NE(err.find(" failed: File too large. Free space there or pass another directory"), std::string::npos) << err;
  EXPECT_NE(error_of([&] { l.backward(); }).find("File too large"), std::string::npos);
  l = torch::Tensor();
  EXPECT_TRUE(dir.files().empty()) << joined(dir.files());
}

// The directory removed while a store writes there: the error says it is
// gone, where it advised freeing space.
TEST(OffloadFaults, ADirectoryRemovedWhileInUseIsNamedAsGone) {
  TempDir dir;
  auto x = torch::randn({128, 256}, torch::requires_grad());
  torch::Tensor l;
  std::string err;
  try {
    OffloadScope scope(disk(dir));
    std::filesystem::remove_all(dir.path);
    l = x.exp().sum();
    scope.wait();
  } catch (const remat::Error& e) {
    err = e.what();
  }
  EXPECT_NE(err.find(" failed: No such file or directory. The directory is gone (removed since the store opened?): "
                     "create it again, or pass another directory to OffloadOptions().directory()."),
            std::string::npos)
      << err;
  l = torch::Tensor();
  EXPECT_TRUE(dir.files().empty());
}

/** Runs forward under a disk scope, lets `tamper` at the files, then
 *  backward; returns backward's error. */
std::string after_tampering(const TempDir& dir, const OffloadOptions& o,
                            const std::function<void(const std::vector<std::string>&)>& tamper) {
  Gpt m;
  torch::Tensor l;
  {
    OffloadScope scope(o);
    l = m.loss();
    scope.wait();
  }
  auto files = dir.files();
  std::sort(files.begin(), files.end());
  tamper(files);
  std::string err = error_of([&] { l.backward(); });
  l = torch::Tensor();
  return err;
}

/** Saved tensors are numbered in save order; files are named ...-<id>.bin. */
std::string last_file(const std::vector<std::string>& files) {
  std::string best;
  long best_id = -1;
  for (const auto& f : files) {
    const long id = std::stol(f.substr(f.rfind('-') + 1));
    if (id > best_id) best_id = id, best = f;
  }
  return best;
}

TEST(OffloadFaults, DeletedFileBeforeBackward) {
  TempDir dir;
  for (int64_t depth : {0, 2}) {  // read at unpack, and by the prefetcher
    std::string gone;
    const std::string err = after_tampering(dir, disk(dir).prefetch_depth(depth), [&](const auto& files) {
      gone = last_file(files);
      std::remove((dir.path + "/" + gone).c_str());
    });
    EXPECT_NE(err.find("[remat::offload] cannot open the file of saved tensor #"), std::string::npos) << err;
    EXPECT_NE(err.find(dir.path + "/" + gone +
                       ": No such file or directory. It was removed before backward; keep "
                       "the offload directory private to this process until backward is "
                       "done."),
              std::string::npos)
        << err;
    EXPECT_TRUE(dir.files().empty()) << joined(dir.files());
  }
}

TEST(OffloadFaults, TruncatedFileBeforeBackward) {
  TempDir dir;
  for (Codec c : {Codec::kNone, Codec::kZstd}) {
    const std::string err = after_tampering(dir, disk(dir).codec(c), [&](const auto& files) {
      const std::string f = dir.path + "/" + last_file(files);
      ASSERT_EQ(::truncate(f.c_str(), 100), 0);
    });
    EXPECT_NE(err.find(" holds 100 B but "), std::string::npos) << err;
    EXPECT_NE(err.find(" were written; it was truncated or replaced. Keep the offload directory private to this "
                       "process until backward is done."),
              std::string::npos)
        << err;
    EXPECT_TRUE(dir.files().empty()) << joined(dir.files());
  }
}

TEST(OffloadFaults, CorruptedCompressedFileIsDetected) {
  TempDir dir;
  const std::string err = after_tampering(dir, disk(dir).codec(Codec::kZstd), [&](const auto& files) {
    // the attention scores compress; scribble over the middle of every compressed file
    for (const auto& name : files) {
      const std::string f = dir.path + "/" + name;
      std::fstream io(f, std::ios::in | std::ios::out | std::ios::binary);
      io.seekg(0, std::ios::end);
      const auto n = static_cast<std::streamoff>(io.tellg());
      io.seekp(n / 2);
      const std::string junk(16, '\x5a');
      io.write(junk.data(), static_cast<std::streamsize>(std::min<std::streamoff>(n / 2, 16)));
    }
  });
  // Raw files (incompressible tensors) are not checksummed; the first
  // compressed one backward reads is refused.
  EXPECT_NE(err.find("does not decompress to the tensor that was stored (corrupted)"), std::string::npos) << err;
  EXPECT_TRUE(dir.files().empty()) << joined(dir.files());
}

TEST(OffloadFaults, FailedReadAtUnpackAndInThePrefetcher) {
  TempDir dir;
  for (int64_t depth : {0, 3}) {
    remat::detail::inject_offload_read_failure(2);
    const std::string err = after_tampering(dir, disk(dir).prefetch_depth(depth), [](const auto&) {});
    remat::detail::inject_offload_read_failure(0);
    EXPECT_EQ(err.rfind("[remat::offload] reading ", 0), 0u) << err;
    EXPECT_NE(err.find(" failed: Input/output error (injected). The saved tensor is lost; run the step again."),
              std::string::npos)
        << err;
    EXPECT_TRUE(dir.files().empty()) << joined(dir.files());
  }
}

TEST(OffloadFaults, ErrorsAreNotStickyAcrossScopes) {
  TempDir dir;
  Gpt m;
  const auto ref = m.plain();
  remat::detail::inject_offload_write_failure(1);
  EXPECT_FALSE(error_of([&] { m.offloaded(disk(dir), nullptr, /*wait=*/true); }).empty());
  remat::detail::inject_offload_write_failure(0);
  remat_test::expect_bitwise_equal(ref, m.offloaded(disk(dir), nullptr, /*wait=*/true));
  EXPECT_TRUE(dir.files().empty()) << joined(dir.files());
}

// ---- Lossy codecs on disk: one result whatever the writers' timing ----

/** Holds the writers of every store while it lives (test seam): each stored
 *  tensor stays pending, and backward unpacks it before its write. */
struct WritersPaused {
  WritersPaused() { remat::detail::pause_offload_writers(true); }
  ~WritersPaused() { remat::detail::pause_offload_writers(false); }
};

// A tensor that is not a view but starts inside its storage (what detach()
// of a slice gives, or an op's chunked outputs): the store keeps its own
// span, whose storage offset is not 0. Unpacked while its write is still
// pending (or kept after a failed write), it must come back from that span,
// not from the storage's start.
TEST(Offload, ATensorStartingInsideItsStorageComesBackWhilePending) {
  TempDir dir;
  const auto base = torch::arange(100, torch::kFloat);
  const auto w = base.narrow(0, 37, 50).detach();  // offset 37, not a view
  ASSERT_EQ(w.storage_offset(), 37);
  auto x = torch::ones({50}, torch::requires_grad());
  torch::Tensor loss;
  {
    WritersPaused paused;
    {
      remat::OffloadScope scope(disk(dir).min_bytes(0));
      loss = (x * w).sum();  // saves w for x's gradient
    }
    loss.backward();
  }
  EXPECT_TRUE(torch::equal(x.grad(), w)) << x.grad().slice(0, 0, 3);
}

TEST(Offload, LossyCodecOnDiskIsTheSameWhetherWritesArePendingOrDone) {
  TempDir dir;
  Gpt m;
  const auto ref = m.plain();
  for (Codec c : {Codec::kBFloat16, Codec::kFloat8, Codec::kInt8Block}) {
    SCOPED_TRACE(remat::to_string(c));
    const OffloadOptions o = disk(dir).codec(c);
    remat::OffloadStats st;
    // Every write done before backward: each tensor comes back from its file.
    const auto written = m.offloaded(o, &st, /*wait=*/true);
    EXPECT_GT(st.bytes_read, 0);
    EXPECT_EQ(st.files_created, st.tensors_saved - st.tensors_kept - st.tensors_shared);
    // Writers held through backward: each tensor is unpacked while its write is pending.
    std::vector<torch::Tensor> pending;
    {
      WritersPaused paused;
      pending = m.offloaded(o, &st);
    }
    EXPECT_EQ(st.files_created, 0) << "every unpack found its write pending";
    EXPECT_EQ(st.prefetch_hits, st.tensors_saved - st.tensors_kept);
    remat_test::expect_bitwise_equal(written, pending);
    // Steps with the writers racing backward: the same, every time.
    for (int i = 0; i < 3; ++i) remat_test::expect_bitwise_equal(written, m.offloaded(o));
    const double err = relative_error(written, ref);
    EXPECT_GT(err, 0) << "the codec was applied";
    std::printf("%s on disk: written and pending bitwise equal, gradient error %.2e\n", remat::to_string(c).c_str(),
                err);
    EXPECT_TRUE(dir.files().empty()) << joined(dir.files());
  }
}

// ---- Several graphs and threads on one store: no pack waits forever ----

/** Runs body on a thread of its own; false when it did not finish within
 *  limit (it threw: rethrown). A body that hangs (a deadlock: the
 *  regression these tests guard against) is left behind, detached, so that
 *  the test fails instead of hanging the suite: body must own what it uses. */
bool finishes_within(std::chrono::seconds limit, std::function<void()> body) {
  auto done = std::make_shared<std::promise<void>>();
  std::future<void> finished = done->get_future();
  std::thread([done, body = std::move(body)]() mutable {
    try {
      body();
      body = nullptr;  // what it captured goes before the test goes on
      done->set_value();
    } catch (...) {
      done->set_exception(std::current_exception());
    }
  }).detach();
  if (finished.wait_for(limit) != std::future_status::ready) return false;
  finished.get();
  return true;
}

constexpr auto kWatchdog = std::chrono::seconds(30);
constexpr int64_t kOneMiB = 1 << 20;

/** n tanh in a row: each saves its output, 512 KiB for a (128, 1024) input. */
torch::Tensor tanhs(torch::Tensor h, int n) {
  for (int i = 0; i < n; ++i) h = h.tanh();
  return h;
}

/** Three leaves of (128, 1024) float32 (512 KiB) and their plain gradients
 *  for tanhs(a, 8), tanhs(b, 4), tanhs(c, 4). */
struct ThreeGraphs {
  torch::Tensor a, b, c;
  std::vector<torch::Tensor> plain;
  ThreeGraphs() {
    torch::manual_seed(5);
    for (auto* x : {&a, &b, &c}) *x = torch::randn({128, 1024}).requires_grad_(true);
    tanhs(a, 8).sum().backward();
    tanhs(b, 4).sum().backward();
    tanhs(c, 4).sum().backward();
    plain = grads();
  }
  std::vector<torch::Tensor> grads() {
    std::vector<torch::Tensor> g;
    for (auto* x : {&a, &b, &c}) {
      g.push_back(x->grad().defined() ? x->grad().clone() : torch::Tensor());
      x->mutable_grad() = torch::Tensor();
    }
    return g;
  }
};

TEST(Offload, TwoGraphsInOneScopeDoNotDeadlockOnPrefetchedReads) {
  TempDir dir;
  auto g = std::make_shared<ThreeGraphs>();
  auto st = std::make_shared<remat::OffloadStats>();
  const std::string path = dir.path;
  const bool finished = finishes_within(kWatchdog, [g, st, path] {
    OffloadScope scope(OffloadOptions(OffloadTarget::kDisk).directory(path).max_inflight_bytes(kOneMiB));
    auto ha = tanhs(g->a, 4);        // graph A, its first half
    auto lb = tanhs(g->b, 4).sum();  // graph B
    scope.wait();                    // all on disk: backward reads and prefetches
    lb.backward();                   // B's last unpacks may prefetch A's newest tensors
    auto la = tanhs(ha, 4).sum();    // more forward of A: its packs must not wait on those reads
    auto lc = tanhs(g->c, 4).sum();  // and a new graph
    la.backward();
    lc.backward();
    *st = scope.stats();
  });
  ASSERT_TRUE(finished) << "deadlock: a pack waited on bytes that only another graph's backward releases";
  remat_test::expect_bitwise_equal(g->plain, g->grads());
  EXPECT_GT(st->prefetches_dropped, 0) << "A's forward made room by dropping the reads B's backward issued";
  EXPECT_LE(st->peak_inflight_bytes, kOneMiB);
  EXPECT_EQ(st->files_live, 0);
  std::printf("two graphs: %lld prefetches issued, %lld dropped, %lld hits, %lld misses, peak in flight %lld B\n",
              (long long)st->prefetches_issued, (long long)st->prefetches_dropped, (long long)st->prefetch_hits,
              (long long)st->prefetch_misses, (long long)st->peak_inflight_bytes);
  EXPECT_TRUE(dir.files().empty()) << joined(dir.files());
}

TEST(Offload, TwoGraphsThroughCheckpointOffloadDoNotDeadlock) {
  TempDir dir;
  auto g = std::make_shared<ThreeGraphs>();
  const auto opts = remat::CheckpointOptions().offload(
      OffloadOptions(OffloadTarget::kDisk).directory(dir.path).max_inflight_bytes(kOneMiB));
  const bool finished = finishes_within(kWatchdog, [g, opts] {
    // A tanh per region; each region's input (but a, b and c: leaves) goes to the store.
    auto regions = [&](torch::Tensor h, int n) {
      for (int i = 0; i < n; ++i)
        h = remat::checkpoint(
            opts, [](const torch::Tensor& t) { return t.tanh(); }, h);
      return h;
    };
    auto ha = regions(g->a, 4);
    auto lb = regions(g->b, 4).sum();
    remat::wait_checkpoint_offloads();
    lb.backward();
    auto la = regions(ha, 4).sum();
    auto lc = regions(g->c, 4).sum();
    la.backward();
    lc.backward();
  });
  ASSERT_TRUE(finished) << "deadlock: a pack waited on bytes that only another graph's backward releases";
  remat_test::expect_bitwise_equal(g->plain, g->grads());
  EXPECT_TRUE(dir.files().empty()) << joined(dir.files());
}

TEST(Offload, TwoThreadsWithTheirOwnGraphsShareAStore) {
  TempDir dir;
  auto g = std::make_shared<ThreeGraphs>();
  auto store = remat::detail::OffloadStore::create(
      OffloadOptions(OffloadTarget::kDisk).directory(dir.path).max_inflight_bytes(kOneMiB));
  auto got = std::make_shared<std::vector<std::vector<torch::Tensor>>>();
  const bool finished = finishes_within(kWatchdog, [g, store, got] {
    // In turn: thread 1 builds half of C, then A; thread 2 half of B.
    // Thread 1 runs A's backward while all is on disk: its last unpacks
    // may prefetch B's tensors or C's. Then thread 2 goes on with B (its
    // saves must not wait on those reads), and thread 1 with C.
    std::promise<void> a_built, b_half, a_done, b_done;
    std::thread t1([&] {
      remat::ScopedHooks hooks(remat::detail::make_offload_hooks(store));
      auto hc = tanhs(g->c, 2);
      auto la = tanhs(g->a, 8).sum();
      a_built.set_value();
      b_half.get_future().wait();
      la.backward();
      a_done.set_value();
      b_done.get_future().wait();
      tanhs(hc, 2).sum().backward();
    });
    std::thread t2([&] {
      remat::ScopedHooks hooks(remat::detail::make_offload_hooks(store));
      a_built.get_future().wait();
      auto hb = tanhs(g->b, 2);
      store->wait();
      b_half.set_value();
      a_done.get_future().wait();
      tanhs(hb, 2).sum().backward();
      b_done.set_value();
    });
    t1.join();
    t2.join();
    got->push_back(g->grads());
    // Then both at once, three steps each, no order imposed.
    auto step = [&](torch::Tensor x, int n) {
      remat::ScopedHooks hooks(remat::detail::make_offload_hooks(store));
      for (int i = 0; i < 3; ++i) tanhs(x, n).sum().backward();  // g + g + g: 3 g, bitwise
    };
    std::thread t3([&] { step(g->a, 8); });
    std::thread t4([&] { step(g->b, 4); });
    t3.join();
    t4.join();
    {
      remat::ScopedHooks hooks(remat::detail::make_offload_hooks(store));
      tanhs(g->c, 4).sum().backward();
    }
    got->push_back(g->grads());
  });
  ASSERT_TRUE(finished) << "deadlock: a pack waited on bytes that only another thread's backward releases";
  ASSERT_EQ(got->size(), 2u);
  EXPECT_TRUE(torch::equal((*got)[0][0], g->plain[0]));
  EXPECT_TRUE(torch::equal((*got)[0][1], g->plain[1]));
  EXPECT_TRUE(torch::equal((*got)[0][2], g->plain[2]));
  EXPECT_TRUE(torch::equal((*got)[1][0], g->plain[0] * 3));
  EXPECT_TRUE(torch::equal((*got)[1][1], g->plain[1] * 3));
  EXPECT_TRUE(torch::equal((*got)[1][2], g->plain[2]));
  const remat::OffloadStats st = store->stats();
  EXPECT_LE(st.peak_inflight_bytes, kOneMiB);
  EXPECT_EQ(st.files_live, 0);
  std::printf("two threads: %lld prefetches issued, %lld dropped, %lld hits, %lld misses\n",
              (long long)st.prefetches_issued, (long long)st.prefetches_dropped, (long long)st.prefetch_hits,
              (long long)st.prefetch_misses);
  EXPECT_TRUE(dir.files().empty()) << joined(dir.files());
}

// ---- CheckpointOptions().offload with an unusable directory ----

TEST(OffloadFaults, CheckpointOffloadToAMissingDirectoryThrowsThenWaitAndALaterStepWork) {
  TempDir dir;
  const std::string missing = dir.path + "/missing";
  auto x = torch::randn({128, 1024}, torch::requires_grad());
  auto region = [](const torch::Tensor& t) { return tanhs(t, 2); };
  auto step = [&](const std::string& d) {
    const auto opts = remat::CheckpointOptions().offload(OffloadOptions(OffloadTarget::kDisk).directory(d));
    auto h = remat::checkpoint(opts, region, x * 2);
    remat::checkpoint(opts, region, h).sum().backward();
  };
  const std::string want = "[remat::offload] directory '" + missing +
                           "' cannot be used: No such file or directory. Create it (mkdir -p) or pass another one "
                           "to OffloadOptions().directory().";
  EXPECT_EQ(error_of([&] { step(missing); }), want);
  EXPECT_EQ(error_of([&] { remat::wait_checkpoint_offloads(); }), "");
  EXPECT_EQ(error_of([&] { step(missing); }), want) << "tried again, not remembered as a store";
  EXPECT_EQ(error_of([&] { remat::wait_checkpoint_offloads(); }), "");
  x.mutable_grad() = torch::Tensor();
  tanhs(tanhs(x * 2, 2), 2).sum().backward();
  const auto plain = x.grad().clone();
  x.mutable_grad() = torch::Tensor();
  step(dir.path);
  remat::wait_checkpoint_offloads();
  EXPECT_TRUE(torch::equal(x.grad(), plain));
  EXPECT_TRUE(dir.files().empty()) << joined(dir.files());
}

}  // namespace
