// remat_compare: the C++ (remat) half of the side-by-side comparison with
// Python PyTorch (bench/py/run_all.py drives it; docs/BENCHMARKS.md).
// Builds one model's block chain (shapes as in bench/py/models.py), runs the
// given strategies interleaved (A B C A B C ...) after warm-up, and prints one
// JSON object: per strategy the peak activation bytes (from the LD_PRELOAD
// counter bench/preload when loaded, else remat::memory) and every step's
// milliseconds and minor page faults; plain also gets forward and backward times.
// Strategies: plain, block, seq:K, useg:K (CheckpointedSequential running seq:K's
// placement), sqrt, opt:F (budget F x plain peak), menu:F (opt:F with each
// stage's menu: --menu-levels selective levels and disk offload to
// --offload-dir, --offload-inflight-kib in flight), select. --explain 1 prints
// the planned strategies' explain() to stderr after their last step.
// Leaves out: the loss head and optimizer (the chain ends in .sum()).
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/record_function.h>
#include <torch/torch.h>

#include <remat/models/gpt.h>
#include <remat/models/resnet.h>
#include <remat/plan/solve.h>
#include <remat/remat.h>
#include <remat/sequential.h>

#include "bench.h"

namespace {

using Fn = std::function<torch::Tensor(const torch::Tensor&)>;

// --- memory: the preload library's counters, or remat::memory -----------------
// --- models (shapes shared with bench/py/models.py) -----------------------------
class MlpBlockImpl : public torch::nn::Module {
 public:
  explicit MlpBlockImpl(int64_t width) : lin(register_module("lin", torch::nn::Linear(width, width))) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::gelu(lin(x)); }  // (B, width)
  torch::nn::Linear lin{nullptr};
};
TORCH_MODULE(MlpBlock);

struct Model {
  torch::nn::Sequential seq;
  torch::Tensor x;
  std::vector<Fn> ckpt;                 // per block: remat::checkpoint(block, h)
  std::function<void(bool)> selective;  // remat's block-level selective switch, if any
};

template <class Block>
void add_blocks(Model& m, const std::vector<Block>& blocks) {
  for (auto b : blocks) {
    m.seq->push_back(b);
    m.ckpt.push_back([b](const torch::Tensor& h) mutable { return remat::checkpoint(b, h); });
  }
}

/** `stages` stages of 2 residual blocks, widths width << stage, stride 2
 *  at the first block of every stage but the first. */
std::vector<remat::models::ResBlock> res_blocks(int64_t stages, int64_t width) {
  std::vector<remat::models::ResBlock> b;
  int64_t in = width;
  for (int64_t stage = 0; stage < stages; ++stage) {
    for (int i = 0; i < 2; ++i) {
      const int64_t mid = width << stage;
      b.emplace_back(in, mid, (stage > 0 && i == 0) ? 2 : 1, /*bottleneck=*/false);
      in = mid;
    }
  }
  return b;
}

