// Compiled, never run: the umbrella header alone declares the whole public
// API of remat::remat (users may include only <remat/remat.h>).
#include <remat/remat.h>

namespace {
[[maybe_unused]] void uses_the_whole_api(torch::nn::Sequential seq, const at::Tensor& x) {
  auto y = remat::checkpoint([](const at::Tensor& t) { return t.exp(); }, x);
  y = remat::checkpoint_sequential(seq, 2, y);
  remat::CheckpointedSequential net(seq, remat::SequentialOptions().memory_budget_bytes(1 << 20));
  remat::plan::Chain chain = remat::profile(seq, x);
  remat::plan::Plan plan = remat::plan::optimal(chain, 1 << 20);
  remat::memory::Probe probe;
  remat::SavedTensorsHooks hooks([](const at::Tensor& t) { return t; }, [](const at::Tensor& t) { return t; });
  (void)net->explain();
  (void)plan.prediction.peak_bytes;
  (void)remat::format_bytes(probe.peak_bytes());
}
}  // namespace
