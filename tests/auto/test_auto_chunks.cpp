// The whole-step planner with chunked calls as units (AutoOptions::chunk_counts):
// a GPT's head and loss (remat::chunked_cross_entropy) and its MLPs'
// remat::chunked regions, planned with the blocks under one budget.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <remat/models/gpt.h>
#include <remat/remat.h>

#include "../common.h"

namespace {

constexpr int kSteps = 4;  // 1 warm-up, 1 profiled, 2 planned

/** A GPT whose head dominates: vocabulary 2048 over 8 x 64 tokens (4 MiB
 *  of float32 logits, held twice by the plain loss), 4 blocks of d_model 64. */
remat::models::GptConfig head_heavy_gpt(int64_t loss_chunks, int64_t mlp_chunks = 0, double dropout = 0.1) {
  remat::models::GptConfig c;
  c.vocab = 2048;
  c.seq_len = 64;
  c.d_model = 64;
  c.heads = 4;
  c.layers = 4;
  c.dropout = dropout;
  c.loss_chunks = loss_chunks;
  c.mlp_chunks = mlp_chunks;
  return c;
}

struct Trial {
  std::vector<std::vector<torch::Tensor>> params;  // after each step
  std::vector<int64_t> peaks;                      // planned steps' measured peaks
  int64_t budget = 0, leanest = 0, profiled = 0;
  std::vector<remat::AutoUnit> units;
  std::string explain;
};

/** The parameters, copied outside the tracked allocator (so that keeping
 *  them does not change the peaks the planner measures). */
std::vector<torch::Tensor> params_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters()) {
    auto c = p.detach().contiguous();
    auto bytes = std::make_shared<std::vector<float>>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
    out.push_back(torch::from_blob(
        bytes->data(), c.sizes(), [bytes](void*) mutable { bytes.reset(); }, torch::kFloat));
  }
  return out;
}

/** kSteps AdamW steps of the GPT on fixed batches; plain without options,
 *  else under auto_checkpoint with them. `budget_of` turns the planner's
 *  profiled peak and leanest peak into the budget (after the profiled step). */
Trial run(const remat::models::GptConfig& c, std::optional<remat::AutoOptions> options,
          const std::function<int64_t(int64_t profiled, int64_t leanest)>& budget_of = nullptr) {
  torch::manual_seed(0);
  auto gpt = remat::models::Gpt(c);
  torch::optim::AdamW opt(gpt->parameters(), torch::optim::AdamWOptions(1e-3));
  torch::manual_seed(1234);
  std::vector<torch::Tensor> idx;
  for (int k = 0; k < kSteps; ++k) idx.push_back(torch::randint(c.vocab, {8, c.seq_len + 1}, torch::kLong));
  torch::manual_seed(1);
  auto step = [&](int k) {
    auto x = idx[k].slice(1, 0, c.seq_len), y = idx[k].slice(1, 1, c.seq_len + 1);
    opt.zero_grad();
    gpt->loss(gpt->blocks->forward(gpt->embed(x)), y).backward();
    opt.step();
  };
  Trial r;
  if (!options) {
    for (int k = 0; k < kSteps; ++k) {
      step(k);
      r.params.push_back(params_of(*gpt));
    }
    return r;
  }
  auto planner = remat::auto_checkpoint(gpt, options->memory_budget_fraction(1.0).profile_repeats(1));
  for (int k = 0; k < kSteps; ++k) {
    const bool planned = planner.planned();
    planner.step([&] { step(k); });
    if (!planned && planner.planned() && budget_of) {
      planner.replan(budget_of(planner.profiled_peak_bytes(), planner.leanest_peak_bytes()));
    }
    if (planned) r.peaks.push_back(planner.measured_peak_bytes());
    r.params.push_back(params_of(*gpt));
  }
  r.budget = planner.budget_bytes();
  r.leanest = planner.leanest_peak_bytes();
  r.profiled = planner.profiled_peak_bytes();
  r.units = planner.units();
  r.explain = planner.explain();
  return r;
}

