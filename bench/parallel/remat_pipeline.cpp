// remat_pipeline: pipeline parallelism (remat::parallel::Pipeline) on 2
// processes here against one process, on the reference GPT as
// a whole training step (8 blocks, d_model 512, 8 heads, T 512, vocabulary
// 256, dropout 0, explicit attention; embedding, blocks, final LayerNorm,
// head tied to the embedding, cross-entropy, AdamW lr 1e-4) at a global
// batch of 4 sequences, 1 intra-op thread per process.
//   one         one process, the whole model, no checkpointing
//   gpipe, 1f1b 2 stages of 4 blocks (rank 0 with the embedding, rank 1
//               with the final LayerNorm, head and loss; the embedding tied
//               over both), 4 micro-batches, no checkpointing
//   gpipe+plan, 1f1b+plan
//               the same, each rank's step planned by remat::auto_checkpoint
//               over its stage's blocks with a budget of --budget-fraction
//               (0.5) x the peak of "one" in the same round
// Each pipeline rank builds the whole GPT from one seed (so its values are
// the one process's) and releases the parameters of the modules it does not
// run before its optimizer exists, so its memory is its own stage's.
// Per configuration, round and rank, one JSON line: step ms per timed step;
// the step's peak of every tracked byte live in the process (parameters,
// gradients, AdamW moments, activations, boundary tensors: a
// remat::memory::Probe opened at the step's start, plus what was live
// then); model state (what is live after a step less what was live before
// the model); for pipelines Pipeline::stats() per timed step and explain();
// for +plan the planner's budget, predicted and measured peak and the units
// it changed. The configurations run one after another in each round
// (--rounds, default 3), so drift hits them alike. Plain runs drop their
// first step (warm-up); +plan runs auto's warm-up and profiled steps
// untimed, then time --steps planned steps.
//
//   remat_pipeline [--rounds 3] [--steps 3] [--quick] [--budget-fraction 0.5]
//                  [--out bench/results/pipeline.json]
//
// --quick: a toy size (4 blocks, d_model 64, T 64) for smoke runs, written
// to bench/results/pipeline-quick.json unless --out says otherwise. Each
// process is this program again with --rank (spawned; pipelines over Gloo
// with a FileStore in a scratch folder).
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/optim/adamw.h>
#include <torch/types.h>

#include <remat/auto.h>
#include <remat/memory.h>
#include <remat/models/gpt.h>
#include <remat/parallel/pipeline.h>

#include "bench.h"

extern char** environ;

namespace {

using bench::arg;
using bench::Clock;

const std::vector<std::string> kConfigs = {"one", "gpipe", "1f1b", "gpipe+plan", "1f1b+plan"};
constexpr int kStages = 2;
constexpr int kMicro = 4;

/** `s` as a JSON string, newlines kept (as \n). */
std::string json_text(const std::string& s) {
  std::string o = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      o += '\\';
      o += c;
    } else if (c == '\n') {
      o += "\\n";
    } else if (c == '\t' || c == '\r') {
      o += ' ';
    } else {
      o += c;
    }
  }
  return o + "\"";
}

std::string int_list(const std::vector<int64_t>& v) { return bench::json_list(v); }

