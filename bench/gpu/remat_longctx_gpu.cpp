// remat_longctx_gpu: the long-context levers on a GPU, for bench/gpu/check.sh.
// remat's whole GPT training step (token and position embedding, blocks,
// final LayerNorm, tied LM head, cross-entropy, backward; no optimizer
// step) at the GPU reference size (d_model 2048, 16 heads, T 2048,
// batch 8, 24 blocks, bf16 autocast, SDPA attention) with a 32k vocabulary,
// per strategy:
//   plain        no checkpointing, full logits
//   block        remat checkpoint per block (enable_checkpointing), full logits
//   loss         chunked head + loss (GptConfig::loss_chunks), no checkpointing
//   loss+block   chunked head + loss, checkpoint per block
//   all          chunked head + loss, chunked MLP, checkpoint per block
// Reports per strategy: the peak of a step above the bytes live before it
// (CUDA caching allocator: parameters and their gradients are live before,
// so excluded), the median of --steps synchronized step times, the loss
// (equal across strategies up to reassociation: checked), and the longest
// sequence at --search-batch whose whole step (parameters and gradients
// included, no optimizer state) peaks under --cap-gib
// (doubling from --seq-len, then bisection in steps of 1024 tokens).
// Prints one JSON object on stdout (and to --json PATH). Runs on CPU too
// (--device cpu --quick) for a smoke test.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <remat/models/gpt.h>
#include <remat/remat.h>

#include "bench.h"
#include "gpu_common.h"

