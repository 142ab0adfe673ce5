// Internal: the process-wide lock that serializes the regions which capture
// or replay RNG state, and the ways it is lent to threads its owner waits
// for (autograd's device threads, a branch the region awaits). The saved-
// tensor engine (hooks.cpp) lends it around Engine::execute; replay.h holds
// it in every ReplayGuard.
#pragma once

#include <cstdint>

namespace remat::detail {

/** NOTE [RNG regions and threads]: LibTorch's default generators are
 *  process-wide. A region's first run and its replay draw the same numbers
 *  only if no other thread draws in between; with two threads running
 *  checkpointed dropout at once, a replayed mask would silently differ from
 *  the first one and the gradients would be wrong. So every piece of remat
 *  that captures or replays RNG state (a checkpoint's first run, a planned
 *  stage's first run, every replay, the profiler) holds one process-wide
 *  recursive lock while it runs: such regions run one at a time across
 *  threads (nested ones on the same thread re-enter). With
 *  preserve_rng_state(false) nothing is locked. Random draws made by other
 *  code outside remat regions while a region runs are not covered. */
class RngRegionLock {
 public:
  explicit RngRegionLock(bool active);
  ~RngRegionLock();
  RngRegionLock(const RngRegionLock&) = delete;
  RngRegionLock& operator=(const RngRegionLock&) = delete;

 private:
  bool held_;
};

/** NOTE [RNG lock lent to device threads]: a region's first run holds the
 *  RNG lock until its forward ends. When fn itself runs a backward
 *  (autograd::grad inside the region) on CUDA tensors, the engine runs it on
 *  autograd's device thread while the calling thread waits in
 *  Engine::execute; a replay there needs the lock, and would wait forever
 *  for its own caller. So while the owner waits in Engine::execute
 *  (RngLockLend, taken by remat's engine), autograd's device threads
 *  (mark_autograd_device_thread(), from the engine's thread_init) may take
 *  the lock too, and the owner goes on only once they have let go. The
 *  owner draws nothing while it waits, and what a device thread runs under
 *  the lock is a replay, which puts the generators back as it found them,
 *  so the owner's first run draws what its replay will. Other threads still
 *  wait for the owner. */
void mark_autograd_device_thread();

/** NOTE [RNG lock lent to awaited threads]: a region's function may run a
 *  checkpointed branch on another thread and wait for it (std::async and
 *  get()); the branch needs the RNG lock that the waiting region holds.
 *  A thread that waits for the lock watches the owner: when the owner has
 *  used less than 1 ms of CPU in each of two 20 ms slices and the kernel
 *  reports it asleep (not merely waiting for a core) at both, and
 *  its hold is gated (gate_rng_hold(): a checkpoint region's first run or
 *  re-run, whose random ops go through wait_rng_unlent()), the waiter
 *  borrows the lock, one borrower (and its nested holds) at a time.
 *  (Gating the hold of a chain stage's first run, which runs no
 *  interceptor, is not possible: a branch awaited there still waits.) The
 *  owner draws nothing while a borrower holds it (its random ops wait), so
 *  each side's draws stay contiguous. A region counts the borrows during
 *  its forward (rng_borrow_epoch()) and its re-run checks that as many
 *  happen again: a branch re-spawned by the re-run draws what it drew
 *  (the stream is replayed), while a borrow by an unrelated thread cannot
 *  be replayed and is reported as an error instead of a wrong gradient. */
/** Sets whether this thread's hold is gated (when it owns the lock);
 *  returns the previous setting. */
bool gate_rng_hold(bool gated);
void wait_rng_unlent();
int64_t rng_borrow_epoch();
class RngLockLend {
 public:
  RngLockLend();
  ~RngLockLend();
  RngLockLend(const RngLockLend&) = delete;
  RngLockLend& operator=(const RngLockLend&) = delete;

 private:
  bool lent_ = false;
};

}  // namespace remat::detail
