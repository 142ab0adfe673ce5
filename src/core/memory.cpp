// Counting wrapper of LibTorch's CPU allocator (remat::memory).
// NOTE [counting allocator]: installed once, at the highest priority (255, so
// it takes effect whatever was installed before, and chains to it); checked
// to be the CPU allocator whenever counting starts. It counts only while
// asked (enable_tracking() for good, or while a Probe or Timeline lives);
// otherwise an allocation costs one relaxed atomic load on top of the wrapped
// allocator. While counting, the hot path takes no global lock:
// - the size of a live allocation sits in a sharded open-addressing table
//   keyed by its data pointer (64 shards, a mutex each; the DataPtr keeps
//   data == context, which raw_allocate() requires);
// - current and peak bytes are atomics (peak by compare-and-swap);
// - probes share one "open segment" maximum: creating a probe closes the
//   segment and opens a new one, and a probe's peak is the maximum over the
//   segments opened since it started. Any number of probes, O(1) per
//   allocation, and nothing at all while no probe is alive.
// A pointer the table does not know (allocated before remat wrapped the
// allocator and released with raw_deallocate()) goes to the wrapped
// allocator's own deleter.
#include <remat/memory.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#ifdef REMAT_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <remat/error.h>

namespace remat::memory {
namespace {

struct Entry {
  void* key = nullptr;  // nullptr: empty
  size_t bytes = 0;
  c10::DeleterFnPtr deleter = nullptr;  // the wrapped allocator's
};

uint64_t hash_ptr(const void* p) { return (reinterpret_cast<uintptr_t>(p) >> 4) * 0x9E3779B97F4A7C15ull; }

/** Linear probing with backward-shift deletion; grows at 50% load. */
class Table {
 public:
  void insert(void* key, size_t bytes, c10::DeleterFnPtr deleter) {
    if (2 * (used_ + 1) > slots_.size()) grow();
    size_t i = index(key);
    while (slots_[i].key != nullptr) i = (i + 1) & mask_;
    slots_[i] = {key, bytes, deleter};
    ++used_;
  }
  /** Removes key; false if absent. */
  bool erase(void* key, Entry& out) {
    if (used_ == 0 || key == nullptr) return false;
    size_t i = index(key);
    while (slots_[i].key != key) {
      if (slots_[i].key == nullptr) return false;
      i = (i + 1) & mask_;
    }
    out = slots_[i];
    // Backward shift: move later entries of the run into the hole.
    size_t hole = i;
    for (size_t j = (i + 1) & mask_; slots_[j].key != nullptr; j = (j + 1) & mask_) {
      const size_t home = index(slots_[j].key);
      // Entry j may fill the hole if its home is not in (hole, j] cyclically.
      const bool in_range = hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
      if (!in_range) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    slots_[hole] = Entry{};
    --used_;
    return true;
  }

 private:
  size_t index(const void* key) const { return static_cast<size_t>(hash_ptr(key) >> 16) & mask_; }
  void grow() {
    std::vector<Entry> old = std::move(slots_);
    slots_.assign(std::max<size_t>(64, old.size() * 2), Entry{});
    mask_ = slots_.size() - 1;
    used_ = 0;
    for (const auto& e : old) {
      if (e.key != nullptr) insert(e.key, e.bytes, e.deleter);
    }
  }
  std::vector<Entry> slots_;
  size_t mask_ = 0;
  size_t used_ = 0;
};

constexpr int kShards = 64;

struct alignas(64) Shard {
  std::mutex mu;
  Table table;
};

struct State {
  std::array<Shard, kShards> shards;
  std::atomic<int64_t> current{0}, peak{0}, count{0};
  // Counting is on while `permanent` or users > 0 (probes, timelines).
  std::atomic<bool> permanent{false};
  std::atomic<int> users{0};
  // Probes (NOTE above): the open segment's maximum, and under probes_mu the
  // closed segments (id -> maximum) and the live probes' start segments.
  std::atomic<int> probes{0};
  std::atomic<int64_t> open_max{0};
  std::mutex probes_mu;
  uint64_t open_id = 0;
  std::map<uint64_t, int64_t> closed;
  std::map<uint64_t, int> starts;  // start segment -> live probes
  // Timeline recording (at most one Timeline at a time).
  std::atomic<bool> recording{false};
  std::mutex timeline_mu;
  std::chrono::steady_clock::time_point t0;
  std::vector<Sample> samples;
  size_t max_samples = 0;
  int64_t dropped = 0;
  // Installation.
  std::once_flag once;
  c10::Allocator* self = nullptr;
  c10::Allocator* inner = nullptr;
};

State& state() {
  static State* s = new State();  // never destroyed: frees may come at exit
  return *s;
}

Shard& shard_of(State& s, const void* p) { return s.shards[hash_ptr(p) >> 58]; }

void update_max(std::atomic<int64_t>& m, int64_t v) {
  int64_t old = m.load(std::memory_order_relaxed);
  while (v > old && !m.compare_exchange_weak(old, v, std::memory_order_relaxed)) {
  }
}

void record(State& s, int64_t now) {
  if (!s.recording.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lock(s.timeline_mu);
  if (!s.recording.load(std::memory_order_relaxed)) return;
  if (s.samples.size() >= s.max_samples) {
    ++s.dropped;
    return;
  }
  const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - s.t0).count();
  s.samples.push_back({us, now});
}

void add_bytes(State& s, size_t n) {
  const int64_t now = s.current.fetch_add(static_cast<int64_t>(n), std::memory_order_relaxed) + static_cast<int64_t>(n);
  s.count.fetch_add(1, std::memory_order_relaxed);
  update_max(s.peak, now);
  if (s.probes.load(std::memory_order_relaxed) > 0) update_max(s.open_max, now);
  record(s, now);
}

void sub_bytes(State& s, size_t n) {
  const int64_t now = s.current.fetch_sub(static_cast<int64_t>(n), std::memory_order_relaxed) - static_cast<int64_t>(n);
  record(s, now);
}

bool counting(const State& s) {
  return s.permanent.load(std::memory_order_relaxed) || s.users.load(std::memory_order_relaxed) > 0;
}

void counting_delete(void* ptr) {
  if (ptr == nullptr) return;  // raw_deallocate(nullptr); also the table's empty key
  State& s = state();
  Entry e;
  bool found;
  {
    Shard& sh = shard_of(s, ptr);
    std::lock_guard<std::mutex> lock(sh.mu);
    found = sh.table.erase(ptr, e);
  }
  if (found) {
    sub_bytes(s, e.bytes);
    e.deleter(ptr);
    return;
  }
  // Not ours: raw_allocate()d from the wrapped allocator before remat
  // installed itself, and released through raw_deallocate().
  c10::DeleterFnPtr inner = s.inner ? s.inner->raw_deleter() : nullptr;
  if (inner != nullptr) inner(ptr);
}

// Context of an allocation whose DataPtr had a context other than its data.
struct Wrapped {
  c10::DataPtr inner;
  size_t bytes;
};

void wrapped_delete(void* ctx) {
  auto* w = static_cast<Wrapped*>(ctx);
  sub_bytes(state(), w->bytes);
  delete w;  // frees through the inner DataPtr
}

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr dp = inner_->allocate(n);
    State& s = state();
    if (!counting(s) || n == 0 || dp.get() == nullptr) return dp;  // not counted
    if (dp.get() == dp.get_context() && dp.get_deleter() != nullptr) {
      // Common case (DefaultCPUAllocator): context == data, plain deleter.
      void* data = dp.get();
      c10::DeleterFnPtr d = dp.get_deleter();
      c10::Device device = dp.device();
      dp.release_context();
      {
        Shard& sh = shard_of(s, data);
        std::lock_guard<std::mutex> lock(sh.mu);
        sh.table.insert(data, n, d);
      }
      add_bytes(s, n);
      return {data, data, &counting_delete, device};
    }
    void* data = dp.get();
    c10::Device device = dp.device();
    auto* w = new Wrapped{std::move(dp), n};
    add_bytes(s, n);
    return {data, w, &wrapped_delete, device};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &counting_delete; }

  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

