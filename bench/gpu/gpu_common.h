// bench/gpu/gpu_common.h: what the GPU benchmark programs share: the
// device's memory counters and synchronization, bf16 autocast as a scope,
// and telling an out-of-memory error apart.
#pragma once

#include <exception>
#include <string>

#include <ATen/autocast_mode.h>
#include <torch/torch.h>
#ifdef REMAT_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <remat/memory.h>

namespace {

// --- device memory and synchronization ------------------------------------------
// Memory through remat::memory's device-aware forms: on CUDA the caching
// allocator's allocated bytes (what torch.cuda.max_memory_allocated reads),
// on CPU remat's counting allocator.
struct Device {
  torch::Device device{torch::kCPU};
  bool cuda() const { return device.is_cuda(); }
  void sync() const {
    if (cuda()) torch::cuda::synchronize(device.index());
  }
  int64_t current() const { return remat::memory::current_bytes(device); }
  int64_t peak() const { return remat::memory::peak_bytes(device); }
  void reset_peak() const { remat::memory::reset_peak(device); }
  void empty_cache() const {
#ifdef REMAT_WITH_CUDA
    if (cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
  }
  std::string meter() const {
    return cuda() ? "remat::memory, CUDA caching allocator (= torch.cuda.max_memory_allocated)" : "remat::memory (CPU)";
  }
};

/** bf16 autocast on the device while it lives, as Python's torch.autocast
 *  (the cast cache is cleared when the outermost one ends). */
class Autocast {
 public:
  Autocast(c10::DeviceType t, bool on) : t_(t), on_(on) {
    if (!on_) return;
    was_ = at::autocast::is_autocast_enabled(t_);
    dtype_ = at::autocast::get_autocast_dtype(t_);
    at::autocast::set_autocast_enabled(t_, true);
    at::autocast::set_autocast_dtype(t_, at::kBFloat16);
    at::autocast::increment_nesting();
  }
  ~Autocast() {
    if (!on_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(t_, was_);
    at::autocast::set_autocast_dtype(t_, dtype_);
  }
  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;

 private:
  c10::DeviceType t_;
  bool on_, was_ = false;
  at::ScalarType dtype_ = at::kBFloat16;
};

bool is_oom(const std::exception& e) {
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e)) return true;
  const std::string w = e.what();
  return w.find("out of memory") != std::string::npos || w.find("CUDA out of memory") != std::string::npos;
}

}  // namespace
