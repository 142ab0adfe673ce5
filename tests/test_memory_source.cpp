// Per-device memory sources (src/core/memory_source.h): the CUDA caching
// allocator's trace replayed on CPU from a recorded trace, the CPU source,
// the device timer, and the planner's measured device (src/auto/measure.h).
#include "common.h"

#include <chrono>
#include <sstream>
#include <thread>

#include "../src/auto/measure.h"
#include "../src/core/memory_source.h"

using namespace remat_test;
using remat::memory::TraceEvent;
using remat::memory::TraceReplay;

namespace {

constexpr int64_t kMiB = 1 << 20;

TEST(CachingRounding, BlocksAreRequestsRoundedTo512Bytes) {
  using remat::memory::caching_block_bytes;
  EXPECT_EQ(caching_block_bytes(0), 512);
  EXPECT_EQ(caching_block_bytes(1), 512);
  EXPECT_EQ(caching_block_bytes(4), 512);
  EXPECT_EQ(caching_block_bytes(512), 512);
  EXPECT_EQ(caching_block_bytes(513), 1024);
  EXPECT_EQ(caching_block_bytes(1000), 1024);
  EXPECT_EQ(caching_block_bytes(3000000), 3000320);
  EXPECT_EQ(caching_block_bytes(kMiB), kMiB);
  EXPECT_TRUE(remat::memory::caching_small_pool(kMiB));
  EXPECT_FALSE(remat::memory::caching_small_pool(kMiB + 1));
}

// A trace of one step on cuda:0, written by hand from the caching
// allocator's documented behaviour (c10/cuda/CUDACachingAllocator.cpp, its
// TraceEntry actions in c10/core/CachingDeviceAllocator.h; the line format
// is parse_trace's, the action names those of torch.cuda.memory._snapshot()'s
// device_traces). The allocator records ALLOC and FREE_REQUESTED with the
// request's size (block->requested_size), a segment with its own size;
// FREE_COMPLETED follows a free at once unless the block was used on another
// stream (record_stream), then when that stream is done. The step started
// with 8 MiB allocated (a block at 0x7f3b00000000) in a 20 MiB segment.
constexpr const char* kRecordedTrace = R"(# action addr size time_us
segment_alloc  0x7f3a00000000 2097152  10   # small pool: a 2 MiB segment for requests of 1 MiB or less
alloc          0x7f3a00000000 1000     11   # a bias: block of 1024
alloc          0x7f3a00000400 4        12   # a scalar: block of 512
segment_alloc  0x7f3a00200000 20971520 20   # large pool: a request of 1-10 MiB takes a 20 MiB buffer
alloc          0x7f3a00200000 4194304  21   # an activation, 4 MiB
alloc          0x7f3a00600000 3000000  22   # block of 3000320
segment_alloc  0x7f3a02000000 12582912 30   # a request over 10 MiB: its own segment, rounded to 2 MiB
alloc          0x7f3a02000000 12000000 31   # block of 12000256 rounded; unsplit (remainder < 1 MiB), so 12 MiB really
free_requested 0x7f3a00600000 3000000  40
free_completed 0x7f3a00600000 3000000  40
free_requested 0x7f3a00200000 4194304  41   # used on a side stream: completes at 50
alloc          0x7f3a00600000 2000000  42   # from the cache: no segment
free_completed 0x7f3a00200000 4194304  50

free_requested 0x7f3b00000000 8388608  51   # allocated before the recording began
free_completed 0x7f3b00000000 8388608  51
snapshot       0              0        52
oom            1073741824     1048576  53   # addr: the free bytes the driver reported
free_requested 0x7f3a02000000 12000000 60
free_completed 0x7f3a02000000 12000000 60
segment_free   0x7f3a02000000 12582912 61   # emptyCache gives the segment back
)";

std::vector<TraceEvent> recorded() {
  std::istringstream in(kRecordedTrace);
  return remat::memory::parse_trace(in);
}

TEST(TraceReplay, ParsesTheRecordedTrace) {
  const auto events = recorded();
  ASSERT_EQ(events.size(), 20u);
  EXPECT_EQ(events[0].action, TraceEvent::Action::kSegmentAlloc);
  EXPECT_EQ(events[0].addr, 0x7f3a00000000ull);
  EXPECT_EQ(events[0].size, 2097152);
  EXPECT_DOUBLE_EQ(events[0].time_us, 10.0);
  EXPECT_EQ(events[15].action, TraceEvent::Action::kSnapshot);
  EXPECT_EQ(events[16].action, TraceEvent::Action::kOom);
  EXPECT_EQ(events[19].action, TraceEvent::Action::kSegmentFree);
}