 private:
  c10::Allocator* inner_;
};

/** Installs the wrapper once; throws if it is not (or no longer) the CPU
 *  allocator, since counting would then silently see nothing. */
void ensure_installed() {
  State& s = state();
  std::call_once(s.once, [&s] {
    s.inner = c10::GetCPUAllocator();
    s.self = new CountingAllocator(s.inner);
    // 255 is the highest priority; SetCPUAllocator accepts equal priorities,
    // so this wins over whatever is installed and wraps it.
    c10::SetCPUAllocator(s.self, /*priority=*/255);
  });
  if (c10::GetCPUAllocator() != s.self) {
    throw Error(
        "[remat::memory] remat's counting allocator is not the CPU allocator: another allocator was installed "
        "with SetCPUAllocator(..., 255) after remat's, so remat would count nothing. Install your allocator "
        "before the first use of remat::memory (remat then wraps it and both count).");
  }
}

/** Counting on for the lifetime of a Probe or Timeline. */
void acquire() {
  ensure_installed();
  state().users.fetch_add(1, std::memory_order_relaxed);
}
void release() { state().users.fetch_sub(1, std::memory_order_relaxed); }

// NOTE [CUDA memory statistics]: the CUDA caching allocator keeps, per
// device, the bytes allocated to tensors now and their peak since its last
// resetPeakStats. remat reads those (no wrapper: every CUDA allocation is
// counted, always). A Probe needs the peak over its own life, so it resets
// the allocator's peak when it starts, after keeping what it read: the
// segments of the CPU counter (NOTE [counting allocator]) with the open
// segment's maximum = max(open_floor, the allocator's peak now), and
// `floor` = the highest peak read before a reset, for peak_bytes(device).
// Only remat's resets are known: a reset from elsewhere (Python's
// torch.cuda.reset_peak_memory_stats in the same process) lowers what
// Probes and peak_bytes(device) see from then on. Reading and resetting are
// two calls: an allocation another thread makes and frees between them
// raises no recorded peak (the CPU counter has no such gap).

[[noreturn]] void unsupported_device(const char* fn, c10::Device d) {
  if (d.is_cuda()) {
    throw Error(std::string("[remat::memory] ") + fn + "(" + d.str() +
                "): this remat was built without CUDA (REMAT_WITH_CUDA is off: it was configured against a "
                "CPU-only LibTorch, or with -DREMAT_CUDA=OFF), so it cannot read the CUDA caching allocator. "
                "Configure remat against a CUDA LibTorch with -DREMAT_CUDA=ON (docs/gpu.md).");
  }
  throw Error(std::string("[remat::memory] ") + fn + "(" + d.str() +
              "): remat measures CPU and CUDA devices only, got " + c10::DeviceTypeName(d.type()) + ".");
}

#ifdef REMAT_WITH_CUDA
struct CudaSegments {
  std::mutex mu;
  int64_t floor = 0;       // highest allocator peak read before a reset (since reset_peak(device))
  int64_t open_floor = 0;  // the open segment's maximum beyond the allocator's peak (merged segments)
  uint64_t open_id = 0;
  std::map<uint64_t, int64_t> closed;  // segment -> maximum, for live probes
  std::map<uint64_t, int> starts;      // start segment -> live probes
};

CudaSegments& cuda_segments(c10::DeviceIndex i) {
  static std::mutex* mu = new std::mutex();  // never destroyed, as state()
  static auto* all = new std::map<c10::DeviceIndex, std::unique_ptr<CudaSegments>>();
  std::lock_guard<std::mutex> lock(*mu);
  auto& p = (*all)[i];
  if (!p) p = std::make_unique<CudaSegments>();
  return *p;
}

c10::DeviceIndex cuda_index(const char* fn, c10::Device d) {
  const int n = c10::cuda::device_count();
  const int i = d.has_index() ? d.index() : (n > 0 ? c10::cuda::current_device() : 0);
  if (n == 0) {
    throw Error(std::string("[remat::memory] ") + fn + "(" + d.str() +
                "): no CUDA device is visible (c10::cuda::device_count() is 0); check the driver and "
                "CUDA_VISIBLE_DEVICES, or measure the CPU.");
  }
  if (i >= n) {
    throw Error(std::string("[remat::memory] ") + fn + "(" + d.str() + "): no such CUDA device (" + std::to_string(n) +
                " visible); pass a device index below " + std::to_string(n) + ".");
  }
  return static_cast<c10::DeviceIndex>(i);
}

struct CudaNow {
  int64_t current, peak;
};

CudaNow cuda_read(c10::DeviceIndex i) {
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(i);
  const auto& a = stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
  return {a.current, a.peak};
}

/** Closes the open segment (c.mu held): keeps its maximum for live probes and
 *  peak_bytes(device), then resets the allocator's peak to its current. */
CudaNow cuda_close_segment(CudaSegments& c, c10::DeviceIndex i) {
  const CudaNow now = cuda_read(i);
  const int64_t open_max = std::max(c.open_floor, now.peak);
  c.floor = std::max(c.floor, open_max);
  if (!c.starts.empty()) c.closed[c.open_id] = open_max;
  c10::cuda::CUDACachingAllocator::resetPeakStats(i);
  c.open_floor = now.current;
  ++c.open_id;
  return now;
}
#endif

}  // namespace

