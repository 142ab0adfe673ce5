// The soak workload, shared by tests/test_soak.cpp (short, asserts) and
// bench/soak.cpp (2,000 steps, prints slopes): a GPT block stack trained
// with Adam under one strategy, one step at a time, and the measures
// sampled after each step (tracked bytes, resident set, least-squares slope).
#pragma once

#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <optional>
#include <vector>

#include <torch/torch.h>

#include <remat/checkpoint.h>
#include <remat/plan/solve.h>
#include <remat/profile.h>
#include <remat/sequential.h>

namespace remat_soak {

/** Resident set of this process, bytes. */
inline int64_t rss_bytes() {
  std::ifstream f("/proc/self/statm");
  int64_t size = 0, resident = 0;
  f >> size >> resident;
  return resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

/** Least-squares slope of ys over x = 0, 1, ... (per sample). */
inline double slope(const std::vector<int64_t>& ys) {
  const double n = static_cast<double>(ys.size());
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (size_t i = 0; i < ys.size(); ++i) {
    const double x = static_cast<double>(i), y = static_cast<double>(ys[i]);
    sx += x, sy += y, sxx += x * x, sxy += x * y;
  }
  return (n * sxy - sx * sy) / (n * sxx - sx * sx);
}

enum class Strategy { kPlain, kPerBlock, kCheckpointSequential, kBudget };

inline const char* name(Strategy s) {
  switch (s) {
    case Strategy::kPlain: return "plain";
    case Strategy::kPerBlock: return "checkpoint per block";
    case Strategy::kCheckpointSequential: return "checkpoint_sequential(2)";
    case Strategy::kBudget: return "CheckpointedSequential(budget)";
  }
  return "?";
}

/** seq trained on random batches of `shape` (data from its own generator);
 *  kBudget plans for a budget a quarter of the way from the smallest
 *  feasible peak to store-all. */
class Workload {
 public:
  Workload(torch::nn::Sequential seq, std::vector<int64_t> shape, Strategy s)
      : seq_(std::move(seq)),
        shape_(std::move(shape)),
        s_(s),
        gen_(torch::make_generator<torch::CPUGeneratorImpl>(1)),
        opt_(seq_->parameters(), torch::optim::AdamOptions(1e-3)) {
    if (s_ == Strategy::kBudget) {
      auto chain = remat::profile(seq_, torch::randn(shape_, gen_));
      const int64_t top = remat::plan::store_all(chain).prediction.peak_bytes;
      const int64_t low = remat::plan::min_feasible_peak_bytes(chain);
      // A budget of the activations (the profile's), parameter gradients left out.
      net_.emplace(
          seq_, remat::SequentialOptions().memory_budget_bytes(low + (top - low) / 4).count_parameter_gradients(false));
    }
  }

  /** One training step; its tensors are dropped when it returns. */
  void step() {
    auto x = torch::randn(shape_, gen_);
    opt_.zero_grad();
    torch::Tensor y;
    switch (s_) {
      case Strategy::kPlain: y = seq_->forward(x); break;
      case Strategy::kPerBlock:
        y = x;
        for (auto& m : *seq_) y = remat::checkpoint([m](torch::Tensor in) mutable { return m.forward(in); }, y);
        break;
      case Strategy::kCheckpointSequential: y = remat::checkpoint_sequential(seq_, 2, x); break;
      case Strategy::kBudget: y = (*net_)->forward(x); break;
    }
    y.square().mean().backward();
    opt_.step();
  }

  /** The planned net's forwards per stage in its last step (kBudget). */
  std::vector<int> forwards_per_stage() const {
    return net_ ? (*net_)->last_step().forwards_per_stage : std::vector<int>{};
  }

 private:
  torch::nn::Sequential seq_;
  std::vector<int64_t> shape_;
  Strategy s_;
  at::Generator gen_;
  torch::optim::Adam opt_;
  std::optional<remat::CheckpointedSequential> net_;
};

}  // namespace remat_soak
