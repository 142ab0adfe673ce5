// remat_longctx: the long-context benchmark (docs/BENCHMARKS.md, "Long
// context"): the reference GPT whole training step with a 32k
// vocabulary, where the (B, T, vocab) logits and the MLP's (B, T, 4C)
// intermediates rival the blocks' activations. One step: token + position
// embedding, 8 blocks (explicit attention), final LayerNorm, LM head tied to
// the token embedding, mean cross-entropy, backward, AdamW step
// (torch::optim::AdamW, defaults: lr 1e-3, weight decay 1e-2), gradients
// zeroed in place (zero_grad(false)). Data: random token ids, a new batch per
// round, the same for every strategy (the values change neither memory nor
// time). Strategies, each its own model and optimizer built from the same
// seed:
//   plain            no checkpointing, the full logits
//   block            every GptBlock checkpointed (enable_checkpointing)
//   chunk            head + loss in --loss-chunks (8) slices of the tokens
//                    (GptConfig::loss_chunks: chunked_cross_entropy)
//   chunk_mlp        chunk, and each MLP over --mlp-chunks (8) checkpointed slices
//                    of the sequence (GptConfig::mlp_chunks)
//   chunk_block      chunk + block
//   chunk_mlp_block  chunk_mlp + block
// Each strategy runs one warm-up step (it allocates the parameter gradients
// and AdamW's state), then the strategies run interleaved, one step each in
// turn (A B C ... A B C ...), for --rounds rounds. Per step: wall time
// (zero_grad to the end of the AdamW step) and the peak of remat::memory
// (c10's CPU allocator) above the bytes alive at the step's start. From the
// second step on the gradients, the parameters and AdamW's state are alive
// at the start, so the peak covers activations, the loss and head's
// temporaries, activation gradients, recompute, fresh parameter gradients
// before they are accumulated and the optimizer's temporaries, not the
// gradient buffers themselves. The peak of each phase (forward with the
// loss, backward, optimizer step; each above the same start) is recorded too,
// so a record says which phase sets the peak. Under LD_PRELOAD of
// bench/preload the same peak is also read from that counter (the one the
// Python anchor, bench/py/longctx.py, reads).
// The warm-up step checks that every strategy's loss equals plain's within a
// relative 1e-5 (same weights, same batch); otherwise it exits 3, loudly.
// Writes JSON lines to bench/results/longctx.json (--quick: a toy size,
// longctx-quick.json; --out elsewhere): a first record {"kind": "meta"}
// with bench.h's run-metadata record, the size and settings, then one
// {"kind": "strategy"} record per strategy: step times, peaks, the paired
// ratios of each round's step time to plain's in the same round (median,
// min, max) and the peak's ratio to plain's. Prints a table.
// Leaves out: dropout (0), SDPA attention, mixed precision, real text.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <remat/checkpointable.h>
#include <remat/memory.h>
#include <remat/models/gpt.h>

#include "bench.h"