bool built_with_cuda() {
#ifdef REMAT_WITH_CUDA
  return true;
#else
  return false;
#endif
}

int64_t current_bytes(c10::Device device) {
  if (device.is_cpu()) return current_bytes();
#ifdef REMAT_WITH_CUDA
  if (device.is_cuda()) return cuda_read(cuda_index("current_bytes", device)).current;
#endif
  unsupported_device("current_bytes", device);
}

int64_t peak_bytes(c10::Device device) {
  if (device.is_cpu()) return peak_bytes();
#ifdef REMAT_WITH_CUDA
  if (device.is_cuda()) {
    const c10::DeviceIndex i = cuda_index("peak_bytes", device);
    CudaSegments& c = cuda_segments(i);
    std::lock_guard<std::mutex> lock(c.mu);
    return std::max({c.floor, c.open_floor, cuda_read(i).peak});
  }
#endif
  unsupported_device("peak_bytes", device);
}

void reset_peak(c10::Device device) {
  if (device.is_cpu()) return reset_peak();
#ifdef REMAT_WITH_CUDA
  if (device.is_cuda()) {
    const c10::DeviceIndex i = cuda_index("reset_peak", device);
    CudaSegments& c = cuda_segments(i);
    std::lock_guard<std::mutex> lock(c.mu);
    const CudaNow now = cuda_close_segment(c, i);
    c.floor = now.current;
    return;
  }
#endif
  unsupported_device("reset_peak", device);
}

