// remat_preload: an LD_PRELOAD library that counts LibTorch's CPU tensor
// bytes the same way in any process (the C++ benchmark and Python alike).
// At load time a constructor wraps c10's CPU allocator (like src/core/memory.cpp)
// with a counting one registered at priority 50: above the default (0), below
// remat::memory (255), which then wraps this one, so both count.
// C interface: remat_preload_current_bytes(), remat_preload_peak_bytes(),
// remat_preload_reset_peak(), remat_preload_installed().
// Leaves out: CUDA, allocations made before load (never counted), and memory
// outside c10's CPU allocator (e.g. oneDNN scratch buffers, Python objects).
#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

namespace {

struct State {
  std::mutex mu;
  std::unordered_map<void*, std::pair<size_t, c10::DeleterFnPtr>> live;  // data -> bytes, inner deleter
  int64_t current = 0;
  int64_t peak = 0;
};

State& state() {
  static State* s = new State();  // never destroyed: frees may come at exit
  return *s;
}

struct Wrapped {  // for DataPtrs whose context is not their data
  c10::DataPtr inner;
  size_t bytes;
};

void add(int64_t n) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.current += n;
  if (s.current > s.peak) s.peak = s.current;
}

void counting_delete(void* ptr) {
  State& s = state();
  c10::DeleterFnPtr d = nullptr;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    auto it = s.live.find(ptr);
    if (it == s.live.end()) return;
    s.current -= static_cast<int64_t>(it->second.first);
    d = it->second.second;
    s.live.erase(it);
  }
  d(ptr);
}

void wrapped_delete(void* ctx) {
  auto* w = static_cast<Wrapped*>(ctx);
  add(-static_cast<int64_t>(w->bytes));
  delete w;
}

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr dp = inner_->allocate(n);
    if (n == 0 || dp.get() == nullptr) return dp;
    if (dp.get() == dp.get_context() && dp.get_deleter() != nullptr) {
      void* data = dp.get();
      c10::DeleterFnPtr d = dp.get_deleter();
      dp.release_context();
      {
        State& s = state();
        std::lock_guard<std::mutex> lock(s.mu);
        s.live.emplace(data, std::make_pair(n, d));
        s.current += static_cast<int64_t>(n);
        if (s.current > s.peak) s.peak = s.current;
      }
      return {data, data, &counting_delete, dp.device()};
    }
    void* data = dp.get();
    c10::Device device = dp.device();
    auto* w = new Wrapped{std::move(dp), n};
    add(static_cast<int64_t>(n));
    return {data, w, &wrapped_delete, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counting_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

 private:
  c10::Allocator* inner_;
};

std::atomic<bool> g_installed{false};

__attribute__((constructor)) void install() {
  static CountingAllocator* alloc = new CountingAllocator(c10::GetCPUAllocator());
  c10::SetCPUAllocator(alloc, /*priority=*/50);
  g_installed = c10::GetCPUAllocator() == alloc;
}

}  // namespace

extern "C" {
__attribute__((visibility("default"))) int64_t remat_preload_current_bytes() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.current;
}
__attribute__((visibility("default"))) int64_t remat_preload_peak_bytes() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.peak;
}
__attribute__((visibility("default"))) void remat_preload_reset_peak() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.peak = s.current;
}
/** 1 when the constructor's allocator was the current CPU allocator at load. */
__attribute__((visibility("default"))) int remat_preload_installed() { return g_installed ? 1 : 0; }
}