namespace {

using bench::arg;
using bench::Clock;
using bench::double_arg;
using bench::flag;
using bench::int_arg;
using bench::num;
using bench::quoted;
using bench::secs_since;
using bench::split;

struct Shape {
  int64_t d_model, heads, blocks, vocab, loss_chunks, mlp_chunks;
};

struct Run {
  std::string strategy;
  int64_t seq_len = 0, batch = 0;
  int64_t peak = -1;   // bytes above the start of the step (parameters and gradients excluded)
  int64_t total = -1;  // the step's peak with everything live (parameters and gradients included)
  double step_s = -1, loss = 0;
  std::string error;
};

remat::models::Gpt build(const Shape& s, const std::string& strategy, int64_t seq_len, const Device& dev) {
  remat::models::GptConfig c;
  c.vocab = s.vocab;
  c.seq_len = seq_len;
  c.d_model = s.d_model;
  c.heads = s.heads;
  c.layers = s.blocks;
  c.sdpa = true;
  c.loss_chunks = strategy == "plain" || strategy == "block" ? 0 : s.loss_chunks;
  c.mlp_chunks = strategy == "all" ? s.mlp_chunks : 0;
  torch::manual_seed(0);
  remat::models::Gpt net(c);
  if (strategy == "block" || strategy == "loss+block" || strategy == "all") {
    remat::enable_checkpointing(*net, remat::select::type<remat::models::GptBlockImpl>());
  }
  net->to(dev.device);
  for (auto& p : net->parameters()) p.mutable_grad() = torch::zeros_like(p);
  return net;
}

/** steps timed steps (after one warm-up) of net (built for strategy) at
 *  (batch, seq_len <= its seq_len). */
Run measure(remat::models::Gpt& net, const Shape& s, const std::string& strategy, int64_t batch, int64_t seq_len,
            int steps, bool autocast, const Device& dev) {
  Run r;
  r.strategy = strategy;
  r.seq_len = seq_len;
  r.batch = batch;
  try {
    torch::manual_seed(1);
    auto ids = torch::randint(s.vocab, {batch, seq_len + 1}, torch::TensorOptions().dtype(torch::kLong)).to(dev.device);
    auto x = ids.slice(1, 0, seq_len), y = ids.slice(1, 1, seq_len + 1);
    std::vector<double> times;
    for (int i = 0; i <= steps; ++i) {
      for (auto& p : net->parameters()) p.mutable_grad().zero_();
      dev.sync();
      dev.reset_peak();
      const int64_t base = dev.current();
      auto t0 = Clock::now();
      torch::Tensor loss;
      {
        Autocast ac(dev.device.type(), autocast);
        loss = net->loss(net->blocks->forward(net->embed(x)), y);
      }
      loss.backward();
      dev.sync();
      if (i > 0) times.push_back(secs_since(t0));
      r.peak = std::max(r.peak, dev.peak() - base);
      r.total = std::max(r.total, dev.peak());
      r.loss = loss.item<double>();
    }
    std::sort(times.begin(), times.end());
    r.step_s = times.empty() ? -1 : times[times.size() / 2];
  } catch (const std::exception& e) {
    r.error = is_oom(e) ? "out of memory" : std::string(e.what()).substr(0, 200);
  }
  dev.empty_cache();
  return r;
}

std::string json(const Run& r) {
  std::ostringstream o;
  o << "{\"strategy\": " << quoted(r.strategy) << ", \"batch\": " << r.batch << ", \"seq_len\": " << r.seq_len
    << ", \"peak_bytes\": " << r.peak << ", \"total_peak_bytes\": " << r.total << ", \"step_s\": " << num(r.step_s)
    << ", \"loss\": " << num(r.loss) << ", \"error\": " << quoted(r.error) << "}";
  return o.str();
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = flag(argc, argv, "--quick");
  Device dev;
  dev.device = torch::Device(arg(argc, argv, "--device", "cuda"));
  if (dev.cuda() && !torch::cuda::is_available()) {
    std::fprintf(stderr, "remat_longctx_gpu: --device cuda but no CUDA device is visible\n");
    return 2;
  }
  if (!dev.cuda()) remat::memory::enable_tracking();  // CPU: remat's counting allocator
  const Shape s{int_arg(argc, argv, "--d-model", quick ? "64" : "2048"),
                int_arg(argc, argv, "--heads", quick ? "4" : "16"),
                int_arg(argc, argv, "--blocks", quick ? "2" : "24"),
                int_arg(argc, argv, "--vocab", quick ? "1000" : "32000"),
                int_arg(argc, argv, "--loss-chunks", "16"),
                int_arg(argc, argv, "--mlp-chunks", "8")};
  const int64_t seq_len = int_arg(argc, argv, "--seq-len", quick ? "64" : "2048");
  const int64_t batch = int_arg(argc, argv, "--batch", quick ? "2" : "8");
  const int steps = static_cast<int>(int_arg(argc, argv, "--steps", quick ? "1" : "3"));
  const bool autocast = arg(argc, argv, "--autocast", dev.cuda() ? "bf16" : "none") == "bf16";
  const auto strategies = split(arg(argc, argv, "--strategies", "plain,block,loss,loss+block,all"), ',');
  const auto searched = split(arg(argc, argv, "--search", "plain,block,loss+block,all"), ',');
  const double cap = double_arg(argc, argv, "--cap-gib", quick ? "0.05" : "40") * (1LL << 30);
  const int64_t search_batch = int_arg(argc, argv, "--search-batch", "1");
  const int64_t granule = int_arg(argc, argv, "--search-step", quick ? "64" : "1024");
  const int64_t max_seq = int_arg(argc, argv, "--max-seq-len", quick ? "1024" : "131072");
  const double time_limit = double_arg(argc, argv, "--time-limit-s", "240");
  const std::string json_path = arg(argc, argv, "--json", "");
  torch::set_num_threads(static_cast<int>(int_arg(argc, argv, "--threads", quick ? "1" : "8")));
  const auto start = Clock::now();

  std::vector<Run> fixed;
  for (const auto& st : strategies) {
    auto net = build(s, st, seq_len, dev);
    fixed.push_back(measure(net, s, st, batch, seq_len, steps, autocast, dev));
    net = nullptr;
    dev.empty_cache();
    std::fprintf(stderr, "%s\n", json(fixed.back()).c_str());
  }
  // Same model, same data: the losses agree up to reassociation (bf16
  // products in the chunked loss run on slices).
  std::string loss_check = "ok";
  for (const auto& r : fixed) {
    if (!r.error.empty() || !fixed[0].error.empty()) continue;
    if (std::abs(r.loss - fixed[0].loss) > 1e-2 * std::abs(fixed[0].loss)) {
      loss_check = "loss of " + r.strategy + " " + std::to_string(r.loss) + " differs from " + fixed[0].strategy +
                   "'s " + std::to_string(fixed[0].loss);
    }
  }

  // Longest sequence under the cap, per searched strategy: double until a
  // step exceeds the cap (or fails), then bisect in granules.
  std::vector<std::string> fits;
  for (const auto& st : searched) {
    // One model per strategy (initialising 1.3 billion parameters takes
    // seconds), its position embedding long enough for every probe.
    auto net = build(s, st, max_seq, dev);
    auto fits_at = [&](int64_t T) {
      auto r = measure(net, s, st, search_batch, T, 0, autocast, dev);
      std::fprintf(stderr, "search %s\n", json(r).c_str());
      return r.error.empty() && r.total <= cap;
    };
    int64_t lo = 0, hi = 0, T = granule;
    std::string note;
    while (T <= max_seq) {
      if (secs_since(start) > time_limit) {
        note = "time limit";
        break;
      }
      if (!fits_at(T)) {
        hi = T;
        break;
      }
      lo = T;
      T *= 2;
    }
    if (hi == 0 && note.empty()) note = "reached --max-seq-len";
    while (hi > 0 && hi - lo > granule && note.empty()) {
      if (secs_since(start) > time_limit) {
        note = "time limit";
        break;
      }
      const int64_t mid = (lo + hi) / 2 / granule * granule;
      (fits_at(mid) ? lo : hi) = mid;
    }
    std::ostringstream o;
    o << "{\"strategy\": " << quoted(st) << ", \"batch\": " << search_batch << ", \"max_seq_len\": " << lo
      << ", \"first_over\": " << hi << ", \"note\": " << quoted(note) << "}";
    fits.push_back(o.str());
    net = nullptr;
    dev.empty_cache();
    std::fprintf(stderr, "fit %s\n", fits.back().c_str());
  }

  std::ostringstream o;
  o << "{\"device\": " << quoted(dev.cuda() ? "cuda" : "cpu") << ", \"meter\": " << quoted(dev.meter())
    << ", \"autocast_bf16\": " << (autocast ? "true" : "false") << ", \"d_model\": " << s.d_model
    << ", \"heads\": " << s.heads << ", \"blocks\": " << s.blocks << ", \"vocab\": " << s.vocab
    << ", \"loss_chunks\": " << s.loss_chunks << ", \"mlp_chunks\": " << s.mlp_chunks
    << ", \"cap_bytes\": " << static_cast<int64_t>(cap) << ", \"loss_check\": " << quoted(loss_check)
    << ",\n \"runs\": [";
  for (size_t i = 0; i < fixed.size(); ++i) o << (i ? ",\n  " : "\n  ") << json(fixed[i]);
  o << "],\n \"fits\": [";
  for (size_t i = 0; i < fits.size(); ++i) o << (i ? ",\n  " : "\n  ") << fits[i];
  o << "]}\n";
  std::fputs(o.str().c_str(), stdout);
  if (!json_path.empty()) std::ofstream(json_path) << o.str();
  return loss_check == "ok" ? 0 : 1;
}