TEST(TraceReplay, AllocatedAndReservedBytesOfARecordedStep) {
  const int64_t start_allocated = 8 * kMiB, start_reserved = 20 * kMiB;
  TraceReplay r(start_allocated, start_reserved);
  const auto events = recorded();
  // Replay up to the side-stream free (time 41): freed, not yet reusable.
  size_t i = 0;
  for (; i < events.size() && events[i].time_us <= 41; ++i) r.apply(events[i]);
  EXPECT_EQ(r.allocated_bytes(), 8388608 + 1024 + 512 + 3000320 + 12000256 - 3000320);
  EXPECT_EQ(r.pending_free_bytes(), 4194304);
  EXPECT_EQ(r.small_pool_bytes(), 1024 + 512);
  for (; i < events.size(); ++i) r.apply(events[i]);

  EXPECT_EQ(r.allocated_bytes(), 1024 + 512 + 2000384);
  EXPECT_EQ(r.reserved_bytes(), 20 * kMiB + 2097152 + 20971520);
  EXPECT_EQ(r.peak_allocated_bytes(), 8388608 + 1024 + 512 + 4194304 + 3000320 + 12000256);
  EXPECT_EQ(r.peak_reserved_bytes(), 20 * kMiB + 2097152 + 20971520 + 12582912);
  EXPECT_EQ(r.pending_free_bytes(), 0);
  EXPECT_EQ(r.small_pool_bytes(), 1024 + 512);
  EXPECT_EQ(r.frees_from_before(), 1);
  EXPECT_EQ(r.ooms(), 1);

  // One point at the start and one per change of allocated or reserved bytes
  // (FREE_COMPLETED, SNAPSHOT and OOM change neither).
  const auto& p = r.points();
  ASSERT_EQ(p.size(), 15u);
  EXPECT_EQ(p[0].time_us, 0.0);
  EXPECT_EQ(p[0].allocated_bytes, start_allocated);
  EXPECT_EQ(p[0].reserved_bytes, start_reserved);
  EXPECT_EQ(p[1].time_us, 10.0);  // the small segment: reserved only
  EXPECT_EQ(p[1].allocated_bytes, start_allocated);
  EXPECT_EQ(p[1].reserved_bytes, start_reserved + 2097152);
  EXPECT_EQ(p[8].time_us, 31.0);  // the peak
  EXPECT_EQ(p[8].allocated_bytes, r.peak_allocated_bytes());
  EXPECT_EQ(p[14].time_us, 61.0);
  EXPECT_EQ(p[14].reserved_bytes, r.reserved_bytes());
  // Reserved bytes hold every allocated block: never below allocated.
  for (const auto& q : p) EXPECT_GE(q.reserved_bytes, q.allocated_bytes) << "at " << q.time_us;
  EXPECT_EQ(r.dropped_points(), 0);
}

TEST(TraceReplay, PointsPastTheCapAreCountedButPeaksStayExact) {
  TraceReplay r(8 * kMiB, 20 * kMiB, /*max_points=*/3);
  for (const auto& e : recorded()) r.apply(e);
  EXPECT_EQ(r.points().size(), 3u);
  EXPECT_EQ(r.dropped_points(), 12);
  EXPECT_EQ(r.peak_allocated_bytes(), 8388608 + 1024 + 512 + 4194304 + 3000320 + 12000256);
}

TEST(TraceReplay, AFreeOfABlockFromBeforeIsItsRoundedRequest) {
  TraceReplay r(4096, 2 * kMiB);
  r.apply({TraceEvent::Action::kFreeRequested, 0x1000, 1000, 1});
  EXPECT_EQ(r.allocated_bytes(), 4096 - 1024);
  EXPECT_EQ(r.frees_from_before(), 1);
  EXPECT_EQ(r.pending_free_bytes(), 1024);
  r.apply({TraceEvent::Action::kFreeCompleted, 0x1000, 1000, 2});
  EXPECT_EQ(r.pending_free_bytes(), 0);
  // Expandable segments map and unmap instead of allocating segments.
  r.apply({TraceEvent::Action::kSegmentMap, 0x200000, 2 * kMiB, 3});
  r.apply({TraceEvent::Action::kSegmentUnmap, 0x200000, kMiB, 4});
  EXPECT_EQ(r.reserved_bytes(), 3 * kMiB);
}

