// remat_gpu_bench: the C++ (remat) half of the GPU benchmark that
// bench/gpu/check.sh runs next to bench/gpu/gpu_bench.py (Python PyTorch).
// The reference GPU workload: a stack of remat::models::GptBlock
// (d_model 2048, 16 heads, T 2048, batch 8, 24 blocks, dropout 0) under bf16
// autocast, with explicit attention and with SDPA; the input is a float32
// (B, T, C) tensor that requires grad and the stack ends in .sum(), as in
// bench/py/models.py. Strategies:
//   plain    no checkpointing
//   block    remat::checkpoint per block
//   matmuls  remat::checkpoint per block with policy::save_matmuls()
//   auto     CheckpointedSequential, budget = --budget-gib minus the bytes
//            live before the step (parameters, gradients, input)
//   megatron remat::checkpoint per block with models::megatron_policy()
//   offload  remat::checkpoint per block, each block's input sent to pinned
//            host memory on a side stream (OffloadTarget::kHost; a no-op on CPU)
//   step@F   the whole-step planner (remat::auto_checkpoint over the blocks,
//            menu: recompute, Megatron, save_matmuls, and on CUDA host offload) at
//            memory_budget_fraction F of the profiled step's peak; step@lean:
//            replanned at its leanest feasible peak. One plain warm-up step,
//            one profiled step, then the measured steps; not interleaved
//            with the others (the planner owns the blocks' switches while it
//            lives) and not searched for the largest batch.
// Per strategy and attention: peak device memory of one step (the caching
// allocator's allocated bytes, what torch.cuda.max_memory_allocated reads;
// remat::memory on CPU), the median of --steps device-synchronized step times
// after --warmup steps, tokens/s, and the largest batch whose step peak stays
// within --budget-gib (doubling, then bisection; at most --search-probes
// steps). Work that would start after --time-limit-s is skipped and says so.
// Prints one JSON object on stdout (and to --json PATH).
// Leaves out: embeddings, the loss head and the optimizer step.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/autocast_mode.h>
#include <torch/torch.h>
#ifdef REMAT_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <remat/auto.h>
#include <remat/models/gpt.h>
#include <remat/remat.h>
#include <remat/sequential.h>

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

struct Config {
  int64_t d_model, heads, seq_len, batch, blocks;
};

using Fn = std::function<torch::Tensor(const torch::Tensor&)>;

struct Model {
  torch::nn::Sequential seq;
  std::vector<remat::models::GptBlock> blocks;
};

Model build(const Config& c, bool sdpa, const Device& dev) {
  torch::manual_seed(0);
  Model m;
  for (int64_t i = 0; i < c.blocks; ++i) {
    m.blocks.emplace_back(c.d_model, c.heads, 0.0, sdpa);
    m.seq->push_back(m.blocks.back());
  }
  m.seq->to(dev.device);
  m.seq->train();
  // Gradients exist from the start, so every measured step has them live.
  for (auto& p : m.seq->parameters()) p.mutable_grad() = torch::zeros_like(p);
  return m;
}

/** Moves an idle model to host memory (gradients dropped), so that it costs
 *  the device nothing and need not be initialised again. */
void park(Model& m) {
  for (auto& p : m.seq->parameters()) p.mutable_grad() = torch::Tensor();
  m.seq->to(torch::kCPU);
}
/** Back on the device, with zero gradients as after build(). */
void unpark(Model& m, const Device& dev) {
  m.seq->to(dev.device);
  for (auto& p : m.seq->parameters()) p.mutable_grad() = torch::zeros_like(p);
}

std::string first_line(const std::string& s) { return s.substr(0, std::min(s.find('\n'), size_t{300})); }

struct Bench {
  Config c;
  Device dev;
  bool autocast;
  double budget_bytes;
  Clock::time_point start;
  double time_limit_s;

  bool out_of_time() const { return secs_since(start) > time_limit_s; }

