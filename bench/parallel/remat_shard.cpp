// remat_shard: sharded data parallel (FullyShard) against data parallel
// (DataParallel) on 2 processes here, each with and without block
// checkpointing, on the reference GPT (8 blocks, d_model 512,
// 8 heads, T 512, vocabulary 256) at a global batch of 4 (2 per rank),
// AdamW. Per rank: model state (parameters, gradients, AdamW moments and
// the strategy's own buffers: what remat::memory counts live after a step,
// less what was live before the model), the step's peak above that, step
// time, and the communication figures each strategy reports. The four
// configurations run one after another within each round (--rounds, default
// 2), so drift hits them alike; each run drops its first step.
//
//   remat_shard [--rounds 2] [--steps 4] [--out bench/results/shard.json]
//
// Each rank is this program again with --rank (spawned, Gloo over a
// FileStore in a scratch folder).
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/optim/adamw.h>
#include <torch/types.h>

#include <remat/checkpointable.h>
#include <remat/memory.h>
#include <remat/models/gpt.h>
#include <remat/parallel/data_parallel.h>
#include <remat/parallel/fully_shard.h>

#include "bench.h"

extern char** environ;

namespace {

using bench::arg;
using bench::Clock;

const std::vector<std::string> kConfigs = {"dp", "dp+block", "shard", "shard+block"};

int run_rank(int argc, char** argv) {
  const int rank = static_cast<int>(bench::int_arg(argc, argv, "--rank", "0"));
  const int world = static_cast<int>(bench::int_arg(argc, argv, "--world", "2"));
  const int steps = static_cast<int>(bench::int_arg(argc, argv, "--steps", "4"));
  const int64_t batch = bench::int_arg(argc, argv, "--batch", "2");
  const std::string config = arg(argc, argv, "--config", "dp");
  torch::set_num_threads(1);
  remat::memory::enable_tracking();
  const int64_t before = remat::memory::current_bytes();
  torch::manual_seed(1);
  remat::models::GptConfig cfg;
  cfg.vocab = 256;
  cfg.seq_len = bench::int_arg(argc, argv, "--seq-len", "512");
  cfg.d_model = bench::int_arg(argc, argv, "--d-model", "512");
  cfg.heads = 8;
  cfg.layers = bench::int_arg(argc, argv, "--layers", "8");
  remat::models::Gpt gpt(cfg);
  if (config.find("+block") != std::string::npos) {
    remat::enable_checkpointing(gpt, remat::select::type<remat::models::GptBlockImpl>());
  }
  auto group = remat::parallel::init_process_group(
      remat::parallel::InitOptions(rank, world).file_store(arg(argc, argv, "--file-store", "")));
  const bool shard = config.rfind("shard", 0) == 0;
  std::unique_ptr<remat::parallel::DataParallel> ddp;
  std::unique_ptr<remat::parallel::FullyShard> fsdp;
  if (shard) {
    fsdp = std::make_unique<remat::parallel::FullyShard>(
        gpt.ptr(), group,
        remat::parallel::FullyShardOptions().units(remat::select::type<remat::models::GptBlockImpl>()));
  } else {
    ddp = std::make_unique<remat::parallel::DataParallel>(gpt.ptr(), group);
  }
  torch::optim::AdamW opt(shard ? fsdp->parameters() : gpt->parameters(), torch::optim::AdamWOptions(1e-4));
  std::vector<double> ms, peak, comm, exposed;
  int64_t state = 0, gathers = 0, scatters = 0;
  for (int step = 0; step < steps; ++step) {
    auto gen = at::detail::createCPUGenerator(1000 + step);
    auto tok = torch::randint(cfg.vocab, {world * batch, cfg.seq_len + 1}, gen, torch::kLong)
                   .slice(0, rank * batch, (rank + 1) * batch);
    auto x = tok.slice(1, 0, cfg.seq_len), y = tok.slice(1, 1, cfg.seq_len + 1);
    group.barrier();
    const int64_t start = remat::memory::current_bytes();
    remat::memory::reset_peak();
    if (fsdp) fsdp->reset_stats();
    const auto t0 = Clock::now();
    opt.zero_grad();
    auto run = [&] { return gpt->loss(gpt->blocks->forward(gpt->embed(x)), y); };
    at::Tensor loss = fsdp ? fsdp->forward(run) : ddp->forward(run);
    loss.backward();
    opt.step();
    const double t = bench::ms_since(t0);
    if (step == 0) continue;
    ms.push_back(t);
    peak.push_back(static_cast<double>(remat::memory::peak_bytes() - start));
    if (fsdp) {
      const auto s = fsdp->stats();
      comm.push_back(s.allgather_ms + s.reduce_scatter_ms);
      exposed.push_back(s.exposed_ms);
      gathers = s.forward_allgathers + s.backward_allgathers;
      scatters = s.reduce_scatters;
    } else {
      const auto s = ddp->last_stats();
      comm.push_back(s.allreduce_ms);
      exposed.push_back(s.exposed_ms);
      gathers = 0;
      scatters = s.buckets;
    }
    state = remat::memory::current_bytes() - before;
  }
  std::ofstream(arg(argc, argv, "--out", "/dev/stdout"))
      << "{\"config\": " << bench::quoted(config) << ", \"rank\": " << rank << ", \"ms\": " << bench::json_list(ms)
      << ", \"step_peak\": " << bench::json_list(peak) << ", \"model_state\": " << state
      << ", \"comm_ms\": " << bench::json_list(comm) << ", \"exposed_ms\": " << bench::json_list(exposed)
      << ", \"allgathers\": " << gathers << ", \"reductions\": " << scatters << "}\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (!arg(argc, argv, "--rank", "").empty()) return run_rank(argc, argv);
    const int rounds = static_cast<int>(bench::int_arg(argc, argv, "--rounds", "2"));
    const std::string steps = arg(argc, argv, "--steps", "4");
    const std::string out_path = arg(argc, argv, "--out", "bench/results/shard.json");
    const bench::ScratchDir scratch(argc, argv, "remat_shard");
    std::vector<std::string> lines;
    for (int round = 0; round < rounds; ++round) {
      for (const auto& config : kConfigs) {
        const std::string tag = scratch.path() + "/" + config + "." + std::to_string(round);
        std::vector<pid_t> pids;
        for (int r = 0; r < 2; ++r) {
          std::vector<std::string> a{argv[0],
                                     "--rank",
                                     std::to_string(r),
                                     "--world",
                                     "2",
                                     "--config",
                                     config,
                                     "--steps",
                                     steps,
                                     "--file-store",
                                     tag + ".store",
                                     "--out",
                                     tag + ".rank" + std::to_string(r) + ".json"};
          for (const char* k : {"--layers", "--d-model", "--seq-len"}) {
            const std::string v = arg(argc, argv, k, "");
            if (!v.empty()) a.insert(a.end(), {k, v});
          }
          const pid_t pid = bench::spawn(argv[0], a, "remat_shard");
          if (pid < 0) return 1;
          pids.push_back(pid);
        }
        for (pid_t pid : pids) {
          int st = 0;
          ::waitpid(pid, &st, 0);
          if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
            std::cerr << "remat_shard: a rank of " << config << " failed (status " << st << ")\n";
            return 1;
          }
        }
        for (int r = 0; r < 2; ++r) {
          std::ifstream in(tag + ".rank" + std::to_string(r) + ".json");
          std::string line;
          std::getline(in, line);
          line.insert(line.size() - 1, ", \"round\": " + std::to_string(round));
          std::cout << line << "\n" << std::flush;
          lines.push_back(line);
        }
      }
    }
    std::ofstream out(out_path);
    out << "{\"kind\": \"meta\", \"meta\": " << bench::metadata(argc, argv) << "}\n";
    for (const auto& l : lines) out << l << "\n";
  } catch (const std::exception& e) {
    std::cerr << "remat_shard: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
