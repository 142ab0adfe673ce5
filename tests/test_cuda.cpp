// remat's CUDA paths (docs/gpu.md): RNG devices, autocast, streams, CUDA
// memory statistics, and CheckpointedSequential planning in CUDA bytes.
// Two kinds of tests:
// - CPU tests, run everywhere: the device list the RNG capture uses (a pure
//   function, fed made-up CUDA devices), the stream helpers on CPU tensors,
//   meta inputs, and the errors of the CUDA memory functions in a CPU build;
// - GPU tests, which skip with "no CUDA device" where none is visible (and
//   in a CPU build), and compare against a plain run on the GPU.
#include "common.h"

#include <atomic>
#include <chrono>
#include <future>
#include <optional>
#include <thread>

#include <ATen/autocast_mode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <remat/plan/plan.h>
#include <remat/sequential.h>

#include "../src/core/replay.h"

using namespace remat_test;

namespace {

namespace rd = remat::detail;

const c10::Device kCpu(c10::kCPU);
c10::Device cuda(int i) { return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i)); }

#define REQUIRE_CUDA()                                                                   \
  do {                                                                                   \
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";                  \
    if (!remat::memory::built_with_cuda()) GTEST_SKIP() << "no CUDA device (CPU build)"; \
  } while (0)

// --- CPU tests -------------------------------------------------------------

TEST(CudaBuild, BuiltWithCudaMatchesTheCompileDefinition) {
#ifdef REMAT_WITH_CUDA
  EXPECT_TRUE(remat::memory::built_with_cuda());
#else
  EXPECT_FALSE(remat::memory::built_with_cuda());
#endif
}

TEST(RngDevices, CpuFirstThenInputsThenDevicesInUse) {
  // Made-up CUDA devices: the same code path in the CPU build.
  const auto got = rd::rng_devices({kCpu, c10::Device(c10::kMeta), cuda(1), cuda(1), cuda(0)}, {cuda(0), cuda(2)});
  const std::vector<c10::Device> want{kCpu, cuda(1), cuda(0), cuda(2)};
  EXPECT_EQ(got, want);
  EXPECT_EQ(rd::rng_devices({}, {}), std::vector<c10::Device>{kCpu});
  // Generator-less device types are left out, not an error.
  EXPECT_EQ(rd::rng_devices({c10::Device(c10::kMeta)}, {}), std::vector<c10::Device>{kCpu});
}

TEST(RngDevices, NoCudaDeviceInUseWithoutAGpu) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "a CUDA device is visible: covered by the GPU tests";
  EXPECT_TRUE(rd::cuda_devices_in_use().empty());
  // The capture then holds exactly the CPU generator.
  const auto r = rd::ReplayState::capture(true, {kCpu}, {});
  ASSERT_EQ(r.rng.size(), 1u);
  EXPECT_EQ(r.rng[0].first.device(), kCpu);
}

TEST(RngDevices, CpuTensorsHaveNoStream) {
  auto t = torch::ones({4});
  EXPECT_FALSE(rd::stream_of(t).has_value());
  EXPECT_FALSE(rd::stream_of(torch::empty({4}, torch::kMeta)).has_value());
  rd::use_on_current_stream(t, std::nullopt);  // a no-op
  EXPECT_EQ(rd::memory_device({t}, {}), kCpu);
}

TEST(RngDevices, MetaInputsNeedNoGenerator) {
  // A region on meta tensors: no meta generator exists, so the capture must
  // skip the device rather than ask LibTorch for one, which it refuses.
  auto w = torch::randn({8, 8}, torch::TensorOptions().device(torch::kMeta).requires_grad(true));
  auto x = torch::randn({4, 8}, torch::TensorOptions().device(torch::kMeta).requires_grad(true));
  auto y = remat::checkpoint([&](const torch::Tensor& h) { return torch::tanh(h.matmul(w)).sin(); }, x);
  y.sum().backward();
  EXPECT_TRUE(x.grad().defined());
  EXPECT_EQ(x.grad().device().type(), c10::kMeta);
}

