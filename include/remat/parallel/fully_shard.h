// remat::parallel::FullyShard: sharded data parallel on c10d (FSDP /
// ZeRO-3 style). Each unit's parameters (a checkpointable module's own,
// flattened into one buffer) are split evenly across the ranks; only this
// rank's shard lives between uses. A unit's forward all-gathers them and
// frees them after; its backward gathers them once more, for the
// recompute of a checkpoint and the backward together, and reduce-scatters
// the gradients into the shard (averaged, as DataParallel). The optimizer
// steps on the shards, so its state is sharded too.
//
//   auto pg = remat::parallel::init_process_group(InitOptions(rank, world));
//   remat::parallel::FullyShard fsdp(model.ptr(), pg);    // rank 0's values
//   torch::optim::AdamW opt(fsdp.parameters(), ...);      // the shards
//   for (...) {
//     opt.zero_grad();
//     auto loss = fsdp.forward([&] { return criterion(model->forward(x), y); });
//     loss.backward();          // gathers, recomputes, reduce-scatters
//     fsdp.clip_grad_norm(1.0); // optional: the norm over every shard
//     opt.step();
//   }
//
// NOTE [FullyShard and recompute]: a unit is gathered at most once per
// backward. The hook on its outputs' gradient gathers it before its
// backward starts; a checkpointed unit's recompute runs its forward while
// it is gathered for backward, which then neither gathers nor frees it; it
// is freed once autograd has accumulated the gradient of every parameter
// it owns (the engine runs a parameter's accumulation after every node that
// uses the parameter, so nothing reads it afterwards) and, when it owns
// frozen parameters (no accumulation tells when their last reader ran),
// once the gradients of its inputs are complete as well.
//
// NOTE [frozen parameters]: a unit keeps the parameters that require grad
// and the frozen ones in two flat buffers, so that the optimizer's shard
// holds no frozen element (AdamW's weight decay would move it). A gathered
// buffer is valid for the shard version it was gathered from: a forward
// after the optimizer stepped (or load_sharded wrote) gathers again.
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/arg.h>

