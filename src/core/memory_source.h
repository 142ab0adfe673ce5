// Per-device memory sources (internal): where a planner reads the bytes of
// the device its model runs on, and how it times work there.
// NOTE [memory sources]: one Source per device kind, each saying what it
// counts (name()):
// - CPU: remat's counting allocator (core/memory.cpp): bytes of CPU tensor
//   storage as requested, no rounding, no cache (reserved == allocated).
// - CUDA (built with REMAT_WITH_CUDA, memory_source_cuda.cpp): the caching
//   allocator of one device. current/peak: its allocated bytes (blocks
//   handed to tensors, each a request rounded up to 512 bytes, or a whole
//   unsplit block; aggregate over the small and large pools), the figure a
//   memory budget bounds. Reserved bytes (segments obtained from the driver,
//   allocated plus cached-but-free) are reported beside it, never planned
//   against: reserved >= allocated always, and the gap is the cache that
//   c10::cuda::CUDACachingAllocator::emptyCache() would give back.
//   Its Recording replays the allocator's own trace (attachAllocatorTraceTracker)
//   through TraceReplay below.
// The trace replay is device-free, so it is tested on CPU with a recorded
// trace (tests/test_memory_source.cpp).
// Leaves out: devices other than CPU and CUDA; CUDA's expandable segments
// are counted as reserved when mapped (SEGMENT_MAP), not per segment.
#pragma once

#include <chrono>
#include <cstdint>
#include <istream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>

#include <remat/memory.h>

namespace remat::memory {

// --- the caching allocator's trace, replayed (device-free) --------------------

/** The CUDA caching allocator's rounding (c10/core/AllocatorConfig.h, the
 *  defaults: no roundup_power2_divisions in PYTORCH_CUDA_ALLOC_CONF). */
constexpr int64_t kCachingMinBlockBytes = 512;         // every block is a multiple of this
constexpr int64_t kCachingSmallSizeBytes = 1 << 20;    // requests up to this go to the small pool
constexpr int64_t kCachingSmallBufferBytes = 2 << 20;  // a small pool segment

/** Bytes of the block the caching allocator hands out for a request: the
 *  request rounded up to 512 bytes (at least 512). A large-pool block that
 *  the allocator does not split (its remainder would be 1 MiB or less) is
 *  larger: see TraceReplay. */
int64_t caching_block_bytes(int64_t requested);
/** True when a request goes to the small pool (1 MiB or less). */
bool caching_small_pool(int64_t requested);

/** One entry of a caching allocator's trace, as remat keeps it
 *  (c10::CachingDeviceAllocator::TraceEntry without its stream, pool and
 *  stack). */
struct TraceEvent {
  /** TraceEntry::Action, same order. */
  enum class Action {
    kAlloc,
    kFreeRequested,
    kFreeCompleted,
    kSegmentAlloc,
    kSegmentFree,
    kSegmentMap,
    kSegmentUnmap,
    kSnapshot,
    kOom
  };
  Action action;
  uint64_t addr = 0;   ///< the block's or segment's address (OOM: free bytes)
  int64_t size = 0;    ///< alloc and free: bytes requested; segments: bytes of the segment
  double time_us = 0;  ///< when it happened, microseconds on the recording's clock
};

/** Reads a trace written one entry a line, "ACTION ADDR SIZE TIME_US", with
 *  the action named as the allocator's snapshots name it (alloc,
 *  free_requested, free_completed, segment_alloc, segment_free,
 *  segment_map, segment_unmap, snapshot, oom; ADDR decimal or 0x hex);
 *  '#' starts a comment, and blank lines are skipped. Throws
 *  remat::Error naming the line for anything else. */
std::vector<TraceEvent> parse_trace(std::istream& in);

/** A point of a replayed timeline: the device's bytes right after an event. */
struct DevicePoint {
  double time_us;
  int64_t allocated_bytes;  ///< blocks handed to tensors (what a budget bounds)
  int64_t reserved_bytes;   ///< segments held from the driver (allocated + cached)
};

/** Replays a caching allocator's trace into allocated and reserved bytes.
 *  Allocated bytes change at ALLOC (+ the block) and FREE_REQUESTED (- the
 *  block): where the allocator's own allocated_bytes statistic changes; a
 *  FREE_COMPLETED (the block reusable, after the streams that used it are
 *  done) changes nothing but pending_free_bytes(). Reserved bytes change at
 *  SEGMENT_ALLOC / SEGMENT_MAP (+ the segment) and SEGMENT_FREE /
 *  SEGMENT_UNMAP (-). A block's bytes are caching_block_bytes(requested),
 *  since the trace gives requests, not blocks: a large block the allocator
 *  did not split holds up to 1 MiB more, so allocated_bytes() is a lower
 *  bound of the allocator's figure, short by at most 1 MiB per live large
 *  block (Recording's reconcile says by how much at its end). A free of a
 *  block allocated before the replay began is subtracted with its request
 *  rounded (counted in frees_from_before()). */
class TraceReplay {
 public:
  /** Starts from the device's allocated and reserved bytes when the
   *  recording began (the allocator's statistics). */
  TraceReplay(int64_t allocated_start, int64_t reserved_start, size_t max_points = 1'000'000);
  /** Applies one event; adds a point when allocated or reserved bytes change. */
  void apply(const TraceEvent& e);
  int64_t allocated_bytes() const { return allocated_; }
  int64_t reserved_bytes() const { return reserved_; }
  int64_t peak_allocated_bytes() const { return peak_allocated_; }
  int64_t peak_reserved_bytes() const { return peak_reserved_; }
  /** Bytes of blocks freed (FREE_REQUESTED) but not yet reusable (no
   *  FREE_COMPLETED yet: still in use on another stream). */
  int64_t pending_free_bytes() const { return pending_; }
  /** Bytes allocated now in the small pool (requests of 1 MiB or less). */
  int64_t small_pool_bytes() const { return small_; }
  /** Frees of blocks allocated before the replay began. */
  int64_t frees_from_before() const { return frees_from_before_; }
  /** OOM entries seen. */
  int64_t ooms() const { return ooms_; }
  /** Points after each change, in trace order (at most max_points; later
   *  ones are counted in dropped_points()). The first is the start. */
  const std::vector<DevicePoint>& points() const { return points_; }
  int64_t dropped_points() const { return dropped_; }

