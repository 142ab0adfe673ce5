// Internal: the store behind remat::OffloadScope, for the other layers that
// offload (CheckpointOptions().offload(...), the kOffload policy result).
// One store per scope; it outlives the scope as long as a graph holds one of
// its handles. NOTE [offload pipeline] in src/offload/offload.cpp says how writes,
// prefetches and releases interleave.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include <remat/hooks.h>
#include <remat/offload.h>

namespace remat::detail {

class OffloadStore {
 public:
  struct Entry;

  /** One reference to a stored tensor, from pack(). Releasing it (it is
   *  RAII; reset() or destruction) lets the store free what it kept (file,
   *  buffer) once no other handle shares the tensor. Movable. */
  class Handle {
   public:
    Handle() = default;
    Handle(Handle&& other) noexcept;
    Handle& operator=(Handle&& other) noexcept;
    ~Handle() { reset(); }
    void reset() noexcept;
    explicit operator bool() const { return entry_ != nullptr; }

   private:
    friend class OffloadStore;
    std::shared_ptr<OffloadStore> store_;
    std::shared_ptr<Entry> entry_;
    bool unpacked_ = false;
    // The tensor within the entry's region (as_strided at unpack).
    std::vector<int64_t> sizes_, strides_;
    int64_t offset_ = 0;
  };

  /** Validates the options and the directory (throws remat::Error naming
   *  the field or directory and a remedy), starts the threads. */
  static std::shared_ptr<OffloadStore> create(const OffloadOptions& options);
  /** As create(), for a store whose entries are independent of each other
   *  (optimizer state, StepInBackward): a failed write keeps its tensor in
   *  memory (unpack returns it; failures() counts it) and a failed read
   *  leaves the file for another try; neither removes the other entries'
   *  files nor fails the store. */
  static std::shared_ptr<OffloadStore> create_isolated(const OffloadOptions& options);
  /** The process's one store for options equal to these, created at the
   *  first call (as create(); a call that throws records nothing, so the
   *  next one tries again). A kDisk store starts threads, so the regions,
   *  modules and steps that offload with the same options share it. */
  static std::shared_ptr<OffloadStore> shared(const OffloadOptions& options);
  /** wait() on every store shared() made. */
  static void wait_shared();
  ~OffloadStore();
  OffloadStore(const OffloadStore&) = delete;
  OffloadStore& operator=(const OffloadStore&) = delete;

  /** Stores t (or keeps it, see OffloadStats::tensors_kept). Throws the
   *  first background error, if any. Call on the thread that saves. */
  Handle pack(const at::Tensor& t);
  /** The tensor pack() was given, bitwise (lossless codecs) or decoded
   *  (lossy); throws remat::Error if it cannot be read back or was modified
   *  in place since pack. Any thread. */
  at::Tensor unpack(Handle& h);
  /** Queues a read of h's tensor ahead of its unpack, if it is in a file
   *  and max_inflight_bytes has room (a no-op otherwise); unlike the
   *  automatic read-ahead, the caller says what comes next. */
  void prefetch(const Handle& h);
  /** Whether h's tensor is in memory now (kept, encoded in memory, pending
   *  its write, or read ahead): its unpack will not wait for a file. */
  bool resident(const Handle& h) const;
  /** create_isolated stores: writes that failed (their tensors stayed in
   *  memory), and the last such error. */
  int64_t failures(std::string* last_error = nullptr) const;
  /** Waits for every pending write; throws the first background error. */
  void wait();
  /** Throws the first background error, if any (does not wait). */
  void check() const;
  OffloadStats stats() const;
  std::string describe() const;
  const OffloadOptions& options() const { return options_; }

 private:
  explicit OffloadStore(const OffloadOptions& options);
  struct State;
  void release(const std::shared_ptr<Entry>& e) noexcept;
  /** Records the first error and removes every file: call with the lock. */
  void fail_locked(const std::string& err);
  void writer_loop();
  void reader_loop();
  OffloadOptions options_;
  bool isolated_ = false;
  std::weak_ptr<OffloadStore> self_;
  std::unique_ptr<State> s_;
};

/** A hook factory that packs every saved tensor into store (what
 *  OffloadScope pushes). */
std::shared_ptr<HookFactory> make_offload_hooks(std::shared_ptr<OffloadStore> store);

/** Test seam: the nth file write (1-based, counted from this call, all
 *  stores) fails after writing half its bytes, as on a full disk (ENOSPC);
 *  0 turns it off. */
void inject_offload_write_failure(int64_t nth);
/** Test seam: the nth file read fails with EIO; 0 turns it off. */
void inject_offload_read_failure(int64_t nth);
/** Test seam: while paused, the writer threads of every store leave their
 *  queues alone, so every stored tensor stays pending (served from memory)
 *  until the seam is lifted. wait() and a pack past max_inflight_bytes
 *  block meanwhile. */
void pause_offload_writers(bool paused);

}  // namespace remat::detail
