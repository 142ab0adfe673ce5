// Offload and compression of saved activations: while an OffloadScope lives,
// every tensor autograd saves goes to a target (a directory, pinned host
// memory, or a compressed buffer in memory) and comes back when backward
// unpacks it; bitwise identical unless a lossy codec is chosen. Built on the
// saved-tensor hooks (hooks.h). See docs/offload.md.
// Leaves out: a pool of pre-registered file buffers (O_DIRECT, io_uring),
// checksums of file contents (sizes are checked), offload of tensors saved
// during double backward.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <remat/hooks.h>

namespace remat {

/** Where saved tensors go. */
enum class OffloadTarget {
  /** Stay in this process's memory, encoded by the codec (compression alone). */
  kMemory,
  /** Pinned host memory, copied from an accelerator on a side stream; a
   *  no-op for CPU tensors (describe() says so). */
  kHost,
  /** Files in OffloadOptions::directory(), written by background threads and
   *  read back ahead of backward by a prefetcher. */
  kDisk,
};

/** How a saved tensor is encoded. kNone, kZstd and kLz4 are lossless
 *  (bitwise identical); kBFloat16, kFloat8 and kInt8Block are lossy and apply
 *  to float32 tensors only (others are stored as they are). A lossy codec gives the same
 *  result whatever the timing: a tensor unpacked while its write is still
 *  pending comes back through the codec, as from its file. */
enum class Codec {
  /** Raw bytes. */
  kNone,
  /** zstd level 1 (libzstd). */
  kZstd,
  /** LZ4 default (liblz4); tensors over ~2 GiB are stored raw. */
  kLz4,
  /** float32 rounded to bfloat16 (round to nearest even): half the bytes. */
  kBFloat16,
  /** float32 scaled per tensor by max|x|/448 and rounded to float8 e4m3:
   *  a quarter of the bytes. Tensors with inf or NaN are stored raw. */
  kFloat8,
  /** float32 in blocks of 256 values, each block scaled by its max|x| and
   *  each value rounded to the nearest of 256 levels spread over 7 decades
   *  below 1 (finer near 1, as the dynamic maps of 8-bit optimizers): a
   *  byte per value plus a float32 per block, 0.27 of the bytes. Small
   *  values survive beside large ones in other blocks (Adam's second
   *  moment). Tensors with inf or NaN are stored raw. */
  kInt8Block,
};

/** The enumerator's name: "kMemory", "kHost" or "kDisk". */
std::string to_string(OffloadTarget target);
/** The enumerator's name, e.g. "kZstd". */
std::string to_string(Codec codec);

/** Options of an OffloadScope: the target is required, the rest optional
 *  with the defaults below, validated when the scope is created. */
class OffloadOptions {
 public:
  /** Options for target; the optional fields start at their defaults. */
  explicit OffloadOptions(OffloadTarget target) : target_(target) {}

  /** Where saved tensors go (the constructor's argument). */
  OffloadTarget target() const { return target_; }
  /** kDisk: an existing, writable directory for the files (required for
   *  kDisk, ignored otherwise). Default "". */
  OffloadOptions& directory(std::string dir) {
    directory_ = std::move(dir);
    return *this;
  }
  /** The directory for kDisk; "" unless set. */
  const std::string& directory() const { return directory_; }
  /** Tensors smaller than this stay in memory as they are, bytes. Default
   *  64 KiB (a file per tiny tensor costs more than it saves). */
  OffloadOptions& min_bytes(int64_t bytes) {
    min_bytes_ = bytes;
    return *this;
  }
  /** Smallest tensor offloaded, bytes. Default 64 KiB. */
  int64_t min_bytes() const { return min_bytes_; }
  /** kDisk: how many tensors the prefetcher reads ahead of backward, in
   *  reverse save order, among those the thread that saved the tensor being
   *  unpacked saved; 0 reads each one when backward needs it. Default 2. */
  OffloadOptions& prefetch_depth(int64_t depth) {
    prefetch_depth_ = depth;
    return *this;
  }
  /** Tensors read ahead of backward (kDisk). Default 2. */
  int64_t prefetch_depth() const { return prefetch_depth_; }
  /** kDisk: bytes that pending writes and prefetched reads may hold at once;
   *  forward waits when writes are this far behind. Prefetched reads not yet
   *  used are dropped to make room, never waited for: several graphs and
   *  threads share a store without deadlock. One tensor larger than this
   *  still goes, alone. Default 256 MiB. */
  OffloadOptions& max_inflight_bytes(int64_t bytes) {
    max_inflight_bytes_ = bytes;
    return *this;
  }
  /** Bound on pending writes plus prefetched reads, bytes (kDisk). Default 256 MiB. */
  int64_t max_inflight_bytes() const { return max_inflight_bytes_; }
  /** Encoding of saved tensors (all targets but kHost). Default kNone. */
  OffloadOptions& codec(Codec c) {
    codec_ = c;
    return *this;
  }
  /** Encoding of saved tensors. Default kNone. */
  Codec codec() const { return codec_; }
  /** kDisk: background writer threads. Default 1. */
  OffloadOptions& writer_threads(int n) {
    writer_threads_ = n;
    return *this;
  }
  /** Background writer threads (kDisk). Default 1. */
  int writer_threads() const { return writer_threads_; }