const remat::AutoUnit* unit_named(const Trial& r, const std::string& name) {
  for (const auto& u : r.units) {
    if (u.name == name) return &u;
  }
  return nullptr;
}

/** Every parameter after every step: bitwise (exact) or within float32
 *  reassociation of the sums over slices, 4 steps of AdamW at lr 1e-3. */
void expect_params(const Trial& plain, const Trial& got, bool exact, const std::string& what) {
  ASSERT_EQ(plain.params.size(), got.params.size());
  for (size_t k = 0; k < plain.params.size(); ++k) {
    for (size_t i = 0; i < plain.params[k].size(); ++i) {
      if (exact) {
        ASSERT_TRUE(torch::equal(plain.params[k][i], got.params[k][i])) << what << ": param " << i << " step " << k;
      } else {
        ASSERT_TRUE(torch::allclose(plain.params[k][i], got.params[k][i], /*rtol=*/1e-4, /*atol=*/1e-5))
            << what << ": param " << i << " step " << k << ", max |diff| "
            << (plain.params[k][i] - got.params[k][i]).abs().max().item<double>();
      }
    }
  }
}

}  // namespace

// The loss head is a unit: its menu is its own count, then the counts
// asked for; the leanest plans chunk it, which lowers the least peak by
// about the logits it no longer holds; every planned step stays within
// its budget, and the parameters match the plain run's (bitwise through
// the profiled step, which runs the call as written).
TEST(AutoChunks, TheLossHeadIsAUnitChunkedAtLowBudgetsWithinBudget) {
  for (int64_t own : {0, 8}) {
    const auto c = head_heavy_gpt(own);
    const Trial plain = run(c, std::nullopt);
    const Trial without = run(c, remat::AutoOptions());
    EXPECT_EQ(unit_named(without, "chunked_cross_entropy"), nullptr) << "no chunk_counts: the call is no unit";
    expect_params(plain, without, /*exact=*/true, "no chunk counts");
    for (double f : {0.0, 0.5, 1.0}) {
      const std::string what = "own count " + std::to_string(own) + ", budget at " + std::to_string(f);
      const Trial got =
          run(c, remat::AutoOptions().chunk_counts(remat::default_chunk_counts()), [&](int64_t hi, int64_t lo) {
            return lo + static_cast<int64_t>(f * static_cast<double>(hi - lo)) + (f == 0.0 ? lo / 100 : 0);
          });
      const remat::AutoUnit* head = unit_named(got, "chunked_cross_entropy");
      ASSERT_NE(head, nullptr) << what << "\n" << got.explain;
      EXPECT_EQ(head->options[0], own == 0 ? "unchunked (as called)" : "8 chunks (as called)") << what;
      EXPECT_NE(std::find(head->options.begin(), head->options.end(), "32 chunks"), head->options.end()) << what;
      EXPECT_NE(got.explain.find("chunked_cross_entropy"), std::string::npos) << got.explain;
      for (size_t i = 0; i < got.peaks.size(); ++i) {
        std::printf("%s: step %zu peak %lld, budget %lld (leanest %lld, plain %lld), head: %s\n", what.c_str(), i,
                    static_cast<long long>(got.peaks[i]), static_cast<long long>(got.budget),
                    static_cast<long long>(got.leanest), static_cast<long long>(got.profiled),
                    head->options[head->choice].c_str());
        EXPECT_LE(static_cast<double>(got.peaks[i]), 1.01 * static_cast<double>(got.budget)) << what << "\n"
                                                                                             << got.explain;
      }
      // Steps 1 and 2 (warm-up, profiled) run the call as written.
      for (size_t k = 0; k < 2; ++k) {
        for (size_t i = 0; i < plain.params[k].size(); ++i) {
          ASSERT_TRUE(torch::equal(plain.params[k][i], got.params[k][i])) << what << ": step " << k;
        }
      }
      expect_params(plain, got, /*exact=*/head->choice == 0, what);
      if (f == 0.0 && own == 0) {
        EXPECT_NE(head->choice, 0) << what << ": the leanest plan chunks the head\n" << got.explain;
        // Plain holds the logits and their log-softmax (2 x 4 MiB) to backward.
        EXPECT_LT(got.leanest, without.leanest - (4 << 20)) << what << "\n" << got.explain << "\n" << without.explain;
      }
    }
  }
}