TEST(CudaMemory, CpuBuildErrorsNameTheRemedy) {
  if (remat::memory::built_with_cuda()) GTEST_SKIP() << "built with CUDA: the CPU-build errors do not apply";
  EXPECT_EQ(error_of([] { remat::memory::peak_bytes(cuda(0)); }),
            "[remat::memory] peak_bytes(cuda:0): this remat was built without CUDA (REMAT_WITH_CUDA is off: it was "
            "configured against a CPU-only LibTorch, or with -DREMAT_CUDA=OFF), so it cannot read the CUDA caching "
            "allocator. Configure remat against a CUDA LibTorch with -DREMAT_CUDA=ON (docs/gpu.md).");
  const std::string remedy = "Configure remat against a CUDA LibTorch with -DREMAT_CUDA=ON";
  EXPECT_NE(error_of([] { remat::memory::current_bytes(cuda(1)); }).find("current_bytes(cuda:1): this remat"),
            std::string::npos);
  EXPECT_NE(error_of([] { remat::memory::reset_peak(c10::Device(c10::kCUDA)); }).find("reset_peak(cuda)"),
            std::string::npos);
  EXPECT_NE(error_of([] { remat::memory::Probe p(cuda(0)); }).find(remedy), std::string::npos);
}

TEST(CudaMemory, CudaBuildWithoutAGpuSaysSo) {
  if (!remat::memory::built_with_cuda()) GTEST_SKIP() << "CPU build: see CpuBuildErrorsNameTheRemedy";
  if (torch::cuda::is_available()) GTEST_SKIP() << "a CUDA device is visible";
  EXPECT_EQ(error_of([] { remat::memory::peak_bytes(cuda(0)); }),
            "[remat::memory] peak_bytes(cuda:0): no CUDA device is visible (c10::cuda::device_count() is 0); check "
            "the driver and CUDA_VISIBLE_DEVICES, or measure the CPU.");
  EXPECT_NE(error_of([] { remat::memory::Probe p(c10::Device(c10::kCUDA)); }).find("Probe(cuda): no CUDA device"),
            std::string::npos);
}

TEST(CudaMemory, OtherDeviceTypesAreErrors) {
  EXPECT_EQ(error_of([] { remat::memory::peak_bytes(c10::Device(c10::kMeta)); }),
            "[remat::memory] peak_bytes(meta): remat measures CPU and CUDA devices only, got META.");
  EXPECT_NE(error_of([] { remat::memory::Probe p(c10::Device(c10::kMeta)); }).find("Probe(meta)"), std::string::npos);
}

TEST(CudaMemory, CpuDeviceFormsAreTheCpuCounter) {
  remat::memory::enable_tracking();
  const int64_t base = remat::memory::current_bytes(kCpu);
  EXPECT_EQ(base, remat::memory::current_bytes());
  remat::memory::reset_peak(kCpu);
  remat::memory::Probe probe(kCpu);
  EXPECT_EQ(probe.device(), kCpu);
  { auto a = torch::empty({1000}, torch::kFloat); }
  EXPECT_EQ(probe.peak_bytes(), 4000);
  EXPECT_EQ(remat::memory::peak_bytes(kCpu) - base, 4000);
  EXPECT_EQ(remat::memory::peak_bytes(kCpu), remat::memory::peak_bytes());
}