namespace {

using remat::models::Gpt;
using remat::models::GptConfig;

struct Size {
  int64_t d_model, heads, blocks, seq_len, batch, vocab;
};
constexpr Size kReference{512, 8, 8, 512, 4, 32000};  // the CPU reference GPT, 32k vocabulary
constexpr Size kQuick{64, 4, 2, 128, 2, 2000};        // a toy size for smoke runs

struct Strategy {
  std::string name, label;
  bool chunk_loss = false, chunk_mlp = false, block = false;
};

const std::vector<Strategy> kStrategies = {
    {"plain", "plain", false, false, false},
    {"block", "block (every block checkpointed)", false, false, true},
    {"chunk", "chunked head+loss", true, false, false},
    {"chunk_mlp", "chunked head+loss+MLP", true, true, false},
    {"chunk_block", "chunked head+loss + block", true, false, true},
    {"chunk_mlp_block", "chunked head+loss+MLP + block", true, true, true},
};

struct Run {
  Strategy s;
  Gpt net{nullptr};
  std::unique_ptr<torch::optim::AdamW> opt;
  double loss1 = 0;         // loss of the warm-up step (step 1)
  int64_t warmup_peak = 0;  // its peak (gradients and AdamW state allocated then)
  std::vector<double> ms, fwd_ms, bwd_ms, opt_ms;
  std::vector<int64_t> peak, peak_preload, held;  // per timed step; held: bytes alive after the step above its start
  std::vector<int64_t> peak_fwd, peak_bwd, peak_opt;  // per timed step: the peak within each phase
};

struct Measured {
  double ms, fwd_ms, bwd_ms, opt_ms, loss;
  int64_t peak, peak_preload, held;
  int64_t peak_fwd, peak_bwd, peak_opt;  // remat::memory's peak in forward (with the loss), backward, optimizer step
};

Measured step(Run& r, const torch::Tensor& idx, const torch::Tensor& targets, bench::Meter& meter) {
  const auto t0 = bench::Clock::now();
  r.opt->zero_grad(/*set_to_none=*/false);  // gradients stay allocated
  const int64_t base = remat::memory::current_bytes(), base_preload = meter.current();
  int64_t peak[3], peak_preload = 0;  // per phase, above base
  auto phase = [&](int i) {           // the phase's peaks; restarts both counters' peaks
    peak[i] = remat::memory::peak_bytes() - base;
    peak_preload = std::max(peak_preload, meter.peak() - base_preload);
    remat::memory::reset_peak();
    meter.reset();
  };
  remat::memory::reset_peak();
  meter.reset();
  auto h = r.net->blocks->forward(r.net->embed(idx));  // (B, T, C)
  auto loss = r.net->loss(h, targets);                 // ()
  h = torch::Tensor();
  const double fwd = bench::ms_since(t0);
  phase(0);
  const auto t1 = bench::Clock::now();
  loss.backward();
  const double bwd = bench::ms_since(t1);
  phase(1);
  const auto t2 = bench::Clock::now();
  r.opt->step();
  const double opt = bench::ms_since(t2);
  const double ms = bench::ms_since(t0);
  phase(2);
  const double value = loss.item<double>();
  loss = torch::Tensor();
  return {ms,           fwd,
          bwd,          opt,
          value,        std::max({peak[0], peak[1], peak[2]}),
          peak_preload, remat::memory::current_bytes() - base,
          peak[0],      peak[1],
          peak[2]};
}

std::string strategy_record(const Run& r, const Run& plain, const GptConfig& c, const std::string& meter_name) {
  std::vector<double> ratio;  // this round's step time / plain's in the same round
  for (size_t i = 0; i < r.ms.size() && i < plain.ms.size(); ++i) ratio.push_back(r.ms[i] / plain.ms[i]);
  std::vector<double> peaks(r.peak.begin(), r.peak.end()), plain_peaks(plain.peak.begin(), plain.peak.end());
  std::vector<double> pre(r.peak_preload.begin(), r.peak_preload.end());
  const double peak = bench::median(peaks), plain_peak = bench::median(plain_peaks);
  const auto [lo, hi] = std::minmax_element(ratio.begin(), ratio.end());
  std::string o = "{\"kind\": \"strategy\", \"lang\": \"cpp\", \"name\": " + bench::quoted(r.s.name) +
                  ", \"label\": " + bench::quoted(r.s.label) + ", \"loss_chunks\": " + std::to_string(c.loss_chunks) +
                  ", \"mlp_chunks\": " + std::to_string(c.mlp_chunks) +
                  ", \"block\": " + (r.s.block ? "true" : "false");
  o += ", \"loss_step1\": " + bench::num(r.loss1, 8) +
       ", \"loss_rel_diff\": " + bench::num(std::abs(r.loss1 - plain.loss1) / std::abs(plain.loss1), 10);
  o += ", \"median_step_ms\": " + bench::num(bench::median(r.ms), 1) +
       ", \"time_x\": " + bench::num(bench::median(ratio), 4) +
       ", \"time_x_min\": " + bench::num(ratio.empty() ? 0 : *lo, 4) +
       ", \"time_x_max\": " + bench::num(ratio.empty() ? 0 : *hi, 4);
  o += ", \"peak_bytes\": " + std::to_string(static_cast<int64_t>(peak)) +
       ", \"peak_x\": " + bench::num(plain_peak > 0 ? peak / plain_peak : 0, 4);
  if (meter_name == "preload")
    o += ", \"peak_preload_bytes\": " + std::to_string(static_cast<int64_t>(bench::median(pre)));
  o += ", \"warmup_peak_bytes\": " + std::to_string(r.warmup_peak);
  o += ", \"step_ms\": " + bench::json_list(r.ms, 1) + ", \"fwd_ms\": " + bench::json_list(r.fwd_ms, 1) +
       ", \"bwd_ms\": " + bench::json_list(r.bwd_ms, 1) + ", \"opt_ms\": " + bench::json_list(r.opt_ms, 1) +
       ", \"time_x_rounds\": " + bench::json_list(ratio, 4) + ", \"peaks\": " + bench::json_list(r.peak) +
       ", \"held_bytes\": " + bench::json_list(r.held) + ", \"peak_fwd_bytes\": " + bench::json_list(r.peak_fwd) +
       ", \"peak_bwd_bytes\": " + bench::json_list(r.peak_bwd) +
       ", \"peak_opt_bytes\": " + bench::json_list(r.peak_opt) + "}";
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  if (bench::flag(argc, argv, "--help")) {
    std::printf(
        "remat_longctx [--quick] [--rounds N (5; --quick 3)] [--threads 1] [--seed 0] [--loss-chunks 8]\n"
        "  [--mlp-chunks 8] [--strategies plain,block,chunk,chunk_mlp,chunk_block,chunk_mlp_block]\n"
        "  [--d-model --heads --blocks --seq-len --batch --vocab] [--out FILE]\n"
        "The reference GPT training step with a 32k vocabulary under chunked loss / MLP and block\n"
        "checkpointing; writes JSON lines to bench/results/longctx.json (--quick: longctx-quick.json).\n");
    return 0;
  }
  const bool quick = bench::flag(argc, argv, "--quick");
  const Size d = quick ? kQuick : kReference;
  Size z;
  z.d_model = bench::int_arg(argc, argv, "--d-model", std::to_string(d.d_model));
  z.heads = bench::int_arg(argc, argv, "--heads", std::to_string(d.heads));
  z.blocks = bench::int_arg(argc, argv, "--blocks", std::to_string(d.blocks));
  z.seq_len = bench::int_arg(argc, argv, "--seq-len", std::to_string(d.seq_len));
  z.batch = bench::int_arg(argc, argv, "--batch", std::to_string(d.batch));
  z.vocab = bench::int_arg(argc, argv, "--vocab", std::to_string(d.vocab));
  const int64_t rounds = bench::int_arg(argc, argv, "--rounds", quick ? "3" : "5");
  const int64_t threads = bench::int_arg(argc, argv, "--threads", "1");
  const int64_t seed = bench::int_arg(argc, argv, "--seed", "0");
  // 8 slices of B*T = 2048 tokens: 256 x 32000 float32 logits, 31 MiB a
  // slice. Measured at the reference size (3 rounds each, 4/8/16/32
  // slices): with block checkpointing the peak is 231.5 MiB at 4 slices and
  // 210.8 MiB from 8 on (one block's recompute sets it then); without it
  // 970/939/923/915 MiB; the step time grows with the slices (chunked
  // head+loss against plain 0.95/1.00/1.03/1.12x: each slice is one more
  // pass over the (vocab, C) weight gradient). 8 is the knee.
  const int64_t loss_chunks = bench::int_arg(argc, argv, "--loss-chunks", "8");
  // 8 slices of T: one slice's (B, T/8, 4C) MLP intermediates, 2 MiB each.
  const int64_t mlp_chunks = bench::int_arg(argc, argv, "--mlp-chunks", "8");
  const std::string names =
      bench::arg(argc, argv, "--strategies", "plain,block,chunk,chunk_mlp,chunk_block,chunk_mlp_block");
#ifdef REMAT_SOURCE_DIR
  const std::string results = REMAT_SOURCE_DIR "/bench/results/";
#else
  const std::string results = "bench/results/";
#endif
  const std::string out = bench::arg(argc, argv, "--out", results + (quick ? "longctx-quick.json" : "longctx.json"));
  if (rounds < 1 || loss_chunks < 1 || mlp_chunks < 1) {
    std::fprintf(stderr, "remat_longctx: --rounds, --loss-chunks and --mlp-chunks must be >= 1\n");
    return 2;
  }
  torch::set_num_threads(static_cast<int>(threads));
  remat::memory::enable_tracking();
  bench::Meter meter("remat_longctx", false);

  std::vector<Run> runs;
  for (const auto& n : bench::split(names, ',')) {
    auto it = std::find_if(kStrategies.begin(), kStrategies.end(), [&](const Strategy& s) { return s.name == n; });
    if (it == kStrategies.end()) {
      std::fprintf(stderr, "remat_longctx: unknown strategy \"%s\"\n", n.c_str());
      return 2;
    }
    runs.emplace_back();
    runs.back().s = *it;
  }
  if (runs.empty() || runs[0].s.name != "plain") {
    std::fprintf(stderr, "remat_longctx: --strategies must start with plain (the reference of the ratios)\n");
    return 2;
  }
  for (auto& r : runs) {
    GptConfig c;
    c.vocab = z.vocab;
    c.seq_len = z.seq_len;
    c.d_model = z.d_model;
    c.heads = z.heads;
    c.layers = z.blocks;
    c.loss_chunks = r.s.chunk_loss ? loss_chunks : 0;
    c.mlp_chunks = r.s.chunk_mlp ? mlp_chunks : 0;
    torch::manual_seed(seed);  // the same weights for every strategy
    r.net = Gpt(c);
    r.net->train();
    if (r.s.block) remat::enable_checkpointing(*r.net, remat::select::type<remat::models::GptBlockImpl>());
    r.opt = std::make_unique<torch::optim::AdamW>(r.net->parameters(), torch::optim::AdamWOptions(1e-3));
  }
  auto batch = [&](int64_t round) {  // (B, T) inputs and next-token targets
    torch::manual_seed(seed + 1000 + round);
    auto tokens = torch::randint(0, z.vocab, {z.batch, z.seq_len + 1}, torch::kLong);  // (B, T + 1)
    return std::make_pair(tokens.slice(1, 0, z.seq_len).contiguous(), tokens.slice(1, 1).contiguous());
  };
  int64_t param_bytes = 0;
  for (const auto& p : runs[0].net->parameters()) param_bytes += p.nbytes();
  std::fprintf(stderr,
               "remat_longctx: d_model %lld, %lld heads, %lld blocks, T %lld, batch %lld, vocab %lld, %lld threads, "
               "%.1f MiB of parameters, %lld rounds, meter %s\n",
               (long long)z.d_model, (long long)z.heads, (long long)z.blocks, (long long)z.seq_len, (long long)z.batch,
               (long long)z.vocab, (long long)threads, param_bytes / 1048576.0, (long long)rounds, meter.name.c_str());

  // Warm-up (step 1) and the loss check: same weights, same batch.
  {
    auto [idx, tgt] = batch(0);
    for (auto& r : runs) {
      const auto m = step(r, idx, tgt, meter);
      r.loss1 = m.loss;
      r.warmup_peak = m.peak;
      std::fprintf(stderr, "  warm-up %-16s loss %.8f  %.0f ms\n", r.s.name.c_str(), m.loss, m.ms);
    }
    bool ok = true;
    for (auto& r : runs) {
      const double rel = std::abs(r.loss1 - runs[0].loss1) / std::abs(runs[0].loss1);
      if (!(rel <= 1e-5)) {
        std::fprintf(stderr,
                     "remat_longctx: LOSS MISMATCH: %s's step-1 loss %.8f differs from plain's %.8f by %.3g "
                     "(relative; at most 1e-5 allowed). The strategies do not compute the same step.\n",
                     r.s.name.c_str(), r.loss1, runs[0].loss1, rel);
        ok = false;
      }
    }
    if (!ok) return 3;
  }
  for (int64_t round = 1; round <= rounds; ++round) {
    auto [idx, tgt] = batch(round);
    for (auto& r : runs) {
      const auto m = step(r, idx, tgt, meter);
      r.ms.push_back(m.ms);
      r.fwd_ms.push_back(m.fwd_ms);
      r.bwd_ms.push_back(m.bwd_ms);
      r.opt_ms.push_back(m.opt_ms);
      r.peak.push_back(m.peak);
      r.peak_preload.push_back(m.peak_preload);
      r.held.push_back(m.held);
      r.peak_fwd.push_back(m.peak_fwd);
      r.peak_bwd.push_back(m.peak_bwd);
      r.peak_opt.push_back(m.peak_opt);
    }
    std::fprintf(stderr, "  round %lld/%lld: plain %.0f ms\n", (long long)round, (long long)rounds, runs[0].ms.back());
  }

  std::string text =
      "{\"kind\": \"meta\", \"meta\": " + bench::metadata(argc, argv) +
      ", \"size\": {\"d_model\": " + std::to_string(z.d_model) + ", \"heads\": " + std::to_string(z.heads) +
      ", \"blocks\": " + std::to_string(z.blocks) + ", \"seq_len\": " + std::to_string(z.seq_len) +
      ", \"batch\": " + std::to_string(z.batch) + ", \"vocab\": " + std::to_string(z.vocab) +
      ", \"dtype\": \"float32\", \"attention\": \"explicit\"" + ", \"quick\": " + (quick ? "true" : "false") +
      "}, \"settings\": {\"rounds\": " + std::to_string(rounds) +
      ", \"warmup\": 1, \"threads\": " + std::to_string(threads) + ", \"seed\": " + std::to_string(seed) +
      ", \"loss_chunks\": " + std::to_string(loss_chunks) + ", \"mlp_chunks\": " + std::to_string(mlp_chunks) +
      ", \"optimizer\": \"AdamW(lr 1e-3, weight_decay 1e-2)\", \"zero_grad\": \"in place\"" +
      ", \"meter\": " + bench::quoted(meter.name) + "}, \"param_bytes\": " + std::to_string(param_bytes) + "}\n";
  std::printf("%-34s %10s %8s %9s %22s %11s\n", "strategy", "peak MiB", "vs plain", "step s", "time vs plain [range]",
              "loss rel");
  for (auto& r : runs) {
    GptConfig c = r.net->config();
    text += strategy_record(r, runs[0], c, meter.name) + "\n";
    std::vector<double> ratio, peaks(r.peak.begin(), r.peak.end()),
        plain_peaks(runs[0].peak.begin(), runs[0].peak.end());
    for (size_t i = 0; i < r.ms.size(); ++i) ratio.push_back(r.ms[i] / runs[0].ms[i]);
    const auto [lo, hi] = std::minmax_element(ratio.begin(), ratio.end());
    std::printf("%-34s %10.1f %7.2fx %9.2f %9.3fx [%.3f-%.3f] %11.2g\n", r.s.label.c_str(),
                bench::median(peaks) / 1048576.0, bench::median(peaks) / bench::median(plain_peaks),
                bench::median(r.ms) / 1e3, bench::median(ratio), *lo, *hi,
                std::abs(r.loss1 - runs[0].loss1) / std::abs(runs[0].loss1));
  }
  const std::string tmp = out + ".tmp";
  {
    std::ofstream f(tmp);
    f << text;
    if (!f) {
      std::fprintf(stderr, "remat_longctx: cannot write %s\n", tmp.c_str());
      return 2;
    }
  }
  if (std::rename(tmp.c_str(), out.c_str()) != 0) {
    std::fprintf(stderr, "remat_longctx: cannot rename %s to %s\n", tmp.c_str(), out.c_str());
    return 2;
  }
  std::printf("wrote %s\n", out.c_str());
  return 0;
}