Model build(const std::string& name) {
  torch::manual_seed(0);
  Model m;
  m.seq = torch::nn::Sequential();
  if (name == "mlp") {  // MLP = dict(blocks=24, width=256, batch=128)
    std::vector<MlpBlock> b;
    for (int i = 0; i < 24; ++i) b.emplace_back(256);
    add_blocks(m, b);
    m.x = torch::randn({128, 256});
  } else if (name == "gpt") {  // GPT = dict(blocks=16, d_model=128, heads=4, seq_len=128, batch=1)
    std::vector<remat::models::GptBlock> b;
    for (int i = 0; i < 16; ++i) b.emplace_back(128, 4, 0.0);
    add_blocks(m, b);
    m.selective = [b](bool on) {
      // Full recompute of each attention module (as the Python worker does).
      for (auto blk : b) blk->attn->set_checkpointing(on ? std::optional(remat::CheckpointOptions()) : std::nullopt);
    };
    m.x = torch::randn({1, 128, 128});
  } else if (name == "gpt-ref") {  // the CPU reference: 8 blocks, d_model 512, 8 heads, T 512, batch 4
    std::vector<remat::models::GptBlock> b;
    for (int i = 0; i < 8; ++i) b.emplace_back(512, 8, 0.0);
    add_blocks(m, b);
    m.x = torch::randn({4, 512, 512});
  } else if (name == "mlp-ref") {  // 24 x (Linear(1024, 1024) + GELU), batch 2048: ~0.4 GiB of activations
    std::vector<MlpBlock> b;
    for (int i = 0; i < 24; ++i) b.emplace_back(1024);
    add_blocks(m, b);
    m.x = torch::randn({2048, 1024});
  } else if (name == "resnet-ref") {  // 3 stages x 2 residual blocks with BatchNorm, width 32, batch 100, 32x32
    add_blocks(m, res_blocks(3, 32));
    m.x = torch::randn({100, 32, 32, 32});
  } else if (name == "resnet-ref-split") {  // resnet-ref's blocks split in two stages each (models::split_blocks)
    torch::nn::Sequential blocks;
    for (auto b : res_blocks(3, 32)) blocks->push_back(b);
    m.seq = remat::models::split_blocks(blocks);  // no per-block hook strategy: block, select are skipped
    m.x = torch::randn({100, 32, 32, 32});
  } else if (name == "resnet") {  // RESNET = dict(width=16, batch=4, image=32), depth 18
    const auto b = res_blocks(4, 16);
    add_blocks(m, b);
    m.selective = [b](bool on) {
      for (auto blk : b) blk->first->set_checkpointing(on ? std::optional(remat::CheckpointOptions()) : std::nullopt);
    };
    m.x = torch::randn({4, 16, 32, 32});
  } else {
    std::fprintf(stderr, "unknown model %s: use mlp, gpt, resnet, mlp-ref, gpt-ref, resnet-ref or resnet-ref-split\n",
                 name.c_str());
    std::exit(2);
  }
  m.x.set_requires_grad(true);
  m.seq->train();
  return m;
}

// --- steps ---------------------------------------------------------------------
using bench::Clock;
using bench::ms_since;

void zero_grads(Model& m) {
  for (auto& p : m.seq->parameters()) {
    if (p.grad().defined()) p.mutable_grad().zero_();
  }
  m.x.mutable_grad() = torch::Tensor();
}

// --op-profile 1: inclusive milliseconds per op and autograd node name
// (RecordFunction, this thread only), summed per strategy over the timed
// steps and printed to stderr: where one runtime's extra time goes.
struct OpProfile {
  struct Frame {
    std::string name;
    Clock::time_point t0;
  };
  static thread_local std::vector<Frame> stack;
  static std::map<std::string, std::pair<double, long>>* current;  // ms, calls
  std::map<std::string, std::map<std::string, std::pair<double, long>>> per_strategy;
  at::CallbackHandle handle = 0;

  void install() {
    handle = at::addThreadLocalCallback(at::RecordFunctionCallback(
                                            [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
                                              if (current) stack.push_back({fn.name(), Clock::now()});
                                              return nullptr;
                                            },
                                            [](const at::RecordFunction&, at::ObserverContext*) {
                                              if (!current || stack.empty()) return;
                                              auto& e = (*current)[stack.back().name];
                                              e.first += ms_since(stack.back().t0);
                                              e.second += 1;
                                              stack.pop_back();
                                            })
                                            .needsInputs(false));
  }
  void print(int steps) const {
    for (const auto& [strategy, ops] : per_strategy) {
      std::vector<std::pair<double, std::string>> v;
      for (const auto& [name, e] : ops) v.push_back({e.first / steps, name + " x" + std::to_string(e.second / steps)});
      std::sort(v.rbegin(), v.rend());
      std::fprintf(stderr, "== %s (inclusive ms per step)\n", strategy.c_str());
      for (size_t k = 0; k < v.size() && k < 40; ++k)
        std::fprintf(stderr, "%10.1f  %s\n", v[k].first, v[k].second.c_str());
    }
  }
};
thread_local std::vector<OpProfile::Frame> OpProfile::stack;
std::map<std::string, std::pair<double, long>>* OpProfile::current = nullptr;

struct Times {
  double fwd_ms, bwd_ms;
  long faults;  // minor page faults during the step (glibc returning and re-taking memory)
};

// With --op-profile: where the step's forward and backward ops are summed.
std::map<std::string, std::pair<double, long>>* g_fwd_ops = nullptr;
std::map<std::string, std::pair<double, long>>* g_bwd_ops = nullptr;