// A chunked region inside a unit (the GPT's MLP over slices of the
// sequence) is that unit's inner unit: where the block recomputes it runs
// with its own count, in forward and in the recompute alike (another
// count there would save other tensors than the recompute makes).
TEST(AutoChunks, ChunkedRegionsInsideBlocksRunTheirOwnCountWhereTheBlockRecomputes) {
  // No dropout: inside a region, another count draws other masks.
  const auto c = head_heavy_gpt(4, 4, 0.0);
  const Trial plain = run(c, std::nullopt);
  for (double f : {0.0, 0.5}) {
    const std::string what = "budget at " + std::to_string(f);
    const Trial got = run(c, remat::AutoOptions().chunk_counts({1, 2, 8}), [&](int64_t hi, int64_t lo) {
      return lo + static_cast<int64_t>(f * static_cast<double>(hi - lo)) + (f == 0.0 ? lo / 100 : 0);
    });
    int sites = 0, inside_recompute = 0;
    for (const auto& u : got.units) {
      if (u.name.find("/chunked") == std::string::npos) continue;
      ++sites;
      EXPECT_EQ(u.options[0], "4 chunks (as called)") << u.name;
      if (!u.runs_in.empty()) {
        ++inside_recompute;
        EXPECT_EQ(u.choice, 0) << u.name << " runs in " << u.runs_in;
      }
    }
    EXPECT_EQ(sites, 4) << got.explain;  // blocks.k.mlp/chunked
    if (f == 0.0) {
      EXPECT_GT(inside_recompute, 0) << "the leanest plan recomputes blocks\n" << got.explain;
    }
    for (int64_t p : got.peaks) EXPECT_LE(static_cast<double>(p), 1.01 * static_cast<double>(got.budget)) << what;
    expect_params(plain, got, /*exact=*/false, what);
  }
}

// recompute(false): the loss head still takes chunk counts (its gradient
// is computed in forward), the MLPs' chunked() regions keep their own count
// (their slices are checkpointed), no block recomputes; the leanest plan
// chunks the head, within the budget, as the plain step up to reassociation.
TEST(AutoChunks, WithoutRecomputeTheHeadTakesCountsAndRegionsKeepTheirOwn) {
  const auto c = head_heavy_gpt(0, 4, 0.0);
  const Trial plain = run(c, std::nullopt);
  const Trial got = run(c, remat::AutoOptions().recompute(false).chunk_counts({1, 2, 8}),
                        [](int64_t, int64_t lo) { return lo + lo / 100; });
  int regions = 0, heads = 0;
  for (const auto& u : got.units) {
    if (u.name.find("/chunked") != std::string::npos) {
      ++regions;
      EXPECT_EQ(u.options, (std::vector<std::string>{"4 chunks (as called)"})) << u.name;
    } else if (u.name == "chunked_cross_entropy") {
      ++heads;
      EXPECT_GT(u.options.size(), 1u) << got.explain;
      EXPECT_NE(u.choice, 0) << "the leanest plan chunks the head\n" << got.explain;
    } else {
      EXPECT_EQ(u.options, (std::vector<std::string>{"keep"})) << u.name;
    }
  }
  EXPECT_EQ(regions, 4) << got.explain;
  EXPECT_EQ(heads, 1) << got.explain;
  for (int64_t p : got.peaks) EXPECT_LE(static_cast<double>(p), 1.01 * static_cast<double>(got.budget));
  expect_params(plain, got, /*exact=*/false, "recompute(false)");
}

