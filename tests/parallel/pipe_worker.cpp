// One stage of a pipeline (remat::parallel::Pipeline) for test_parallel, or
// with --plain the same model in one process: the GPT of fsdp_model.h (4
// blocks) cut into --world stages of equal blocks, rank 0 with the
// embedding, the last with the head and loss (the embedding is tied to the
// head: PipelineOptions::tied). AdamW on a global batch of --batch
// sequences, --micro micro-batches, --steps steps.
//   --strategy none | block (every block checkpointed) | auto (each rank's
//     step planned by auto_checkpoint; --budget-between B: the budget is
//     the leanest plan's peak + B x (the plain step's peak - that))
//   --mismatch: rank 0 sends half its width (the next stage cannot run it)
//   --extras: each stage but the last also sends an int64 tensor, an empty
//     one and one that needs no gradient; the next checks them
//   --fail-backward: rank 0's first micro-batch's backward throws
//   --other-micro-on-rank-1: rank 1 asks for twice the micro-batches
//   --inplace-relu: an in-place ReLU before block L/2 (the first op of a
//     stage that starts there: on the tensor the stage received)
//   --die-at-step K: rank 1 exits at step K's start (exit code 7)
//   --clip N: gradients clipped to a global norm of N before each step
//   --replicas D: --world / D stages, each replicated D times (rank =
//     replica x stages + stage); replicas split the batch and average their
//     gradients over a group of their own (ProcessGroup::new_group)
// Writes the parameters it owns (named as in the GPT) to --out.rankR.pt and
// a line of figures to --out.rankR.stats: max_in_flight planned_in_flight
// peak_bytes kept_bytes_per_micro budget measured_peak units_changed loss
// grad_bytes (of the parameters it owns).
// Exit codes: 0 done, 3 an error (message on stderr), 7 died on purpose.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <torch/serialize.h>
#include <torch/types.h>

#include <remat/auto.h>
#include <remat/checkpointable.h>
#include <remat/error.h>
#include <remat/memory.h>
#include <remat/models/gpt.h>
#include <remat/optim.h>
#include <remat/parallel/pipeline.h>

#include "fsdp_model.h"
#include "worker_args.h"

namespace {

using worker::arg;
using worker::flag;

}  // namespace