// NOTE [RNG lock lent to device threads]: the lock's rules, on CPU threads
// standing in for autograd's device threads.
TEST(RngLock, LentToDeviceThreadsOnlyWhileTheOwnerWaitsInExecute) {
  using namespace std::chrono_literals;
  remat::detail::lock_rng_regions();  // this thread: a region's first run
  auto device_thread = [] {
    remat::detail::mark_autograd_device_thread();
    remat::detail::lock_rng_regions();
    remat::detail::lock_rng_regions();  // a nested replay re-enters
    remat::detail::unlock_rng_regions();
    remat::detail::unlock_rng_regions();
  };
  // Not lent: a device thread waits for the owner like any other thread.
  auto before = std::async(std::launch::async, device_thread);
  EXPECT_EQ(before.wait_for(200ms), std::future_status::timeout) << "the lock must not be lent outside execute";
  std::future<void> during, other;
  std::atomic<bool> other_got{false};
  {
    remat::detail::RngLockLend lend;  // what remat's engine does around Engine::execute
    EXPECT_EQ(before.wait_for(5s), std::future_status::ready) << "a waiting device thread is let in";
    during = std::async(std::launch::async, device_thread);
    EXPECT_EQ(during.wait_for(5s), std::future_status::ready) << "a device thread must not wait for its caller";
    other = std::async(std::launch::async, [&] {
      remat::detail::lock_rng_regions();
      other_got = true;
      remat::detail::unlock_rng_regions();
    });
    std::this_thread::sleep_for(200ms);
    EXPECT_FALSE(other_got) << "other threads still wait for the owner";
  }
  EXPECT_FALSE(other_got);
  remat::detail::unlock_rng_regions();
  other.wait();
  EXPECT_TRUE(other_got);
}

// --- GPU tests (skip without a CUDA device) --------------------------------

/** Linear, GELU, dropout blocks on `device`. */
torch::nn::Sequential dropout_mlp(torch::Device device, int64_t width = 256, int blocks = 4, double p = 0.3) {
  torch::manual_seed(0);
  torch::nn::Sequential s;
  for (int i = 0; i < blocks; ++i) {
    s->push_back(torch::nn::Linear(width, width));
    s->push_back(torch::nn::GELU());
    s->push_back(torch::nn::Dropout(p));
  }
  s->to(device);
  return s;
}

TEST(CudaCheckpoint, DropoutGradientsBitwiseEqualToPlain) {
  REQUIRE_CUDA();
  auto seq = dropout_mlp(torch::kCUDA);
  auto x = torch::randn({64, 256}, torch::TensorOptions().device(torch::kCUDA).requires_grad(true));
  torch::cuda::manual_seed_all(7);
  auto plain = step_grads(*seq, x, [&](torch::Tensor h) { return seq->forward(h); });
  const auto before = remat::checkpoint_stats().recomputations;
  torch::cuda::manual_seed_all(7);
  auto got = step_grads(*seq, x, [&](torch::Tensor h) {
    for (size_t i = 0; i < seq->size(); i += 3) {
      h = remat::checkpoint(
          [&, i](const torch::Tensor& a) {
            return seq[i + 2]->as<torch::nn::Dropout>()->forward(
                seq[i + 1]->as<torch::nn::GELU>()->forward(seq[i]->as<torch::nn::Linear>()->forward(a)));
          },
          h);
    }
    return h;
  });
  expect_bitwise_equal(plain, got);
  EXPECT_EQ(remat::checkpoint_stats().recomputations - before, 4);
}

TEST(CudaCheckpoint, DropoutOnADeviceNoInputLivesOn) {
  // The region's input is on the CPU; fn moves it to the GPU and draws there:
  // the CUDA generator is captured because the device is in use.
  REQUIRE_CUDA();
  torch::zeros({1}, torch::kCUDA);  // CUDA in use before the region
  auto x = torch::randn({128, 64}, torch::requires_grad());
  auto fn = [](const torch::Tensor& h) { return torch::dropout(h.to(torch::kCUDA).sin(), 0.5, true).cpu(); };
  torch::cuda::manual_seed_all(3);
  fn(x).sum().backward();
  auto plain = x.grad().clone();
  x.mutable_grad() = torch::Tensor();
  torch::cuda::manual_seed_all(3);
  remat::checkpoint(fn, x).sum().backward();
  EXPECT_TRUE(torch::equal(plain, x.grad()));
}

