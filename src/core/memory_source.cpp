// Per-device memory sources: the CPU source, the device-free replay of a
// caching allocator's trace, the source chosen per device, and the device
// timer (NOTE [memory sources], memory_source.h).
#include "memory_source.h"

#include <algorithm>
#include <array>
#include <sstream>
#include <stdexcept>
#include <utility>

#include <c10/core/impl/VirtualGuardImpl.h>

#include <remat/error.h>

namespace remat::memory {

int64_t caching_block_bytes(int64_t requested) {
  if (requested < kCachingMinBlockBytes) return kCachingMinBlockBytes;
  return kCachingMinBlockBytes * ((requested + kCachingMinBlockBytes - 1) / kCachingMinBlockBytes);
}

bool caching_small_pool(int64_t requested) { return requested <= kCachingSmallSizeBytes; }

std::vector<TraceEvent> parse_trace(std::istream& in) {
  using A = TraceEvent::Action;
  static constexpr std::array<std::pair<const char*, A>, 9> kNames{{{"alloc", A::kAlloc},
                                                                    {"free_requested", A::kFreeRequested},
                                                                    {"free_completed", A::kFreeCompleted},
                                                                    {"segment_alloc", A::kSegmentAlloc},
                                                                    {"segment_free", A::kSegmentFree},
                                                                    {"segment_map", A::kSegmentMap},
                                                                    {"segment_unmap", A::kSegmentUnmap},
                                                                    {"snapshot", A::kSnapshot},
                                                                    {"oom", A::kOom}}};
  std::vector<TraceEvent> out;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    line = line.substr(0, line.find('#'));
    while (!line.empty() && (line.back() == ' ' || line.back() == '\t' || line.back() == '\r')) line.pop_back();
    const size_t first = line.find_first_not_of(" \t\r");
    if (first == std::string::npos) continue;
    std::istringstream fields(line);
    std::string action, addr, extra;
    TraceEvent e{A::kSnapshot};
    if (!(fields >> action >> addr >> e.size >> e.time_us) || (fields >> extra)) {
      throw Error("[remat::memory] trace line " + std::to_string(n) +
                  ": expected \"ACTION ADDR SIZE TIME_US\", got \"" + line + "\".");
    }
    bool known = false;
    for (const auto& [name, a] : kNames) {
      if (action == name) {
        e.action = a;
        known = true;
      }
    }
    if (!known) {
      throw Error("[remat::memory] trace line " + std::to_string(n) + ": unknown action '" + action +
                  "' (expected alloc, free_requested, free_completed, segment_alloc, segment_free, segment_map, "
                  "segment_unmap, snapshot or oom).");
    }
    try {
      size_t used = 0;
      e.addr = std::stoull(addr, &used, 0);
      if (used != addr.size()) throw std::invalid_argument(addr);
    } catch (const std::exception&) {
      throw Error("[remat::memory] trace line " + std::to_string(n) + ": address '" + addr +
                  "' is not a number (decimal or 0x hex).");
    }
    out.push_back(e);
  }
  return out;
}

TraceReplay::TraceReplay(int64_t allocated_start, int64_t reserved_start, size_t max_points)
    : allocated_(allocated_start),
      reserved_(reserved_start),
      peak_allocated_(allocated_start),
      peak_reserved_(reserved_start),
      max_points_(std::max<size_t>(1, max_points)) {
  points_.push_back({0.0, allocated_, reserved_});
}

void TraceReplay::add_point(double time_us) {
  peak_allocated_ = std::max(peak_allocated_, allocated_);
  peak_reserved_ = std::max(peak_reserved_, reserved_);
  if (points_.size() >= max_points_) {
    ++dropped_;
    return;
  }
  points_.push_back({time_us, allocated_, reserved_});
}

