// Memory telemetry: a counting wrapper around LibTorch's CPU allocator.
// current/peak bytes of tensor storage allocated on the CPU since
// enable_tracking(), thread-safe. Leaves out: the CUDA caching allocator
// (this build is CPU-only; see docs), and allocations made before tracking
// was enabled (they are never counted, so frees of them are not either).
#pragma once

#include <cstdint>

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

}  // namespace remat::memory