void autocast_replay(at::ScalarType dtype) {
  auto seq = dropout_mlp(torch::kCUDA, 128, 3, 0.0);
  auto x = torch::randn({32, 128}, torch::TensorOptions().device(torch::kCUDA).requires_grad(true));
  auto run = [&](bool ckpt) {
    at::autocast::set_autocast_enabled(at::kCUDA, true);
    at::autocast::set_autocast_dtype(at::kCUDA, dtype);
    auto g = step_grads(*seq, x, [&](torch::Tensor h) {
      auto y = ckpt ? remat::checkpoint([&](const torch::Tensor& a) { return seq->forward(a); }, h) : seq->forward(h);
      EXPECT_EQ(y.scalar_type(), dtype);  // the Linear ran under autocast
      return y.to(torch::kFloat);
    });
    at::autocast::set_autocast_enabled(at::kCUDA, false);
    at::autocast::clear_cache();
    return g;
  };
  auto plain = run(false);
  // Backward runs outside autocast (on autograd's CUDA device thread): the
  // re-run must replay it, or the recomputed dtypes differ (an error).
  auto got = run(true);
  expect_bitwise_equal(plain, got);
}

TEST(CudaCheckpoint, AutocastFp16Replayed) {
  REQUIRE_CUDA();
  autocast_replay(at::kHalf);
}

TEST(CudaCheckpoint, AutocastBf16Replayed) {
  REQUIRE_CUDA();
  autocast_replay(at::kBFloat16);
}

TEST(CudaCheckpoint, SideStreamForwardAndBackward) {
  // Forward and backward on a stream from the pool: the engine runs the
  // nodes (and so the re-run) on that stream.
  REQUIRE_CUDA();
  auto seq = dropout_mlp(torch::kCUDA, 256, 4, 0.0);
  auto x = torch::randn({64, 256}, torch::TensorOptions().device(torch::kCUDA).requires_grad(true));
  auto plain = step_grads(*seq, x, [&](torch::Tensor h) { return seq->forward(h); });
  c10::impl::VirtualGuardImpl impl(c10::kCUDA);
  c10::Stream side = impl.getStreamFromGlobalPool(x.device());
  std::vector<torch::Tensor> got;
  {
    c10::StreamGuard guard(side);
    got = step_grads(*seq, x, [&](torch::Tensor h) {
      return remat::checkpoint([&](const torch::Tensor& a) { return seq->forward(a); }, h);
    });
    impl.synchronizeStream(side);
  }
  expect_bitwise_equal(plain, got);
}

TEST(CudaMemory, CurrentPeakAndProbesOnTheDevice) {
  REQUIRE_CUDA();
  const auto d = cuda(0);
  constexpr int64_t kMiB = 1 << 20;
  const int64_t base = remat::memory::current_bytes(d);
  remat::memory::reset_peak(d);
  EXPECT_EQ(remat::memory::peak_bytes(d), base);
  {
    remat::memory::Probe outer(d);
    EXPECT_EQ(outer.device(), d);
    auto a = torch::empty({kMiB / 4}, torch::TensorOptions().device(torch::kCUDA).dtype(torch::kFloat));
    EXPECT_EQ(remat::memory::current_bytes(d) - base, kMiB);
    {
      remat::memory::Probe inner(d);
      { auto b = torch::empty({2 * kMiB / 4}, torch::TensorOptions().device(torch::kCUDA)); }
      EXPECT_EQ(inner.peak_bytes(), 2 * kMiB);
      EXPECT_EQ(inner.delta_bytes(), 0);
    }
    // The inner probe reset the allocator's peak; the outer one still sees it.
    EXPECT_EQ(outer.peak_bytes(), 3 * kMiB);
    EXPECT_EQ(outer.delta_bytes(), kMiB);
  }
  EXPECT_EQ(remat::memory::current_bytes(d), base);
  EXPECT_EQ(remat::memory::peak_bytes(d) - base, 3 * kMiB);
  EXPECT_EQ(remat::memory::peak_bytes(c10::Device(c10::kCUDA)), remat::memory::peak_bytes(d));  // current device
  remat::memory::reset_peak(d);
  EXPECT_EQ(remat::memory::peak_bytes(d), base);
  // CUDA tensors are not CPU bytes.
  remat::memory::Probe cpu;
  { auto c = torch::empty({kMiB}, torch::TensorOptions().device(torch::kCUDA)); }
  EXPECT_EQ(cpu.peak_bytes(), 0);
  const int n = static_cast<int>(torch::cuda::device_count());
  EXPECT_NE(error_of([n] { remat::memory::peak_bytes(cuda(n)); }).find("no such CUDA device"), std::string::npos);
}

