// remat_offload_bench: offload and compression of saved activations
// (remat::OffloadScope, docs/offload.md) on the GPT block stack at the reference CPU size
// (remat::models::GptBlock, d_model 512, 8 heads, T 512, batch 4, 8 blocks,
// float32, dropout 0, explicit attention, 1 intra-op thread). Strategies:
//   plain      everything saved in memory
//   full       remat::checkpoint on every block (full recompute)
//   disk       OffloadScope(kDisk) around the forward, prefetch depth 2
//   disk_nopf  the same with prefetch_depth(0) (each read when backward needs it)
//   ckpt_disk  full recompute per block inside OffloadScope(kDisk): the block
//              inputs (the checkpoints) go to disk, the rest is recomputed
// Each strategy runs in its own process (this binary with --run NAME), so
// that its RSS high-water mark (VmHWM at exit, against VmRSS before the
// first step: parameters, input) is not raised by another strategy's heap.
// Per step (1 warm-up step, then --steps timed ones):
// peak tracked bytes above the bytes live before the forward (remat::memory),
// bytes held after the forward, step time. Every strategy's gradients are
// hashed and must equal plain's bitwise (exit 3 otherwise).
// --codecs: after a warm-up step and one timed plain step, one forward +
// backward per codec with OffloadScope (kMemory or kDisk, min_bytes 64 KiB):
// compression ratio over the saved activations, time, and gradient error
// against plain (bitwise for lossless codecs).
// bench/py/offload.py drives it and writes bench/results/offload.json.
// Prints a run-metadata line ({"meta": ...}, bench/common/bench.h), then one
// JSON object per strategy (or codec), and a table on stderr.
// Leaves out: the loss head and optimizer (the stack ends in .square().mean()).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <remat/checkpoint.h>
#include <remat/checkpointable.h>
#include <remat/memory.h>
#include <remat/models/gpt.h>
#include <remat/offload.h>

#include "bench.h"

