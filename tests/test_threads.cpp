// Threads: remat from several threads at once. Every test name
// contains "Thread": `make test-tsan` runs `ctest -R Thread` under
// ThreadSanitizer.
//
// Determinism and LibTorch's global generator: dropout draws from the
// process-wide default CPU generator, so with several threads training at
// once the numbers each thread draws depend on the interleaving, and no
// seeding (per thread or under a mutex) makes a threaded run equal a serial
// one unless whole steps are serialized, which would test nothing. So:
//  1. SeparateModelsBitwiseAgainstSerial: no dropout; each thread's data
//     comes from its own torch::Generator; 4 threads x 4 strategies must
//     give parameters bitwise equal to the same training run serially.
//  2. DropoutReplayPerThread: dropout on, drawn from the global generator.
//     What remat must guarantee is that a recompute replays the masks of
//     its own first run whatever other threads draw meanwhile (NOTE [RNG
//     regions and threads] in src/core/rng_lock.h). The dropout module records
//     every mask it draws, first runs and recomputes apart: each recompute's
//     mask must equal its first run's, bitwise, and each thread's final
//     parameters must equal a serial plain run that applies the recorded
//     first-run masks (no RNG at all in the reference).
//  3. SharedReadOnlyModelInputGradients: 4 threads run forward/backward at
//     once through ONE model (parameters require grad, so its graph is
//     real), each with its own inputs, taking autograd::grad w.r.t. its
//     inputs only (parameters' .grad must stay undefined); every strategy
//     (plain, checkpoint per block, checkpoint_sequential, one shared
//     CheckpointedSequential) runs in every thread; each result must equal
//     the serial plain result bitwise.
#include "common.h"

#include <array>
#include <atomic>
#include <barrier>
#include <optional>
#include <thread>

#include <remat/sequential.h>

using namespace remat_test;

namespace {

constexpr int kThreads = 4;

/** GPT-ish stack: `blocks` GptBlocks (no dropout), d_model 32, 4 heads. */
torch::nn::Sequential gpt_stack(uint64_t seed, int blocks = 2) {
  torch::manual_seed(seed);
  torch::nn::Sequential s;
  for (int i = 0; i < blocks; ++i) s->push_back(GptBlock(32, 4, 0.0));
  return s;
}

enum class Strategy { kPlain, kCheckpointPerBlock, kCheckpointSequential, kPlanned };
const char* name(Strategy s) {
  switch (s) {
    case Strategy::kPlain: return "plain";
    case Strategy::kCheckpointPerBlock: return "checkpoint per block";
    case Strategy::kCheckpointSequential: return "checkpoint_sequential";
    case Strategy::kPlanned: return "CheckpointedSequential";
  }
  return "?";
}

torch::Tensor run(Strategy s, torch::nn::Sequential& seq, remat::CheckpointedSequential* net, torch::Tensor x) {
  switch (s) {
    case Strategy::kPlain: return seq->forward(x);
    case Strategy::kCheckpointPerBlock:
      for (auto& m : *seq) x = remat::checkpoint([m](torch::Tensor in) mutable { return m.forward(in); }, x);
      return x;
    case Strategy::kCheckpointSequential: return remat::checkpoint_sequential(seq, 2, x);
    case Strategy::kPlanned: return (*net)->forward(x);
  }
  return {};
}

std::vector<torch::Tensor> params_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (auto& p : m.parameters()) out.push_back(p.detach().clone());
  return out;
}

/** Trains seq for `steps` SGD steps on data from its own generator. */
std::vector<torch::Tensor> train(torch::nn::Sequential seq, Strategy s, uint64_t data_seed, int steps,
                                 const std::vector<int64_t>& shape) {
  std::optional<remat::CheckpointedSequential> net;
  if (s == Strategy::kPlanned) net.emplace(seq, remat::SequentialOptions().algorithm("sqrt"));
  torch::optim::SGD opt(seq->parameters(), 0.05);
  auto gen = torch::make_generator<torch::CPUGeneratorImpl>(data_seed);
  for (int k = 0; k < steps; ++k) {
    auto x = torch::randn(shape, gen);
    opt.zero_grad();
    run(s, seq, net ? &*net : nullptr, x).square().mean().backward();
    opt.step();
  }
  return params_of(*seq);
}

