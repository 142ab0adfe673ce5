// Memory telemetry: a counting wrapper around LibTorch's CPU allocator, and
// the CUDA caching allocator's statistics per device.
// CPU: current/peak bytes of CPU tensor storage allocated while counting is
// on (after enable_tracking(), or while a Probe or Timeline lives), any
// number of threads. Costs one atomic load per allocation while counting is
// off. CUDA (built with REMAT_WITH_CUDA, docs/gpu.md): the overloads taking
// a c10::Device read the caching allocator's allocated bytes of that device
// (always counted: no enable_tracking() needed).
// Leaves out: CPU allocations made while counting was off (never counted, so
// frees of them are not either); Timeline records CPU bytes only; devices
// other than CPU and CUDA.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <c10/core/Device.h>

/** Memory telemetry: current and peak bytes of the CPU allocator (and of
 *  CUDA devices), scoped probes, timelines. */
namespace remat::memory {

/** True when this remat was built with its CUDA paths (REMAT_WITH_CUDA: cmake
 *  -DREMAT_CUDA=AUTO or ON against a CUDA LibTorch). Says nothing about
 *  whether a GPU is present at run time. */
bool built_with_cuda();

/** Wraps the CPU allocator (once, chaining to whatever allocator is
 *  installed) and counts every allocation from now on; idempotent,
 *  thread-safe. Throws if another allocator replaced remat's afterwards.
 *  The first call (or the first Probe, Timeline or profile) installs the
 *  wrapper with c10::SetCPUAllocator, which publishes it with a plain store:
 *  make that first call before other threads allocate (TSan reports the
 *  install otherwise; c10 offers no synchronized way to swap allocators). */
void enable_tracking();
/** True while enable_tracking() is in effect: it has run and remat's
 *  allocator is still the CPU allocator. */
bool tracking_enabled();
/** True while allocations are counted (tracking_enabled(), or a Probe or a
 *  Timeline alive). */
bool counting_now();
/** Bytes of CPU tensor storage currently allocated (tracked allocations). */
int64_t current_bytes();
/** Highest current_bytes() since tracking started or the last reset_peak(). */
int64_t peak_bytes();
/** Sets peak_bytes() to current_bytes(). */
void reset_peak();
/** Number of tracked allocations so far (for tests and benchmarks). */
int64_t allocation_count();

/** Device-aware forms. For a CPU device they are the functions above. For a
 *  CUDA device (index -1: the current one) they read the CUDA caching
 *  allocator's statistics of that device: bytes allocated to tensors (all
 *  memory pools; c10::CachingDeviceAllocator::DeviceStats::allocated_bytes,
 *  aggregate), not the larger reserved (cached) bytes. peak_bytes(d) is the
 *  highest value since the process started or the last reset_peak(d);
 *  reset_peak(d) also resets the caching allocator's own peak statistics
 *  (torch.cuda.reset_peak_memory_stats), and so does every CUDA Probe
 *  (below). Throw remat::Error: for a CUDA device in a build without CUDA
 *  (the message names the remedy: configure remat with -DREMAT_CUDA=ON
 *  against a CUDA LibTorch), for a CUDA device that does not exist, and for
 *  other device types. */
int64_t current_bytes(c10::Device device);
/** Highest current_bytes(device) since the process started or the last
 *  reset_peak(device); see current_bytes(c10::Device). */
int64_t peak_bytes(c10::Device device);
/** Sets peak_bytes(device) to current_bytes(device); see current_bytes(c10::Device). */
void reset_peak(c10::Device device);

/** Scoped probe: the peak above the bytes live when it was created, seen
 *  while it lives. Nested probes and other threads' probes are independent;
 *  any number may live at once. Allocations are counted while it lives.
 *  A probe of a CUDA device reads that device's caching allocator (all
 *  threads and streams allocating there); to see the peak over its life it
 *  resets the allocator's peak statistics when it starts (remat keeps what
 *  it read, so peak_bytes(device) and other probes are unaffected). */
class Probe {
 public:
  /** Probes the CPU allocator. */
  Probe();
  /** Probes `device`: CPU or CUDA (index -1: the current device); throws
   *  remat::Error as current_bytes(device) does. */
  explicit Probe(c10::Device device);
  ~Probe();
  Probe(const Probe&) = delete;
  Probe& operator=(const Probe&) = delete;
  /** Bytes live when the probe started. */
  int64_t baseline_bytes() const { return baseline_bytes_; }
  /** max(current) - baseline, over the probe's life so far (>= 0). */
  int64_t peak_bytes() const;
  /** current - baseline (may be negative if memory was freed). */
  int64_t delta_bytes() const;
  /** The device it probes (CUDA with its index resolved). */
  c10::Device device() const { return device_; }

 private:
  c10::Device device_;
  uint64_t start_;  // first allocator segment it reads
  int64_t baseline_bytes_;
};

/** One point of a memory timeline: microseconds since the Timeline started
 *  and tracked CPU bytes right after an allocation or free. */
struct Sample {
  double time_us;  ///< microseconds since the Timeline started
  int64_t bytes;   ///< tracked CPU bytes live after the event
};

/** A named interval on a timeline (e.g. "forward", "backward"). */
struct Span {
  std::string name;  ///< label of the slice
  /** Start and end, microseconds since the Timeline started. */
  ///@{
  double begin_us, end_us;
  ///@}
};

/** Records a Sample at every tracked allocation and free while it lives
 *  (at most max_samples; later ones are counted as dropped). One Timeline
 *  at a time per process. Allocations are counted while it records. */
class Timeline {
 public:
  /** Starts recording (and counting allocations); at most max_samples
   *  samples are kept (16 bytes each). Default 1,000,000. */
  explicit Timeline(size_t max_samples = 1'000'000);
  ~Timeline();
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;
  /** Microseconds since this timeline started. */
  double now_us() const;
  /** Marks [begin_us, end_us] with a name (shown as a slice in Perfetto). */
  void add_span(std::string name, double begin_us, double end_us);
  /** Stops recording (idempotent); samples() stays readable. */
  void stop();
  /** The samples recorded so far, in time order. */
  std::vector<Sample> samples() const;
  /** The spans added with add_span(), in the order added. */
  const std::vector<Span>& spans() const { return spans_; }
  /** Samples not recorded because max_samples was reached. */
  int64_t dropped_samples() const;
  /** Writes Chrome trace event JSON: a "bytes" counter track plus the spans;
   *  opens in Perfetto (ui.perfetto.dev) or chrome://tracing. */
  void write_chrome_trace(const std::string& path, const std::string& process_name = "remat") const;

 private:
  std::vector<Span> spans_;
  bool stopped_ = false;
};

}  // namespace remat::memory
