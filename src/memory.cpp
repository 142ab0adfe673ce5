// Counting wrapper of LibTorch's CPU allocator (remat::memory).
// enable_tracking() registers an allocator that forwards to the one it
// replaces and records each allocation's size under a mutex; the deleter it
// hands out looks the size up again. Tensors allocated before tracking keep
// their original deleter and are never counted.
#include <remat/memory.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <chrono>
#include <fstream>
#include <mutex>
#include <unordered_map>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <remat/error.h>

namespace remat::memory {
namespace {

constexpr int kMaxProbes = 64;

struct Live {
  size_t bytes;
  c10::DeleterFnPtr deleter;  // the wrapped allocator's
};

struct State {
  std::mutex mu;
  std::unordered_map<void*, Live> live;
  int64_t current = 0;
  int64_t peak = 0;
  int64_t count = 0;
  std::array<int64_t, kMaxProbes> probe_peak{};
  std::array<bool, kMaxProbes> probe_used{};
  // Timeline recording (at most one Timeline at a time).
  bool recording = false;
  std::chrono::steady_clock::time_point t0;
  std::vector<Sample> samples;
  size_t max_samples = 0;
  int64_t dropped = 0;
};

State& state() {
  static State* s = new State();  // never destroyed: frees may come at exit
  return *s;
}

void record(State& s) {
  if (!s.recording) return;
  if (s.samples.size() >= s.max_samples) {
    ++s.dropped;
    return;
  }
  const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - s.t0).count();
  s.samples.push_back({us, s.current});
}

void raise_peaks(State& s) {
  record(s);
  if (s.current > s.peak) s.peak = s.current;
  for (int i = 0; i < kMaxProbes; ++i) {
    if (s.probe_used[i] && s.current > s.probe_peak[i]) s.probe_peak[i] = s.current;
  }
}

// Context of an allocation whose DataPtr had a context other than its data.
struct Wrapped {
  c10::DataPtr inner;
  size_t bytes;
};

void counting_delete(void* ptr) {
  State& s = state();
  c10::DeleterFnPtr deleter = nullptr;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    auto it = s.live.find(ptr);
    if (it == s.live.end()) return;  // cannot happen: we only hand out tracked ptrs
    s.current -= static_cast<int64_t>(it->second.bytes);
    record(s);
    deleter = it->second.deleter;
    s.live.erase(it);
  }
  deleter(ptr);
}

void wrapped_delete(void* ctx) {
  auto* w = static_cast<Wrapped*>(ctx);
  {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mu);
    s.current -= static_cast<int64_t>(w->bytes);
    record(s);
  }
  delete w;  // frees through the inner DataPtr
}

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr dp = inner_->allocate(n);
    if (n == 0 || dp.get() == nullptr) return dp;  // nothing to count
    State& s = state();
    if (dp.get() == dp.get_context() && dp.get_deleter() != nullptr) {
      // Common case (DefaultCPUAllocator): context == data, plain deleter.
      void* data = dp.get();
      c10::DeleterFnPtr d = dp.get_deleter();
      dp.release_context();
      {
        std::lock_guard<std::mutex> lock(s.mu);
        s.live.emplace(data, Live{n, d});
        s.current += static_cast<int64_t>(n);
        ++s.count;
        raise_peaks(s);
      }
      return {data, data, &counting_delete, dp.device()};
    }
    void* data = dp.get();
    c10::Device device = dp.device();
    auto* w = new Wrapped{std::move(dp), n};
    {
      std::lock_guard<std::mutex> lock(s.mu);
      s.current += static_cast<int64_t>(n);
      ++s.count;
      raise_peaks(s);
    }
    return {data, w, &wrapped_delete, device};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &counting_delete; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  c10::Allocator* inner_;
};

std::once_flag g_once;
bool g_enabled = false;

}  // namespace

void enable_tracking() {
  std::call_once(g_once, [] {
    static CountingAllocator* alloc = new CountingAllocator(c10::GetCPUAllocator());
    // Priority above the default registration so later defaults don't win.
    c10::SetCPUAllocator(alloc, /*priority=*/100);
    g_enabled = true;
  });
}

bool tracking_enabled() { return g_enabled; }

int64_t current_bytes() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.current;
}

int64_t peak_bytes() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.peak;
}

void reset_peak() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.peak = s.current;
}

int64_t allocation_count() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.count;
}

Probe::Probe() {
  enable_tracking();
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  slot_ = -1;
  for (int i = 0; i < kMaxProbes; ++i) {
    if (!s.probe_used[i]) {
      slot_ = i;
      break;
    }
  }
  if (slot_ < 0) {
    throw Error("[remat::memory] more than " + std::to_string(kMaxProbes) +
                " probes alive at once; destroy some Probe objects first.");
  }
  s.probe_used[slot_] = true;
  s.probe_peak[slot_] = s.current;
  baseline_bytes_ = s.current;
}

Probe::~Probe() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.probe_used[slot_] = false;
}

int64_t Probe::peak_bytes() const {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.probe_peak[slot_] - baseline_bytes_;
}

int64_t Probe::delta_bytes() const {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.current - baseline_bytes_;
}

Timeline::Timeline(size_t max_samples) {
  enable_tracking();
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.recording) {
    throw Error("[remat::memory] a Timeline is already recording; stop or destroy it before starting another.");
  }
  s.recording = true;
  s.t0 = std::chrono::steady_clock::now();
  s.samples.clear();
  s.samples.reserve(std::min<size_t>(max_samples, 1 << 16));
  s.samples.push_back({0.0, s.current});
  s.max_samples = max_samples;
  s.dropped = 0;
}

Timeline::~Timeline() { stop(); }

void Timeline::stop() {
  if (stopped_) return;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.recording = false;
  stopped_ = true;
}

double Timeline::now_us() const {
  State& s = state();
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - s.t0).count();
}

void Timeline::add_span(std::string name, double begin_us, double end_us) {
  spans_.push_back({std::move(name), begin_us, end_us});
}

std::vector<Sample> Timeline::samples() const {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.samples;
}

int64_t Timeline::dropped_samples() const {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.dropped;
}

void Timeline::write_chrome_trace(const std::string& path, const std::string& process_name) const {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    if (!out) throw Error("[remat::memory] cannot write the trace to '" + path + "'; check the directory exists.");
    out << "{\"traceEvents\":[\n";
    out << "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":1,\"args\":{\"name\":\"" << process_name << "\"}}";
    for (const auto& sm : samples()) {
      out << ",\n{\"name\":\"cpu memory\",\"ph\":\"C\",\"pid\":1,\"ts\":" << sm.time_us
          << ",\"args\":{\"bytes\":" << sm.bytes << "}}";
    }
    for (const auto& sp : spans_) {
      out << ",\n{\"name\":\"" << sp.name << "\",\"ph\":\"X\",\"pid\":1,\"tid\":1,\"ts\":" << sp.begin_us
          << ",\"dur\":" << (sp.end_us - sp.begin_us) << "}";
    }
    out << "\n],\"displayTimeUnit\":\"ms\"}\n";
    if (!out) throw Error("[remat::memory] writing the trace to '" + path + "' failed (disk full?).");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw Error("[remat::memory] cannot move the trace into place at '" + path + "'.");
  }
}

}  // namespace remat::memory
