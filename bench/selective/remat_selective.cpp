// remat_selective_bench: the C++ (remat) half of the selective-checkpointing
// benchmark (bench/py/selective.py drives it, against
// bench/py/selective_worker.py; docs/BENCHMARKS.md, "Selective
// checkpointing"). A stack of remat::models::GptBlock (dropout 0, explicit
// attention), switched between strategies with remat::enable_checkpointing
// on every block:
//   plain     no checkpointing
//   full      per-block full recompute (no policy: no op is intercepted)
//   nothing   policy::save_nothing(): full recompute through the interception
//             path (what the interception costs)
//   matmuls   policy::save_matmuls()
//   megatron  models::megatron_policy() = save_names(attn_qkv, attn_out, mlp_fc)
//   qkv_fc    save_names(attn_qkv, mlp_fc)
//   megatron_ctx  save_names(attn_qkv, attn_out, mlp_fc, attn_context)
// The strategies run interleaved (one step of each in turn) after warm-up.
// Every step is measured with the LD_PRELOAD counter of bench/preload (both
// workers run under it): peak bytes during forward + backward above the bytes
// alive before the forward, and the bytes held right after the forward; and
// the minor page faults of each step (getrusage).
// Before timing, each strategy's warm-up step checks that every parameter
// gradient (and the input's) equals plain's bitwise; a mismatch exits 3.
// --ops prints the op sequence the policy sees in one block's first run (at
// the given size), for the op-for-op check against the Python model.
// Prints one JSON object on stdout.
// Leaves out: the loss head and optimizer (the stack ends in .sum()).

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <remat/checkpoint.h>
#include <remat/checkpointable.h>
#include <remat/models/gpt.h>
#include <remat/policy.h>
#include <remat/selective.h>

#include "bench.h"

namespace {

using bench::arg;
using bench::Clock;
using bench::int_arg;
using bench::minor_faults;
using bench::ms_since;

/** nullopt: plain. Otherwise the options every GptBlock is switched on with. */
std::optional<remat::CheckpointOptions> options_of(const std::string& s) {
  namespace p = remat::policy;
  if (s == "plain") return std::nullopt;
  remat::CheckpointOptions o;
  if (s == "full") return o;
  if (s == "nothing") return o.policy(p::save_nothing());
  if (s == "matmuls") return o.policy(p::save_matmuls());
  if (s == "megatron") return o.policy(remat::models::megatron_policy());
  if (s == "qkv_fc") return o.policy(p::save_names({"attn_qkv", "mlp_fc"}));
  if (s == "megatron_ctx") return o.policy(p::save_names({"attn_qkv", "attn_out", "mlp_fc", "attn_context"}));
  std::fprintf(stderr, "unknown strategy %s\n", s.c_str());
  std::exit(2);
}

struct Config {
  int64_t d_model, heads, seq_len, batch, blocks;
};

}  // namespace