TEST(CudaSequential, AutoModePlansUnderACudaBudget) {
  REQUIRE_CUDA();
  torch::manual_seed(1);
  torch::nn::Sequential seq;
  const int64_t w[] = {256, 1024, 512, 2048, 256, 1024, 512, 1024, 256};
  for (int i = 0; i + 1 < 9; ++i) {
    seq->push_back(torch::nn::Linear(w[i], w[i + 1]));
    seq->push_back(torch::nn::GELU());
  }
  seq->to(torch::kCUDA);
  auto x = torch::randn({512, 256}, torch::TensorOptions().device(torch::kCUDA).requires_grad(true));
  auto plain = step_grads(*seq, x, [&](torch::Tensor h) { return seq->forward(h); });
  // The profile is in CUDA bytes: the CPU counter would see next to nothing.
  auto chain = remat::profile(seq, x);
  int64_t saved = 0;
  for (const auto& s : chain.stages) saved += s.saved_bytes;
  EXPECT_GT(saved, 512 * 1024 * 4) << "saved bytes should be CUDA activations";
  const int64_t top = remat::plan::store_all(chain).prediction.peak_bytes;
  const int64_t low = remat::plan::min_feasible_peak_bytes(chain);
  const int64_t budget = low + (top - low) / 3;
  remat::CheckpointedSequential net(seq, activations_only().memory_budget_bytes(budget));  // the profile's budget
  auto got = step_grads(*seq, x, [&](torch::Tensor h) { return net->forward(h); });
  expect_bitwise_equal(plain, got);
  const auto& plan = net->plan();
  EXPECT_LE(plan.prediction.peak_bytes, budget);
  const int64_t measured = net->last_step().chain_peak_bytes;
  ASSERT_GT(measured, 0);
  // Not run on a GPU yet: CUDA blocks are rounded up to 512 bytes and
  // cuBLAS may allocate a workspace; allow 5% and 1 MiB.
  EXPECT_LE(measured, budget + budget / 20 + (1 << 20)) << net->explain();
  std::printf("CUDA auto plan: budget %lld, predicted %lld, measured %lld bytes (store-all %lld)\n",
              static_cast<long long>(budget), static_cast<long long>(plan.prediction.peak_bytes),
              static_cast<long long>(measured), static_cast<long long>(top));
}