// Two chunked calls in one step are two units, told apart by their order.
TEST(AutoChunks, TwoCallsInAStepAreTwoUnits) {
  struct Heads : torch::nn::Module, remat::Checkpointable {
    Heads() {
      body = register_module("body", torch::nn::Linear(32, 32));
      a = register_parameter("a", torch::randn({512, 32}) * 0.1);
      b = register_parameter("b", torch::randn({256, 32}) * 0.1);
    }
    torch::Tensor forward(const torch::Tensor& x) {
      return checkpointed([this](const torch::Tensor& h) { return torch::relu(body(h)); }, x);
    }
    torch::nn::Linear body{nullptr};
    torch::Tensor a, b;
  };
  torch::manual_seed(0);
  auto net = std::make_shared<Heads>();
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  auto x = torch::randn({256, 32});
  auto ya = torch::randint(512, {256}), yb = torch::randint(256, {256});
  auto planner = remat::auto_checkpoint(
      *net,
      remat::AutoOptions().memory_budget_fraction(1.0).chunk_counts(remat::default_chunk_counts()).profile_repeats(1));
  for (int k = 0; k < 3; ++k) {
    planner.step([&] {
      opt.zero_grad();
      auto h = net->forward(x);
      auto la = remat::chunked_cross_entropy(h, net->a, ya, remat::ChunkedCrossEntropyOptions(0));
      auto lb = remat::chunked_cross_entropy(h, net->b, yb, remat::ChunkedCrossEntropyOptions(2));
      (la + lb).backward();
      opt.step();
    });
  }
  std::vector<std::string> names;
  for (const auto& u : planner.units()) names.push_back(u.name + ": " + u.options[0]);
  EXPECT_NE(std::find(names.begin(), names.end(), "chunked_cross_entropy: unchunked (as called)"), names.end())
      << planner.explain();
  EXPECT_NE(std::find(names.begin(), names.end(), "chunked_cross_entropy #2: 2 chunks (as called)"), names.end())
      << planner.explain();
}

TEST(AutoChunks, ErrorsNameTheValue) {
  auto gpt = remat::models::Gpt(head_heavy_gpt(0));
  EXPECT_EQ(remat_test::error_of([&] {
              remat::auto_checkpoint(gpt, remat::AutoOptions().memory_budget_fraction(1.0).chunk_counts({4, 0}));
            }),
            "[remat::auto] chunk_counts holds 0; each count must be >= 1 (a call's own count, 0 included, is always "
            "its first option). Pass e.g. remat::default_chunk_counts().");
}

