// remat::parallel: data-parallel training on PyTorch's own c10d, the engine
// Python's DistributedDataParallel runs on. A small layer, not a framework:
// a process group (TCPStore or FileStore rendezvous, Gloo on CPU, NCCL on
// CUDA when built with it) and gradient synchronisation through
// c10d::Reducer (buckets, all-reduce overlapped with backward), with every
// remat strategy inside the model (NOTE [Reducer and planned chains] in
// docs/parallel.md).
//
//   auto pg = remat::parallel::init_process_group(
//       remat::parallel::InitOptions(rank, world_size).master_port(29500));
//   remat::parallel::DataParallel ddp(model, pg);   // broadcasts rank 0's state
//   for (...) {
//     auto loss = ddp.forward([&] { return criterion(model->forward(x), y); });
//     loss.backward();                               // all-reduce overlaps it
//     optimizer.step();                              // gradients are averaged
//   }
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/arg.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace torch::nn {
class Module;
}  // namespace torch::nn

/** Data-parallel training on c10d (library remat::parallel). */
namespace remat::parallel {

/** How a process joins its group. rank in [0, world_size). */
struct InitOptions {
  /** The required values; the rest start at their defaults. */
  InitOptions(int rank, int world_size) : rank_(rank), world_size_(world_size) {}
  /** This process's rank, in [0, world_size). Required. */
  TORCH_ARG(int, rank);
  /** Processes in the group, >= 1. Required. */
  TORCH_ARG(int, world_size);
  /** TCPStore host: rank 0 listens there, the others connect. Default 127.0.0.1. */
  TORCH_ARG(std::string, master_addr) = "127.0.0.1";
  /** TCPStore port, 1..65535. Default 29500 (as torch.distributed). */
  TORCH_ARG(int, master_port) = 29500;
  /** Non-empty: rendezvous through a c10d::FileStore at this path (on a
   *  file system every rank sees) instead of TCP. The file is removed by
   *  the store when every rank has left. Default "". */
  TORCH_ARG(std::string, file_store) = "";
  /** Rendezvous and collective timeout: a peer that does not answer
   *  within it fails the call with remat::Error. Default 300 s. */
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::seconds(300);
  /** kCPU: Gloo; kCUDA: NCCL (a remat built with REMAT_CUDA). Default kCPU. */
  TORCH_ARG(c10::DeviceType, device) = c10::kCPU;
};

/** A joined process group (c10d's, shared by copies). */
class ProcessGroup {
 public:
  /** An empty group (defined() is false); init_process_group() makes real ones. */
  ProcessGroup() = default;
  /** This process's rank in the group (0 for an empty group). */
  int rank() const;
  /** Processes in the group (1 for an empty group). */
  int world_size() const;
  /** kCPU (Gloo) or kCUDA (NCCL), as InitOptions::device. */
  c10::DeviceType device() const { return device_; }
  /** InitOptions::timeout, for collectives on this group. */
  std::chrono::milliseconds timeout() const { return timeout_; }
  /** The c10d group, for collectives of your own. */
  const c10::intrusive_ptr<c10d::ProcessGroup>& c10d() const { return pg_; }
  /** Waits until every rank calls barrier(). */
  void barrier() const;
  /** Sum of t over the ranks, in place (t on the group's device). */
  void all_reduce_sum(at::Tensor& t) const;
  /** False for a default-constructed group. */
  bool defined() const { return static_cast<bool>(pg_); }
  /** A group of some of this group's ranks (their order gives the new
   *  ranks: ranks[i] is rank i there), on the same store and backend, for a
   *  2-D layout (pipeline stages x data-parallel replicas). A collective of
   *  the ranks listed only: each calls it with the same list, and calls for
   *  several groups come in the same order on every rank. Throws
   *  remat::Error for a rank listed twice or out of range, or when this
   *  rank is not listed. */
  ProcessGroup new_group(const std::vector<int>& ranks) const;