// Host offload (the offload issue's kHost) on CUDA tensors: saved
// activations go to pinned host memory on a side stream during forward and
// come back for backward. Gradients are bitwise those of a plain run, the
// activations leave the GPU (its peak drops), and what was sent is counted.
TEST(CudaOffload, HostOffloadGivesBitwiseGradientsAndFreesTheGpu) {
  REQUIRE_CUDA();
  torch::manual_seed(0);
  torch::nn::Sequential seq;
  for (int i = 0; i < 6; ++i) {
    seq->push_back(torch::nn::Linear(1024, 1024));
    seq->push_back(torch::nn::GELU());
  }
  seq->to(torch::kCUDA);
  auto x = torch::randn({2048, 1024}, torch::TensorOptions().device(torch::kCUDA).requires_grad(true));
  const auto dev = cuda(0);
  auto run = [&](bool offload, remat::OffloadStats* st) {
    zero_grads(*seq, x);
    remat::memory::Probe probe(dev);
    torch::Tensor loss;
    {
      std::optional<remat::OffloadScope> scope;
      if (offload) scope.emplace(remat::OffloadOptions(remat::OffloadTarget::kHost).min_bytes(0));
      loss = seq->forward(x).square().mean();
      if (st) *st = scope->stats();
    }
    loss.backward();
    torch::cuda::synchronize();
    return std::make_pair(grads_of(*seq, x), probe.peak_bytes());
  };
  const auto [plain, plain_peak] = run(false, nullptr);
  remat::OffloadStats st;
  const auto [got, offload_peak] = run(true, &st);
  expect_bitwise_equal(plain, got);
  EXPECT_GT(st.tensors_saved, 0);
  EXPECT_LT(st.tensors_kept, st.tensors_saved) << "activations went to the host";
  EXPECT_GE(st.bytes_raw, int64_t{6} * 2048 * 1024 * 4) << "at least one saved activation per layer";
  // Each layer saves ~8 MiB of CUDA activations in the plain run; offloaded,
  // they are on the host between forward and backward.
  EXPECT_LT(offload_peak, plain_peak - (int64_t{16} << 20))
      << "plain " << plain_peak << " bytes, offloaded " << offload_peak;
  std::printf("CUDA host offload: plain peak %lld, offloaded %lld bytes, %lld bytes sent\n",
              static_cast<long long>(plain_peak), static_cast<long long>(offload_peak),
              static_cast<long long>(st.bytes_raw));
}

// fn runs a backward of its own (a gradient penalty) on CUDA tensors inside
// a region that preserves RNG state: that backward runs on autograd's device
// thread and replays the nested region there, which needs the RNG lock the
// calling thread holds (NOTE [RNG lock lent to device threads]). It used to
// deadlock; gradients must equal a plain run's.
TEST(CudaCheckpoint, GradInsideARegionOnTheDeviceThread) {
  REQUIRE_CUDA();
  auto run = [](bool checkpointing) {
    torch::manual_seed(11);
    auto lin = torch::nn::Linear(64, 64);
    lin->to(torch::kCUDA);
    auto x = torch::randn({32, 64}, torch::TensorOptions().device(torch::kCUDA).requires_grad(true));
    auto inner = [lin](const torch::Tensor& a) mutable { return torch::dropout(lin->forward(a).tanh(), 0.2, true); };
    auto fn = [&](const torch::Tensor& in) {
      auto y = checkpointing ? remat::checkpoint(inner, in) : inner(in);
      auto g = torch::autograd::grad({y.pow(2).sum()}, {in}, {}, true, true)[0];
      return y.mean() + 0.1 * g.pow(2).mean();
    };
    torch::cuda::manual_seed_all(5);
    auto loss = checkpointing ? remat::checkpoint(fn, x) : fn(x);
    loss.backward();
    torch::cuda::synchronize();
    return std::vector<torch::Tensor>{x.grad(), lin->weight.grad(), lin->bias.grad()};
  };
  auto done = std::async(std::launch::async, [&] { return std::make_pair(run(false), run(true)); });
  ASSERT_EQ(done.wait_for(std::chrono::seconds(120)), std::future_status::ready) << "deadlocked";
  const auto [plain, ckpt] = done.get();
  expect_bitwise_equal(plain, ckpt);
}

// --- chunking on the GPU -----------------------------------------------------