int run_rank(int argc, char** argv) {
  remat::memory::enable_tracking();
  torch::set_num_threads(1);
  const int64_t before = remat::memory::current_bytes();
  const int rank = static_cast<int>(bench::int_arg(argc, argv, "--rank", "0"));
  const int steps = static_cast<int>(bench::int_arg(argc, argv, "--steps", "3"));
  const int64_t batch = bench::int_arg(argc, argv, "--batch", "4");
  const int64_t budget = bench::int_arg(argc, argv, "--budget", "0");
  const std::string config = arg(argc, argv, "--config", "one");
  const bool pipeline = config != "one";
  const bool plan = config.find("+plan") != std::string::npos;
  const int world = pipeline ? kStages : 1;
  torch::manual_seed(1);
  remat::models::GptConfig cfg;
  cfg.vocab = 256;
  cfg.seq_len = bench::int_arg(argc, argv, "--seq-len", "512");
  cfg.d_model = bench::int_arg(argc, argv, "--d-model", "512");
  cfg.heads = 8;
  cfg.layers = bench::int_arg(argc, argv, "--layers", "8");
  cfg.dropout = 0.0;
  remat::models::Gpt gpt(cfg);
  const int64_t L = cfg.layers;
  const auto stage_cut = remat::models::gpt_stage(L, rank, world);
  const bool first = stage_cut.embeds;
  // The parameters this rank runs; the others' storage is released.
  std::vector<torch::Tensor> params;
  {
    const auto mine = remat::models::gpt_stage_parameters(*gpt, stage_cut);
    for (const auto& p : gpt->parameters()) {
      if (std::any_of(mine.begin(), mine.end(), [&](const auto& m) { return m.second.is_same(p); })) {
        params.push_back(p);
      } else {
        p.set_data(torch::empty({0}));
      }
    }
  }
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-4));
  std::vector<int64_t> cut;
  if (pipeline) cut.push_back(L / world);
  torch::nn::Sequential stage_blocks = pipeline ? remat::parallel::pipeline_part(gpt->blocks, cut, rank) : gpt->blocks;
  std::optional<remat::AutoCheckpoint> planner;
  if (plan) planner.emplace(remat::auto_checkpoint(stage_blocks, remat::AutoOptions().memory_budget_bytes(budget)));
  remat::parallel::ProcessGroup group;
  std::optional<remat::parallel::Pipeline> pipe;
  if (pipeline) {
    group = remat::parallel::init_process_group(
        remat::parallel::InitOptions(rank, world).file_store(arg(argc, argv, "--file-store", "")));
    auto stage = [&](const std::vector<torch::Tensor>& in) -> std::vector<torch::Tensor> {
      return {stage_blocks->forward(first ? gpt->embed(in[0]) : in[0])};
    };
    pipe.emplace(group, stage,
                 remat::parallel::PipelineOptions()
                     .microbatches(kMicro)
                     .schedule(remat::parallel::parse_pipeline_schedule(config.substr(0, config.find('+'))))
                     .tied({gpt->wte->weight}));
  }
  const int untimed = plan ? 2 : 1;  // auto: a warm-up and the profiled step; else a warm-up
  std::vector<double> ms, fwd, bwd, recv, send, bubble, loss;
  std::vector<int64_t> peak, step_peak, in_flight;
  int64_t state = 0;
  for (int step = 0; step < untimed + steps; ++step) {
    auto gen = at::detail::createCPUGenerator(1000 + step);
    auto tok = torch::randint(cfg.vocab, {batch, cfg.seq_len + 1}, gen, torch::kLong);
    auto x = tok.slice(1, 0, cfg.seq_len), y = tok.slice(1, 1, cfg.seq_len + 1);
    double loss_value = 0;
    auto body = [&] {
      opt.zero_grad();
      if (pipe) {
        auto l = pipe->step({x}, {y}, [&](const std::vector<torch::Tensor>& o, const std::vector<torch::Tensor>& t) {
          return gpt->loss(o[0], t[0]);
        });
        loss_value = l.item<double>();
      } else {
        auto l = gpt->loss(gpt->blocks->forward(gpt->embed(x)), y);
        l.backward();
        loss_value = l.item<double>();
      }
      opt.step();
    };
    if (pipe) group.barrier();
    double t = 0;
    int64_t total_peak = 0;
    {
      remat::memory::Probe probe;
      const auto t0 = Clock::now();
      if (planner) {
        planner->step(body);
      } else {
        body();
      }
      t = bench::ms_since(t0);
      total_peak = probe.baseline_bytes() + probe.peak_bytes();
    }
    if (step < untimed) continue;
    if (planner && !planner->planned()) throw std::runtime_error("remat_pipeline: the planner has no plan");
    ms.push_back(t);
    peak.push_back(total_peak);
    loss.push_back(loss_value);
    if (pipe) {
      const auto s = pipe->stats();
      fwd.push_back(s.forward_ms);
      bwd.push_back(s.backward_ms);
      recv.push_back(s.recv_ms);
      send.push_back(s.send_ms);
      bubble.push_back(s.bubble);
      in_flight.push_back(s.max_in_flight);
      step_peak.push_back(s.peak_bytes);
    }
    state = remat::memory::current_bytes() - before;
  }
  int64_t param_bytes = 0;
  for (const auto& p : params) param_bytes += static_cast<int64_t>(p.nbytes());
  std::ostringstream o;
  o << "{\"config\": " << bench::quoted(config) << ", \"rank\": " << rank << ", \"stages\": " << world
    << ", \"blocks\": [" << stage_cut.first_block << ", " << stage_cut.end_block
    << "], \"ms\": " << bench::json_list(ms) << ", \"peak\": " << int_list(peak)
    << ", \"peak_max\": " << *std::max_element(peak.begin(), peak.end()) << ", \"model_state\": " << state
    << ", \"param_bytes\": " << param_bytes << ", \"loss\": " << bench::json_list(loss, 6);
  if (pipe) {
    o << ", \"microbatches\": " << kMicro << ", \"planned_in_flight\": " << pipe->planned_in_flight()
      << ", \"max_in_flight\": " << int_list(in_flight) << ", \"bubble\": " << bench::json_list(bubble)
      << ", \"forward_ms\": " << bench::json_list(fwd) << ", \"backward_ms\": " << bench::json_list(bwd)
      << ", \"recv_ms\": " << bench::json_list(recv) << ", \"send_ms\": " << bench::json_list(send)
      << ", \"step_peak\": " << int_list(step_peak);
  }
  if (planner) {
    int changed = 0, units = 0;
    for (const auto& u : planner->units()) {
      units += u.calls > 0;
      changed += u.choice != 0;
    }
    o << ", \"budget_bytes\": " << planner->budget_bytes()
      << ", \"predicted_peak_bytes\": " << planner->plan().prediction.peak_bytes
      << ", \"measured_peak_bytes\": " << planner->measured_peak_bytes()
      << ", \"profiled_peak_bytes\": " << planner->profiled_peak_bytes()
      << ", \"leanest_peak_bytes\": " << planner->leanest_peak_bytes() << ", \"units\": " << units
      << ", \"units_changed\": " << changed << ", \"replans\": " << planner->replans();
  }
  if (pipe) o << ", \"explain\": " << json_text(pipe->explain(planner ? &*planner : nullptr));
  o << "}\n";
  std::ofstream(arg(argc, argv, "--out", "/dev/stdout")) << o.str();
  return 0;
}