  torch::Tensor input(int64_t batch) const {
    torch::manual_seed(1);
    return torch::randn({batch, c.seq_len, c.d_model}, torch::TensorOptions().device(dev.device)).requires_grad_(true);
  }

  static void zero_grads(Model& m) {
    for (auto& p : m.seq->parameters()) {
      if (p.grad().defined()) p.mutable_grad().zero_();
    }
  }

  /** One forward + backward; seconds between device synchronizations. */
  double step(Model& m, const Fn& f, const torch::Tensor& x) const {
    zero_grads(m);
    dev.sync();
    auto t0 = Clock::now();
    torch::Tensor loss;
    {
      Autocast ac(dev.device.type(), autocast);
      loss = f(x).sum();
    }
    loss.backward();
    dev.sync();
    return secs_since(t0);
  }

  /** Peak bytes of one step (absolute: parameters, gradients and input
   *  included) and the bytes live before it. */
  std::pair<int64_t, int64_t> peak_of(Model& m, const Fn& f, const torch::Tensor& x) const {
    zero_grads(m);
    dev.sync();
    dev.reset_peak();
    const int64_t base = dev.current();
    step(m, f, x);
    return {dev.peak(), base};
  }
};

/** The strategy's step function for the given model (and batch, for auto:
 *  a CheckpointedSequential planned for it). Throws remat::Error when auto
 *  has no feasible plan. */
struct Strategy {
  std::string name;
  Fn fn;
  std::shared_ptr<remat::CheckpointedSequential> net;
  int64_t predicted = -1;
  std::string note;
};

Strategy make(const std::string& name, Model& m, const Bench& b, const torch::Tensor& x) {
  Strategy s;
  s.name = name;
  if (name == "plain") {
    s.fn = [&m](const torch::Tensor& in) { return m.seq->forward(in); };
  } else if (name == "block") {
    s.fn = [&m](const torch::Tensor& in) {
      torch::Tensor h = in;
      for (auto& blk : m.blocks) h = remat::checkpoint(blk, h);
      return h;
    };
  } else if (name == "matmuls") {
    s.fn = [&m](const torch::Tensor& in) {
      const auto opts = remat::CheckpointOptions().policy(remat::policy::save_matmuls());
      torch::Tensor h = in;
      for (auto& blk : m.blocks)
        h = remat::checkpoint(
            opts, [&blk](const torch::Tensor& t) { return blk->forward(t); }, h);
      return h;
    };
  } else if (name == "megatron") {
    s.fn = [&m](const torch::Tensor& in) {
      const auto opts = remat::CheckpointOptions().policy(remat::models::megatron_policy());
      torch::Tensor h = in;
      for (auto& blk : m.blocks)
        h = remat::checkpoint(
            opts, [&blk](const torch::Tensor& t) { return blk->forward(t); }, h);
      return h;
    };
  } else if (name == "offload") {
    s.fn = [&m](const torch::Tensor& in) {
      const auto opts = remat::CheckpointOptions().offload(remat::OffloadOptions(remat::OffloadTarget::kHost));
      torch::Tensor h = in;
      for (auto& blk : m.blocks)
        h = remat::checkpoint(
            opts, [&blk](const torch::Tensor& t) { return blk->forward(t); }, h);
      return h;
    };
  } else if (name == "auto") {
    // Activation budget: the fixed budget less what is live before the step.
    Bench::zero_grads(m);
    b.dev.sync();
    const int64_t live = b.dev.current();
    const int64_t act = static_cast<int64_t>(b.budget_bytes) - live;
    if (act <= 0) throw remat::Error("[remat_gpu_bench] nothing of the budget is left for activations");
    s.net = std::make_shared<remat::CheckpointedSequential>(
        m.seq, remat::SequentialOptions().memory_budget_bytes(act).measure_memory(false));
    {
      Autocast ac(b.dev.device.type(), b.autocast);  // the plan is per autocast state
      s.predicted = (*s.net)->plan(x).prediction.peak_bytes;
    }
    auto net = s.net;
    s.fn = [net](const torch::Tensor& in) { return (*net)->forward(in); };
    s.note = "activation budget " + std::to_string(act) + " bytes";
  } else {
    std::fprintf(
        stderr,
        "remat_gpu_bench: unknown strategy %s (plain, block, matmuls, megatron, offload, auto, step@F, step@lean)\n",
        name.c_str());
    std::exit(2);
  }
  return s;
}

