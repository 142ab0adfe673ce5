// The process-wide RNG region lock (see rng_lock.h).
#include "rng_lock.h"

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>

#include <pthread.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

namespace remat::detail {

namespace {

/** The RNG region lock: recursive for its owner, and lendable to autograd's
 *  device threads while the owner waits in Engine::execute (NOTE [RNG lock
 *  lent to device threads] in rng_lock.h). */
struct RngLock {
  std::mutex m;
  std::condition_variable cv;
  std::thread::id owner;
  pthread_t owner_handle{};  // for its CPU clock (NOTE [RNG lock lent to awaited threads])
  pid_t owner_tid = 0;       // for its scheduling state
  int depth = 0;             // the owner's holds
  int lent = 0;              // the owner's Engine::execute calls in progress
  int borrowers = 0;         // holds taken while lent (device threads) or while the owner waits (awaited threads)
  int idle_borrowers = 0;    // of which: taken while the owner waits
  bool gated = false;        // the owner's random ops wait for idle borrowers (a region's run)
  int64_t borrow_epoch = 0;  // idle borrows so far
};

/** True when the kernel reports thread `tid` of this process as sleeping
 *  (waiting for an event: 'S' or 'D'), not running or runnable. */
bool sleeping(pid_t tid) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/self/task/%d/stat", static_cast<int>(tid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return false;
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* close = std::strrchr(buf, ')');  // after "tid (comm)"
  return close != nullptr && close[1] == ' ' && (close[2] == 'S' || close[2] == 'D');
}

/** CPU time the thread has used, ns; -1 when unknown. */
int64_t cpu_ns(pthread_t t) {
  clockid_t c;
  timespec ts{};
  if (pthread_getcpuclockid(t, &c) != 0 || clock_gettime(c, &ts) != 0) return -1;
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

RngLock& rng_lock() {
  static RngLock* l = new RngLock();  // never destroyed: device threads may outlive statics
  return *l;
}

thread_local int t_borrowed = 0;          // this thread's borrowed holds
thread_local bool t_idle_borrow = false;  // ... taken while the owner waited
thread_local bool t_device_thread = false;

}  // namespace

void lock_rng_regions() {
  RngLock& l = rng_lock();
  std::unique_lock<std::mutex> g(l.m);
  const auto me = std::this_thread::get_id();
  if (l.depth > 0 && l.owner == me) {
    ++l.depth;
    return;
  }
  if (t_borrowed > 0) {  // nested inside a borrowed hold
    ++t_borrowed;
    ++l.borrowers;
    return;
  }
  // NOTE [RNG lock lent to awaited threads]: wait in slices; an owner
  // whose thread used (almost) no CPU for two slices in a row is waiting
  // for something, maybe for this thread's result.
  constexpr auto kSlice = std::chrono::milliseconds(20);
  constexpr int64_t kIdleNs = 1000000;  // < 1 ms of CPU in a slice
  int idle_slices = 0;
  int64_t last = -1;
  std::thread::id watched;
  auto sampled = std::chrono::steady_clock::now();
  while (!(l.depth == 0 || (l.lent > 0 && t_device_thread))) {
    l.cv.wait_for(g, kSlice);
    if (l.depth == 0 || (l.lent > 0 && t_device_thread)) break;
    if (std::chrono::steady_clock::now() - sampled < kSlice) continue;  // woken early: not a whole slice yet
    sampled = std::chrono::steady_clock::now();
    if (!l.gated || l.borrowers > 0 || watched != l.owner) {
      watched = l.owner;
      idle_slices = 0;
      last = -1;
      if (!l.gated || l.borrowers > 0) continue;
    }
    const int64_t now = cpu_ns(l.owner_handle);
    // Idle: asleep (not merely waiting for a core on a busy machine) and
    // no CPU used since the last sample.
    idle_slices = now >= 0 && last >= 0 && now - last < kIdleNs && sleeping(l.owner_tid) ? idle_slices + 1 : 0;
    last = now;
    if (idle_slices >= 2) {
      ++t_borrowed;
      ++l.borrowers;
      ++l.idle_borrowers;
      ++l.borrow_epoch;
      t_idle_borrow = true;
      return;
    }
  }
  if (l.depth == 0) {
    l.owner = me;
    l.owner_handle = pthread_self();
    l.owner_tid = static_cast<pid_t>(syscall(SYS_gettid));
    l.depth = 1;
    l.gated = false;
  } else {
    ++t_borrowed;
    ++l.borrowers;
  }
}

void unlock_rng_regions() {
  RngLock& l = rng_lock();
  std::lock_guard<std::mutex> g(l.m);
  if (t_borrowed > 0) {
    --t_borrowed;
    --l.borrowers;
    if (t_borrowed == 0 && t_idle_borrow) {
      t_idle_borrow = false;
      --l.idle_borrowers;
    }
  } else if (--l.depth == 0) {
    l.owner = std::thread::id();
    l.gated = false;
  }
  l.cv.notify_all();
}

bool gate_rng_hold(bool gated) {
  RngLock& l = rng_lock();
  std::lock_guard<std::mutex> g(l.m);
  if (l.depth == 0 || l.owner != std::this_thread::get_id()) return false;
  const bool before = l.gated;
  l.gated = gated;
  l.cv.notify_all();
  return before;
}

void wait_rng_unlent() {
  RngLock& l = rng_lock();
  std::unique_lock<std::mutex> g(l.m);
  if (l.depth == 0 || l.owner != std::this_thread::get_id()) return;
  l.cv.wait(g, [&] { return l.idle_borrowers == 0; });
}

int64_t rng_borrow_epoch() {
  RngLock& l = rng_lock();
  std::lock_guard<std::mutex> g(l.m);
  return l.borrow_epoch;
}

void mark_autograd_device_thread() { t_device_thread = true; }

RngLockLend::RngLockLend() {
  RngLock& l = rng_lock();
  std::lock_guard<std::mutex> g(l.m);
  lent_ = l.depth > 0 && l.owner == std::this_thread::get_id();
  if (!lent_) return;
  ++l.lent;
  l.cv.notify_all();
}

RngLockLend::~RngLockLend() {
  if (!lent_) return;
  RngLock& l = rng_lock();
  std::unique_lock<std::mutex> g(l.m);
  // The owner goes on only once no device thread holds it on its behalf
  // (or on another backward's: their replays restore the state they swap).
  if (--l.lent == 0) l.cv.wait(g, [&] { return l.borrowers == 0; });
}

RngRegionLock::RngRegionLock(bool active) : held_(active) {
  if (held_) lock_rng_regions();
}

RngRegionLock::~RngRegionLock() {
  if (held_) unlock_rng_regions();
}

}  // namespace remat::detail
