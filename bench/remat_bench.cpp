// remat_bench: memory and step time of checkpoint strategies, measured side
// by side in one process (runs interleaved, medians), one intra-op thread.
//  A. n = 64 layer MLP: plain vs per-layer checkpoint vs sqrt(n) segments.
//  B. uneven MLP and GPT block stack: the optimal plan (CheckpointedSequential)
//     against checkpoint_sequential with the best k that fits the same budget,
//     at budgets of 0.5, 0.35, 0.25, 0.15 of the plain run's peak.
// Leaves out: comparison with Python PyTorch (bench/compare/remat_compare.cpp
// and bench/py/run_all.py, `make bench`).
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include <remat/models/gpt.h>
#include <remat/plan/plan.h>
#include <remat/remat.h>
#include <remat/sequential.h>

#include "bench.h"

namespace {

using Step = std::function<torch::Tensor(const torch::Tensor&)>;

struct Measure {
  double median_ms = 0;
  int64_t peak_bytes = 0;  // above the pre-step baseline, plus the input
};

/** One training step's peak (parameter gradients already allocated). */
int64_t step_peak(torch::nn::Module& m, const Step& fwd, const torch::Tensor& x) {
  for (auto& p : m.parameters()) {
    if (p.grad().defined()) p.mutable_grad().zero_();
  }
  remat::memory::Probe probe;
  auto loss = fwd(x).sum();
  loss.backward();
  return probe.peak_bytes() + static_cast<int64_t>(x.nbytes());
}

double step_ms(torch::nn::Module& m, const Step& fwd, const torch::Tensor& x) {
  for (auto& p : m.parameters()) {
    if (p.grad().defined()) p.mutable_grad().zero_();
  }
  auto t0 = bench::Clock::now();
  auto loss = fwd(x).sum();
  loss.backward();
  return bench::ms_since(t0);
}

/** Interleaved timing (A B C A B C ...) after warm-up; peaks from one step. */
std::vector<Measure> compare(torch::nn::Module& m, const std::vector<Step>& fs, const torch::Tensor& x, int steps) {
  std::vector<std::vector<double>> t(fs.size());
  std::vector<Measure> out(fs.size());
  for (size_t i = 0; i < fs.size(); ++i) {
    step_ms(m, fs[i], x);  // warm-up (allocates gradients, plans)
    out[i].peak_bytes = step_peak(m, fs[i], x);
  }
  for (int s = 0; s < steps; ++s) {
    for (size_t i = 0; i < fs.size(); ++i) t[i].push_back(step_ms(m, fs[i], x));
  }
  for (size_t i = 0; i < fs.size(); ++i) out[i].median_ms = bench::median(t[i]);
  return out;
}

std::string mib(int64_t b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f MiB", b / 1048576.0);
  return buf;
}

void part_a(int steps) {
  const int64_t n = 64, width = 128, batch = 128;
  torch::manual_seed(0);
  torch::nn::Sequential seq;
  for (int64_t i = 0; i < n; ++i) {
    seq->push_back(torch::nn::Linear(width, width));
    seq->push_back(torch::nn::GELU());
  }
  auto x = torch::randn({batch, width});
  const int64_t k = static_cast<int64_t>(std::llround(std::sqrt(static_cast<double>(n))));
  std::vector<std::string> names = {"plain", "per-layer checkpoint", "sqrt(n) = " + std::to_string(k) + " segments"};
  std::vector<Step> fs = {
      [&](const torch::Tensor& in) { return seq->forward(in); },
      [&](const torch::Tensor& in) {
        torch::Tensor h = in;
        for (int64_t i = 0; i < n; ++i) {
          auto lin = *(seq->begin() + 2 * i), act = *(seq->begin() + 2 * i + 1);
          h = remat::checkpoint(
              [lin, act](const torch::Tensor& t) mutable {
                return act.forward<torch::Tensor>(lin.forward<torch::Tensor>(t));
              },
              h);
        }
        return h;
      },
      // 2 modules per layer: k segments of n/k layers each.
      [&](const torch::Tensor& in) { return remat::checkpoint_sequential(seq, k, in); },
  };
  auto r = compare(*seq, fs, x, steps);
  std::printf("\nA. MLP, n = %lld layers (Linear %lldx%lld + GELU), batch %lld, %d steps, 1 thread\n", (long long)n,
              (long long)width, (long long)width, (long long)batch, steps);
  std::printf("%-26s %14s %12s %12s %10s\n", "strategy", "peak act.", "vs plain", "step ms", "time x");
  for (size_t i = 0; i < fs.size(); ++i) {
    std::printf("%-26s %14s %11.3fx %12.2f %9.3fx\n", names[i].c_str(), mib(r[i].peak_bytes).c_str(),
                double(r[i].peak_bytes) / r[0].peak_bytes, r[i].median_ms, r[i].median_ms / r[0].median_ms);
  }
}

void part_b(const char* name, torch::nn::Sequential seq, const torch::Tensor& x, int steps) {
  Step plain = [&](const torch::Tensor& in) { return seq->forward(in); };
  step_ms(*seq, plain, x);
  const int64_t plain_peak = step_peak(*seq, plain, x);
  const double plain_ms = compare(*seq, {plain}, x, steps)[0].median_ms;
  // Each candidate is timed interleaved with plain; its ratio is to that plain.
  auto against_plain = [&](const Step& f, int n_steps) {
    auto r = compare(*seq, {plain, f}, x, n_steps);
    return std::make_pair(r[1], r[1].median_ms / r[0].median_ms);
  };
  const int n = static_cast<int>(seq->size());
  // checkpoint_sequential for every k: peak, then time the ones that fit.
  std::map<int, int64_t> k_peak;
  std::map<int, double> k_ratio;
  for (int k = 1; k <= n; ++k) {
    Step f = [&, k](const torch::Tensor& in) { return remat::checkpoint_sequential(seq, k, in); };
    step_ms(*seq, f, x);
    k_peak[k] = step_peak(*seq, f, x);
  }
  const remat::plan::Chain chain = remat::profile(seq, x);
  const int64_t min_peak = remat::plan::min_feasible_peak_bytes(chain);
  std::printf(
      "\nB. %s: %d stages, plain peak %s, plain step %.2f ms, %d steps, 1 thread\n"
      "   smallest peak any schedule can reach (planner model): %s = %.2f of plain\n",
      name, n, mib(plain_peak).c_str(), plain_ms, steps, mib(min_peak).c_str(), double(min_peak) / plain_peak);
  // Last column: the planner model's time of the plan over all schedules
  // (what kAuto picks at these sizes) against rotor's persistent class.
  std::printf("%-7s %12s | %-30s | %-34s | %s\n", "budget", "bytes", "optimal plan: peak, time x",
              "checkpoint_sequential best k", "model all/persistent");
  for (double f : {0.5, 0.35, 0.25, 0.15}) {
    const int64_t budget = static_cast<int64_t>(f * plain_peak);
    std::string opt_cell, seq_cell;
    try {
      remat::CheckpointedSequential net(seq,
                                        remat::SequentialOptions().memory_budget_bytes(budget).measure_memory(false));
      Step g = [&](const torch::Tensor& in) { return net->forward(in); };
      auto [m, ratio] = against_plain(g, steps);
      char buf[96];
      std::snprintf(buf, sizeof buf, "%s, %.3fx", mib(m.peak_bytes).c_str(), ratio);
      opt_cell = buf;
    } catch (const remat::Error& e) {
      opt_cell = "infeasible";
    }
    int best_k = -1;
    double best_ratio = 0;
    for (auto [k, peak] : k_peak) {
      if (peak > budget) continue;
      if (!k_ratio.count(k)) {  // timed once per k, reused across budgets
        Step g = [&, k = k](const torch::Tensor& in) { return remat::checkpoint_sequential(seq, k, in); };
        k_ratio[k] = against_plain(g, std::max(5, steps / 3)).second;
      }
      if (best_k < 0 || k_ratio[k] < best_ratio) {
        best_k = k;
        best_ratio = k_ratio[k];
      }
    }
    Measure best;
    if (best_k > 0) {
      Step g = [&, k = best_k](const torch::Tensor& in) { return remat::checkpoint_sequential(seq, k, in); };
      std::tie(best, best_ratio) = against_plain(g, steps);
    }
    if (best_k < 0) {
      int64_t lowest = INT64_MAX;
      for (auto [k, p] : k_peak) lowest = std::min(lowest, p);
      seq_cell = "none fits (lowest peak " + mib(lowest) + ")";
    } else {
      char buf[96];
      std::snprintf(buf, sizeof buf, "k=%d: %s, %.3fx", best_k, mib(best.peak_bytes).c_str(), best_ratio);
      seq_cell = buf;
    }
    std::string scope_cell = "-";
    try {
      namespace rp = remat::plan;
      const double all = rp::optimal(chain, budget, 500, rp::OptimalScope::kAll).prediction.time_ms;
      const double persistent = rp::optimal(chain, budget, 500, rp::OptimalScope::kPersistent).prediction.time_ms;
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.3f", all / persistent);
      scope_cell = buf;
    } catch (const remat::Error&) {
    }
    std::printf("%-7.2f %12s | %-30s | %-34s | %s\n", f, mib(budget).c_str(), opt_cell.c_str(), seq_cell.c_str(),
                scope_cell.c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  torch::set_num_threads(1);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // progress shows when piped
  remat::memory::enable_tracking();
  const int steps = argc > 1 ? std::atoi(argv[1]) : 20;
  std::printf(
      "remat_bench: medians of %d steps after warm-up; peak = activation bytes above the pre-step\n"
      "baseline plus the input (parameter gradients preallocated); time x = step time / plain.\n",
      steps);
  part_a(steps);
  {
    torch::manual_seed(1);
    torch::nn::Sequential mlp;
    const int64_t w[] = {256, 1024, 256, 1536, 256, 512,  1024, 256, 768,  256, 1536, 256, 512,
                         256, 1024, 256, 768,  256, 1024, 512,  256, 1536, 256, 768,  256};
    for (int i = 0; i + 1 < 25; ++i) {
      mlp->push_back(torch::nn::Linear(w[i], w[i + 1]));
      mlp->push_back(torch::nn::GELU());
    }
    part_b("uneven MLP (24 Linear+GELU, widths 256..1536, batch 128)", mlp, torch::randn({128, 256}), steps);
  }
  {
    torch::manual_seed(2);
    torch::nn::Sequential gpt;
    for (int i = 0; i < 16; ++i) gpt->push_back(remat::models::GptBlock(128, 4, 0.0));
    part_b("GPT stack (16 blocks, d_model 128, 4 heads, T 128, batch 4)", gpt, torch::randn({4, 128, 128}), steps);
  }
  return 0;
}