struct Result {
  std::string attention, strategy, note;
  int64_t peak = -1, base = -1, predicted = -1;
  double median_ms = -1;
  std::vector<double> ms;
  int64_t max_batch = -1;       // largest batch within the budget (-1: not searched)
  int64_t max_batch_peak = -1;  // its peak bytes
  std::string search_note;
  std::vector<std::pair<int64_t, int64_t>> probes;  // (batch, peak or -1 for OOM/infeasible)
};

/** Peak of one step at this batch, -1 if it runs out of memory or has no plan. */
int64_t probe(Model& m, const std::string& name, const Bench& b, int64_t batch, std::string& why) {
  try {
    auto x = b.input(batch);
    auto s = make(name, m, b, x);
    return b.peak_of(m, s.fn, x).first;
  } catch (const std::exception& e) {
    why = is_oom(e) ? "out of memory" : first_line(e.what());
    Bench::zero_grads(m);
    b.dev.sync();
    b.dev.empty_cache();
    return -1;
  }
}

/** A whole-step planner strategy ("step@0.5", "step@lean"): plans, then
 *  measures its own steps (peak, then `steps` timed). The planner is
 *  destroyed at the end, giving the blocks' switches back. */
void run_whole_step(Model& m, const Bench& b, const torch::Tensor& x, int steps, Result& r) {
  const std::string arg = r.strategy.substr(5);
  const bool lean = arg == "lean";
  const double fraction = lean ? 1.0 : std::stod(arg);
  auto options = remat::AutoOptions().memory_budget_fraction(fraction).warmup_steps(1).policies(
      {remat::models::megatron_policy(), remat::policy::save_matmuls()});
  // Pinned host memory is for accelerator tensors (the planner refuses kHost on the CPU).
  if (b.dev.cuda()) options.offload({remat::OffloadOptions(remat::OffloadTarget::kHost)});
  auto planner = remat::auto_checkpoint(*m.seq, options);
  auto body = [&] {
    Bench::zero_grads(m);
    torch::Tensor loss;
    {
      Autocast ac(b.dev.device.type(), b.autocast);
      loss = m.seq->forward(x).sum();
    }
    loss.backward();
  };
  auto timed = [&] {
    b.dev.sync();
    auto t0 = Clock::now();
    planner.step(body);
    b.dev.sync();
    return secs_since(t0);
  };
  timed();  // the plain warm-up
  timed();  // the profiled step: plans
  if (!planner.planned()) throw remat::Error("[remat_gpu_bench] the planner made no plan");
  if (lean) planner.replan(planner.leanest_peak_bytes());
  r.predicted = planner.plan().prediction.peak_bytes;
  timed();  // the plan's first step (its stores warm up)
  b.dev.sync();
  b.dev.reset_peak();
  r.base = b.dev.current();
  timed();
  r.peak = b.dev.peak();
  for (int i = 0; i < steps && !b.out_of_time(); ++i) r.ms.push_back(1e3 * timed());
  r.note = "budget " + std::to_string(planner.plan().budget_bytes) + " bytes (" +
           (lean ? std::string("its leanest plan") : "fraction " + arg) + "), replans " +
           std::to_string(planner.replans());
}

