// One rank of a sharded (FullyShard) or plain run for test_parallel: a small
// GPT (4 blocks, d_model 64) under one checkpoint strategy, AdamW on a
// global batch of world x --batch sequences split by rank (as
// DistributedSampler). Rank 0 writes the full model after the steps
// (torch::save of the module: FullyShard::save_full, or the plain model),
// and every rank writes one line of figures to PREFIX.rankR.stats:
//   forward_allgathers backward_allgathers reduce_scatters (last step)
//   model_state_bytes (remat::memory after the last step, less before the
//   model) max_gathered_bytes largest_unit_bytes root_bytes units
//   last_norm by_allreduce
// --at-end: with --step-in-backward, StepInBackward::update_at_backward_end.
// --skip-last-block-every N: on steps k with k % N == 1 the forward skips
// the last block (no rank uses it then).
// --freeze: the blocks' attention qkv and MLP fc layers are frozen (units of
// frozen and trainable parameters). --eval: after each step's backward, an
// evaluation forward without gradient, before the optimizer's step;
// --eval-grad: that evaluation with gradient, its graph dropped (the root and
// kept units stay gathered). --sgd: SGD with momentum 0.9 at lr 0.1 (its
// step writes through p.data(), not bumping the shards' versions) instead
// of AdamW.
// Exit codes: 0 done, 3 an error (message on stderr), 7 killed itself on
// purpose (--die-at-step, rank world-1, before that step's backward).
//
// AdamW with eps 1e-3: an element whose gradient is near 0 then moves by
// lr x g / eps, not by lr x sign(g), so runs whose gradients differ in the
// last float bits (another summation order) stay within 1e-6 of each other.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>
#include <torch/types.h>

#include <remat/auto.h>
#include <remat/checkpointable.h>
#include <remat/error.h>
#include <remat/memory.h>
#include <remat/models/gpt.h>
#include <remat/offload.h>
#include <remat/optim.h>
#include <remat/parallel/fully_shard.h>
#include <remat/sequential.h>

#include "fsdp_model.h"
#include "worker_args.h"

namespace {

using worker::arg;
using worker::flag;

}  // namespace