 private:
  OffloadTarget target_;
  std::string directory_;
  int64_t min_bytes_ = 64 << 10;
  int64_t prefetch_depth_ = 2;
  int64_t max_inflight_bytes_ = int64_t{256} << 20;
  Codec codec_ = Codec::kNone;
  int writer_threads_ = 1;
};

/** Counters of one OffloadScope (its store), since it was created. */
struct OffloadStats {
  /** Saved tensors seen by the pack hook (a tensor saved twice counts twice). */
  int64_t tensors_saved = 0;
  /** Of those, kept in memory as they are: below min_bytes, leaves that
   *  require grad (parameters), non-strided or, for kHost, CPU tensors. */
  int64_t tensors_kept = 0;
  /** Saves that found the same tensor (storage, offset, shape, version)
   *  already stored and shared it. */
  int64_t tensors_shared = 0;
  /** Bytes of the tensors sent to the target, before encoding. */
  int64_t bytes_raw = 0;
  /** Bytes they occupy at the target, after encoding. */
  int64_t bytes_stored = 0;
  /** Bytes written to files (kDisk). */
  int64_t bytes_written = 0;
  int64_t bytes_read = 0;  ///< bytes read back from files (kDisk)
  /** Files that exist now (kDisk). */
  int64_t files_live = 0;
  int64_t files_created = 0;  ///< files created in all (kDisk)
  /** Unpacks served from memory without waiting for a read (prefetched,
   *  or still waiting to be written). */
  int64_t prefetch_hits = 0;
  int64_t prefetch_misses = 0;  ///< unpacks that had to read their tensor or wait for it
  /** Reads handed to the prefetcher (some may be taken over by an unpack
   *  that came first). */
  int64_t prefetches_issued = 0;
  /** Of those, dropped unused (queued, or read but not yet unpacked) to make
   *  room for a save under max_inflight_bytes; their files stay and are read
   *  again when needed. */
  int64_t prefetches_dropped = 0;
  /** Time forward waited for writes (max_inflight_bytes), ms. */
  double write_stall_ms = 0;
  /** Time backward waited for reads, ms. */
  double read_stall_ms = 0;
  /** Time spent encoding and writing files (kDisk; the writer threads'
   *  busy time, summed over threads), ms: bytes_written over it is the
   *  pace the disk took. */
  double write_ms = 0;
  /** Time spent reading files and decoding them (kDisk; the reader thread
   *  and unpacks that read for themselves), ms. */
  double read_ms = 0;
  /** Highest bytes held by pending writes and prefetched reads at once. */
  int64_t peak_inflight_bytes = 0;
  /** bytes_raw / bytes_stored (1 when nothing was stored). */
  double compression_ratio() const {
    return bytes_stored > 0 ? static_cast<double>(bytes_raw) / static_cast<double>(bytes_stored) : 1.0;
  }
};

namespace detail {
class OffloadStore;
}

/** RAII: tensors autograd saves on this thread while the scope lives go to
 *  the target. Backward may run after the scope ends (the saved tensors'
 *  hooks keep the store alive). Not movable.
 *
 *    torch::Tensor loss;
 *    {
 *      remat::OffloadScope scope(remat::OffloadOptions(remat::OffloadTarget::kDisk).directory("/scratch"));
 *      loss = model(x).mean();
 *    }
 *    loss.backward();  // reads the activations back, prefetching ahead
 *
 *  Throws remat::Error on invalid options or an unusable directory. Errors of
 *  the background threads (a write that failed) surface at the next save,
 *  at wait(), in the destructor (when no other exception is in flight) and
 *  at the unpack of the tensor they concern. */
class OffloadScope {
 public:
  /** Validates options, opens the store (kDisk: checks the directory) and
   *  starts sending this thread's saved tensors to it. */
  explicit OffloadScope(const OffloadOptions& options);
  ~OffloadScope() noexcept(false);
  OffloadScope(const OffloadScope&) = delete;
  OffloadScope& operator=(const OffloadScope&) = delete;

  /** Blocks until every pending write is done; throws the first background
   *  error. */
  void wait();
  /** The store's counters so far (a snapshot). */
  OffloadStats stats() const;
  /** Human-readable summary: target, codec, what is offloaded, counters. */
  std::string describe() const;

 private:
  std::shared_ptr<detail::OffloadStore> store_;
  std::unique_ptr<ScopedHooks> hooks_;
};

}  // namespace remat
