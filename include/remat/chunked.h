// Chunking along a dimension (the sequence): run a function over slices of
// its inputs, each slice checkpointed, so that only one slice's
// intermediates exist at a time in forward and in backward (the
// Mini-Sequence Transformer scheme); and a chunked LM head + cross-entropy
// that never holds the whole (tokens, vocabulary) logits or their gradient
// (the Liger / Cut Cross-Entropy scheme).
//
//   // MLP over 8 slices of the sequence (dim 1 of (B, T, C)):
//   auto y = remat::chunked([&](const std::vector<at::Tensor>& in) { return mlp->transform(in[0]); },
//                           {x}, remat::ChunkOptions(/*dim=*/1, /*chunks=*/8));
//   // Loss of logits = hidden @ weight^T without the logits:
//   auto loss = remat::chunked_cross_entropy(hidden, weight, targets, remat::ChunkedCrossEntropyOptions(8));
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <remat/checkpoint.h>
#include <remat/checkpointable.h>

namespace remat {

namespace detail {
/** Runs one chunked() or chunked_cross_entropy() call again on `inputs`
 *  (the call's tensors, in argument order) with `chunks` slices (-1: the
 *  call's own count; 0: chunked_cross_entropy's unchunked form), returning
 *  its output. Valid only while ChunkObserver::begin() runs. */
using ChunkRun = std::function<std::vector<at::Tensor>(int64_t chunks, const std::vector<at::Tensor>& inputs)>;

/** Sees every chunked() and chunked_cross_entropy() call on this thread
 *  while installed (the whole-step planner, auto.h), with grad on or off,
 *  except those made while a checkpoint recomputes or inside another
 *  chunked call: each call may then be a unit whose options are chunk
 *  counts. */
class ChunkObserver {
 public:
  virtual ~ChunkObserver() = default;
  /** Before a call: `kind` ("chunked" or "chunked_cross_entropy"), the
   *  most slices it can take (`limit`: the length sliced), its tensor
   *  inputs and a way to run it again. *chunks holds the call's own count
   *  and may be set to the count the call runs with (>= 1; 0 only where
   *  the call's own count is 0). Returns an observed call, finished with
   *  the output, or nullptr. */
  virtual std::unique_ptr<UnitObserver::Call> begin(const char* kind, int64_t limit,
                                                    const std::vector<at::Tensor>& inputs, const ChunkRun& run,
                                                    int64_t* chunks) = 0;
};
/** This thread's chunk observer, or nullptr (the common case). */
ChunkObserver* chunk_observer();
/** Installs `o` on this thread (nullptr removes it); returns the previous one. */
ChunkObserver* set_chunk_observer(ChunkObserver* o);
}  // namespace detail

/** How chunked() combines the outputs of its slices. */
enum class ChunkReduce {
  kConcat,  ///< concatenated along the chunked dimension (outputs keep it)
  kSum,     ///< summed (e.g. a loss summed over the sequence)
  /** Summed, each slice's output weighted by its length / the whole length:
   *  the mean of a per-position quantity that fn already averages over its
   *  slice (e.g. a mean loss), right also when the slices differ in length. */
  kMean,
};

/** Options of chunked(): the dimension and the number of slices
 *  (required), how outputs combine, and the checkpoint of each slice. */
struct ChunkOptions {
  /** dim: the dimension of every input that is sliced (negative counts from
   *  the end, as in PyTorch); chunks: how many slices, >= 1. */
  ChunkOptions(int64_t dim, int64_t chunks) : dim_(dim), chunks_(chunks) {}
  /** The dimension sliced (and, for kConcat, concatenated along). */
  TORCH_ARG(int64_t, dim);
  /** Slices; at most the length along dim (more are run as that many).
   *  Lengths that chunks does not divide give the first length % chunks
   *  slices one more position. */
  TORCH_ARG(int64_t, chunks);
  /** How the slices' outputs combine. Default kConcat. */
  TORCH_ARG(ChunkReduce, reduce) = ChunkReduce::kConcat;
  /** Checkpoint each slice (its intermediates are recomputed in backward,
   *  one slice at a time). false runs the slices plainly, which bounds only
   *  the forward's transient memory. Default true. */
  TORCH_ARG(bool, checkpoint) = true;
  /** The options of each slice's checkpoint (RNG replay, policy, ...). */
  TORCH_ARG(CheckpointOptions, checkpoint_options);
};

/** fn(inputs) computed slice by slice along options.dim(): every tensor in
 *  inputs is split along that dimension (all must have the same length
 *  there), fn runs on each slice in order (checkpointed unless
 *  options.checkpoint() is false) and the outputs are combined as
 *  options.reduce() says. fn must compute each position of the output from
 *  the same positions of the inputs (row-wise in dim, as an MLP, a head or
 *  a per-token loss are; attention across the sequence is not); tensors it
 *  captures (weights) get their gradients summed over the slices.
 *  Gradients equal the unchunked run's up to floating-point reassociation
 *  of the sums over the slices. Under the whole-step planner
 *  (AutoOptions::chunk_counts) each call outside a recompute is a unit
 *  whose options are chunk counts, and may run with another count than
 *  options.chunks(). Throws remat::Error for chunks < 1, no inputs, an
 *  undefined input, a dim an input does not have, or inputs of different
 *  lengths along dim. */
at::Tensor chunked(const std::function<at::Tensor(const std::vector<at::Tensor>&)>& fn,
                   const std::vector<at::Tensor>& inputs, const ChunkOptions& options);

/** How chunked_cross_entropy() reduces the per-token losses. */
enum class LossReduction {
  kMean,  ///< over the targets that are not ignore_index (LibTorch's default)
  kSum,   ///< summed over the targets that are not ignore_index
};

/** Options of chunked_cross_entropy(): the number of row slices (required)
 *  and LibTorch's cross_entropy options that it supports. */
struct ChunkedCrossEntropyOptions {
  /** chunks: how many slices of the rows (tokens), >= 0 (0: unchunked). */
  explicit ChunkedCrossEntropyOptions(int64_t chunks) : chunks_(chunks) {}
  /** Row slices; at most the number of rows. 0: unchunked, the plain form
   *  cross_entropy(linear(hidden, weight, bias)) through autograd, which
   *  holds the whole logits and their log-softmax from forward to backward
   *  (bitwise what LibTorch computes; the whole-step planner, auto.h, may
   *  then choose a count for it). 1: one slice with the gradients computed
   *  in forward (the logits exist only while it runs). */
  TORCH_ARG(int64_t, chunks);
  /** Targets equal to this add nothing to the loss or its gradient and are
   *  not counted by kMean. Default -100, as LibTorch. */
  TORCH_ARG(int64_t, ignore_index) = -100;
  /** In [0, 1]: the target distribution is (1 - s) one-hot + s / vocab, as
   *  LibTorch's label_smoothing. Default 0. */
  TORCH_ARG(double, label_smoothing) = 0.0;
  /** Default kMean. */
  TORCH_ARG(LossReduction, reduction) = LossReduction::kMean;
};

/** cross_entropy(linear(hidden, weight, bias) as (rows, vocab) in float32
 *  (float64 for float64 inputs), targets as (rows)) without ever holding the whole logits or their
 *  gradient: hidden (..., C) and targets (...) are flattened to rows, and
 *  each slice of rows computes its logits (rows / chunks, vocab), its loss
 *  and, when a gradient is needed, at once its gradients with respect to
 *  hidden, weight (vocab, C) and bias (vocab, optional), which backward
 *  then scales by the loss's gradient. Memory: gradients of hidden, weight
 *  and bias held from forward to backward, plus one slice's logits (about
 *  two copies of rows / chunks x vocab floats) while it runs. The matrix
 *  products run in the autocast dtype when autocast is on, as linear()
 *  would; the softmax in float32 (float64 for float64 inputs). The gradient is not differentiable again:
 *  a backward with create_graph throws remat::Error (no double backward).
 *  Equal to the unchunked loss up to floating-point
 *  reassociation. Under the whole-step planner (AutoOptions::chunk_counts)
 *  each call is a unit whose options are chunk counts, and it may run with
 *  another count than options.chunks(). Throws remat::Error for chunks < 0,
 *  label_smoothing outside [0, 1], shapes that do not match (naming them),
 *  or, when chunked (chunks >= 1), integer targets out of range (the
 *  unchunked form leaves that check to LibTorch's cross_entropy, whose
 *  c10::Error names the target). */
at::Tensor chunked_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                 const ChunkedCrossEntropyOptions& options, const at::Tensor& bias = {});

}  // namespace remat