int main(int argc, char** argv) {
  const int rank = std::stoi(arg(argc, argv, "rank", "0"));
  const int world = std::stoi(arg(argc, argv, "world", "1"));
  const int die_at = std::stoi(arg(argc, argv, "die-at-step", "0"));
  const int64_t batch = std::stoi(arg(argc, argv, "batch", "2"));
  const int steps = std::stoi(arg(argc, argv, "steps", "3"));
  const int accum = std::stoi(arg(argc, argv, "grad-accum", "1"));
  const double clip = std::stod(arg(argc, argv, "clip", "0"));
  const std::string strategy = arg(argc, argv, "strategy", "none");
  const std::string units = arg(argc, argv, "units", "blocks");
  const std::string out = arg(argc, argv, "out", "");
  const bool plain = flag(argc, argv, "plain");
  const bool eval = flag(argc, argv, "eval") || flag(argc, argv, "eval-grad");
  const bool eval_grad = flag(argc, argv, "eval-grad");
  const int skip_every = std::stoi(arg(argc, argv, "skip-last-block-every", "0"));
  try {
    torch::set_num_threads(1);
    remat::memory::enable_tracking();
    const int64_t before_model = remat::memory::current_bytes();
    remat::models::Gpt gpt = worker::fsdp_gpt();
    const remat::models::GptConfig& cfg = gpt->config();
    using Block = remat::models::GptBlockImpl;
    if (flag(argc, argv, "freeze")) {
      for (auto& p : gpt->named_parameters()) {
        if (p.key().find(".attn.qkv.") != std::string::npos || p.key().find(".mlp.fc.") != std::string::npos)
          p.value().set_requires_grad(false);
      }
    }
    if (strategy == "block") {
      remat::enable_checkpointing(gpt, remat::select::type<Block>());
    } else if (strategy == "selective") {
      remat::enable_checkpointing(gpt, remat::select::type<Block>(),
                                  remat::CheckpointOptions().policy(remat::models::megatron_policy()));
    } else if (strategy == "inner") {  // the blocks' attention and MLP, each checkpointed
      remat::enable_checkpointing(gpt, remat::select::name("blocks.*.*"));
    } else if (strategy == "offload") {  // what the blocks save goes to files (--offload-dir)
      remat::enable_offloading(
          gpt, remat::select::type<Block>(),
          remat::OffloadOptions(remat::OffloadTarget::kDisk).directory(arg(argc, argv, "offload-dir", "")));
    } else if (strategy != "none" && strategy != "auto" && strategy != "chain") {
      throw remat::Error("fsdp_worker: unknown --strategy " + strategy);
    }
    std::unique_ptr<remat::parallel::FullyShard> fsdp;
    remat::parallel::ProcessGroup group;
    if (!plain) {
      group = remat::parallel::init_process_group(
          remat::parallel::InitOptions(rank, world)
              .file_store(arg(argc, argv, "file-store", ""))
              .master_port(std::stoi(arg(argc, argv, "port", "29500")))
              .timeout(std::chrono::milliseconds(std::stoi(arg(argc, argv, "timeout-ms", "60000")))));
      auto o = remat::parallel::FullyShardOptions()
                   .units(units == "all" ? remat::select::all() : remat::select::type<Block>())
                   .reshard_after_forward(!flag(argc, argv, "no-reshard"))
                   .keep_gathered(
                       arg(argc, argv, "keep-gathered", "").empty()
                           ? std::nullopt
                           : std::optional<remat::Selector>(remat::select::name(arg(argc, argv, "keep-gathered", ""))))
                   .prefetch_bytes(std::stoll(arg(argc, argv, "prefetch", "67108864")));
      fsdp = std::make_unique<remat::parallel::FullyShard>(gpt.ptr(), group, o);
    }
    const auto params = plain ? gpt->parameters() : fsdp->parameters();
    // chain: the blocks as a CheckpointedSequential of 2 segments (the
    // blocks, FullyShard's units, are its stages).
    std::optional<remat::CheckpointedSequential> chain;
    if (strategy == "chain")
      chain.emplace(std::vector<torch::nn::Sequential>{gpt->blocks}, remat::SequentialOptions().segments(2));
    // auto: the whole step planned (step 1 warm-up, step 2 profiled, then
    // each rank's leanest plan: the most recompute).
    std::optional<remat::AutoCheckpoint> planner;
    if (strategy == "auto")
      planner.emplace(remat::auto_checkpoint(gpt, remat::AutoOptions().memory_budget_fraction(1.0)));
    std::unique_ptr<torch::optim::Optimizer> opt_ptr;
    if (flag(argc, argv, "sgd")) {
      opt_ptr = std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
    } else {
      opt_ptr =
          std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-2).eps(1e-3).weight_decay(0.01));
    }
    torch::optim::Optimizer& opt = *opt_ptr;
    // --step-in-backward: each shard updated once reduced, in backward's end
    // (the optimizer's step() after it then finds nothing to do).
    std::optional<remat::StepInBackward> in_backward;
    if (flag(argc, argv, "step-in-backward")) in_backward.emplace(opt);
    if (in_backward && flag(argc, argv, "at-end")) in_backward->update_at_backward_end(true);
    if (!plain && !arg(argc, argv, "load-sharded", "").empty()) fsdp->load_sharded(arg(argc, argv, "load-sharded", ""));
    double norm = 0;
    remat::parallel::ShardStats last;
    for (int step = 0; step < steps; ++step) {
      opt.zero_grad();
      if (fsdp) fsdp->reset_stats();
      for (int micro = 0; micro < accum; ++micro) {
        auto gen = at::detail::createCPUGenerator(1000 + step * 16 + micro);
        auto tok = torch::randint(cfg.vocab, {world * batch, cfg.seq_len + 1}, gen, torch::kLong)
                       .slice(0, rank * batch, (rank + 1) * batch);
        auto x = tok.slice(1, 0, cfg.seq_len), y = tok.slice(1, 1, cfg.seq_len + 1);
        auto run = [&] {
          auto h = gpt->embed(x);
          if (skip_every > 0 && step % skip_every == 1) {  // the last block unused on every rank
            for (size_t b = 0; b + 1 < gpt->blocks->size(); ++b) h = gpt->blocks[b]->as<Block>()->forward(h);
          } else {
            h = chain ? (*chain)->forward(h) : gpt->blocks->forward(h);
          }
          return gpt->loss(h, y) / static_cast<double>(accum);
        };
        auto micro_step = [&] {
          auto loss = fsdp ? fsdp->forward(run) : run();
          if (die_at > 0 && rank == world - 1 && step + 1 == die_at) std::_Exit(7);
          loss.backward();
        };
        if (planner) {
          planner->step(micro_step);
        } else {
          micro_step();
        }
      }
      if (eval) {  // an evaluation between backward and the optimizer's step
        std::optional<torch::NoGradGuard> no_grad;
        if (!eval_grad) no_grad.emplace();
        auto gen = at::detail::createCPUGenerator(7);
        auto tok = torch::randint(cfg.vocab, {batch, cfg.seq_len + 1}, gen, torch::kLong);
        auto x = tok.slice(1, 0, cfg.seq_len), y = tok.slice(1, 1, cfg.seq_len + 1);
        auto run = [&] { return gpt->loss(gpt->blocks->forward(gpt->embed(x)), y); };
        (fsdp ? fsdp->forward(run) : run()).item<double>();
      }
      if (planner && step == 1) planner->replan(planner->leanest_peak_bytes());
      if (clip > 0) {
        norm = fsdp ? fsdp->clip_grad_norm(clip) : torch::nn::utils::clip_grad_norm_(gpt->parameters(), clip);
      }
      opt.step();
      if (fsdp) last = fsdp->stats();
    }
    if (in_backward && in_backward->stats().updates == 0) {
      std::fprintf(stderr, "fsdp_worker: nothing was updated in backward: %s\n", in_backward->describe().c_str());
      return 3;
    }
    // A collective's buffers may be freed on the process group's thread a
    // little after the step returns (seen on a loaded machine: 200 KB more
    // on one rank): wait until the count holds still for 100 ms (1 s at most).
    int64_t state_bytes = remat::memory::current_bytes() - before_model;
    for (int still = 0, waited = 0; still < 10 && waited < 100; ++waited) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      const int64_t now = remat::memory::current_bytes() - before_model;
      still = now == state_bytes ? still + 1 : 0;
      state_bytes = now;
    }
    if (planner) {  // the planned step must have recomputed something, or the run shows nothing
      int changed = 0;
      for (const auto& u : planner->units()) changed += u.choice != 0;
      if (changed == 0) throw remat::Error("fsdp_worker: the leanest auto plan keeps every unit");
    }
    if (!plain && !arg(argc, argv, "save-sharded", "").empty()) fsdp->save_sharded(arg(argc, argv, "save-sharded", ""));
    if (!out.empty()) {
      if (fsdp) {
        fsdp->save_full(out);
      } else {
        torch::save(gpt, out);
      }
      int64_t largest = 0, root = 0, n_units = 0;
      if (fsdp) {
        const auto mem = fsdp->memory();
        largest = mem.largest_unit_bytes;
        const auto us = fsdp->units();
        n_units = static_cast<int64_t>(us.size()) - 1;
        root = us[0].shard_numel * world * 4;
      }
      std::ofstream(out + ".rank" + std::to_string(rank) + ".stats")
          << last.forward_allgathers << " " << last.backward_allgathers << " " << last.reduce_scatters << " "
          << state_bytes << " " << last.max_gathered_bytes << " " << largest << " " << root << " " << n_units << " "
          << norm << " " << last.reduce_scatter_by_allreduce << "\n";
    }
  } catch (const std::exception& e) {
    const auto* c = dynamic_cast<const c10::Error*>(&e);
    std::cerr << "fsdp_worker rank " << rank << ": " << (c ? c->what_without_backtrace() : e.what()) << "\n";
    return 3;
  }
  return 0;
}