void enable_tracking() {
  ensure_installed();
  state().permanent.store(true, std::memory_order_relaxed);
}

bool tracking_enabled() {
  const State& s = state();
  return s.permanent.load() && s.self != nullptr && c10::GetCPUAllocator() == s.self;
}

bool counting_now() {
  const State& s = state();
  return counting(s) && s.self != nullptr && c10::GetCPUAllocator() == s.self;
}

int64_t current_bytes() { return state().current.load(std::memory_order_relaxed); }

int64_t peak_bytes() { return state().peak.load(std::memory_order_relaxed); }

void reset_peak() {
  State& s = state();
  s.peak.store(s.current.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

int64_t allocation_count() { return state().count.load(std::memory_order_relaxed); }

Probe::Probe() : Probe(c10::Device(c10::kCPU)) {}

Probe::Probe(c10::Device device) : device_(device) {
  if (!device.is_cpu()) {
#ifdef REMAT_WITH_CUDA
    if (device.is_cuda()) {
      const c10::DeviceIndex i = cuda_index("Probe", device);
      device_ = c10::Device(c10::kCUDA, i);
      CudaSegments& c = cuda_segments(i);
      std::lock_guard<std::mutex> lock(c.mu);
      const CudaNow now = cuda_close_segment(c, i);
      start_ = c.open_id;
      ++c.starts[start_];
      baseline_bytes_ = now.current;
      return;
    }
#endif
    unsupported_device("Probe", device);
  }
  acquire();
  State& s = state();
  std::lock_guard<std::mutex> lock(s.probes_mu);
  const int64_t now = s.current.load(std::memory_order_relaxed);
  // Close the open segment (kept only if an older probe still reads it).
  const int64_t closed_max = s.open_max.exchange(now, std::memory_order_relaxed);
  if (!s.starts.empty()) s.closed[s.open_id] = closed_max;
  start_ = ++s.open_id;
  ++s.starts[start_];
  s.probes.fetch_add(1, std::memory_order_relaxed);
  baseline_bytes_ = now;
}

Probe::~Probe() {
#ifdef REMAT_WITH_CUDA
  if (device_.is_cuda()) {
    CudaSegments& c = cuda_segments(device_.index());
    std::lock_guard<std::mutex> lock(c.mu);
    auto it = c.starts.find(start_);
    if (--it->second == 0) {
      c.starts.erase(it);
      // As for the CPU below; the open segment's maximum is open_floor.
      auto cur = c.closed.lower_bound(start_);
      if (cur != c.closed.begin()) {
        auto prev = std::prev(cur);
        if (cur != c.closed.end() && cur->first == start_) {
          prev->second = std::max(prev->second, cur->second);
          c.closed.erase(cur);
        } else if (start_ == c.open_id && cur == c.closed.end()) {
          c.open_floor = std::max(c.open_floor, prev->second);
          c.closed.erase(prev);
        }
      }
      const uint64_t oldest = c.starts.empty() ? c.open_id + 1 : c.starts.begin()->first;
      c.closed.erase(c.closed.begin(), c.closed.lower_bound(oldest));
    }
    return;
  }
#endif
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.probes_mu);
    s.probes.fetch_sub(1, std::memory_order_relaxed);
    auto it = s.starts.find(start_);
    if (--it->second == 0) {
      s.starts.erase(it);
      // No probe starts at start_ any more: merge segment start_ into the
      // one before it, so the map holds at most one entry per live probe.
      // (Segments absent from the map were merged into their predecessor.)
      auto cur = s.closed.lower_bound(start_);
      if (cur != s.closed.begin()) {
        auto prev = std::prev(cur);
        if (cur != s.closed.end() && cur->first == start_) {
          prev->second = std::max(prev->second, cur->second);
          s.closed.erase(cur);
        } else if (start_ == s.open_id && cur == s.closed.end()) {
          update_max(s.open_max, prev->second);
          s.closed.erase(prev);
        }
      }
      // Segments older than every live probe are read by none.
      const uint64_t oldest = s.starts.empty() ? s.open_id + 1 : s.starts.begin()->first;
      s.closed.erase(s.closed.begin(), s.closed.lower_bound(oldest));
    }
  }
  release();
}

