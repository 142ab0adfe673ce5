// Internal: capture a graph's gradients without reaching its leaves.
// NOTE [redirected gradient edges]: a backward that must compute parameter
// gradients but deliver them itself (the profiler, which must not touch the
// real parameters; CheckpointedSequential, which returns them as its own
// node's outputs so that hooks and DDP see one gradient per backward) cannot
// use autograd::grad with the parameters as inputs: the engine runs a leaf's
// tensor pre-hooks when it captures there, and again when the gradient is
// delivered. Instead, every edge of the graph into a target's gradient edge
// (or into any other leaf's AccumulateGrad) is redirected to an input of a
// GradSink, and Engine::execute captures at the sink's inputs, where no hook
// sits. Only nodes created after `seq0` on this thread are rewired: graphs
// that existed before (an attached input's history) are left alone. When the
// sink runs as an ordinary node (a higher-order backward through the graph,
// or another backward through a kept one), it passes each gradient on to
// where its edge led before, so the graph stays correct for every use.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>

#include "../core/node_ptr.h"

namespace remat::detail {

/** Receives one redirected gradient: captured there by Engine::execute, or
 *  passed through to the original edge when run. One sink per target, so
 *  that each gradient is ready (and can be delivered) as soon as it is
 *  complete, not when the last of the stage's is. */
struct GradSink : torch::autograd::Node {
  torch::autograd::variable_list apply(torch::autograd::variable_list&& in) override;
  std::string name() const override { return "remat::GradSink"; }
};

/** NOTE [early delivery]: a tensor pre-hook on a sink. While `target` is
 *  set, the gradient captured at the sink goes straight to the target leaf
 *  (its hooks, then .grad, through accumulate_into) and the capture gets an
 *  undefined tensor instead: a stage's parameter gradients then land in
 *  .grad one by one during the stage's inner backward, as in a plain run,
 *  instead of all being held until it ends. */
struct DeliverHook : torch::autograd::FunctionPreHook {
  at::Tensor target;
  /** The profiler's stand-in for delivery: the gradient is dropped as soon
   *  as it is complete, as an early-delivered one is once added to .grad. */
  bool discard = false;
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override;
};

struct Redirected {
  std::vector<NodePtr<GradSink>> sinks;  // one per distinct redirected edge
  std::vector<DeliverHook*> hooks;       // owned by their sinks
  /** Per target: the sink input its gradient arrives at, or -1 when the
   *  graph does not reach it. */
  std::vector<int64_t> target_input;
  /** Leaves the graph reaches that are not targets (tensors used inside a
   *  stage but not registered as its parameters), with their sink input. */
  std::vector<std::pair<at::Tensor, uint32_t>> other_leaves;

  /** The edge at which a gradient is captured (its sink's only input). */
  torch::autograd::Edge edge(uint32_t input) const { return {sinks.at(input), 0}; }
  uint32_t num_inputs() const { return static_cast<uint32_t>(sinks.size()); }
};

/** Redirects the graph of `outs` (see the NOTE). targets: tensors whose
 *  gradients are wanted (parameters, a stage's inputs); duplicates share an
 *  input; undefined ones are skipped (target_input -1). */
Redirected redirect_gradient_edges(const std::vector<at::Tensor>& outs, const std::vector<at::Tensor>& targets,
                                   uint64_t seq0);
inline Redirected redirect_gradient_edges(const at::Tensor& out, const std::vector<at::Tensor>& targets,
                                          uint64_t seq0) {
  return redirect_gradient_edges(std::vector<at::Tensor>{out}, targets, seq0);
}

/** Delivers g to leaf as a backward would (its hooks, then .grad). */
void accumulate_into(const at::Tensor& leaf, const at::Tensor& g);

/** A stage's inner backward from `outs` with gradients `gs` (aligned),
 *  capturing at `outputs`, that holds neither: Engine::execute copies its
 *  `inputs` and the caller's vector outlives the call, so a gradient passed
 *  there stays alive through the whole backward. Here they go in through a
 *  seed node that lets go of them once handed on, and the caller's outputs
 *  are released (only the graph keeps what it saved), as in one plain
 *  backward. */
torch::autograd::variable_list backward_releasing(std::vector<at::Tensor> outs, std::vector<at::Tensor> gs,
                                                  bool keep_graph, const torch::autograd::edge_list& outputs);

}  // namespace remat::detail
