// The CUDA caching allocator as a memory source (NOTE [memory sources],
// memory_source.h). Compiled only with REMAT_WITH_CUDA (src/CMakeLists.txt).
// NOTE [CUDA recordings]: remat attaches one trace tracker to the caching
// allocator, once per process (the allocator keeps its trackers for good:
// there is no detach), the first time a CUDA source is enabled. The
// allocator calls it for every device, under that device's allocator lock,
// on the allocating thread: it takes remat's own lock only (never the
// allocator's: no lock-order inversion) and, while a Recording of that
// device lives, turns the entry into a TraceEvent on the recording's host
// clock and replays it (TraceReplay). Host time is the right clock here:
// the caching allocator hands out and takes back blocks when the host asks
// (stream order makes reuse safe), so its allocated bytes change at host
// time, the clock the planner's windows are on.
// The replay's start is the allocator's statistics when the recording
// begins; at stop() the recording compares its end with the statistics
// (rounding_gap_bytes: what unsplit blocks add, NOTE in TraceReplay).
#include <mutex>

#include <ATen/Context.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>

#include <remat/error.h>

#include "memory_source.h"

namespace remat::memory {
namespace {

using c10::CachingDeviceAllocator::TraceEntry;

TraceEvent::Action action_of(TraceEntry::Action a) {
  using A = TraceEvent::Action;
  switch (a) {
    case TraceEntry::ALLOC: return A::kAlloc;
    case TraceEntry::FREE_REQUESTED: return A::kFreeRequested;
    case TraceEntry::FREE_COMPLETED: return A::kFreeCompleted;
    case TraceEntry::SEGMENT_ALLOC: return A::kSegmentAlloc;
    case TraceEntry::SEGMENT_FREE: return A::kSegmentFree;
    case TraceEntry::SEGMENT_MAP: return A::kSegmentMap;
    case TraceEntry::SEGMENT_UNMAP: return A::kSegmentUnmap;
    case TraceEntry::OOM: return A::kOom;
    default: return A::kSnapshot;
  }
}

struct DeviceStatsNow {
  int64_t allocated, allocated_peak, reserved, reserved_peak;
};

DeviceStatsNow stats_of(c10::DeviceIndex i) {
  const auto s = c10::cuda::CUDACachingAllocator::getDeviceStats(i);
  constexpr auto kAll = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  return {s.allocated_bytes[kAll].current, s.allocated_bytes[kAll].peak, s.reserved_bytes[kAll].current,
          s.reserved_bytes[kAll].peak};
}

class CudaRecording;

/** NOTE [CUDA recordings]: the tracker's state. */
struct Tracker {
  std::mutex mu;
  std::once_flag attached;
  std::map<c10::DeviceIndex, CudaRecording*> live;  // one recording per device
};
Tracker& tracker() {
  static auto* t = new Tracker();  // never destroyed: the allocator may call it at exit
  return *t;
}

class CudaRecording final : public Recording {
 public:
  CudaRecording(c10::DeviceIndex index, size_t max_samples) : index_(index), replay_(0, 0, max_samples) {
    // The statistics are read outside remat's lock (the tracker takes it
    // under the allocator's: the other order could deadlock). An allocation
    // another thread makes between this read and the registration below is
    // not replayed (the planner's own thread allocates nothing there).
    const DeviceStatsNow now = stats_of(index);
    replay_ = TraceReplay(now.allocated, now.reserved, max_samples);
    Tracker& t = tracker();
    std::lock_guard<std::mutex> lock(t.mu);
    if (t.live.count(index) != 0) {
      throw Error("[remat::memory] a recording of cuda:" + std::to_string(index) +
                  " is already under way; stop or destroy it before starting another.");
    }
    t0_ = std::chrono::steady_clock::now();
    t.live[index] = this;
  }
  ~CudaRecording() override { stop(); }

  /** Called by the tracker with tracker().mu held. */
  void apply(const TraceEntry& e) {
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0_).count();
    replay_.apply({action_of(e.action_), static_cast<uint64_t>(e.addr_), static_cast<int64_t>(e.size_), us});
  }

  double now_us() const override {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0_).count();
  }
  void stop() override {
    Tracker& t = tracker();
    {
      std::lock_guard<std::mutex> lock(t.mu);
      auto it = t.live.find(index_);
      if (it == t.live.end() || it->second != this) return;
      t.live.erase(it);
    }
    const int64_t allocated = stats_of(index_).allocated;  // outside t.mu, as in the constructor
    std::lock_guard<std::mutex> lock(t.mu);
    rounding_gap_ = allocated - replay_.allocated_bytes();
  }
  int64_t rounding_gap_bytes() const override {
    std::lock_guard<std::mutex> lock(tracker().mu);
    return rounding_gap_;
  }
  std::vector<Sample> samples() const override {
    std::lock_guard<std::mutex> lock(tracker().mu);
    std::vector<Sample> out;
    out.reserve(replay_.points().size());
    int64_t last = -1;
    for (const DevicePoint& p : replay_.points()) {
      if (p.allocated_bytes == last) continue;  // a segment event: allocated bytes unchanged
      out.push_back({p.time_us, p.allocated_bytes});
      last = p.allocated_bytes;
    }
    return out;
  }
  int64_t dropped_samples() const override {
    std::lock_guard<std::mutex> lock(tracker().mu);
    return replay_.dropped_points();
  }
  int64_t peak_reserved_bytes() const override {
    std::lock_guard<std::mutex> lock(tracker().mu);
    return replay_.peak_reserved_bytes();
  }

 private:
  c10::DeviceIndex index_;
  std::chrono::steady_clock::time_point t0_;
  TraceReplay replay_;
  int64_t rounding_gap_ = 0;
};

class CudaSource final : public Source {
 public:
  explicit CudaSource(c10::Device d) : device_(d) {}
  c10::Device device() const override { return device_; }
  std::string name() const override {
    return device_.str() +
           ": the CUDA caching allocator's allocated bytes (blocks handed to tensors: requests rounded up to 512 "
           "bytes, or whole unsplit blocks; small and large pools), not its reserved bytes (allocated plus "
           "cached-but-free segments)";
  }
  void enable() override {
    // The allocator's per-device state exists once CUDA is initialised
    // (getDeviceStats of a device it does not know throws "Invalid device argument").
    at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
    std::call_once(tracker().attached, [] {
      c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker([](const TraceEntry& e) {
        Tracker& t = tracker();
        std::lock_guard<std::mutex> lock(t.mu);
        auto it = t.live.find(e.device_);
        if (it != t.live.end()) it->second->apply(e);
      });
    });
  }
  int64_t current_bytes() override { return memory::current_bytes(device_); }
  int64_t peak_bytes() override { return memory::peak_bytes(device_); }
  void reset_peak() override { memory::reset_peak(device_); }
  int64_t reserved_bytes() override { return stats_of(device_.index()).reserved; }
  std::shared_ptr<Recording> record(size_t max_samples) override {
    enable();
    return std::make_shared<CudaRecording>(device_.index(), max_samples);
  }

 private:
  c10::Device device_;
};

}  // namespace

std::shared_ptr<Source> make_cuda_source(c10::Device device) {
  const int n = c10::cuda::device_count();
  const int i = device.has_index() ? device.index() : (n > 0 ? c10::cuda::current_device() : 0);
  if (n == 0 || i >= n) {
    throw Error("[remat::memory] source_for(" + device.str() + "): no such CUDA device (" + std::to_string(n) +
                " visible); check the driver and CUDA_VISIBLE_DEVICES.");
  }
  at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
  return std::make_shared<CudaSource>(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i)));
}

}  // namespace remat::memory
