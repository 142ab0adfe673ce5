// Internal: the state a recomputation must replay to match the first run
// (RNG streams, autocast, module buffers), shared by remat::checkpoint and
// CheckpointedSequential, and the test for tensors that need no recompute.
#pragma once

#include <optional>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/GradMode.h>
#include <c10/core/Stream.h>

namespace remat::detail {

/** Leaf tensors that require grad (parameters) and views of them: alive
 *  anyway, so saved by reference. */
bool is_parameter_like(const at::Tensor& t);

/** CPU and CUDA autocast state of this thread. */
struct AutocastState {
  bool cpu_enabled = false, cuda_enabled = false, cache_enabled = true;
  at::ScalarType cpu_dtype = at::kBFloat16, cuda_dtype = at::kHalf;
  static AutocastState capture();
  void apply() const;
};

/** NOTE [RNG devices]: the generators a region's RNG state covers, as
 *  torch.utils.checkpoint picks them and a little more: the CPU generator
 *  always; the default generator of every device of the region's inputs
 *  that has one (CUDA and the other accelerators; meta and other
 *  generator-less device types are skipped, not an error); and every CUDA
 *  device already in use, i.e. with a primary context (`in_use`, from
 *  cuda_devices_in_use()), which covers the current device and a region
 *  that draws on a device none of its inputs lives on (torch.randn(...,
 *  device="cuda") inside fn). Not covered: a device first initialized
 *  inside the region (its generator is at its initial state then, but a
 *  manual_seed before would not be replayed). Order: CPU, inputs' devices
 *  in order, then `in_use`; no duplicates. A pure function, so the CPU
 *  build tests the same code path with made-up device lists. */
std::vector<c10::Device> rng_devices(const std::vector<c10::Device>& inputs, const std::vector<c10::Device>& in_use);
/** CUDA devices with a primary context; empty when CUDA is not available
 *  (always in a CPU build: at::hasCUDA() is false there). */
std::vector<c10::Device> cuda_devices_in_use();

/** NOTE [recompute streams]: the autograd engine runs a node's backward
 *  (and so the unpack that triggers a re-run) with the stream of the node's
 *  forward current (Engine::evaluate_function guards onto Node::stream()),
 *  on the CPU thread of the backward's caller or on autograd's device
 *  thread for that GPU. The re-run therefore runs on the stream the
 *  backward runs on, with no guard of remat's. When a region's forward used
 *  several streams, a tensor re-run for one node may be unpacked by a node
 *  on another stream: stream_of() records where it was produced, and
 *  use_on_current_stream() makes the current stream wait for that one (an
 *  event) and tells the caching allocator the storage is used there
 *  (recordDataPtrOnStream), as autograd's InputBuffer does for gradients.
 *  Device-generic (c10::Event, VirtualGuardImpl): CPU and meta tensors
 *  have no stream and cost nothing. */
std::optional<c10::Stream> stream_of(const at::Tensor& t);
void use_on_current_stream(const at::Tensor& t, const std::optional<c10::Stream>& produced_on);

/** The device a chain's memory is measured on (the profiler,
 *  CheckpointedSequential): the first CUDA device among `inputs`, else
 *  among `parameters`, else the CPU. A CUDA chain is then planned and
 *  measured in CUDA bytes (remat::memory::Probe(device)). */
c10::Device memory_device(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& parameters);

/** What a first run looked like: RNG states of its devices (shared with
 *  the previous capture on this thread when unchanged), autocast state, and
 *  the module buffers with their values before the first run (a re-run
 *  starts from those and puts the current ones back after). */
struct ReplayState {
  std::vector<std::pair<at::Generator, at::Tensor>> rng;  // generator, state
  AutocastState autocast;
  std::vector<at::Tensor> buffers;
  std::vector<at::Tensor> buffer_values;  // clones, taken at capture
  /** Captures the generators of rng_devices(devices, cuda_devices_in_use()). */
  static ReplayState capture(bool preserve_rng, const std::vector<c10::Device>& devices,
                             std::vector<at::Tensor> buffers);
};

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

/** For its lifetime: RNG, autocast and buffer values as captured (and grad
 *  mode on when asked: checkpoint re-runs must save), marks the thread as
 *  recomputing; then restores all and puts the buffers' current values back
 *  (without bumping their version counters). */
class ReplayGuard {
 public:
  ReplayGuard(const ReplayState& state, bool enable_grad);
  ~ReplayGuard();
  ReplayGuard(const ReplayGuard&) = delete;
  ReplayGuard& operator=(const ReplayGuard&) = delete;

 private:
  RngRegionLock rng_lock_;  // first: held while the state is swapped
  const ReplayState& state_;
  c10::AutoGradMode grad_;  // the current mode unless enable_grad
  AutocastState autocast_now_;
  /** A generator's state as the guard found it. The CPU generator's is
   *  its engine, copied as is: get_state() would allocate a 5056-byte
   *  tensor inside every replay, bytes no plan counts (a tight budget went
   *  over by them). Other devices' come from get_state() (a small CPU
   *  tensor, not counted on the device). */
  struct RngNow {
    at::Tensor state;
    std::optional<at::mt19937> engine;
    std::optional<float> next_float;
    std::optional<double> next_double;
  };
  std::vector<RngNow> rng_now_;
  std::vector<at::Tensor> buffers_now_;
};

}  // namespace remat::detail