TEST(TraceReplay, ParseErrorsNameTheLine) {
  auto error_of_trace = [](const std::string& text) {
    std::istringstream in(text);
    return error_of([&] { remat::memory::parse_trace(in); });
  };
  EXPECT_EQ(error_of_trace("# header\nallocate 0x10 512 1\n"),
            "[remat::memory] trace line 2: unknown action 'allocate' (expected alloc, free_requested, "
            "free_completed, segment_alloc, segment_free, segment_map, segment_unmap, snapshot or oom).");
  EXPECT_EQ(error_of_trace("alloc 0x10 512\n"),
            "[remat::memory] trace line 1: expected \"ACTION ADDR SIZE TIME_US\", got \"alloc 0x10 512\".");
  EXPECT_EQ(error_of_trace("alloc 0x10 512 1 extra\n"),
            "[remat::memory] trace line 1: expected \"ACTION ADDR SIZE TIME_US\", got \"alloc 0x10 512 1 extra\".");
  EXPECT_EQ(error_of_trace("\nalloc 0xzz 512 1\n"),
            "[remat::memory] trace line 2: address '0xzz' is not a number (decimal or 0x hex).");
}

TEST(MemorySource, CpuSourceIsTheCpuCounter) {
  auto src = remat::memory::source_for(c10::Device(c10::kCPU));
  ASSERT_NE(src, nullptr);
  EXPECT_EQ(src, remat::memory::source_for(c10::Device(c10::kCPU)));  // one per process
  EXPECT_TRUE(src->device().is_cpu());
  EXPECT_NE(src->name().find("counting allocator"), std::string::npos);
  src->enable();
  EXPECT_TRUE(remat::memory::tracking_enabled());
  const int64_t base = src->current_bytes();
  src->reset_peak();
  {
    auto a = torch::empty({kMiB / 4}, torch::kFloat);
    EXPECT_EQ(src->current_bytes() - base, kMiB);
    EXPECT_EQ(src->current_bytes(), remat::memory::current_bytes());
    EXPECT_EQ(src->reserved_bytes(), src->current_bytes());  // no cache
  }
  EXPECT_EQ(src->peak_bytes() - base, kMiB);
  EXPECT_EQ(src->peak_bytes(), remat::memory::peak_bytes());
}

TEST(MemorySource, CpuRecordingIsTheTimeline) {
  auto src = remat::memory::source_for(c10::Device(c10::kCPU));
  auto rec = src->record();
  const int64_t base = remat::memory::current_bytes();
  { auto a = torch::empty({kMiB / 4}, torch::kFloat); }
  EXPECT_EQ(error_of([&] { src->record(); }),
            "[remat::memory] a Timeline is already recording; stop or destroy it before starting another.");
  rec->stop();
  rec->stop();  // idempotent
  const auto s = rec->samples();
  ASSERT_GE(s.size(), 3u);
  EXPECT_EQ(s.front().bytes, base);
  int64_t top = 0;
  for (const auto& x : s) top = std::max(top, x.bytes);
  EXPECT_EQ(top, base + kMiB);
  EXPECT_EQ(s.back().bytes, base);
  EXPECT_EQ(rec->peak_reserved_bytes(), top);
  EXPECT_EQ(rec->rounding_gap_bytes(), 0);
  EXPECT_EQ(rec->dropped_samples(), 0);
  EXPECT_GE(rec->now_us(), s.back().time_us);
}

TEST(MemorySource, OtherDevicesAreErrors) {
  EXPECT_EQ(error_of([] { remat::memory::source_for(c10::Device(c10::kMeta)); }),
            "[remat::memory] source_for(meta): remat has memory sources for CPU and CUDA only, got META.");
  if (remat::memory::built_with_cuda()) GTEST_SKIP() << "built with CUDA: the CPU-build error does not apply";
  EXPECT_EQ(error_of([] { remat::memory::source_for(c10::Device(c10::kCUDA, 0)); }),
            "[remat::memory] source_for(cuda:0): this remat was built without CUDA (REMAT_WITH_CUDA is off), so it "
            "has no memory source for a CUDA device. Configure remat against a CUDA LibTorch with -DREMAT_CUDA=ON "
            "(docs/gpu.md).");
}