void TraceReplay::apply(const TraceEvent& e) {
  using A = TraceEvent::Action;
  switch (e.action) {
    case A::kAlloc: {
      const Block b{caching_block_bytes(e.size), caching_small_pool(e.size)};
      live_[e.addr] = b;
      allocated_ += b.bytes;
      if (b.small) small_ += b.bytes;
      add_point(e.time_us);
      return;
    }
    case A::kFreeRequested: {
      Block b{caching_block_bytes(e.size), caching_small_pool(e.size)};
      auto it = live_.find(e.addr);
      if (it != live_.end()) {
        b = it->second;
        live_.erase(it);
        if (b.small) small_ -= b.bytes;
      } else {
        ++frees_from_before_;
      }
      allocated_ -= b.bytes;
      freeing_[e.addr] = b.bytes;
      pending_ += b.bytes;
      add_point(e.time_us);
      return;
    }
    case A::kFreeCompleted: {
      auto it = freeing_.find(e.addr);
      if (it != freeing_.end()) {
        pending_ -= it->second;
        freeing_.erase(it);
      }
      return;
    }
    case A::kSegmentAlloc:
    case A::kSegmentMap:
      reserved_ += e.size;
      add_point(e.time_us);
      return;
    case A::kSegmentFree:
    case A::kSegmentUnmap:
      reserved_ -= e.size;
      add_point(e.time_us);
      return;
    case A::kOom: ++ooms_; return;
    case A::kSnapshot: return;
  }
}

namespace {

/** NOTE [memory sources]: remat's CPU counter. */
class CpuRecording final : public Recording {
 public:
  explicit CpuRecording(size_t max_samples) : tl_(max_samples) {}
  double now_us() const override { return tl_.now_us(); }
  void stop() override { tl_.stop(); }
  std::vector<Sample> samples() const override { return tl_.samples(); }
  int64_t dropped_samples() const override { return tl_.dropped_samples(); }
  int64_t peak_reserved_bytes() const override {
    int64_t top = 0;
    for (const Sample& s : tl_.samples()) top = std::max(top, s.bytes);
    return top;
  }

 private:
  Timeline tl_;
};

class CpuSource final : public Source {
 public:
  c10::Device device() const override { return c10::Device(c10::kCPU); }
  std::string name() const override {
    return "cpu: remat's counting allocator, bytes of CPU tensor storage as requested (no rounding, no cache: "
           "reserved = allocated)";
  }
  void enable() override { enable_tracking(); }
  int64_t current_bytes() override { return memory::current_bytes(); }
  int64_t peak_bytes() override { return memory::peak_bytes(); }
  void reset_peak() override { memory::reset_peak(); }
  int64_t reserved_bytes() override { return memory::current_bytes(); }
  std::shared_ptr<Recording> record(size_t max_samples) override { return std::make_shared<CpuRecording>(max_samples); }
};

}  // namespace

std::shared_ptr<Source> source_for(c10::Device device) {
  if (device.is_cpu()) {
    static const std::shared_ptr<Source> cpu = std::make_shared<CpuSource>();
    return cpu;
  }
  if (device.is_cuda()) {
#ifdef REMAT_WITH_CUDA
    return make_cuda_source(device);
#else
    throw Error("[remat::memory] source_for(" + device.str() +
                "): this remat was built without CUDA (REMAT_WITH_CUDA is off), so it has no memory source for a "
                "CUDA device. Configure remat against a CUDA LibTorch with -DREMAT_CUDA=ON (docs/gpu.md).");
#endif
  }
  throw Error("[remat::memory] source_for(" + device.str() + "): remat has memory sources for CPU and CUDA only, got " +
              c10::DeviceTypeName(device.type()) + ".");
}

c10::Device measured_device(const std::vector<at::Tensor>& tensors) {
  for (const auto& t : tensors) {
    if (t.defined() && t.device().is_cuda()) return t.device();
  }
  return c10::Device(c10::kCPU);
}

DeviceTimer::DeviceTimer(c10::Device device) : device_(device) { restart(); }

void DeviceTimer::restart() {
  if (device_.is_cpu()) {
    t0_ = std::chrono::steady_clock::now();
    return;
  }
  c10::impl::VirtualGuardImpl impl(device_.type());
  start_.emplace(device_.type(), c10::EventFlag::BACKEND_DEFAULT);  // timing on
  start_->record(impl.getStream(device_));
}

double DeviceTimer::elapsed_ms() {
  if (!start_) return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0_).count();
  c10::impl::VirtualGuardImpl impl(device_.type());
  c10::Event end(device_.type(), c10::EventFlag::BACKEND_DEFAULT);
  end.record(impl.getStream(device_));
  end.synchronize();
  return start_->elapsedTime(end);
}

}  // namespace remat::memory