#include <remat/checkpointable.h>
#include <remat/parallel/data_parallel.h>

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace remat::parallel {

/** How FullyShard cuts the model into units and when it gathers them. */
struct FullyShardOptions {
  /** The units: checkpointable modules of the tree (as enable_checkpointing
   *  selects them). A unit owns the parameters under it that no unit inside
   *  it owns; the parameters of no unit form the root unit, gathered by
   *  forward() and freed after backward. Default every checkpointable
   *  module that owns a parameter. */
  TORCH_ARG(Selector, units) = select::all();
  /** Free a unit's gathered parameters after its forward (gather again for
   *  backward). false keeps every unit gathered from its forward to its
   *  backward: fewer gathers, more memory. Default true. */
  TORCH_ARG(bool, reshard_after_forward) = true;
  /** Units (of those `units` chose) that stay gathered from their forward
   *  to their backward even with reshard_after_forward on: the last ones,
   *  whose backward comes first, gain most. nullopt (default): none. */
  TORCH_ARG(std::optional<Selector>, keep_gathered) = std::nullopt;
  /** Gathers started ahead of use (the next unit in forward order, the
   *  previous one in backward) while the current unit runs, bytes: a
   *  unit is prefetched only while the gathered bytes that are not in use
   *  stay within this. 0 turns prefetch off. Default 64 MiB. */
  TORCH_ARG(int64_t, prefetch_bytes) = int64_t{64} << 20;
};

/** Collectives since construction or reset_stats(). Times in ms (steady
 *  clock), bytes of the full (gathered) buffers. */
struct ShardStats {
  int64_t forward_allgathers = 0;    ///< all-gathers for a forward
  int64_t backward_allgathers = 0;   ///< all-gathers for a backward (recompute included)
  int64_t reduce_scatters = 0;       ///< gradient reductions into the shards
  int64_t allgather_bytes = 0;       ///< bytes gathered (full buffers)
  int64_t reduce_scatter_bytes = 0;  ///< gradient bytes reduced (full buffers)
  double allgather_ms = 0;           ///< sum of launch-to-completion times
  double reduce_scatter_ms = 0;      ///< sum of launch-to-completion times
  /** Time the training thread waited for a collective: communication the
   *  compute did not hide. */
  double exposed_ms = 0;
  /** Most full parameter bytes gathered (or being gathered) at once. */
  int64_t max_gathered_bytes = 0;
  /** True when the backend has no reduce-scatter (Gloo in some builds) and
   *  gradients go through an all-reduce, each rank keeping its slice. */
  bool reduce_scatter_by_allreduce = false;
};

/** What this rank holds, bytes. */
struct ShardMemory {
  int64_t shard_parameter_bytes = 0;  ///< this rank's shards (padding included)
  int64_t shard_gradient_bytes = 0;   ///< their gradients, where defined
  int64_t gathered_bytes = 0;         ///< full parameter buffers gathered right now
  int64_t full_parameter_bytes = 0;   ///< every unit's full buffer: one process's parameters (padded)
  int64_t largest_unit_bytes = 0;     ///< the largest unit's full buffer
};

/** One unit as FullyShard cut it. */
struct ShardUnit {
  std::string name;         ///< the module's name ("blocks.3"); "(root)" for the parameters of no unit
  int64_t parameters = 0;   ///< parameter tensors it owns
  int64_t numel = 0;        ///< their elements
  int64_t shard_numel = 0;  ///< elements per rank (numel padded up to a multiple of the world size, / world)
};

/** Shards `module`'s parameters over `group` (a collective: every rank
 *  constructs it at the same point, on the same model). Rank 0's
 *  parameters and buffers are broadcast first, so every rank starts equal.
 *  Afterwards the module's parameters keep their shapes and names but hold
 *  data only while gathered: read them through save_full(), not directly
 *  (an op on one that holds no data, a module.to(dtype) or an init, is
 *  undefined behaviour: LibTorch's kernels read its null storage), and
 *  write them through the shards of parameters(). Buffers (BatchNorm's
 *  running statistics) are broadcast from rank 0 here only: each rank then
 *  updates its own, as in PyTorch's FSDP.
 *  The module must outlive this object and its parameters must not be
 *  replaced; every forward whose parameters may be sharded runs inside
 *  forward(). Parameters must be dense, on the group's device, and share a
 *  dtype within a unit. Gradients are averaged over the ranks; every rank
 *  must run the same units in the same order (as c10d requires of
 *  collectives), and which units get a gradient must not depend on the
 *  rank (a unit no rank used gets none; a parameter a used unit did not
 *  use gets a zero gradient, which weight decay and momentum move). Under
 *  auto_checkpoint, units must be outermost checkpointable modules (a nested
 *  one is refused while it profiles). One thread drives the forward and
 *  backward, and every unit's outputs are on the group's device. */
class FullyShard {
 public:
  /** Shards module over group (see the class comment). Bad options or
   *  parameters throw remat::Error before anything changes; a failed
   *  collective throws it naming the rank and the collective. */
  FullyShard(std::shared_ptr<torch::nn::Module> module, ProcessGroup group, FullyShardOptions options = {});
  /** Removes the hooks; the module's parameters then hold no data (save
   *  first with save_full()). */
  ~FullyShard();
  FullyShard(const FullyShard&) = delete;
  FullyShard& operator=(const FullyShard&) = delete;

  /** The shards for the optimizer (its state is then sharded too): per
   *  unit, one flat tensor of the parameters that require grad, and one of
   *  the frozen ones (requires_grad false, no gradient: optimizers skip it),
   *  each where the unit has such parameters. */
  std::vector<at::Tensor> parameters() const;
  /** Gathers the root unit's parameters and runs fn (the forward and loss);
   *  returns what fn returns. A forward without gradient (an evaluation
   *  under torch::NoGradGuard) frees the root again when no backward is
   *  pending. A read of a unit's parameters outside the unit's own forward
   *  (a module of the unit called by other code) throws remat::Error naming
   *  the units sharded then. */
  template <class F>
  auto forward(F&& fn) -> std::invoke_result_t<F&> {
    begin_forward();
    struct End {  // after fn, returned or thrown
      FullyShard* f;
      int unwinding = std::uncaught_exceptions();
      ~End() { f->end_forward(std::uncaught_exceptions() > unwinding); }
    } end{this};
    try {
      if constexpr (std::is_void_v<std::invoke_result_t<F&>>) {
        fn();
        check_forward_writes();
      } else {
        auto out = fn();
        check_forward_writes();
        return out;
      }
    } catch (const c10::Error& e) {
      explain_failed_forward(e);  // throws remat::Error when it was a read of sharded parameters
      throw;
    }
  }
  /** What forward() does before fn: gathers the root unit (again, when the
   *  optimizer changed its shard since). Throws remat::Error for a write
   *  into a unit's gathered parameters found as the unit was freed since the
   *  last check (see check_forward_writes). */
  void begin_forward();
  /** What forward() does after fn returns: throws remat::Error if a
   *  parameter of a gathered unit was written in place (a module that
   *  changes its own weights in forward, as Embedding's max_norm does): the
   *  write would stay in the gathered copy, which is freed, and never reach
   *  the shard the optimizer holds. */
  void check_forward_writes();
  /** What forward() does after fn: frees the root after a forward without
   *  gradient, unless a backward still needs it; after fn threw (`failed`),
   *  frees what this forward gathered or prefetched, so that the next step
   *  runs as usual. Never throws. */
  void end_forward(bool failed = false) noexcept;
  /** Scales the shards' gradients so that their global 2-norm (over every
   *  rank) is at most max_norm, as torch::nn::utils::clip_grad_norm_;
   *  returns the norm before clipping. A collective. max_norm must be
   *  positive and finite (remat::Error otherwise, before any collective). */
  double clip_grad_norm(double max_norm);
  /** Writes the full model (torch::save of the module, loadable into an
   *  unsharded one with torch::load) to path on rank 0, through a
   *  temporary file renamed into place. A collective: every unit is
   *  gathered once, then freed. */
  void save_full(const std::string& path);
  /** Each rank writes its shards and the module's buffers to prefix +
   *  ".rank<r>-of-<world>" (temporary file, renamed); a collective that ends
   *  with a barrier, so every rank's file exists when it returns. */
  void save_sharded(const std::string& prefix) const;
  /** Loads what save_sharded(prefix) wrote with the same world size and
   *  units. A collective, all or nothing: when any rank's file is missing,
   *  unreadable or does not match, every rank throws remat::Error (that rank
   *  naming the file or the mismatch) and no rank changes anything. */
  void load_sharded(const std::string& prefix);

  /** Collectives since construction or reset_stats(). */
  ShardStats stats() const;
  /** Zeroes stats() (e.g. at a step's start, for per-step figures). */
  void reset_stats();
  /** This rank's parameter memory now. */
  ShardMemory memory() const;
  /** The units, root first. */
  std::vector<ShardUnit> units() const;
  /** The group it shards over. */
  const ProcessGroup& group() const;

  struct Impl;  ///< internal (the units' state, shared with their hooks)

 private:
  /** forward()'s translation of c10's "data is not allocated yet" into a
   *  remat::Error naming the units sharded then; returns for other errors. */
  void explain_failed_forward(const c10::Error& e) const;
  std::shared_ptr<Impl> impl_;
};

}  // namespace remat::parallel