TEST(MemorySource, MeasuredDeviceIsTheFirstCudaTensorsElseTheCpu) {
  EXPECT_TRUE(remat::memory::measured_device({}).is_cpu());
  EXPECT_TRUE(remat::memory::measured_device({torch::ones({2}), at::Tensor()}).is_cpu());
  EXPECT_TRUE(remat::memory::measured_device({torch::ones({2}, torch::TensorOptions().device(torch::kMeta))}).is_cpu());
}

TEST(DeviceTimer, HostClockOnTheCpu) {
  remat::memory::DeviceTimer t(c10::Device(c10::kCPU));
  EXPECT_FALSE(t.on_device());
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const double first = t.elapsed_ms();
  EXPECT_GE(first, 19.0);
  t.restart();
  EXPECT_LT(t.elapsed_ms(), first);
}

TEST(AutoMeasure, AUnitOffTheMeasuredDeviceIsRefusedByName) {
  const auto meta = torch::ones({2}, torch::TensorOptions().device(torch::kMeta));
  const auto cpu = c10::Device(c10::kCPU);
  EXPECT_NO_THROW(remat::detail::check_unit_device("u", false, {torch::ones({2}), at::Tensor()}, cpu));
  // Measuring the CPU: the text the planner has always given.
  EXPECT_EQ(error_of([&] { remat::detail::check_unit_device("u", false, {meta}, cpu); }),
            "[remat::auto] unit 'u' runs on meta; the whole-step planner measures CPU memory only. On a CUDA "
            "device, use CheckpointedSequential's memory budget or the per-module switch (enable_checkpointing).");
  EXPECT_EQ(error_of([&] { remat::detail::check_unit_device("(root)", true, {meta}, cpu); }),
            "[remat::auto] unit '(root)' runs on meta; the whole-step planner measures CPU memory only. On a CUDA "
            "device, use the chain's own memory budget (SequentialOptions) without auto_checkpoint.");
  // Measuring a GPU (a device value: no GPU needed): an input elsewhere.
  EXPECT_EQ(error_of([&] {
              remat::detail::check_unit_device("block", false, {torch::ones({2})}, {c10::kCUDA, 0});
            }),
            "[remat::auto] unit 'block' runs on cpu; the whole-step planner measures cuda:0 (the device of the "
            "model's parameters) and plans units whose inputs are there. Move the unit's inputs to cuda:0, or its "
            "parameters to cpu.");
}

// --- on a CUDA device (skipped without one) ------------------------------------

TEST(CudaMemorySource, RecordingReplaysTheAllocatorsTrace) {
  if (!remat::memory::built_with_cuda()) GTEST_SKIP() << "CPU build: the CUDA source is not compiled";
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const c10::Device d(c10::kCUDA, 0);
  auto src = remat::memory::source_for(d);
  src->enable();
  EXPECT_NE(src->name().find("caching allocator's allocated bytes"), std::string::npos);
  torch::cuda::synchronize();
  const int64_t base = src->current_bytes();
  auto rec = src->record();
  {
    // 4 MiB: a large-pool block split off a 20 MiB buffer (exact); 400 bytes:
    // a small-pool block of 512.
    auto a = torch::empty({kMiB}, torch::TensorOptions().device(d).dtype(torch::kFloat));
    auto b = torch::empty({100}, torch::TensorOptions().device(d).dtype(torch::kFloat));
    EXPECT_EQ(src->current_bytes() - base, 4 * kMiB + 512);
  }
  rec->stop();
  const auto s = rec->samples();
  ASSERT_GE(s.size(), 3u);
  int64_t top = 0;
  for (const auto& x : s) top = std::max(top, x.bytes);
  EXPECT_EQ(s.front().bytes, base);
  EXPECT_EQ(top, base + 4 * kMiB + 512);
  EXPECT_EQ(s.back().bytes, base);
  EXPECT_EQ(rec->rounding_gap_bytes(), 0);
  EXPECT_GE(rec->peak_reserved_bytes(), top);
  EXPECT_GE(src->reserved_bytes(), src->current_bytes());
}

TEST(CudaMemorySource, TimerUsesEventsOnTheDevice) {
  if (!remat::memory::built_with_cuda()) GTEST_SKIP() << "CPU build";
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  remat::memory::DeviceTimer t(c10::Device(c10::kCUDA, 0));
  EXPECT_TRUE(t.on_device());
  auto a = torch::randn({2048, 2048}, torch::TensorOptions().device(torch::kCUDA));
  for (int i = 0; i < 10; ++i) a = a.mm(a).tanh();
  EXPECT_GT(t.elapsed_ms(), 0.0);
}

}  // namespace