// A chunked call inside a checkpointed region of the user's own keeps its
// count (the region's recompute runs it again with that count), and one
// inside another chunked call is part of it (the outer count decides how
// often it runs): neither is a unit, and the planned steps run through
// their recomputes.
TEST(AutoChunks, CallsInsideARegionOfYourOwnOrAnotherChunkedCallKeepTheirCount) {
  struct Body : torch::nn::Module, remat::Checkpointable {
    Body() {
      fc = register_module("fc", torch::nn::Linear(32, 32));
      w = register_parameter("w", torch::randn({512, 32}) * 0.1);
    }
    torch::Tensor forward(const torch::Tensor& x) {
      return checkpointed([this](const torch::Tensor& h) { return torch::relu(fc(h)); }, x);
    }
    torch::nn::Linear fc{nullptr};
    torch::Tensor w;
  };
  for (bool nested : {false, true}) {
    auto run_steps = [&](bool planned) {
      torch::manual_seed(0);
      auto net = std::make_shared<Body>();
      torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
      auto x = torch::randn({4, 64, 32});
      auto y = torch::randint(512, {4, 64});
      auto step = [&] {
        opt.zero_grad();
        auto h = net->forward(x);
        torch::Tensor loss;
        if (nested) {  // per sequence slice, each slice's loss chunked again
          loss = remat::chunked(
              [&](const std::vector<torch::Tensor>& in) {
                return remat::chunked_cross_entropy(in[0], net->w, in[1], remat::ChunkedCrossEntropyOptions(2));
              },
              {h, y}, remat::ChunkOptions(1, 4).reduce(remat::ChunkReduce::kMean));
        } else {
          loss = remat::checkpoint(
              remat::CheckpointOptions(),
              [&](const std::vector<torch::Tensor>& in) {
                return remat::chunked_cross_entropy(in[0], net->w, y, remat::ChunkedCrossEntropyOptions(0));
              },
              std::vector<torch::Tensor>{h});
        }
        loss.backward();
        opt.step();
      };
      std::vector<std::string> names;
      if (!planned) {
        for (int k = 0; k < 4; ++k) step();
      } else {
        auto planner = remat::auto_checkpoint(*net, remat::AutoOptions()
                                                        .memory_budget_fraction(1.0)
                                                        .chunk_counts(remat::default_chunk_counts())
                                                        .profile_repeats(1));
        for (int k = 0; k < 2; ++k) planner.step(step);
        planner.replan(planner.leanest_peak_bytes() + planner.leanest_peak_bytes() / 100);
        for (int k = 0; k < 2; ++k) planner.step(step);
        for (const auto& u : planner.units()) names.push_back(u.name + ": " + u.options[u.choice]);
      }
      return std::make_pair(params_of(*net), names);
    };
    const auto plain = run_steps(false);
    const auto got = run_steps(true);
    std::string all;
    for (const auto& n : got.second) all += n + "\n";
    EXPECT_EQ(all.find("chunked_cross_entropy"), std::string::npos) << (nested ? "nested" : "in a region") << "\n"
                                                                    << all;
    if (nested) {
      EXPECT_NE(all.find("chunked: "), std::string::npos) << "the outer call is a unit\n" << all;
    } else {
      // Its own count throughout: the step is the plain one.
      for (size_t i = 0; i < plain.first.size(); ++i) EXPECT_TRUE(torch::equal(plain.first[i], got.first[i])) << i;
    }
  }
}

// A head profiled unchunked and planned chunked is predicted at the
// chunked head's bytes: its backward's window runs until its last node
// returns, so the (tokens x vocabulary) gradient of the logits that the
// matmul's backward holds after its last unpack is the head's, not left
// outside every unit at the unchunked size (the leanest plan was then
// predicted a logits' gradient high: 11.9 MB here against 8.7 MB).
TEST(AutoChunks, AHeadProfiledUnchunkedIsPredictedAtItsChunkedBytes) {
  auto c = head_heavy_gpt(/*loss_chunks=*/0, /*mlp_chunks=*/8, /*dropout=*/0.0);  // profiled unchunked
  c.vocab = 1000;
  c.seq_len = 224;
  c.heads = 2;
  c.layers = 2;
  c.sdpa = true;
  const Trial planned =
      run(c, remat::AutoOptions().chunk_counts({8}), [](int64_t, int64_t lo) { return lo + lo / 100; });
  const remat::AutoUnit* head = unit_named(planned, "chunked_cross_entropy");
  ASSERT_NE(head, nullptr) << planned.explain;
  ASSERT_EQ(head->options[head->choice], "8 chunks") << planned.explain;
  ASSERT_FALSE(planned.peaks.empty());
  for (size_t i = 0; i < planned.peaks.size(); ++i) {
    EXPECT_LE(static_cast<double>(planned.peaks[i]), 1.01 * static_cast<double>(planned.budget)) << planned.explain;
    EXPECT_GE(static_cast<double>(planned.peaks[i]), 0.97 * static_cast<double>(planned.leanest))
        << "predicted within 3% of the measured peak\n"
        << planned.explain;
  }
}
