// Memory telemetry: a counting wrapper around LibTorch's CPU allocator.
// current/peak bytes of tensor storage allocated on the CPU since
// enable_tracking(), thread-safe. Leaves out: the CUDA caching allocator
// (this build is CPU-only; see docs), and allocations made before tracking
// was enabled (they are never counted, so frees of them are not either).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace remat::memory {

/** Wraps the CPU allocator; idempotent, thread-safe, never uninstalled. */
void enable_tracking();
/** True once enable_tracking() has run. */
bool tracking_enabled();
/** Bytes of CPU tensor storage currently allocated (tracked allocations). */
int64_t current_bytes();
/** Highest current_bytes() since tracking started or the last reset_peak(). */
int64_t peak_bytes();
/** Sets peak_bytes() to current_bytes(). */
void reset_peak();
/** Number of tracked allocations so far (for tests and benchmarks). */
int64_t allocation_count();

/** Scoped probe: the peak above the bytes live when it was created, seen
 *  while it lives. Nested probes and other threads' probes are independent.
 *  Enables tracking if needed. */
class Probe {
 public:
  Probe();
  ~Probe();
  Probe(const Probe&) = delete;
  Probe& operator=(const Probe&) = delete;
  /** Bytes live when the probe started. */
  int64_t baseline_bytes() const { return baseline_bytes_; }
  /** max(current) - baseline, over the probe's life so far (>= 0). */
  int64_t peak_bytes() const;
  /** current - baseline (may be negative if memory was freed). */
  int64_t delta_bytes() const;

 private:
  int slot_;
  int64_t baseline_bytes_;
};

/** One point of a memory timeline: microseconds since the Timeline started
 *  and tracked CPU bytes right after an allocation or free. */
struct Sample {
  double time_us;
  int64_t bytes;
};

/** A named interval on a timeline (e.g. "forward", "backward"). */
struct Span {
  std::string name;
  double begin_us, end_us;
};

/** Records a Sample at every tracked allocation and free while it lives
 *  (at most max_samples; later ones are counted as dropped). One Timeline
 *  at a time per process. Enables tracking if needed. */
class Timeline {
 public:
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
  std::vector<Sample> samples() const;
  const std::vector<Span>& spans() const { return spans_; }
  int64_t dropped_samples() const;
  /** Writes Chrome trace event JSON: a "bytes" counter track plus the spans;
   *  opens in Perfetto (ui.perfetto.dev) or chrome://tracing. */
  void write_chrome_trace(const std::string& path, const std::string& process_name = "remat") const;

 private:
  std::vector<Span> spans_;
  bool stopped_ = false;
};

}  // namespace remat::memory