void search(Model& m, const Bench& b, Result& r, int max_probes, int64_t max_batch) {
  auto fits = [&](int64_t batch) {
    std::string why;
    const int64_t p = probe(m, r.strategy, b, batch, why);
    r.probes.emplace_back(batch, p);
    if (p >= 0 && p <= b.budget_bytes) {
      if (batch > r.max_batch) r.max_batch = batch, r.max_batch_peak = p;
      return true;
    }
    return false;
  };
  int64_t lo = 0, hi = -1;  // lo fits (0: none yet), hi does not (-1: none yet)
  // Start from the reference batch's measurement when it has one.
  int64_t bt = 1;
  if (r.peak >= 0 && r.peak <= b.budget_bytes) {
    lo = b.c.batch, r.max_batch = lo, r.max_batch_peak = r.peak;
    bt = 2 * lo;
  } else if (r.peak >= 0 || r.note == "out of memory") {
    hi = b.c.batch;
    bt = std::max<int64_t>(1, b.c.batch / 2);
  }
  int used = 0;
  while (used < max_probes && !b.out_of_time()) {
    if (lo > 0 && hi >= 0) {  // bisection
      if (hi - lo <= 1) break;
      const int64_t mid = lo + (hi - lo) / 2;
      ++used;
      if (fits(mid)) {
        lo = mid;
      } else {
        hi = mid;
      }
      continue;
    }
    if (hi >= 0 && hi <= 1) break;  // batch 1 does not fit
    if (bt > max_batch) break;
    ++used;
    if (fits(bt)) {
      lo = bt;
      if (hi < 0) bt *= 2;  // doubling up
    } else {
      hi = bt;
      if (lo == 0) bt = std::max<int64_t>(1, bt / 2);  // halving down
    }
  }
  if (hi >= 0 && lo > 0 && hi - lo > 1) r.search_note = "between " + std::to_string(lo) + " and " + std::to_string(hi);
  if (hi < 0 && lo > 0) r.search_note = "at least " + std::to_string(lo) + " (search capped)";
  if (lo == 0 && hi == 1) r.max_batch = 0, r.search_note = "batch 1 does not fit";
  if (b.out_of_time()) r.search_note += (r.search_note.empty() ? "" : "; ") + std::string("time limit reached");
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = flag(argc, argv, "--quick");
  const std::string device = arg(argc, argv, "--device", "cuda");
  Config c{int_arg(argc, argv, "--d-model", quick ? "64" : "2048"), int_arg(argc, argv, "--heads", quick ? "4" : "16"),
           int_arg(argc, argv, "--seq-len", quick ? "64" : "2048"), int_arg(argc, argv, "--batch", quick ? "2" : "8"),
           int_arg(argc, argv, "--blocks", quick ? "4" : "24")};
  const auto attentions = split(arg(argc, argv, "--attention", "explicit,sdpa"), ',');
  const auto strategies =
      split(arg(argc, argv, "--strategies", "plain,block,matmuls,megatron,offload,auto,step@0.5,step@lean"), ',');
  const auto searched = split(arg(argc, argv, "--search", "plain,block,matmuls,auto"), ',');
  const int steps = static_cast<int>(int_arg(argc, argv, "--steps", quick ? "2" : "5"));
  const int warmup = static_cast<int>(int_arg(argc, argv, "--warmup", quick ? "1" : "2"));
  const int max_probes = static_cast<int>(int_arg(argc, argv, "--search-probes", "6"));
  const int64_t max_batch = int_arg(argc, argv, "--max-batch", "256");
  const double budget_gib = double_arg(argc, argv, "--budget-gib", quick ? "0.05" : "40");
  const bool autocast = arg(argc, argv, "--autocast", "bf16") == "bf16";
  const std::string json_path = arg(argc, argv, "--json", "");
  torch::set_num_threads(static_cast<int>(int_arg(argc, argv, "--threads", quick ? "1" : "8")));

  Device dev;
  if (device == "cuda") {
    if (!torch::cuda::is_available()) {
      std::fprintf(stderr, "remat_gpu_bench: --device cuda but torch::cuda::is_available() is false\n");
      return 3;
    }
    dev.device = torch::Device(torch::kCUDA, 0);
  } else if (device != "cpu") {
    std::fprintf(stderr, "remat_gpu_bench: --device must be cuda or cpu\n");
    return 2;
  }
  remat::memory::enable_tracking();
  Bench b{c,
          dev,
          autocast,
          budget_gib * double(int64_t{1} << 30),
          Clock::now(),
          double_arg(argc, argv, "--time-limit-s", "170")};

  // The SDPA path against the explicit one: one block, the same weights,
  // float32 without autocast, a small input on the device.
  double sdpa_max_diff = -1;
  {
    torch::manual_seed(0);
    remat::models::GptBlock e(c.d_model, c.heads, 0.0, false), s(c.d_model, c.heads, 0.0, true);
    {
      torch::NoGradGuard g;
      auto pe = e->parameters(), ps = s->parameters();
      for (size_t i = 0; i < pe.size(); ++i) ps[i].copy_(pe[i]);
    }
    e->to(dev.device), s->to(dev.device);
    auto xs =
        torch::randn({2, std::min<int64_t>(c.seq_len, 128), c.d_model}, torch::TensorOptions().device(dev.device));
    torch::NoGradGuard g;
    sdpa_max_diff = (e->forward(xs) - s->forward(xs)).abs().max().item<double>();
  }
  std::vector<Result> results;
  std::map<std::string, Model> parked;  // per attention, in host memory between phases
  for (const auto& attention : attentions) {
    if (attention != "explicit" && attention != "sdpa") {
      std::fprintf(stderr, "remat_gpu_bench: --attention takes explicit and/or sdpa\n");
      return 2;
    }
    Model m = build(c, attention == "sdpa", dev);
    auto x = b.input(c.batch);
    struct Live {
      Result r;
      Strategy s;
    };
    std::vector<Live> live;
    for (const auto& name : strategies) {
      if (name.rfind("step@", 0) == 0) continue;  // after the interleaved ones
      Live l;
      l.r.attention = attention;
      l.r.strategy = name;
      if (b.out_of_time()) {
        l.r.note = "skipped: time limit";
        results.push_back(l.r);
        continue;
      }
      try {
        l.s = make(name, m, b, x);
        l.r.predicted = l.s.predicted;
        l.r.note = l.s.note;
        for (int i = 0; i < warmup; ++i) b.step(m, l.s.fn, x);
        auto [peak, base] = b.peak_of(m, l.s.fn, x);
        l.r.peak = peak, l.r.base = base;
      } catch (const std::exception& e) {
        l.r.note = (is_oom(e) ? std::string("out of memory") : "failed: " + first_line(e.what()));
        l.s.fn = nullptr;
        Bench::zero_grads(m);
        dev.sync();
        dev.empty_cache();
      }
      live.push_back(std::move(l));
    }
    // Timed steps interleaved (A B C A B C ...), so drifts hit all alike.
    for (int i = 0; i < steps && !b.out_of_time(); ++i) {
      for (auto& l : live) {
        if (l.s.fn) l.r.ms.push_back(1e3 * b.step(m, l.s.fn, x));
      }
    }
    for (auto& l : live) {
      if (!l.r.ms.empty()) {
        auto v = l.r.ms;
        std::sort(v.begin(), v.end());
        l.r.median_ms = v[v.size() / 2];
      }
      results.push_back(l.r);
    }
    live.clear();
    for (const auto& name : strategies) {
      if (name.rfind("step@", 0) != 0) continue;
      Result r;
      r.attention = attention;
      r.strategy = name;
      if (b.out_of_time()) {
        r.note = "skipped: time limit";
      } else {
        try {
          run_whole_step(m, b, x, steps, r);
        } catch (const std::exception& e) {
          r.note = (is_oom(e) ? std::string("out of memory") : "failed: " + first_line(e.what()));
          Bench::zero_grads(m);
          dev.sync();
          dev.empty_cache();
        }
      }
      if (!r.ms.empty()) {
        auto v = r.ms;
        std::sort(v.begin(), v.end());
        r.median_ms = v[v.size() / 2];
      }
      results.push_back(r);
    }
    x = torch::Tensor();
    if (dev.cuda()) {  // on CPU a parked model would count in the next one's peaks: built again instead
      park(m);
      parked[attention] = m;
    }
    m = Model();
    dev.empty_cache();
  }
  // Largest batches, after every timing: first for the first two strategies
  // of --search on every attention, then for the rest, while time is left.
  for (int pass = 0; pass < 2; ++pass) {
    for (const auto& attention : attentions) {
      std::vector<Result*> todo;
      for (auto& r : results) {
        auto pos = std::find(searched.begin(), searched.end(), r.strategy) - searched.begin();
        if (r.attention == attention && pos < static_cast<long>(searched.size()) && (pos < 2) == (pass == 0) &&
            r.note.rfind("skipped", 0) != 0) {
          todo.push_back(&r);
        }
      }
      if (todo.empty()) continue;
      if (b.out_of_time()) {
        for (auto* r : todo) r->search_note = "skipped: time limit";
        continue;
      }
      Model m;
      if (parked.count(attention)) {
        m = parked[attention];
        parked.erase(attention);
        unpark(m, dev);
      } else {
        m = build(c, attention == "sdpa", dev);
      }
      for (auto* r : todo) {
        if (b.out_of_time()) {
          r->search_note = "skipped: time limit";
        } else {
          search(m, b, *r, max_probes, max_batch);
        }
      }
      if (dev.cuda()) {
        park(m);
        parked[attention] = m;
      }
      m = Model();
      dev.empty_cache();
    }
  }
  parked.clear();

  int64_t params = 0;
  {
    Model m0 = build({c.d_model, c.heads, c.seq_len, c.batch, 1}, false, Device());
    for (auto& p : m0.seq->parameters()) params += p.numel();
    params *= c.blocks;
  }
  std::ostringstream o;
  o << "{\"lang\": \"cpp\", \"meta\": " << bench::metadata(argc, argv) << ", \"torch\": " << quoted(TORCH_VERSION)
    << ", \"device\": " << quoted(device) << ", \"meter\": " << quoted(dev.meter())
    << ", \"autocast\": " << quoted(autocast ? "bf16" : "off") << ", \"d_model\": " << c.d_model
    << ", \"heads\": " << c.heads << ", \"seq_len\": " << c.seq_len << ", \"batch\": " << c.batch
    << ", \"blocks\": " << c.blocks << ", \"params\": " << params
    << ", \"sdpa_vs_explicit_max_abs_diff\": " << sdpa_max_diff
    << ", \"budget_bytes\": " << static_cast<int64_t>(b.budget_bytes) << ", \"elapsed_s\": " << num(secs_since(b.start))
    << ",\n \"runs\": [\n";
  for (size_t i = 0; i < results.size(); ++i) {
    const auto& r = results[i];
    const double tok_s = r.median_ms > 0 ? double(c.batch * c.seq_len) / (r.median_ms / 1e3) : -1;
    o << "  {\"attention\": " << quoted(r.attention) << ", \"strategy\": " << quoted(r.strategy)
      << ", \"peak_bytes\": " << r.peak << ", \"base_bytes\": " << r.base << ", \"predicted_bytes\": " << r.predicted
      << ", \"median_ms\": " << num(r.median_ms) << ", \"tokens_per_s\": " << num(tok_s) << ", \"ms\": [";
    for (size_t k = 0; k < r.ms.size(); ++k) o << (k ? ", " : "") << num(r.ms[k]);
    o << "], \"max_batch\": " << r.max_batch << ", \"max_batch_peak_bytes\": " << r.max_batch_peak
      << ", \"search_note\": " << quoted(r.search_note) << ", \"probes\": [";
    for (size_t k = 0; k < r.probes.size(); ++k) {
      o << (k ? ", " : "") << "[" << r.probes[k].first << ", " << r.probes[k].second << "]";
    }
    o << "], \"note\": " << quoted(r.note) << "}" << (i + 1 < results.size() ? "," : "") << "\n";
  }
  o << " ]}\n";
  std::fputs(o.str().c_str(), stdout);
  if (!json_path.empty()) std::ofstream(json_path) << o.str();
  return 0;
}