TEST(Threads, SeparateModelsBitwiseAgainstSerial) {
  const std::array<Strategy, kThreads> strategy = {Strategy::kCheckpointPerBlock, Strategy::kPlanned,
                                                   Strategy::kCheckpointSequential, Strategy::kPlanned};
  // Models are built here: construction seeds the global generator.
  std::vector<torch::nn::Sequential> threaded, serial;
  for (int t = 0; t < kThreads; ++t) {
    const bool gpt = t < 2;
    threaded.push_back(gpt ? gpt_stack(10 + t) : make_mlp(4, 32, 10 + t));
    serial.push_back(gpt ? gpt_stack(10 + t) : make_mlp(4, 32, 10 + t));
  }
  auto shape = [](int t) { return t < 2 ? std::vector<int64_t>{2, 8, 32} : std::vector<int64_t>{8, 32}; };
  // Install remat's counting allocator before the threads (the profiler's
  // first Probe would install it): c10::SetCPUAllocator publishes it with a
  // plain store, so a thread allocating while another installs it is a data
  // race TSan reports (remat::memory; docs/RELIABILITY.md, "Sanitizers").
  { remat::memory::Probe install; }
  std::vector<std::vector<torch::Tensor>> got(kThreads), want(kThreads);
  std::barrier start(kThreads);
  std::vector<std::thread> pool;
  for (int t = 0; t < kThreads; ++t) {
    pool.emplace_back([&, t] {
      start.arrive_and_wait();
      got[t] = train(threaded[t], strategy[t], 100 + t, 4, shape(t));
    });
  }
  for (auto& th : pool) th.join();
  for (int t = 0; t < kThreads; ++t) want[t] = train(serial[t], Strategy::kPlain, 100 + t, 4, shape(t));
  for (int t = 0; t < kThreads; ++t) {
    SCOPED_TRACE(std::string("thread ") + std::to_string(t) + ": " + name(strategy[t]));
    expect_bitwise_equal(got[t], want[t]);
  }
  EXPECT_EQ(remat::current_hooks(), nullptr);
}

// ---- dropout: each thread's replays match its own first runs ----

/** Dropout that records its masks. kDraw: draws from the global generator
 *  and records the mask (first runs and recomputes apart); kFixed: applies
 *  the given masks in order (a reference without RNG). */
struct RecordingDropoutImpl : torch::nn::Module {
  explicit RecordingDropoutImpl(double p) : p_(p) {}
  torch::Tensor forward(torch::Tensor x) {
    torch::Tensor mask;
    if (fixed) {
      mask = fixed_masks.at(fixed_next++);
    } else {
      mask = torch::empty_like(x).bernoulli_(1.0 - p_);  // global generator
      if (remat::is_recomputing()) {
        replays.emplace_back(first.size() - 1, mask);
      } else {
        first.push_back(mask);
      }
    }
    return x * mask / (1.0 - p_);
  }
  double p_;
  bool fixed = false;
  std::vector<torch::Tensor> fixed_masks;
  size_t fixed_next = 0;
  std::vector<torch::Tensor> first;                       // one per step
  std::vector<std::pair<size_t, torch::Tensor>> replays;  // (step, mask)
};
TORCH_MODULE(RecordingDropout);

/** Three (Linear, Tanh, RecordingDropout) groups and a Linear. */
torch::nn::Sequential dropout_mlp(uint64_t seed, std::vector<RecordingDropout>& drops) {
  torch::manual_seed(seed);
  torch::nn::Sequential s;
  drops.clear();
  for (int i = 0; i < 3; ++i) {
    s->push_back(torch::nn::Linear(48, 48));
    s->push_back(torch::nn::Tanh());
    drops.emplace_back(0.3);
    s->push_back(drops.back());
  }
  s->push_back(torch::nn::Linear(48, 48));
  return s;
}

