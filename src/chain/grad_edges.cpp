// Redirected gradient edges (see grad_edges.h).
#include "grad_edges.h"

#include <map>
#include <unordered_set>
#include <utility>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include <remat/optim.h>

namespace remat::detail {

torch::autograd::variable_list GradSink::apply(torch::autograd::variable_list&& in) {
  // Run as an ordinary node (not captured: a later backward through a kept
  // graph, or a higher-order one through it): pass each gradient on to the
  // edge it was redirected from.
  return std::move(in);
}

torch::autograd::variable_list DeliverHook::operator()(const torch::autograd::variable_list& grads) {
  if (discard) return {at::Tensor()};
  if (!target.defined()) return grads;
  accumulate_into(target, grads.at(0));
  return {at::Tensor()};
}

Redirected redirect_gradient_edges(const std::vector<at::Tensor>& outs, const std::vector<at::Tensor>& targets,
                                   uint64_t seq0) {
  Redirected r;
  r.target_input.assign(targets.size(), -1);
  // Gradient edge (node, input_nr) of each target -> target indices.
  std::map<std::pair<const torch::autograd::Node*, uint32_t>, std::vector<size_t>> wanted;
  for (size_t k = 0; k < targets.size(); ++k) {
    if (!targets[k].defined() || !targets[k].requires_grad()) continue;
    const auto e = torch::autograd::impl::gradient_edge(targets[k]);
    wanted[{e.function.get(), e.input_nr}].push_back(k);
  }
  std::map<std::pair<const torch::autograd::Node*, uint32_t>, uint32_t> input_of;  // edge -> sink input
  std::vector<torch::autograd::Node*> stack;
  std::unordered_set<torch::autograd::Node*> visited;
  for (const auto& out : outs) {
    if (out.defined() && out.grad_fn() && visited.insert(out.grad_fn().get()).second)
      stack.push_back(out.grad_fn().get());
  }
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    for (size_t k = 0; k < node->num_outputs(); ++k) {
      const torch::autograd::Edge& e = node->next_edge(k);
      if (!e.is_valid()) continue;
      torch::autograd::Node* next = e.function.get();
      const std::pair<const torch::autograd::Node*, uint32_t> key{next, e.input_nr};
      auto hit = wanted.find(key);
      auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(next);
      if (hit != wanted.end() || acc != nullptr) {
        auto it = input_of.find(key);
        uint32_t nr;
        if (it != input_of.end()) {
          nr = it->second;
        } else {
          // The sink's input takes the metadata the target's node expects.
          auto sink = make_node<GradSink>();
          const auto& meta = next->input_metadata(e.input_nr);
          if (meta.was_default_constructed()) {
            sink->add_input_metadata(torch::autograd::Node::undefined_input());
          } else {
            sink->add_input_metadata(meta.options(), meta.shape_as_dim_vector(), meta.is_tensor_subclass(),
                                     meta.is_nested_tensor(), meta.grad_dtype());
          }
          sink->add_next_edge(e);  // its output leads where its input was headed
          auto hook = std::make_unique<DeliverHook>();
          r.hooks.push_back(hook.get());
          sink->add_tensor_pre_hook(std::move(hook));
          nr = static_cast<uint32_t>(r.sinks.size());
          r.sinks.push_back(std::move(sink));
          input_of.emplace(key, nr);
          if (hit != wanted.end()) {
            for (size_t t : hit->second) r.target_input[t] = nr;
          } else {
            r.other_leaves.emplace_back(acc->variable, nr);
          }
        }
        node->next_edges()[k] = r.edge(nr);  // not set_next_edge: the node has a parent, and
                                             // the sink, like the AccumulateGrad, has topological_nr 0
        continue;
      }
      if (next->sequence_nr() >= seq0 && next->sequence_nr() != UINT64_MAX && visited.insert(next).second) {
        stack.push_back(next);
      }
    }
  }
  return r;
}

void accumulate_into(const at::Tensor& leaf, const at::Tensor& g) {
  if (!g.defined()) return;
  // Its hooks run in the nested task below. Called from a chain's node, the
  // end of updates goes on the outer backward; from a DeliverHook (inside a
  // stage's own backward) it lands on that nested task and does nothing,
  // and the chain queued the outer one when it armed the hook.
  queue_end_of_updates(leaf);
  torch::autograd::Engine::get_default_engine().execute({torch::autograd::impl::gradient_edge(leaf)}, {g},
                                                        /*keep_graph=*/false, /*create_graph=*/g.requires_grad(),
                                                        /*accumulate_grad=*/true);
}

namespace {

struct SeedGrad final : torch::autograd::Node {
  std::vector<at::Tensor> grads;
  SeedGrad(std::vector<at::Tensor> gs, torch::autograd::edge_list next, const at::Tensor& dummy)
      : grads(std::move(gs)) {
    set_next_edges(std::move(next));
    add_input_metadata(dummy);
  }
  torch::autograd::variable_list apply(torch::autograd::variable_list&&) override {
    torch::autograd::variable_list out = std::move(grads);
    grads.clear();
    return out;
  }
  std::string name() const override { return "remat::SeedGrad"; }
};

}  // namespace

torch::autograd::variable_list backward_releasing(std::vector<at::Tensor> outs, std::vector<at::Tensor> gs,
                                                  bool keep_graph, const torch::autograd::edge_list& outputs) {
  torch::autograd::edge_list out_edges;
  for (auto& out : outs) {
    out_edges.push_back(torch::autograd::impl::gradient_edge(out));
    out = at::Tensor();
  }
  const at::Tensor dummy = at::zeros({}, gs.at(0).options());  // the seed's own (ignored) input
  auto seed = make_node<SeedGrad>(std::move(gs), std::move(out_edges), dummy);
  return torch::autograd::Engine::get_default_engine().execute({torch::autograd::Edge(seed, 0)}, {dummy}, keep_graph,
                                                               /*create_graph=*/false, /*accumulate_grad=*/false,
                                                               outputs);
}

}  // namespace remat::detail