/** The integer after "key": in a JSON line, or -1. */
int64_t json_int(const std::string& line, const std::string& key) {
  const std::string k = "\"" + key + "\": ";
  const size_t at = line.find(k);
  return at == std::string::npos ? -1 : std::stoll(line.substr(at + k.size()));
}

/** The 1-minute load average (/proc/loadavg), -1 if unreadable. */
double load_average() {
  double v = -1;
  std::ifstream("/proc/loadavg") >> v;
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  remat::memory::enable_tracking();
  try {
    if (!arg(argc, argv, "--rank", "").empty()) return run_rank(argc, argv);
    torch::set_num_threads(1);  // as every rank (the run-metadata record says so)
    const bool quick = bench::flag(argc, argv, "--quick");
    const int rounds = static_cast<int>(bench::int_arg(argc, argv, "--rounds", "3"));
    const std::string steps = arg(argc, argv, "--steps", "3");
    const double fraction = bench::double_arg(argc, argv, "--budget-fraction", "0.5");
    const std::string out_path =
        arg(argc, argv, "--out", quick ? "bench/results/pipeline-quick.json" : "bench/results/pipeline.json");
    if (bench::int_arg(argc, argv, "--steps", "3") < 2) {
      std::cerr << "remat_pipeline: --steps must be at least 2\n";
      return 2;
    }
    std::vector<std::string> size;
    for (const char* k : {"--layers", "--d-model", "--seq-len"}) {
      const std::string v = arg(argc, argv, k, "");
      if (!v.empty()) {
        size.insert(size.end(), {k, v});
      } else if (quick) {
        size.insert(size.end(), {k, std::string(k) == "--layers" ? "4" : "64"});
      }
    }
    const bench::ScratchDir scratch(argc, argv, "remat_pipeline");
    std::vector<std::string> lines;
    std::vector<double> load;  // at each configuration's start
    const auto t_run = Clock::now();
    for (int round = 0; round < rounds; ++round) {
      int64_t budget = 0;
      for (const auto& config : kConfigs) {
        const std::string tag = scratch.path() + "/" + config + "." + std::to_string(round);
        const int world = config == "one" ? 1 : kStages;
        load.push_back(load_average());
        std::vector<pid_t> pids;
        for (int r = 0; r < world; ++r) {
          std::vector<std::string> a{argv[0],
                                     "--rank",
                                     std::to_string(r),
                                     "--config",
                                     config,
                                     "--steps",
                                     steps,
                                     "--file-store",
                                     tag + ".store",
                                     "--out",
                                     tag + ".rank" + std::to_string(r) + ".json"};
          a.insert(a.end(), size.begin(), size.end());
          if (config.find("+plan") != std::string::npos) a.insert(a.end(), {"--budget", std::to_string(budget)});
          const pid_t pid = bench::spawn(argv[0], a, "remat_pipeline");
          if (pid < 0) return 1;
          pids.push_back(pid);
        }
        bool failed = false;
        for (pid_t pid : pids) {
          int st = 0;
          ::waitpid(pid, &st, 0);
          failed = failed || !WIFEXITED(st) || WEXITSTATUS(st) != 0;
          if (failed) std::cerr << "remat_pipeline: a rank of " << config << " failed (status " << st << ")\n";
        }
        if (failed) return 1;
        for (int r = 0; r < world; ++r) {
          std::ifstream in(tag + ".rank" + std::to_string(r) + ".json");
          std::string line;
          std::getline(in, line);
          if (config == "one")
            budget = static_cast<int64_t>(fraction * static_cast<double>(json_int(line, "peak_max")));
          line.insert(line.size() - 1, ", \"round\": " + std::to_string(round));
          const size_t cut = line.find(", \"explain\"");  // the console gets the figures, the file everything
          std::cout << (cut == std::string::npos ? line : line.substr(0, cut) + "}") << "\n" << std::flush;
          lines.push_back(line);
        }
      }
    }
    std::ofstream out(out_path);
    out << "{\"kind\": \"meta\", \"meta\": " << bench::metadata(argc, argv) << ", \"budget_fraction\": " << fraction
        << ", \"microbatches\": " << kMicro << ", \"stages\": " << kStages
        << ", \"wall_s\": " << bench::num(bench::secs_since(t_run), 1) << ", \"load\": " << bench::json_list(load, 2)
        << "}\n";
    for (const auto& l : lines) out << l << "\n";
  } catch (const std::exception& e) {
    std::cerr << "remat_pipeline: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