TEST(Threads, DropoutReplayPerThread) {
  constexpr int kSteps = 4;
  std::vector<torch::nn::Sequential> models(kThreads);
  std::vector<std::vector<RecordingDropout>> drops(kThreads);
  std::vector<std::optional<remat::CheckpointedSequential>> nets(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    models[t] = dropout_mlp(20 + t, drops[t]);
    if (t % 2 == 1) {
      // uniform:3: the first two segments are recomputed in backward.
      nets[t].emplace(models[t], remat::SequentialOptions().segments(3));
      (*nets[t])->plan(torch::zeros({16, 48}));  // profile here, not in the threads
      for (auto& d : drops[t]) d->first.clear(), d->replays.clear();
    }
  }
  auto step_fn = [&](int t, torch::Tensor x) {
    auto& seq = models[t];
    if (nets[t]) return (*nets[t])->forward(x);
    torch::Tensor h = x;
    for (size_t i = 0; i + 1 < seq->size(); i += 3) {
      torch::nn::Sequential group(*(seq->begin() + i), *(seq->begin() + i + 1), *(seq->begin() + i + 2));
      h = remat::checkpoint(group, h);
    }
    return (seq->end() - 1)->forward<torch::Tensor>(h);
  };
  std::vector<std::vector<torch::Tensor>> got(kThreads);
  std::barrier start(kThreads);
  std::vector<std::thread> pool;
  for (int t = 0; t < kThreads; ++t) {
    pool.emplace_back([&, t] {
      torch::optim::SGD opt(models[t]->parameters(), 0.05);
      auto gen = torch::make_generator<torch::CPUGeneratorImpl>(200 + t);
      start.arrive_and_wait();
      for (int k = 0; k < kSteps; ++k) {
        auto x = torch::randn({16, 48}, gen);
        opt.zero_grad();
        step_fn(t, x).square().mean().backward();
        opt.step();
      }
      got[t] = params_of(*models[t]);
    });
  }
  for (auto& th : pool) th.join();

  for (int t = 0; t < kThreads; ++t) {
    SCOPED_TRACE("thread " + std::to_string(t) + (nets[t] ? " (CheckpointedSequential)" : " (checkpoint)"));
    int replays = 0;
    for (size_t d = 0; d < drops[t].size(); ++d) {
      auto& rd = *drops[t][d];
      ASSERT_EQ(rd.first.size(), static_cast<size_t>(kSteps)) << "dropout " << d;
      for (auto& [step, mask] : rd.replays) {
        ++replays;
        EXPECT_TRUE(torch::equal(mask, rd.first[step]))
            << "dropout " << d << " step " << step << ": the recompute drew another mask";
      }
    }
    // Every dropout in a recomputed group, once per step.
    EXPECT_EQ(replays, (nets[t] ? 2 : 3) * kSteps);
    // Serial plain reference with the recorded masks.
    std::vector<RecordingDropout> ref_drops;
    auto ref = dropout_mlp(20 + t, ref_drops);
    for (size_t d = 0; d < ref_drops.size(); ++d) {
      ref_drops[d]->fixed = true;
      ref_drops[d]->fixed_masks = drops[t][d]->first;
    }
    torch::optim::SGD opt(ref->parameters(), 0.05);
    auto gen = torch::make_generator<torch::CPUGeneratorImpl>(200 + t);
    for (int k = 0; k < kSteps; ++k) {
      auto x = torch::randn({16, 48}, gen);
      opt.zero_grad();
      ref->forward(x).square().mean().backward();
      opt.step();
    }
    expect_bitwise_equal(got[t], params_of(*ref));
  }
}

// ---- one shared model, read-only, 4 threads at once ----

TEST(Threads, SharedReadOnlyModelInputGradients) {
  constexpr int kIters = 3;
  const std::array<Strategy, 4> all = {Strategy::kPlain, Strategy::kCheckpointPerBlock, Strategy::kCheckpointSequential,
                                       Strategy::kPlanned};
  auto seq = gpt_stack(30, 4);
  remat::CheckpointedSequential net(seq, remat::SequentialOptions().algorithm("sqrt"));
  auto input = [](int t, int i) {
    auto gen = torch::make_generator<torch::CPUGeneratorImpl>(1000 * t + i);
    return torch::randn({2, 8, 32}, gen);
  };
  net->plan(input(0, 0).requires_grad_(true));  // profile and solve before the threads start
  auto grad_x = [&](Strategy s, torch::Tensor x) {
    x.requires_grad_(true);
    auto loss = run(s, seq, &net, x).square().mean();
    return torch::autograd::grad({loss}, {x})[0];
  };
  // got[t][i * 4 + k]: thread t, iteration i, strategy (t + k) % 4.
  std::vector<std::vector<torch::Tensor>> got(kThreads);
  std::barrier start(kThreads);
  std::vector<std::thread> pool;
  for (int t = 0; t < kThreads; ++t) {
    pool.emplace_back([&, t] {
      start.arrive_and_wait();
      for (int i = 0; i < kIters; ++i) {
        for (int k = 0; k < 4; ++k) got[t].push_back(grad_x(all[(t + k) % 4], input(t, i)));
      }
      EXPECT_EQ(remat::current_hooks(), nullptr);
      EXPECT_FALSE(remat::is_recomputing());
    });
  }
  for (auto& th : pool) th.join();
  for (auto& p : seq->parameters()) EXPECT_FALSE(p.grad().defined()) << "autograd::grad must not accumulate";
  for (int t = 0; t < kThreads; ++t) {
    for (int i = 0; i < kIters; ++i) {
      const auto want = grad_x(Strategy::kPlain, input(t, i));
      for (int k = 0; k < 4; ++k) {
        SCOPED_TRACE("thread " + std::to_string(t) + " iteration " + std::to_string(i) + ": " + name(all[(t + k) % 4]));
        expect_bitwise_equal({got[t][i * 4 + k]}, {want});
      }
    }
  }
  EXPECT_EQ(net->profiles(), 1);
}

}  // namespace
