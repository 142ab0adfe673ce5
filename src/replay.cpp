// Replay of a first run's RNG, autocast and buffer state (see replay.h).
#include "replay.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include <pthread.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <remat/checkpoint.h>

namespace remat {
namespace {

thread_local int t_recompute_depth = 0;
// The last RNG state captured per device on this thread. Consecutive
// captures without random ops in between see the same state and share one
// copy (~5 KiB for the CPU generator) instead of keeping one each.
thread_local std::vector<std::pair<c10::Device, at::Tensor>> t_last_rng;

at::Tensor dedup_rng_state(c10::Device d, at::Tensor state) {
  for (auto& [dev, last] : t_last_rng) {
    if (dev != d) continue;
    if (last.numel() == state.numel() && last.scalar_type() == state.scalar_type() &&
        std::memcmp(last.data_ptr(), state.data_ptr(), state.numel() * state.element_size()) == 0) {
      return last;
    }
    last = state;
    return state;
  }
  t_last_rng.emplace_back(d, state);
  return state;
}

}  // namespace

bool is_recomputing() { return t_recompute_depth > 0; }

namespace detail {

bool is_parameter_like(const at::Tensor& t) {
  if (t.requires_grad() && t.is_leaf()) return true;
  if (t.is_view()) {
    const at::TensorBase& base = t._base();
    return base.requires_grad() && base.is_leaf();
  }
  return false;
}

AutocastState AutocastState::capture() {
  return {at::autocast::is_autocast_enabled(at::kCPU), at::autocast::is_autocast_enabled(at::kCUDA),
          at::autocast::is_autocast_cache_enabled(), at::autocast::get_autocast_dtype(at::kCPU),
          at::autocast::get_autocast_dtype(at::kCUDA)};
}

void AutocastState::apply() const {
  at::autocast::set_autocast_enabled(at::kCPU, cpu_enabled);
  at::autocast::set_autocast_enabled(at::kCUDA, cuda_enabled);
  at::autocast::set_autocast_cache_enabled(cache_enabled);
  at::autocast::set_autocast_dtype(at::kCPU, cpu_dtype);
  at::autocast::set_autocast_dtype(at::kCUDA, cuda_dtype);
}

namespace {

/** Device types whose default generator at::globalContext() can hand out
 *  (Context::getAcceleratorHooksInterface); CPU is handled apart. */
bool has_default_generator(c10::DeviceType t) {
  switch (t) {
    case c10::kCUDA:
    case c10::kXPU:
    case c10::kMPS:
    case c10::kPrivateUse1:
    case c10::kMTIA:
    case c10::kHIP:
    case c10::kHPU: return true;
    default: return false;
  }
}

}  // namespace

std::vector<c10::Device> rng_devices(const std::vector<c10::Device>& inputs, const std::vector<c10::Device>& in_use) {
  std::vector<c10::Device> out{c10::Device(c10::kCPU)};
  auto add = [&out](const c10::Device& d) {
    if (!has_default_generator(d.type())) return;
    if (std::find(out.begin(), out.end(), d) == out.end()) out.push_back(d);
  };
  for (const auto& d : inputs) add(d);
  for (const auto& d : in_use) add(d);
  return out;
}

std::vector<c10::Device> cuda_devices_in_use() {
  std::vector<c10::Device> out;
  if (!at::hasCUDA()) return out;  // CPU build, or no GPU: nothing to ask
  const auto& hooks = at::detail::getCUDAHooks();
  const int n = hooks.deviceCount();
  for (int i = 0; i < n; ++i) {
    const auto idx = static_cast<c10::DeviceIndex>(i);
    if (hooks.hasPrimaryContext(idx)) out.emplace_back(c10::kCUDA, idx);
  }
  return out;
}

std::optional<c10::Stream> stream_of(const at::Tensor& t) {
  if (!t.defined()) return std::nullopt;
  const c10::Device d = t.device();
  if (d.is_cpu() || d.is_meta() || !c10::impl::hasDeviceGuardImpl(d.type())) return std::nullopt;
  return c10::impl::VirtualGuardImpl(d.type()).getStream(d);
}

void use_on_current_stream(const at::Tensor& t, const std::optional<c10::Stream>& produced_on) {
  if (!produced_on || !t.defined()) return;
  const c10::Device d = t.device();
  const c10::impl::VirtualGuardImpl impl(d.type());
  const c10::Stream now = impl.getStream(d);
  if (now == *produced_on) return;
  c10::Event ready(d.type());
  ready.record(*produced_on);
  ready.block(now);
  impl.recordDataPtrOnStream(t.storage().data_ptr(), now);
}

c10::Device memory_device(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& parameters) {
  for (const auto* ts : {&inputs, &parameters}) {
    for (const auto& t : *ts) {
      if (t.defined() && t.is_cuda()) return t.device();
    }
  }
  return c10::Device(c10::kCPU);
}

ReplayState ReplayState::capture(bool preserve_rng, const std::vector<c10::Device>& devices,
                                 std::vector<at::Tensor> buffers) {
  ReplayState r;
  r.autocast = AutocastState::capture();
  r.buffers = std::move(buffers);
  for (const auto& b : r.buffers) r.buffer_values.push_back(b.detach().clone());
  if (!preserve_rng) return r;
  for (const auto& d : rng_devices(devices, cuda_devices_in_use())) {
    at::Generator gen = at::globalContext().defaultGenerator(d);
    at::Tensor state;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      state = gen.get_state();
    }
    r.rng.emplace_back(gen, dedup_rng_state(d, std::move(state)));
  }
  return r;
}

namespace {

/** The RNG region lock: recursive for its owner, and lendable to autograd's
 *  device threads while the owner waits in Engine::execute (NOTE [RNG lock
 *  lent to device threads] in replay.h). */
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

ReplayGuard::ReplayGuard(const ReplayState& state, bool enable_grad)
    : rng_lock_(!state.rng.empty()),
      state_(state),
      grad_(enable_grad || at::GradMode::is_enabled()),
      autocast_now_(AutocastState::capture()) {
  ++t_recompute_depth;
  for (auto [gen, s] : state_.rng) {
    std::lock_guard<std::mutex> lock(gen.mutex());
    RngNow now;
    if (auto* cpu = dynamic_cast<at::CPUGeneratorImpl*>(gen.unsafeGetGeneratorImpl())) {
      now.engine = cpu->engine();
      now.next_float = cpu->next_float_normal_sample();
      now.next_double = cpu->next_double_normal_sample();
    } else {
      now.state = gen.get_state();
    }
    rng_now_.push_back(std::move(now));
    gen.set_state(s);
  }
  state_.autocast.apply();
  // Like torch.autocast's context: casts cached while the re-run is under
  // autocast are dropped when the outermost autocast region ends, else the
  // next forward would reuse casts of parameters the optimizer has since
  // changed (see ~ReplayGuard).
  if (state_.autocast.cpu_enabled || state_.autocast.cuda_enabled) at::autocast::increment_nesting();
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < state_.buffers.size(); ++i) {
    const at::Tensor& b = state_.buffers[i];
    buffers_now_.push_back(b.detach().clone());
    // Rewind to the first run's values: a re-run must see what it saw
    // (BatchNorm saves its running statistics for backward).
    b.variable_data().copy_(state_.buffer_values[i]);
  }
}

ReplayGuard::~ReplayGuard() {
  {
    at::NoGradGuard no_grad;
    // variable_data(): new version counter, so saved buffers stay valid.
    for (size_t i = 0; i < buffers_now_.size(); ++i) state_.buffers[i].variable_data().copy_(buffers_now_[i]);
  }
  autocast_now_.apply();
  // The autocast cache maps a parameter to its cast without checking its
  // version: left filled, it would hand the next step's forward (under the
  // user's autocast) the casts of this step's weights. Python's checkpoint
  // clears it the same way when its recompute's autocast context exits.
  if ((state_.autocast.cpu_enabled || state_.autocast.cuda_enabled) && at::autocast::decrement_nesting() == 0) {
    at::autocast::clear_cache();
  }
  for (size_t i = 0; i < rng_now_.size(); ++i) {
    at::Generator gen = state_.rng[i].first;
    std::lock_guard<std::mutex> lock(gen.mutex());
    const RngNow& now = rng_now_[i];
    if (now.engine) {
      auto* cpu = static_cast<at::CPUGeneratorImpl*>(gen.unsafeGetGeneratorImpl());  // as captured above
      cpu->set_engine(*now.engine);
      cpu->set_next_float_normal_sample(now.next_float);
      cpu->set_next_double_normal_sample(now.next_double);
    } else {
      gen.set_state(now.state);
    }
  }
  --t_recompute_depth;
}

}  // namespace detail
}  // namespace remat
