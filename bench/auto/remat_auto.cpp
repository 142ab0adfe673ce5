// remat_auto: the whole-step planner's frontier (docs/BENCHMARKS.md, "Whole
// training step under a budget"). The reference GPT of DESIGN.md as a whole
// training step: token + position embedding, 8 blocks (explicit attention),
// final LayerNorm, LM head tied to the embedding over an 8192-token
// vocabulary, mean cross-entropy, backward, AdamW step (lr 1e-3), gradients
// zeroed in place (zero_grad(false)). One model and optimizer for every
// strategy (the values change neither memory nor time); data: random token
// ids, a new batch per step.
//
// Strategies:
//   plain         every block plain
//   block         every GptBlock checkpointed (enable_checkpointing)
//   half          every 2nd block checkpointed
//   megatron      every block with the Megatron selective policy (saves the
//                 qkv, attention output and MLP-up projections)
//   save_matmuls  every block with policy::save_matmuls()
//   auto@i        remat::auto_checkpoint (the Megatron and save_matmuls
//                 policies on its menu beside its own selective levels:
//                 AutoOptions().policies) at budget i of --budgets (default 6)
//                 evenly spaced from its leanest feasible plan to the plain
//                 step's peak (one profile, replan() per budget; no replan
//                 on overrun, so the recorded peak is the plan's own)
//   auto=S        auto at the peak hand-placed strategy S measured in a warm
//                 step before the rounds (the comparison at equal memory)
// auto_checkpoint profiles once (1 plain warm-up step, 1 profiled step);
// then the strategies run interleaved, one step each in turn, for --rounds
// rounds (3). Per step: wall time (zero_grad to the end of the AdamW step)
// and the peak of remat::memory's tracked CPU bytes during the step, all
// tensors counted (parameters, gradients, AdamW state, activations, the
// loss), which is what auto's budget bounds. Ratios are paired with plain's
// step of the same round (median, min, max over rounds).
// Writes JSON lines to bench/results/auto.json (--quick: a toy size,
// auto-quick.json; --out elsewhere): {"kind": "meta"} with the run-metadata
// record and the settings, {"kind": "profile"} (profile and solver figures),
// then one {"kind": "strategy"} per strategy. Prints a table.
// Leaves out: dropout, SDPA, mixed precision, offload (disk bandwidth here
// is not a user's), the Python anchors.

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <remat/auto.h>
#include <remat/checkpointable.h>
#include <remat/memory.h>
#include <remat/models/gpt.h>
#include <remat/plan/step.h>

#include "bench.h"

namespace {

using remat::models::Gpt;
using remat::models::GptBlockImpl;
using remat::models::GptConfig;

struct Size {
  int64_t d_model, heads, blocks, seq_len, batch, vocab;
};
constexpr Size kReference{512, 8, 8, 512, 4, 8192};  // DESIGN.md's CPU reference GPT
constexpr Size kQuick{64, 4, 4, 64, 4, 512};         // a toy size for smoke runs

struct Record {
  std::string name, label;
  int64_t budget = 0;          // auto only
  int64_t predicted_peak = 0;  // auto only
  double predicted_ms = 0;     // auto only (profiled plain step + the plan's added time)
  std::string plan;            // auto only: option per unit
  std::vector<double> ms;
  std::vector<int64_t> peaks;
  std::vector<double> time_ratios;
};

}  // namespace

