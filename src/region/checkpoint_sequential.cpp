// remat::checkpoint_sequential: torch.utils.checkpoint.checkpoint_sequential's
// segments (all but the last checkpointed) over a torch::nn::Sequential, a
// ModuleList, a vector of module holders or of callables.
#include <remat/checkpoint.h>

#include <torch/nn/modules/container/sequential.h>

namespace remat {

namespace detail {

at::Tensor checkpoint_stages(std::vector<SequentialStage> stages, int64_t segments, const at::Tensor& x,
                             const CheckpointOptions& options, const char* what) {
  const auto n = static_cast<int64_t>(stages.size());
  if (segments < 1 || segments > n) {
    throw Error("[remat::checkpoint_sequential] segments must be in [1, " + std::to_string(n) + "] (the number of " +
                what + "), got " + std::to_string(segments) + ". Pass a value in that range; 1 runs the whole " +
                (std::string(what) == "modules" ? "Sequential" : "list") + " without checkpoints.");
  }
  auto shared = std::make_shared<std::vector<SequentialStage>>(std::move(stages));  // the recompute keeps them
  auto run = [shared](int64_t first, int64_t last, at::Tensor h) {
    for (int64_t i = first; i <= last; ++i) h = (*shared)[i].fn(h);
    return h;
  };
  const int64_t size = n / segments;
  at::Tensor h = x;
  int64_t end = -1;
  for (int64_t start = 0; start < size * (segments - 1); start += size) {
    end = start + size - 1;
    ModuleState state;
    for (int64_t i = start; i <= end; ++i) {
      const auto& s = (*shared)[i].state;
      state.parameters.insert(state.parameters.end(), s.parameters.begin(), s.parameters.end());
      state.buffers.insert(state.buffers.end(), s.buffers.begin(), s.buffers.end());
      state.modules.insert(state.modules.end(), s.modules.begin(), s.modules.end());
    }
    h = checkpoint_impl(
        options, std::move(state), [run, start, end](const at::Tensor& in) { return run(start, end, in); }, h);
  }
  return run(end + 1, n - 1, h);
}

}  // namespace detail

at::Tensor checkpoint_sequential(const torch::nn::Sequential& seq, int64_t segments, const at::Tensor& x,
                                 const CheckpointOptions& options) {
  torch::nn::Sequential net = seq;  // shared: the recompute keeps the modules
  std::vector<detail::SequentialStage> stages;
  for (size_t i = 0; i < net->size(); ++i) {
    stages.push_back({[net, i](const at::Tensor& h) mutable { return (net->begin() + i)->forward<at::Tensor>(h); },
                      {net->ptr(i)->parameters(), net->ptr(i)->buffers(), detail::module_tree(*net->ptr(i))}});
  }
  return detail::checkpoint_stages(std::move(stages), segments, x, options, "modules");
}

at::Tensor checkpoint_sequential(const std::vector<std::function<at::Tensor(const at::Tensor&)>>& fns, int64_t segments,
                                 const at::Tensor& x, const CheckpointOptions& options) {
  std::vector<detail::SequentialStage> stages;
  for (const auto& f : fns) stages.push_back({f, {}});
  return detail::checkpoint_stages(std::move(stages), segments, x, options, "functions");
}

}  // namespace remat