 private:
  friend ProcessGroup init_process_group(const InitOptions& options);
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  c10::DeviceType device_ = c10::kCPU;
  std::chrono::milliseconds timeout_{0};
  c10::intrusive_ptr<c10d::Store> store_;  // the rendezvous store, for new_group
  std::string master_addr_;                // "" for a FileStore (Gloo's device choice)
  std::string name_;                       // prefix of this group's keys in the store
  std::shared_ptr<int> groups_made_;       // new_group calls so far, shared by copies
};

/** Averages the gradients of `parameters` over the group's ranks, in place
 *  (one all-reduce per dtype; a parameter without a gradient on a rank adds
 *  zeros and gets the average too). For data parallel outside
 *  DataParallel's Reducer: replicas of a pipeline stage after each step. A
 *  collective: every rank gives its parameters in the same order, of the
 *  same shapes. */
void average_gradients(const ProcessGroup& group, const std::vector<at::Tensor>& parameters);

/** Joins the group: rendezvous through the store (rank 0 serves the
 *  TCPStore), then the backend. Blocks until every rank has joined or the
 *  timeout passes; throws remat::Error for bad values, an unreachable
 *  store, a port in use, or a backend this build lacks. */
ProcessGroup init_process_group(const InitOptions& options);

/** How DataParallel buckets and reduces gradients (DDP's options). */
struct DataParallelOptions {
  /** Gradient bucket size once buckets are rebuilt in backward order after
   *  the first step, bytes. Default 25 MiB (as DDP's bucket_cap_mb). */
  TORCH_ARG(int64_t, bucket_cap_bytes) = int64_t{25} << 20;
  /** Cap of the first rebuilt bucket (the gradients ready first), bytes:
   *  small, so that their all-reduce starts early. Default 1 MiB (DDP's). */
  TORCH_ARG(int64_t, first_bucket_cap_bytes) = int64_t{1} << 20;
  /** Broadcast rank 0's buffers (BatchNorm statistics) before each
   *  forward, as DDP's broadcast_buffers. Default true. */
  TORCH_ARG(bool, broadcast_buffers) = true;
  /** Parameters that get no gradient in some step are reduced as zero
   *  (c10d searches the graph from the outputs given to forward()); one
   *  that no rank used keeps its .grad untouched. The set may change from
   *  step to step (a branch taken on some steps). Costs a graph walk per
   *  step. Default false: every parameter must get a gradient each step,
   *  or the next step fails with c10d's error. */
  TORCH_ARG(bool, find_unused_parameters) = false;
};

/** Timings of the last synchronised backward, milliseconds (steady clock). */
struct CommStats {
  int64_t buckets = 0;  ///< all-reduces launched
  int64_t bytes = 0;    ///< gradient bytes reduced
  /** Sum over buckets of launch to completion. */
  double allreduce_ms = 0.0;
  /** From the last bucket's launch (its last gradient was ready: backward's
   *  compute is over) to the last completion: the communication backward
   *  did not hide. */
  double exposed_ms = 0.0;
  /** Share of allreduce_ms that ran while backward was still computing
   *  (before the last launch), 0..1. */
  double overlap = 0.0;
};

/** Synchronises the gradients of `module`'s parameters across the group
 *  through c10d::Reducer, averaged (each rank's gradient / world_size,
 *  summed). The constructor broadcasts rank 0's parameters, frozen ones
 *  (requires_grad false) included, and buffers, so every rank starts equal. The module must outlive this object, and
 *  its parameters must not be replaced afterwards. */
class DataParallel {
 public:
  /** Wraps module for group (a collective: every rank constructs its
   *  DataParallel at the same point). */
  DataParallel(std::shared_ptr<torch::nn::Module> module, ProcessGroup group, DataParallelOptions options = {});
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  /** Before a forward whose backward is synchronised: rebuilds buckets in
   *  backward order after the first step, broadcasts buffers. */
  void prepare_for_forward();
  /** After that forward, before backward(): arms the Reducer's gradient
   *  hooks for the next backward (nothing under no grad mode: an
   *  evaluation has no backward). outputs: with find_unused_parameters,
   *  what the backward starts from. A backward without this call is not
   *  synchronised: its gradients accumulate locally (DDP's no_sync), and
   *  the next synchronised backward reduces their sum. */
  void prepare_for_backward(const std::vector<at::Tensor>& outputs = {});
  /** prepare_for_forward(); r = fn(); prepare_for_backward(tensors of r).
   *  fn returns an at::Tensor (the loss) or a std::vector<at::Tensor>. */
  template <class F>
  auto forward(F&& fn) -> std::invoke_result_t<F&> {
    prepare_for_forward();
    auto r = fn();
    if constexpr (std::is_same_v<std::decay_t<decltype(r)>, at::Tensor>) {
      prepare_for_backward({r});
    } else {
      prepare_for_backward(r);
    }
    return r;
  }

  /** Timings of the last synchronised backward. */
  CommStats last_stats() const;
  /** The group it reduces over. */
  const ProcessGroup& group() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace remat::parallel