int main(int argc, char** argv) {
  using namespace bench;
  const bool quick = flag(argc, argv, "--quick");
  const Size size = quick ? kQuick : kReference;
  const int rounds = static_cast<int>(int_arg(argc, argv, "--rounds", quick ? "2" : "3"));
  const int nbudgets = static_cast<int>(int_arg(argc, argv, "--budgets", "6"));
  const std::string out_path =
      arg(argc, argv, "--out", quick ? "bench/results/auto-quick.json" : "bench/results/auto.json");
  torch::set_num_threads(static_cast<int>(int_arg(argc, argv, "--threads", "1")));
  remat::memory::enable_tracking();
  torch::manual_seed(0);

  GptConfig c;
  c.vocab = size.vocab;
  c.seq_len = size.seq_len;
  c.d_model = size.d_model;
  c.heads = size.heads;
  c.layers = size.blocks;
  Gpt gpt(c);
  torch::optim::AdamW opt(gpt->parameters(), torch::optim::AdamWOptions(1e-3));
  auto data_gen = at::detail::createCPUGenerator(7);
  auto step = [&] {
    auto idx = torch::randint(size.vocab, {size.batch, size.seq_len + 1}, data_gen, torch::kLong);
    auto x = idx.slice(1, 0, size.seq_len), y = idx.slice(1, 1, size.seq_len + 1);
    opt.zero_grad(false);
    auto loss = gpt->loss(gpt->blocks->forward(gpt->embed(x)), y);
    loss.backward();
    opt.step();
  };

  // One profile; every auto budget is a replan() of it.
  const auto p0 = Clock::now();
  auto planner = remat::auto_checkpoint(
      gpt, remat::AutoOptions().memory_budget_fraction(1.0).replan_on_overrun(false).profile_repeats(2).policies(
               {remat::models::megatron_policy(), remat::policy::save_matmuls()}));
  planner.step(step);  // warm-up
  planner.step(step);  // profiled
  const double profile_s = secs_since(p0);
  const auto& model = planner.step_model();
  const remat::plan::StepPlan lean = remat::plan::min_peak_step(model);
  const int64_t low = lean.prediction.peak_bytes, high = planner.profiled_peak_bytes();
  std::fflush(stdout);
  std::printf("profile: %.1f s (2 steps), profiled peak %s, leanest plan %s (%.3f of it), %zu units\n", profile_s,
              remat::format_bytes(high).c_str(), remat::format_bytes(low).c_str(),
              static_cast<double>(low) / static_cast<double>(high), model.units.size());

  std::vector<Record> recs;
  for (const auto& [name, label] :
       std::vector<std::pair<std::string, std::string>>{{"plain", "plain"},
                                                        {"block", "every block checkpointed"},
                                                        {"half", "every 2nd block checkpointed"},
                                                        {"megatron", "selective: Megatron policy"},
                                                        {"save_matmuls", "selective: save_matmuls"}}) {
    Record r;
    r.name = name;
    r.label = label;
    recs.push_back(r);
  }
  const remat::Selector blocks = remat::select::type<GptBlockImpl>();
  auto configure = [&](Record& r) {
    remat::disable_checkpointing(gpt);
    if (r.name == "block") remat::enable_checkpointing(gpt, blocks);
    if (r.name == "half") remat::enable_checkpointing(gpt, remat::select::every_n(2, blocks));
    if (r.name == "megatron") {
      remat::enable_checkpointing(gpt, blocks, remat::CheckpointOptions().policy(remat::models::megatron_policy()));
    }
    if (r.name == "save_matmuls") {
      remat::enable_checkpointing(gpt, blocks, remat::CheckpointOptions().policy(remat::policy::save_matmuls()));
    }
    if (r.budget > 0) {
      planner.replan(r.budget);
      r.predicted_peak = planner.plan().prediction.peak_bytes;
      r.predicted_ms = planner.plan().prediction.time_ms;
      r.plan.clear();
      for (const auto& u : planner.units())
        r.plan += (r.plan.empty() ? "" : ", ") + u.name + ": " + u.options[u.choice];
    }
  };
  // Auto at budgets evenly spaced from its leanest plan to plain, and at
  // each hand-placed strategy's own peak (one warm step each measures it):
  // the comparison at equal memory.
  const size_t hand = recs.size();
  for (int i = 0; i < nbudgets; ++i) {
    Record r;
    r.name = "auto@" + std::to_string(i);
    r.budget = low + (nbudgets > 1 ? (high - low) * i / (nbudgets - 1) : 0);
    r.label = "auto at " + remat::format_bytes(r.budget);
    recs.push_back(r);
  }
  for (size_t h = 1; h < hand; ++h) {
    configure(recs[h]);
    remat::memory::reset_peak();
    step();
    const int64_t peak = remat::memory::peak_bytes();
    if (peak < low) continue;  // leaner than any plan of auto's menu
    Record r;
    r.name = "auto=" + recs[h].name;
    r.budget = peak;
    r.label = "auto at " + recs[h].name + "'s peak";
    recs.push_back(r);
  }
  for (int round = 0; round < rounds; ++round) {
    for (auto& r : recs) {
      configure(r);
      remat::memory::reset_peak();
      const auto t0 = Clock::now();
      step();
      r.ms.push_back(ms_since(t0));
      r.peaks.push_back(remat::memory::peak_bytes());
      std::printf("round %d %-14s %9.1f ms  peak %s\n", round, r.name.c_str(), r.ms.back(),
                  remat::format_bytes(r.peaks.back()).c_str());
      std::fflush(stdout);
    }
  }
  const Record& plain = recs[0];
  std::ofstream out(out_path);
  out << "{\"kind\": \"meta\", \"meta\": " << metadata(argc, argv) << ", \"size\": {\"d_model\": " << size.d_model
      << ", \"heads\": " << size.heads << ", \"blocks\": " << size.blocks << ", \"seq_len\": " << size.seq_len
      << ", \"batch\": " << size.batch << ", \"vocab\": " << size.vocab << "}, \"rounds\": " << rounds
      << ", \"quick\": " << (quick ? "true" : "false") << "}\n";
  out << "{\"kind\": \"profile\", \"profile_s\": " << num(profile_s) << ", \"units\": " << model.units.size()
      << ", \"segments\": " << model.segment_peak_bytes.size() << ", \"profiled_peak\": " << high
      << ", \"profiled_ms\": " << num(planner.profiled_time_ms()) << ", \"leanest_peak\": " << low
      << ", \"leanest_solve_ms\": " << num(lean.solve_ms) << "}\n";
  std::printf("\n%-14s %10s %8s %14s %10s %10s\n", "strategy", "step ms", "x plain", "peak", "x plain", "budget");
  for (auto& r : recs) {
    for (int i = 0; i < rounds; ++i) r.time_ratios.push_back(r.ms[i] / plain.ms[i]);
    const int64_t peak = *std::max_element(r.peaks.begin(), r.peaks.end());
    const double peak_ratio = static_cast<double>(peak) / static_cast<double>(plain.peaks[0]);
    std::printf("%-14s %10.1f %8.3f %14s %10.3f %10s\n", r.name.c_str(), median(r.ms), median(r.time_ratios),
                remat::format_bytes(peak).c_str(), peak_ratio, r.budget ? remat::format_bytes(r.budget).c_str() : "-");
    out << "{\"kind\": \"strategy\", \"name\": " << quoted(r.name) << ", \"label\": " << quoted(r.label)
        << ", \"ms\": " << json_list(r.ms) << ", \"peaks\": " << json_list(r.peaks)
        << ", \"time_ratio\": {\"median\": " << num(median(r.time_ratios))
        << ", \"min\": " << num(*std::min_element(r.time_ratios.begin(), r.time_ratios.end()))
        << ", \"max\": " << num(*std::max_element(r.time_ratios.begin(), r.time_ratios.end()))
        << "}, \"peak\": " << peak << ", \"peak_ratio\": " << num(peak_ratio);
    if (r.budget) {
      out << ", \"budget\": " << r.budget << ", \"predicted_peak\": " << r.predicted_peak
          << ", \"predicted_ms\": " << num(r.predicted_ms) << ", \"plan\": " << quoted(r.plan);
    }
    out << "}\n";
  }
  std::printf("wrote %s\n", out_path.c_str());
  return 0;
}