namespace {

using bench::arg;
using bench::Clock;
using bench::flag;
using bench::int_arg;
using bench::ms_since;

struct Config {
  int64_t d_model, heads, seq_len, batch, blocks;
};

struct Model {
  torch::nn::Sequential seq;
  torch::Tensor x;
  std::vector<torch::Tensor> params;
  explicit Model(const Config& c) {
    torch::manual_seed(0);
    for (int64_t i = 0; i < c.blocks; ++i) seq->push_back(remat::models::GptBlock(c.d_model, c.heads, 0.0));
    seq->train();
    x = torch::randn({c.batch, c.seq_len, c.d_model}).requires_grad_(true);
    params = seq->parameters();
  }
  void zero() {
    for (auto& p : params) {
      if (p.grad().defined()) p.mutable_grad().zero_();
    }
    x.mutable_grad() = torch::Tensor();
  }
  std::vector<torch::Tensor> grads() const {
    std::vector<torch::Tensor> g;
    for (const auto& p : params) g.push_back(p.grad().clone());
    g.push_back(x.grad().clone());
    return g;
  }
};

/** FNV-1a over the bytes of every gradient: equal hashes, equal bits. */
uint64_t hash_of(const std::vector<torch::Tensor>& gs) {
  uint64_t h = 1469598103934665603ull;
  for (const auto& g : gs) {
    auto c = g.contiguous();
    const auto* p = static_cast<const uint64_t*>(c.data_ptr());  // float32 counts are even here
    const int64_t n = static_cast<int64_t>(c.nbytes() / 8);
    for (int64_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  }
  return h;
}

std::optional<remat::OffloadOptions> offload_of(const std::string& s, const std::string& dir) {
  if (s == "disk" || s == "ckpt_disk") return remat::OffloadOptions(remat::OffloadTarget::kDisk).directory(dir);
  if (s == "disk_nopf") return remat::OffloadOptions(remat::OffloadTarget::kDisk).directory(dir).prefetch_depth(0);
  return std::nullopt;
}

/** One strategy, in this process. */
int run_one(const std::string& name, const Config& c, int steps, const std::string& dir) {
  remat::memory::enable_tracking();
  Model m(c);
  if (name == "full" || name == "ckpt_disk") {
    remat::enable_checkpointing(*m.seq, remat::select::type<remat::models::GptBlockImpl>(), remat::CheckpointOptions());
  } else if (name != "plain" && name != "disk" && name != "disk_nopf") {
    std::fprintf(stderr, "unknown strategy %s\n", name.c_str());
    return 2;
  }
  const auto offload = offload_of(name, dir);
  std::vector<double> ms, fwd_ms, bwd_ms;
  std::vector<int64_t> peak, held;
  const int64_t rss_before = bench::status_kib("VmRSS");
  for (int i = 0; i < steps + 1; ++i) {  // step 0: warm-up (allocates the gradients)
    m.zero();
    remat::memory::reset_peak();
    const int64_t base = remat::memory::current_bytes();
    std::unique_ptr<remat::OffloadScope> scope;
    auto t0 = Clock::now();
    if (offload) scope = std::make_unique<remat::OffloadScope>(*offload);
    auto loss = m.seq->forward(m.x).square().mean();
    if (scope) scope.reset();  // backward runs after the scope, as usual
    const double f = ms_since(t0);
    const int64_t h = remat::memory::current_bytes() - base;
    auto t1 = Clock::now();
    loss.backward();
    const double b = ms_since(t1);
    if (i == 0) continue;
    fwd_ms.push_back(f);
    bwd_ms.push_back(b);
    ms.push_back(f + b);
    peak.push_back(remat::memory::peak_bytes() - base);
    held.push_back(h);
  }
  const uint64_t hash = hash_of(m.grads());
  auto med = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::printf(
      "{\"strategy\": \"%s\", \"step_ms\": %.1f, \"fwd_ms\": %.1f, \"bwd_ms\": %.1f, \"peak_bytes\": %lld, "
      "\"held_bytes\": %lld, \"rss_before_kb\": %lld, \"hwm_kb\": %lld, \"grad_hash\": "
      "\"%016llx\"}\n",
      name.c_str(), med(ms), med(fwd_ms), med(bwd_ms), (long long)*std::max_element(peak.begin(), peak.end()),
      (long long)*std::max_element(held.begin(), held.end()), (long long)rss_before,
      (long long)bench::status_kib("VmHWM"), (unsigned long long)hash);
  return 0;
}

/** Every codec on the saved activations of one step, kMemory. */
int run_codecs(const Config& c, const std::string& dir) {
  Model m(c);
  m.zero();
  m.seq->forward(m.x).square().mean().backward();  // warm-up: allocates the gradients, as run_one's step 0
  m.zero();
  auto t0 = Clock::now();
  m.seq->forward(m.x).square().mean().backward();
  const double plain_ms = ms_since(t0);
  const auto ref = m.grads();
  std::printf("{\"codec\": \"plain\", \"step_ms\": %.1f}\n", plain_ms);
  struct Case {
    std::string name;
    remat::OffloadOptions o;
  };
  const std::vector<Case> cases = {
      {"zstd (memory)", remat::OffloadOptions(remat::OffloadTarget::kMemory).codec(remat::Codec::kZstd)},
      {"lz4 (memory)", remat::OffloadOptions(remat::OffloadTarget::kMemory).codec(remat::Codec::kLz4)},
      {"bfloat16 (memory)", remat::OffloadOptions(remat::OffloadTarget::kMemory).codec(remat::Codec::kBFloat16)},
      {"float8 (memory)", remat::OffloadOptions(remat::OffloadTarget::kMemory).codec(remat::Codec::kFloat8)},
      {"zstd (disk)", remat::OffloadOptions(remat::OffloadTarget::kDisk).directory(dir).codec(remat::Codec::kZstd)},
      {"lz4 (disk)", remat::OffloadOptions(remat::OffloadTarget::kDisk).directory(dir).codec(remat::Codec::kLz4)},
  };
  for (const auto& k : cases) {
    m.zero();
    t0 = Clock::now();
    torch::Tensor loss;
    remat::OffloadStats st;
    {
      remat::OffloadScope scope(k.o);
      loss = m.seq->forward(m.x).square().mean();
      scope.wait();
      st = scope.stats();
    }
    const double f = ms_since(t0);
    auto t1 = Clock::now();
    loss.backward();
    const double b = ms_since(t1);
    const auto g = m.grads();
    double num = 0, den = 0;
    bool bitwise = true;
    for (size_t i = 0; i < g.size(); ++i) {
      bitwise = bitwise && torch::equal(g[i], ref[i]);
      num = std::max(num, (g[i] - ref[i]).abs().max().item<double>());
      den = std::max(den, ref[i].abs().max().item<double>());
    }
    std::printf(
        "{\"codec\": \"%s\", \"raw_bytes\": %lld, \"stored_bytes\": %lld, \"ratio\": %.3f, \"fwd_ms\": %.1f, "
        "\"bwd_ms\": %.1f, \"bitwise\": %s, \"grad_rel_error\": %.3e}\n",
        k.name.c_str(), (long long)st.bytes_raw, (long long)st.bytes_stored, st.compression_ratio(), f, b,
        bitwise ? "true" : "false", num / den);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = static_cast<int>(int_arg(argc, argv, "--threads", "1"));
  torch::set_num_threads(threads);
  const bool quick = flag(argc, argv, "--quick");
  const Config c{int_arg(argc, argv, "--d-model", quick ? "64" : "512"),
                 int_arg(argc, argv, "--heads", quick ? "4" : "8"),
                 int_arg(argc, argv, "--seq-len", quick ? "64" : "512"),
                 int_arg(argc, argv, "--batch", quick ? "2" : "4"), int_arg(argc, argv, "--blocks", quick ? "2" : "8")};
  const int steps = static_cast<int>(int_arg(argc, argv, "--steps", "2"));
  const std::string dir = arg(argc, argv, "--dir", "/tmp");
  const std::string run = arg(argc, argv, "--run", "");
  if (!run.empty()) return run_one(run, c, steps, dir);
  std::printf("{\"meta\": %s}\n", bench::metadata(argc, argv).c_str());  // the run-metadata line first
  std::fflush(stdout);
  if (flag(argc, argv, "--codecs")) return run_codecs(c, dir);

  // Driver: each strategy in a child process; gradients compared by hash.
  const std::string strategies = arg(argc, argv, "--strategies", "plain,full,disk,disk_nopf,ckpt_disk");
  std::string plain_hash;
  int status = 0;
  std::string s;
  for (size_t at = 0; at <= strategies.size(); ++at) {
    if (at < strategies.size() && strategies[at] != ',') {
      s += strategies[at];
      continue;
    }
    if (s.empty()) continue;
    std::string cmd = std::string("'") + argv[0] + "' --run " + s + " --steps " + std::to_string(steps) +
                      " --threads " + std::to_string(threads) + " --dir '" + dir + "' --d-model " +
                      std::to_string(c.d_model) + " --heads " + std::to_string(c.heads) + " --seq-len " +
                      std::to_string(c.seq_len) + " --batch " + std::to_string(c.batch) + " --blocks " +
                      std::to_string(c.blocks);
    FILE* p = ::popen(cmd.c_str(), "r");
    std::string out;
    char buf[4096];
    while (p && std::fgets(buf, sizeof buf, p)) out += buf;
    const int rc = p ? ::pclose(p) : -1;
    std::fputs(out.c_str(), stdout);
    std::fflush(stdout);
    if (rc != 0) {
      std::fprintf(stderr, "strategy %s failed (status %d)\n", s.c_str(), rc);
      status = 1;
    }
    const auto h = out.find("\"grad_hash\": \"");
    const std::string hash = h == std::string::npos ? "" : out.substr(h + 14, 16);
    if (s == "plain") plain_hash = hash;
    if (!plain_hash.empty() && hash != plain_hash) {
      std::fprintf(stderr, "strategy %s: gradients differ from plain's\n", s.c_str());
      status = 3;
    }
    s.clear();
  }
  return status;
}