int main(int argc, char** argv) {
  torch::set_num_threads(static_cast<int>(int_arg(argc, argv, "--threads", "1")));
  const Config c{int_arg(argc, argv, "--d-model", "512"), int_arg(argc, argv, "--heads", "8"),
                 int_arg(argc, argv, "--seq-len", "512"), int_arg(argc, argv, "--batch", "4"),
                 int_arg(argc, argv, "--blocks", "8")};
  torch::manual_seed(0);

  if (bench::flag(argc, argv, "--ops")) {  // the ops of one block's first run, as the policy sees them
    std::vector<std::string> seen;
    remat::Policy log("log", [&seen](const remat::OpCall& call) {
      if (call.tag().empty()) seen.push_back(call.name() + (call.overload().empty() ? "" : "." + call.overload()));
      return remat::OpDecision::kPreferRecompute;
    });
    remat::models::GptBlock block(c.d_model, c.heads, 0.0);
    block->train();
    auto x = torch::randn({c.batch, c.seq_len, c.d_model}).requires_grad_(true);
    remat::enable_checkpointing(*block, remat::select::type<remat::models::GptBlockImpl>(),
                                remat::CheckpointOptions().policy(log));
    block->forward(x).sum().backward();
    std::printf("{\"lang\": \"cpp\", \"ops\": [");
    for (size_t i = 0; i < seen.size(); ++i) std::printf("%s\"%s\"", i ? ", " : "", seen[i].c_str());
    std::printf("]}\n");
    return 0;
  }

  const int steps = static_cast<int>(int_arg(argc, argv, "--steps", "3"));
  const int warmup = std::max(1, static_cast<int>(int_arg(argc, argv, "--warmup", "1")));
  auto names = bench::split(arg(argc, argv, "--strategies", "plain,full,matmuls,megatron"), ',');
  if (names.empty() || names[0] != "plain") names.insert(names.begin(), "plain");  // the reference

  bench::Meter meter("remat_selective_bench", true);
  torch::nn::Sequential seq;
  for (int64_t i = 0; i < c.blocks; ++i) seq->push_back(remat::models::GptBlock(c.d_model, c.heads, 0.0));
  seq->train();
  auto x = torch::randn({c.batch, c.seq_len, c.d_model}).requires_grad_(true);
  auto params = seq->parameters();
  const auto block_type = remat::select::type<remat::models::GptBlockImpl>();

  struct Run {
    std::string name;
    std::optional<remat::CheckpointOptions> options;
    std::string policy;
    bool grads_equal = true;
    std::vector<double> ms, fwd_ms, bwd_ms;
    std::vector<int64_t> peak, held, minflt;
    int64_t ops_saved = 0, ops_replayed = 0, ops_recomputed = 0;  // per step
  };
  std::vector<Run> runs;
  for (const auto& n : names) {
    Run r;
    r.name = n;
    r.options = options_of(n);
    r.policy = !r.options ? "-" : r.options->policy() ? r.options->policy()->description() : "none (full recompute)";
    runs.push_back(std::move(r));
  }

  auto step = [&](Run& r, bool record) {
    remat::disable_checkpointing(*seq);
    if (r.options) remat::enable_checkpointing(*seq, block_type, *r.options);
    for (auto& p : params) {
      if (p.grad().defined()) p.mutable_grad().zero_();
    }
    x.mutable_grad() = torch::Tensor();
    remat::reset_checkpoint_stats();
    meter.reset();
    const int64_t base = meter.current();
    const int64_t faults0 = minor_faults();
    auto t0 = Clock::now();
    auto loss = seq->forward(x).sum();
    const double fwd = ms_since(t0);
    const int64_t held = meter.current() - base;
    auto t1 = Clock::now();
    loss.backward();
    const double bwd = ms_since(t1);
    const int64_t peak = meter.peak() - base;
    const int64_t faults = minor_faults() - faults0;
    if (record) {
      r.minflt.push_back(faults);
      r.ms.push_back(fwd + bwd);
      r.fwd_ms.push_back(fwd);
      r.bwd_ms.push_back(bwd);
      r.peak.push_back(peak);
      r.held.push_back(held);
      const auto st = remat::checkpoint_stats();
      r.ops_saved = st.ops_saved;
      r.ops_replayed = st.ops_replayed;
      r.ops_recomputed = st.ops_recomputed;
    }
  };

  // One plain step allocates the parameter gradients, so every later step
  // (plain's reference included) accumulates into zeroed buffers alike.
  step(runs[0], false);
  std::vector<torch::Tensor> ref;
  auto bitwise_equal = [](const torch::Tensor& a, const torch::Tensor& b) {
    return a.defined() && b.defined() && a.sizes() == b.sizes() &&
           torch::equal(a.contiguous().view(torch::kInt32), b.contiguous().view(torch::kInt32));
  };
  for (auto& r : runs) {
    for (int i = 0; i < warmup; ++i) step(r, false);
    std::vector<torch::Tensor> g;
    for (auto& p : params) g.push_back(p.grad().clone());
    g.push_back(x.grad().clone());
    if (ref.empty()) {
      ref = std::move(g);
      continue;
    }
    for (size_t i = 0; i < g.size(); ++i) r.grads_equal = r.grads_equal && bitwise_equal(g[i], ref[i]);
    std::fprintf(stderr, "gradients of %s vs plain (%zu parameters + input): %s\n", r.name.c_str(), params.size(),
                 r.grads_equal ? "bitwise equal" : "DIFFERENT");
  }
  ref.clear();
  for (int s = 0; s < steps; ++s) {
    for (auto& r : runs) step(r, true);
  }

  bool all_equal = true;
  int64_t param_bytes = 0;
  for (auto& p : params) param_bytes += p.nbytes();
  std::printf(
      "{\"lang\": \"cpp\", \"threads\": %d, \"d_model\": %lld, \"heads\": %lld, \"seq_len\": %lld, "
      "\"batch\": %lld, \"blocks\": %lld,\n \"param_bytes\": %lld, \"input_bytes\": %lld, \"runs\": [\n",
      torch::get_num_threads(), (long long)c.d_model, (long long)c.heads, (long long)c.seq_len, (long long)c.batch,
      (long long)c.blocks, (long long)param_bytes, (long long)x.nbytes());
  for (size_t i = 0; i < runs.size(); ++i) {
    const auto& r = runs[i];
    all_equal = all_equal && r.grads_equal;
    std::printf(
        "  {\"name\": \"%s\", \"policy\": \"%s\", \"grads_equal\": %s, \"ops_saved\": %lld, "
        "\"ops_replayed\": %lld, \"ops_recomputed\": %lld,\n   \"peak\": %s, \"held\": %s, \"minflt\": %s,\n   \"ms\": "
        "%s, "
        "\"fwd_ms\": %s, \"bwd_ms\": %s}%s\n",
        r.name.c_str(), r.policy.c_str(), r.grads_equal ? "true" : "false", (long long)r.ops_saved,
        (long long)r.ops_replayed, (long long)r.ops_recomputed, bench::json_list(r.peak).c_str(),
        bench::json_list(r.held).c_str(), bench::json_list(r.minflt).c_str(), bench::json_list(r.ms, 3).c_str(),
        bench::json_list(r.fwd_ms, 3).c_str(), bench::json_list(r.bwd_ms, 3).c_str(), i + 1 < runs.size() ? "," : "");
  }
  std::printf(" ],\n \"meta\": %s}\n", bench::metadata(argc, argv).c_str());
  return all_equal ? 0 : 3;
}