int64_t Probe::peak_bytes() const {
#ifdef REMAT_WITH_CUDA
  if (device_.is_cuda()) {
    CudaSegments& c = cuda_segments(device_.index());
    std::lock_guard<std::mutex> lock(c.mu);
    int64_t top = std::max({c.open_floor, cuda_read(device_.index()).peak, baseline_bytes_});
    for (auto it = c.closed.lower_bound(start_); it != c.closed.end(); ++it) top = std::max(top, it->second);
    return top - baseline_bytes_;
  }
#endif
  State& s = state();
  std::lock_guard<std::mutex> lock(s.probes_mu);
  int64_t top = std::max(s.open_max.load(std::memory_order_relaxed), baseline_bytes_);
  for (auto it = s.closed.lower_bound(start_); it != s.closed.end(); ++it) top = std::max(top, it->second);
  return top - baseline_bytes_;
}

int64_t Probe::delta_bytes() const {
#ifdef REMAT_WITH_CUDA
  if (device_.is_cuda()) return cuda_read(device_.index()).current - baseline_bytes_;
#endif
  return state().current.load(std::memory_order_relaxed) - baseline_bytes_;
}

Timeline::Timeline(size_t max_samples) {
  acquire();
  State& s = state();
  std::lock_guard<std::mutex> lock(s.timeline_mu);
  if (s.recording.load()) {
    release();
    throw Error("[remat::memory] a Timeline is already recording; stop or destroy it before starting another.");
  }
  s.t0 = std::chrono::steady_clock::now();
  s.samples.clear();
  s.samples.reserve(std::min<size_t>(max_samples, 1 << 16));
  s.samples.push_back({0.0, s.current.load()});
  s.max_samples = max_samples;
  s.dropped = 0;
  s.recording.store(true);
}

Timeline::~Timeline() { stop(); }

void Timeline::stop() {
  if (stopped_) return;
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.timeline_mu);
    s.recording.store(false);
  }
  stopped_ = true;
  release();
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
  std::lock_guard<std::mutex> lock(s.timeline_mu);
  return s.samples;
}

int64_t Timeline::dropped_samples() const {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.timeline_mu);
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
    if (!out) {
      out.close();
      std::remove(tmp.c_str());
      throw Error("[remat::memory] writing the trace to '" + path + "' failed (disk full?).");
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw Error("[remat::memory] cannot move the trace into place at '" + path + "'.");
  }
}

}  // namespace remat::memory