Times step(Model& m, const Fn& f) {
  zero_grads(m);
  const int64_t f0 = bench::minor_faults();
  OpProfile::current = g_fwd_ops;
  auto t0 = Clock::now();
  auto loss = f(m.x).sum();
  const double fwd = ms_since(t0);
  OpProfile::current = g_bwd_ops;
  auto t1 = Clock::now();
  loss.backward();
  const double bwd = ms_since(t1);
  OpProfile::current = nullptr;
  return {fwd, bwd, static_cast<long>(bench::minor_faults() - f0)};
}

// hold_output: the chain's output lives through backward, as in
// `f(x).sum().backward()` (a C++ temporary lives to the end of the full
// expression; the tables of docs/BENCHMARKS.md were measured so). Without
// it the output is released before backward, as the planner's model
// assumes (bench/py/accuracy.py).
int64_t peak_of(Model& m, const Fn& f, bench::Meter& meter, bool hold_output) {
  zero_grads(m);
  meter.reset();
  const int64_t base = meter.current();
  if (hold_output) {
    f(m.x).sum().backward();
  } else {
    auto loss = f(m.x).sum();
    loss.backward();
  }
  return meter.peak() - base + static_cast<int64_t>(m.x.nbytes());
}

/** "1: offload disk, 4: save 2 addmm": the stage options a chain's plan uses, or "none". */
std::string options_used(const remat::CheckpointedSequentialImpl& net) {
  std::string used;
  for (const auto& op : net.plan().schedule.ops) {
    if (op.option == 0) continue;
    used += (used.empty() ? "" : ", ") + std::to_string(op.stage) + ": " +
            net.chain().stages[op.stage].options[op.option - 1].name;
  }
  return used.empty() ? "none" : used;
}

}  // namespace