/** max |a - b| / max |b|. */
double rel_err(const torch::Tensor& a, const torch::Tensor& b) {
  auto d = (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
  return d / std::max(b.to(torch::kDouble).abs().max().item<double>(), 1e-30);
}

TEST(CudaChunked, CrossEntropyMatchesAndPeaksBelowTheLogits) {
  REQUIRE_CUDA();
  // 8192 tokens x 32000 classes: the float32 logits alone are 1 GiB.
  const int64_t N = 8192, C = 1024, V = 32000;
  const auto on = torch::TensorOptions().device(torch::kCUDA);
  torch::manual_seed(3);
  auto h = torch::randn({N, C}, on).requires_grad_();
  auto w = (torch::randn({V, C}, on) * 0.03).requires_grad_();
  auto t = torch::randint(V, {N}, on.dtype(torch::kLong)).masked_fill_(torch::rand({N}, on) < 0.1, -100);
  auto run = [&](const std::function<torch::Tensor()>& f) {
    h.mutable_grad() = torch::Tensor();
    w.mutable_grad() = torch::Tensor();
    torch::cuda::synchronize();
    remat::memory::reset_peak(cuda(0));
    const int64_t base = remat::memory::current_bytes(cuda(0));
    auto l = f();
    l.backward();
    torch::cuda::synchronize();
    return std::make_tuple(l.detach(), h.grad().clone(), w.grad().clone(), remat::memory::peak_bytes(cuda(0)) - base);
  };
  auto [l0, gh0, gw0, peak0] = run([&] {
    return torch::nn::functional::cross_entropy(torch::linear(h, w), t,
                                                torch::nn::functional::CrossEntropyFuncOptions().label_smoothing(0.1));
  });
  auto [l1, gh1, gw1, peak1] = run([&] {
    return remat::chunked_cross_entropy(h, w, t, remat::ChunkedCrossEntropyOptions(16).label_smoothing(0.1));
  });
  std::cout << "[ figures  ] CUDA cross-entropy, " << N << " x " << V << ": peak above start unchunked " << peak0
            << " B, chunked(16) " << peak1 << " B; logits " << N * V * 4 << " B\n";
  EXPECT_LE(rel_err(l1, l0), 1e-5);
  EXPECT_LE(rel_err(gh1, gh0), 1e-4);  // CUDA reductions and products reorder sums
  EXPECT_LE(rel_err(gw1, gw0), 1e-4);
  // What it may hold: the gradients of h and w (w's twice where backward
  // scales it by the loss's gradient), and a few copies of one slice's logits.
  EXPECT_LT(peak1, 2 * V * C * 4 + 2 * N * C * 4 + 4 * (N / 16) * V * 4);
  EXPECT_LT(peak1, N * V * 4 / 2);
  EXPECT_GT(peak0, 2 * N * V * 4);
}

TEST(CudaChunked, MlpWithDropoutUnderBf16BitwiseInsideACheckpoint) {
  REQUIRE_CUDA();
  // Slices of a dropout MLP, each checkpointed, nested in an outer region:
  // the re-runs replay the CUDA RNG, so everything equals the same chunked
  // call without the outer region bit for bit.
  auto seq = dropout_mlp(torch::kCUDA, 256, 2, 0.2);
  auto x = torch::randn({4, 96, 256}, torch::TensorOptions().device(torch::kCUDA).requires_grad(true));
  auto body = [&](const torch::Tensor& in) {
    return remat::chunked([&](const std::vector<torch::Tensor>& a) { return seq->forward(a[0]); }, {in},
                          remat::ChunkOptions(1, 5));
  };
  auto run = [&](bool outer) {
    for (auto& p : seq->parameters()) p.mutable_grad() = torch::Tensor();
    x.mutable_grad() = torch::Tensor();
    torch::cuda::manual_seed_all(11);
    torch::Tensor y;
    {
      at::autocast::set_autocast_enabled(at::kCUDA, true);
      at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
      y = outer ? remat::checkpoint(body, x) : body(x);
      at::autocast::set_autocast_enabled(at::kCUDA, false);
      at::autocast::clear_cache();
    }
    y.to(torch::kFloat).pow(2).sum().backward();
    std::vector<torch::Tensor> g{x.grad().clone()};
    for (auto& p : seq->parameters()) g.push_back(p.grad().clone());
    return g;
  };
  auto a = run(false), b = run(true);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << i;
}

}  // namespace