 private:
  void add_point(double time_us);
  struct Block {
    int64_t bytes;
    bool small;
  };
  int64_t allocated_, reserved_, peak_allocated_, peak_reserved_;
  int64_t pending_ = 0, small_ = 0, frees_from_before_ = 0, ooms_ = 0, dropped_ = 0;
  size_t max_points_;
  std::map<uint64_t, Block> live_;       // allocated blocks by address
  std::map<uint64_t, int64_t> freeing_;  // freed, not yet completed
  std::vector<DevicePoint> points_;
};

// --- sources ------------------------------------------------------------------

/** A timeline of one device's bytes while it lives (memory::Timeline on
 *  the CPU). One per device at a time. */
class Recording {
 public:
  virtual ~Recording() = default;
  /** Microseconds since the recording started (the samples' clock: host). */
  virtual double now_us() const = 0;
  /** Stops recording (idempotent); samples() stays readable. */
  virtual void stop() = 0;
  /** The counted bytes (Source::current_bytes) after each event, in order. */
  virtual std::vector<Sample> samples() const = 0;
  /** Samples not kept (the cap was reached). */
  virtual int64_t dropped_samples() const = 0;
  /** Highest reserved bytes seen while recording (CPU: of the samples,
   *  the CPU counter caching nothing). */
  virtual int64_t peak_reserved_bytes() const = 0;
  /** After stop(): the source's own count at the end less the recording's
   *  (CUDA: the unsplit blocks' bytes beyond their rounded requests, the
   *  trace giving requests only; CPU: 0). */
  virtual int64_t rounding_gap_bytes() const { return 0; }
};

/** Where the bytes of one device are read. */
class Source {
 public:
  virtual ~Source() = default;
  virtual c10::Device device() const = 0;
  /** What it counts, in words (NOTE [memory sources]). */
  virtual std::string name() const = 0;
  /** Makes the counts valid from now on (CPU: enable_tracking(); CUDA: the
   *  allocator initialised and remat's trace tracker attached). Idempotent. */
  virtual void enable() = 0;
  /** Bytes counted now: what a memory budget bounds. */
  virtual int64_t current_bytes() = 0;
  /** Highest current_bytes() since the last reset_peak(). */
  virtual int64_t peak_bytes() = 0;
  virtual void reset_peak() = 0;
  /** Bytes held from the system: CPU, current_bytes(); CUDA, the
   *  allocator's reserved bytes (allocated + cached-but-free). */
  virtual int64_t reserved_bytes() = 0;
  /** Starts a timeline of current_bytes() (one per device at a time). */
  virtual std::shared_ptr<Recording> record(size_t max_samples = 1'000'000) = 0;
};

/** The source of a device: CPU, or CUDA in a build with REMAT_WITH_CUDA
 *  (index -1: the current device). Throws remat::Error for CUDA in a build
 *  without CUDA and for other device types (meta, ...). */
std::shared_ptr<Source> source_for(c10::Device device);

/** The device a model's memory is measured on: the first CUDA tensor's
 *  device among `tensors` (its parameters), else the CPU. */
c10::Device measured_device(const std::vector<at::Tensor>& tensors);

#ifdef REMAT_WITH_CUDA
/** memory_source_cuda.cpp. */
std::shared_ptr<Source> make_cuda_source(c10::Device device);
#endif

// --- timing -------------------------------------------------------------------

/** Times work on a device: the host clock on the CPU; on another device
 *  (CUDA) a timing event recorded on its current stream at the start and
 *  at elapsed_ms(), which waits for the second (so the work's time on the
 *  device, not the host's time to launch it). Streams other than the
 *  current one at those two points are not covered. */
class DeviceTimer {
 public:
  /** Starts timing. */
  explicit DeviceTimer(c10::Device device);
  /** Starts again from now. */
  void restart();
  /** Milliseconds since the start (on a device: synchronizes with it). */
  double elapsed_ms();
  /** True when it times with events on a device, false for the host clock. */
  bool on_device() const { return start_.has_value(); }

 private:
  c10::Device device_;
  std::chrono::steady_clock::time_point t0_;
  std::optional<c10::Event> start_;
};

}  // namespace remat::memory