int main(int argc, char** argv) {
  using bench::arg;
  const int threads = static_cast<int>(bench::int_arg(argc, argv, "--threads", "1"));
  torch::set_num_threads(threads);
  const std::string model = arg(argc, argv, "--model", "gpt");
  const int steps = static_cast<int>(bench::int_arg(argc, argv, "--steps", "10"));
  const int sweep_steps = static_cast<int>(bench::int_arg(argc, argv, "--sweep-steps", "4"));
  const int warmup = static_cast<int>(bench::int_arg(argc, argv, "--warmup", "2"));
  const auto strategies = bench::split(arg(argc, argv, "--strategies", "plain,block"), ',');
  const bool rss_mode = arg(argc, argv, "--rss", "0") == "1";
  const bool hold_output = arg(argc, argv, "--hold-output", "1") == "1";
  const bool op_profile = arg(argc, argv, "--op-profile", "0") == "1";
  const bool explain = arg(argc, argv, "--explain", "0") == "1";
  // menu:F's offload store (a new directory under /tmp unless given, removed at the end).
  const bench::ScratchDir scratch(argc, argv, "remat_compare");
  const std::string& offload_dir = scratch.path();
  const auto menu =
      remat::ProfileOptions()
          .selective_levels(static_cast<int>(bench::int_arg(argc, argv, "--menu-levels", "2")))
          .offload({remat::OffloadOptions(remat::OffloadTarget::kDisk)
                        .directory(offload_dir)
                        .max_inflight_bytes(bench::int_arg(argc, argv, "--offload-inflight-kib", "16384") << 10)});

  bench::Meter meter("remat_compare", false);
  // remat::memory's wrapper is installed in any case (profile() needs it), so
  // every strategy pays for the same two counting layers.
  remat::memory::enable_tracking();
  Model m = build(model);
  // RSS cross-check: reset the high-water mark (VmHWM, what ru_maxrss reports)
  // after set-up, so the growth is this run's own; baseline = RSS now.
  {
    std::FILE* f = std::fopen("/proc/self/clear_refs", "w");
    if (f) {
      std::fputs("5", f);
      std::fclose(f);
    }
  }
  const long rss0_kib = static_cast<long>(bench::status_kib("VmRSS"));

  Fn plain = [&](const torch::Tensor& in) { return m.seq->forward(in); };
  int64_t plain_peak = 0;
  if (!rss_mode) {   // --rss 1: only the given strategy runs, so ru_maxrss is its own
    step(m, plain);  // allocates parameter gradients
    plain_peak = peak_of(m, plain, meter, hold_output);
  }

  struct Run {
    std::string name;
    Fn fn;
    bool sweep = false;
    std::string note;
    int64_t peak = -1, predicted = -1;
    double predicted_ms = -1;                            // the plan's predicted step time
    std::shared_ptr<remat::CheckpointedSequential> net;  // planned strategies, for --explain
    std::vector<double> ms, fwd_ms, bwd_ms, faults;
  };
  std::vector<Run> runs;
  std::vector<std::shared_ptr<remat::CheckpointedSequential>> nets;
  for (const auto& s : strategies) {
    Run r;
    r.name = s;
    if (s == "plain") {
      r.fn = plain;
    } else if (s == "block") {
      if (m.ckpt.empty()) continue;
      r.fn = [&](const torch::Tensor& in) {
        torch::Tensor h = in;
        for (auto& c : m.ckpt) h = c(h);
        return h;
      };
    } else if (s.rfind("seq:", 0) == 0) {
      const int k = std::stoi(s.substr(4));
      r.fn = [&, k](const torch::Tensor& in) { return remat::checkpoint_sequential(m.seq, k, in); };
      r.sweep = true;
    } else if (s == "select") {
      if (!m.selective) continue;
      r.fn = [&](const torch::Tensor& in) {
        m.selective(true);
        auto out = m.seq->forward(in);
        m.selective(false);
        return out;
      };
    } else if (s == "sqrt" || s.rfind("opt:", 0) == 0 || s.rfind("useg:", 0) == 0 || s.rfind("menu:", 0) == 0) {
      auto opts = remat::SequentialOptions().measure_memory(false);
      if (s == "sqrt") {
        opts.algorithm("sqrt");
      } else if (s.rfind("useg:", 0) == 0) {  // the planned runtime on seq:K's placement
        opts.segments(std::stoi(s.substr(5)));
      } else if (s.rfind("menu:", 0) == 0) {
        opts.memory_budget_bytes(static_cast<int64_t>(std::stod(s.substr(5)) * plain_peak)).profile(menu);
      } else {
        opts.memory_budget_bytes(static_cast<int64_t>(std::stod(s.substr(4)) * plain_peak));
      }
      try {
        auto net = std::make_shared<remat::CheckpointedSequential>(m.seq, opts);
        const auto& plan = (*net)->plan(m.x);
        r.predicted = plan.prediction.peak_bytes;
        r.predicted_ms = plan.prediction.time_ms;
        // Which schedule, and what the DP would pick if it priced every
        // forward at forward_ms (its choice before recompute_ms entered the
        // base case), timed with the cut counted: stderr, for BENCHMARKS.
        auto counts = [](const remat::plan::Prediction& p) {
          std::string out;
          for (int f : p.forwards_per_stage) out += std::to_string(f);
          return out;
        };
        std::fprintf(stderr, "%s: forwards per stage %s, predicted %.0f ms", s.c_str(), counts(plan.prediction).c_str(),
                     plan.prediction.time_ms);
        if (s.rfind("opt:", 0) == 0) {
          remat::plan::Chain uncut = (*net)->chain();
          for (auto& st : uncut.stages) st.recompute_ms = -1;
          const auto old = remat::plan::optimal(uncut, static_cast<int64_t>(std::stod(s.substr(4)) * plain_peak));
          const auto timed = remat::plan::simulate((*net)->chain(), old.schedule);
          std::fprintf(stderr, "; uncut DP: %s, %.0f ms with the cut counted", counts(timed).c_str(), timed.time_ms);
        }
        if (s.rfind("menu:", 0) == 0) std::fprintf(stderr, "; options used: %s", options_used(**net).c_str());
        std::fprintf(stderr, "\n");
        nets.push_back(net);
        r.net = net;
        r.fn = [net](const torch::Tensor& in) { return (*net)->forward(in); };
      } catch (const remat::Error& e) {
        if (s.rfind("menu:", 0) == 0) {  // the runtime's own floor (the menu and the in-flight bytes)
          r.note = std::string("infeasible; ") + e.what();
          runs.push_back(r);
          continue;
        }
        const int64_t min_peak = remat::plan::min_feasible_peak_bytes(remat::profile(m.seq, m.x));
        r.note = "infeasible; smallest feasible peak " + std::to_string(min_peak) +
                 " bytes = " + std::to_string(double(min_peak) / plain_peak) + " of plain";
        runs.push_back(r);
        continue;
      }
    } else {
      std::fprintf(stderr, "unknown strategy %s\n", s.c_str());
      return 2;
    }
    runs.push_back(r);
  }

  for (auto& r : runs) {
    if (!r.fn) continue;
    for (int i = 0; i < warmup; ++i) step(m, r.fn);
    r.peak = peak_of(m, r.fn, meter, hold_output);
  }
  OpProfile prof;
  if (op_profile) prof.install();
  for (int s = 0; s < steps; ++s) {
    for (auto& r : runs) {
      if (!r.fn || (r.sweep && s >= sweep_steps)) continue;
      if (op_profile) {
        g_fwd_ops = &prof.per_strategy[r.name + " forward"];
        g_bwd_ops = &prof.per_strategy[r.name + " backward"];
      }
      auto t = step(m, r.fn);
      g_fwd_ops = g_bwd_ops = nullptr;
      r.ms.push_back(t.fwd_ms + t.bwd_ms);
      r.fwd_ms.push_back(t.fwd_ms);
      r.bwd_ms.push_back(t.bwd_ms);
      r.faults.push_back(static_cast<double>(t.faults));
    }
  }
  if (op_profile) prof.print(sweep_steps < steps ? sweep_steps : steps);
  for (const auto& r : runs) {  // menu:F after its steps (a step may reprice disk offload and re-plan)
    if (!r.net || r.name.rfind("menu:", 0) != 0) continue;
    const std::string how = (*r.net)->explain();
    const size_t at = how.find("disk offload repriced");
    std::fprintf(stderr, "%s final: predicted %.0f ms; options used: %s; %s\n", r.name.c_str(),
                 (*r.net)->plan().prediction.time_ms, options_used(**r.net).c_str(),
                 at == std::string::npos ? "not repriced" : how.substr(at, how.find('\n', at) - at).c_str());
  }
  if (explain) {  // the planned runs' explain() after their last step: stages, predicted and measured peaks
    for (const auto& r : runs) {
      if (r.net) std::fprintf(stderr, "== %s\n%s\n", r.name.c_str(), (*r.net)->explain().c_str());
    }
  }
  struct rusage ru1;
  getrusage(RUSAGE_SELF, &ru1);
  const long hwm_kib = std::max<long>(static_cast<long>(bench::status_kib("VmHWM")), 0);

  std::printf("{\"lang\": \"cpp\", \"model\": \"%s\", \"threads\": %d, \"meter\": \"%s\", \"plain_peak\": %lld,\n",
              model.c_str(), torch::get_num_threads(), meter.name.c_str(), (long long)plain_peak);
  std::printf(
      " \"blocks\": %zu, \"input_bytes\": %lld, \"param_bytes\": %lld, \"rss_delta_kib\": %ld, \"rss_mode\": %s,\n",
      m.seq->size(), (long long)m.x.nbytes(),
      [&] {
        int64_t b = 0;
        for (auto& p : m.seq->parameters()) b += p.nbytes();
        return (long long)b;
      }(),
      hwm_kib - rss0_kib, rss_mode ? "true" : "false");
  std::printf(" \"runs\": [\n");
  for (size_t i = 0; i < runs.size(); ++i) {
    const auto& r = runs[i];
    std::printf(
        "  {\"name\": \"%s\", \"peak\": %lld, \"predicted\": %lld, \"predicted_ms\": %.3f, \"note\": \"%s\", "
        "\"ms\": %s, \"fwd_ms\": %s, \"bwd_ms\": %s, \"faults\": %s}%s\n",
        r.name.c_str(), (long long)r.peak, (long long)r.predicted, r.predicted_ms, r.note.c_str(),
        bench::json_list(r.ms).c_str(), bench::json_list(r.fwd_ms).c_str(), bench::json_list(r.bwd_ms).c_str(),
        bench::json_list(r.faults).c_str(), i + 1 < runs.size() ? "," : "");
  }
  std::printf(" ],\n \"meta\": %s}\n", bench::metadata(argc, argv).c_str());
  return 0;
}