int main(int argc, char** argv) {
  const int rank = std::stoi(arg(argc, argv, "rank", "0"));
  const int world = std::stoi(arg(argc, argv, "world", "1"));
  const int micro = std::stoi(arg(argc, argv, "micro", "4"));
  const int64_t batch = std::stoi(arg(argc, argv, "batch", "8"));
  const int steps = std::stoi(arg(argc, argv, "steps", "3"));
  const int die_at = std::stoi(arg(argc, argv, "die-at-step", "0"));
  // auto: the budget, between the leanest plan's peak (0) and the plain
  // step's (1), set once the step is profiled.
  const double budget_between = std::stod(arg(argc, argv, "budget-between", "0.5"));
  const std::string strategy = arg(argc, argv, "strategy", "none");
  const std::string schedule = arg(argc, argv, "schedule", "1f1b");
  const std::string out = arg(argc, argv, "out", "");
  const bool plain = flag(argc, argv, "plain");
  const bool mismatch = flag(argc, argv, "mismatch");
  const double clip = std::stod(arg(argc, argv, "clip", "0"));
  const int replicas = std::stoi(arg(argc, argv, "replicas", "1"));
  const bool extras = flag(argc, argv, "extras");
  const bool fail_backward = flag(argc, argv, "fail-backward");
  const bool inplace_relu = flag(argc, argv, "inplace-relu");
  try {
    torch::set_num_threads(1);
    remat::memory::enable_tracking();
    remat::models::Gpt gpt = worker::fsdp_gpt();
    const remat::models::GptConfig& cfg = gpt->config();
    using Block = remat::models::GptBlockImpl;
    if (strategy == "block") {
      remat::enable_checkpointing(gpt, remat::select::type<Block>());
    } else if (strategy != "none" && strategy != "auto") {
      throw remat::Error("pipe_worker: unknown --strategy " + strategy);
    }
    // --replicas D: world = P stages x D replicas; rank = replica * P + stage.
    const int D = plain ? 1 : replicas;
    const int P = plain ? 1 : world / D;
    if (!plain && P * D != world) throw remat::Error("pipe_worker: --replicas must divide --world");
    const int stage_of = rank % P, replica = rank / P;
    const int64_t L = cfg.layers;
    if (L % P != 0) throw remat::Error("pipe_worker: the stages must divide the GPT's blocks");
    const auto cut = remat::models::gpt_stage(L, stage_of, P);
    const int64_t lo = cut.first_block, hi = cut.end_block;
    const bool first = cut.embeds, last = cut.heads;
    // The parameters this rank owns, by name.
    const auto owned = remat::models::gpt_stage_parameters(*gpt, cut);
    std::vector<torch::Tensor> params;
    for (auto& [n, t] : owned) params.push_back(t);
    auto run_blocks = [&](torch::Tensor h) {
      torch::nn::ReLU relu(torch::nn::ReLUOptions().inplace(true));
      for (int64_t b = lo; b < hi; ++b) {
        if (inplace_relu && b == L / 2) h = relu(h);
        h = gpt->blocks[b]->as<Block>()->forward(h);
      }
      return h;
    };
    std::optional<remat::AutoCheckpoint> planner;
    if (strategy == "auto") {
      planner.emplace(remat::auto_checkpoint(gpt, remat::AutoOptions().memory_budget_fraction(1.0)));
    }
    torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-2).eps(1e-3).weight_decay(0.01));
    // --step-in-backward: each stage's parameters are updated in its last
    // micro-batch's backward; the tied embedding, summed across stages after
    // it, by opt.step().
    std::optional<remat::StepInBackward> in_backward;
    if (flag(argc, argv, "step-in-backward")) in_backward.emplace(opt);
    remat::parallel::ProcessGroup group, stages_group, data_group;
    std::optional<remat::parallel::Pipeline> pipe;
    int calls = 0;  // of the stage function (outlives the Pipeline that calls it)
    if (!plain) {
      group = remat::parallel::init_process_group(
          remat::parallel::InitOptions(rank, world)
              .file_store(arg(argc, argv, "file-store", ""))
              .timeout(std::chrono::milliseconds(std::stoi(arg(argc, argv, "timeout-ms", "60000")))));
      stages_group = group;
      if (D > 1) {  // this replica's stages, then this stage's replicas
        std::vector<int> stages_ranks, replica_ranks;
        for (int s = 0; s < P; ++s) stages_ranks.push_back(replica * P + s);
        for (int d = 0; d < D; ++d) replica_ranks.push_back(d * P + stage_of);
        stages_group = group.new_group(stages_ranks);
        data_group = group.new_group(replica_ranks);
      }
      auto stage = [&](const std::vector<torch::Tensor>& in) -> std::vector<torch::Tensor> {
        if (extras && !first) {  // what the previous stage added, as it sent it
          const bool ok = in.size() == 4 && in[1].scalar_type() == torch::kLong &&
                          torch::equal(in[1], torch::arange(cfg.seq_len)) && in[2].numel() == 0 &&
                          !in[3].requires_grad() && torch::equal(in[3], in[0].detach() * 2);
          if (!ok) throw remat::Error("pipe_worker: the boundary's extra tensors arrived wrong");
        }
        auto h = first ? gpt->embed(in[0]) : in[0];
        h = run_blocks(h);
        if (mismatch && first) h = h.narrow(-1, 0, h.size(-1) / 2).contiguous();
        if (fail_backward && first && calls++ == 0) {
          h.register_hook(
              [](const torch::Tensor&) -> torch::Tensor { throw remat::Error("pipe_worker: a backward that throws"); });
          h = h * 1.0;  // the hook on a tensor inside the stage's graph
        }
        if (extras && !last) {
          // An int64 tensor, an empty one, and one without a gradient.
          return {h, torch::arange(cfg.seq_len), torch::empty({0, 3}), h.detach() * 2};
        }
        return {h};
      };
      pipe.emplace(stages_group, stage,
                   remat::parallel::PipelineOptions()
                       .microbatches(rank == 1 && flag(argc, argv, "other-micro-on-rank-1") ? micro * 2 : micro)
                       .schedule(remat::parallel::parse_pipeline_schedule(schedule))
                       .tied({gpt->wte->weight}));
    }
    // What one micro-batch's forward keeps on this stage (activations held
    // for its backward), measured once before training.
    int64_t kept_per_micro = 0, grad_bytes = 0;
    for (const auto& p : params) grad_bytes += static_cast<int64_t>(p.nbytes());
    if (!plain && strategy != "auto") {
      const int64_t mb = batch / D / micro;
      auto tok = torch::randint(cfg.vocab, {mb, cfg.seq_len}, torch::kLong);
      // Not a leaf: a stage may work on what it receives in place (--inplace-relu).
      torch::Tensor h = first ? torch::Tensor() : torch::randn({mb, cfg.seq_len, cfg.d_model}).requires_grad_().clone();
      const int64_t before = remat::memory::current_bytes();
      auto o = run_blocks(first ? gpt->embed(tok) : h);
      kept_per_micro = remat::memory::current_bytes() - before;
    }
    double loss_value = 0;
    for (int step = 0; step < steps; ++step) {
      if (die_at > 0 && rank == 1 && step + 1 == die_at) std::_Exit(7);
      auto gen = at::detail::createCPUGenerator(1000 + step);
      // Each replica takes its rows of the global batch.
      auto tok = torch::randint(cfg.vocab, {batch, cfg.seq_len + 1}, gen, torch::kLong)
                     .slice(0, replica * batch / D, (replica + 1) * batch / D);
      auto x = tok.slice(1, 0, cfg.seq_len), y = tok.slice(1, 1, cfg.seq_len + 1);
      auto body = [&] {
        opt.zero_grad();
        if (pipe) {
          auto l = pipe->step({x}, {y}, [&](const std::vector<torch::Tensor>& o, const std::vector<torch::Tensor>& t) {
            return gpt->loss(o[0], t[0]);
          });
          loss_value = l.item<double>();
          if (D > 1) {
            remat::parallel::average_gradients(data_group, params);
            auto mean = l.reshape({1}).clone();
            data_group.all_reduce_sum(mean);
            loss_value = mean.item<double>() / D;
          }
          if (clip > 0) pipe->clip_grad_norm(params, clip);
        } else {
          auto l = gpt->loss(run_blocks(gpt->embed(x)), y);
          l.backward();
          loss_value = l.item<double>();
          if (clip > 0) torch::nn::utils::clip_grad_norm_(params, clip);
        }
        opt.step();
      };
      if (planner) {
        const bool profiled = planner->planned();
        planner->step(body);
        if (!profiled && planner->planned()) {
          const int64_t lean = planner->leanest_peak_bytes();
          planner->replan(
              lean + static_cast<int64_t>(budget_between * static_cast<double>(planner->profiled_peak_bytes() - lean)));
        }
      } else {
        body();
      }
    }
    if (in_backward && (in_backward->stats().updates == 0 || (pipe && in_backward->stats().deferred == 0))) {
      std::fprintf(stderr, "pipe_worker: not updated in backward as expected: %s\n", in_backward->describe().c_str());
      return 3;
    }
    if (!out.empty()) {
      torch::serialize::OutputArchive archive;
      for (auto& [n, t] : owned) archive.write(n, t.detach());
      archive.save_to(out + ".rank" + std::to_string(rank) + ".pt");
      int changed = 0;
      if (planner) {
        for (const auto& u : planner->units()) changed += u.choice != 0;
      }
      const auto s = pipe ? pipe->stats() : remat::parallel::PipelineStats{};
      char loss_text[64];
      std::snprintf(loss_text, sizeof loss_text, "%.9g", loss_value);
      std::ofstream(out + ".rank" + std::to_string(rank) + ".stats")
          << s.max_in_flight << " " << (pipe ? pipe->planned_in_flight() : 0) << " " << s.peak_bytes << " "
          << kept_per_micro << " " << (planner ? planner->budget_bytes() : 0) << " "
          << (planner ? planner->measured_peak_bytes() : 0) << " " << changed << " " << loss_text << " " << grad_bytes
          << "\n";
      if (pipe) std::cout << pipe->explain(planner ? &*planner : nullptr);
    }
  } catch (const std::exception& e) {
    const auto* c = dynamic_cast<const c10::Error*>(&e);
    std::cerr << "pipe_worker rank " << rank << ": " << (c ? c->what_without_backtrace() : e.what()) << "\n";
    return 3;
  }
  return 0;
}
