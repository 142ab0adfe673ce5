// remat::checkpoint_sequential: torch.utils.checkpoint.checkpoint_sequential's
// segments on a torch::nn::Sequential (all segments but the last checkpointed).
#include <remat/checkpoint.h>

#include <torch/nn/modules/container/sequential.h>

namespace remat {

at::Tensor checkpoint_sequential(const torch::nn::Sequential& seq, int64_t segments, const at::Tensor& x,
                                 const CheckpointOptions& options) {
  torch::nn::Sequential net = seq;  // shared: the recompute keeps the modules
  const auto n = static_cast<int64_t>(net->size());
  if (segments < 1 || segments > n) {
    throw Error("[remat::checkpoint_sequential] segments must be in [1, " + std::to_string(n) +
                "] (the number of modules), got " + std::to_string(segments) +
                ". Pass a value in that range; 1 runs the whole Sequential without checkpoints.");
  }
  auto run = [net](int64_t first, int64_t last, at::Tensor h) mutable {
    for (int64_t i = first; i <= last; ++i) h = (net->begin() + i)->forward<at::Tensor>(h);
    return h;
  };
  const int64_t size = n / segments;
  at::Tensor h = x;
  int64_t end = -1;
  for (int64_t start = 0; start < size * (segments - 1); start += size) {
    end = start + size - 1;
    detail::ModuleState state;
    for (int64_t i = start; i <= end; ++i) {
      auto p = net->ptr(i)->parameters();
      auto b = net->ptr(i)->buffers();
      state.parameters.insert(state.parameters.end(), p.begin(), p.end());
      state.buffers.insert(state.buffers.end(), b.begin(), b.end());
    }
    h = detail::checkpoint_impl(
        options, std::move(state), [run, start, end](const at::Tensor& in) mutable { return run(start, end, in); }, h);
  }
  return run(end + 1, n - 1, h);
}

}  // namespace remat
