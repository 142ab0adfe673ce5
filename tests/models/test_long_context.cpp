// Long-context levers on remat's GPT: the chunked head + loss
// (GptConfig::loss_chunks) and the chunked MLP (GptConfig::mlp_chunks),
// alone and combined with block checkpointing, selective policies, dropout
// and the trainer's peak prediction; against the unchunked model.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include <remat/models/gpt.h>
#include <remat/models/trainer.h>
#include <remat/remat.h>

namespace {

using remat::models::Gpt;
using remat::models::GptConfig;

const bool kOneThread = (torch::set_num_threads(1), true);

// float32 results that differ from the unchunked model only by the order
// of sums over slices (weights' gradients, the loss).
constexpr double kRel = 1e-5;

double rel_err(const torch::Tensor& a, const torch::Tensor& b) {
  auto d = (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
  return d / std::max(b.to(torch::kDouble).abs().max().item<double>(), 1e-30);
}

GptConfig config(int64_t loss_chunks, int64_t mlp_chunks, double dropout = 0.0) {
  GptConfig c;
  c.vocab = 512;
  c.seq_len = 48;
  c.d_model = 32;
  c.heads = 4;
  c.layers = 3;
  c.dropout = dropout;
  c.loss_chunks = loss_chunks;
  c.mlp_chunks = mlp_chunks;
  return c;
}

/** One forward + backward: the loss, then every parameter's gradient. */
std::vector<torch::Tensor> step(Gpt& net, const torch::Tensor& x, const torch::Tensor& y, uint64_t seed = 11) {
  for (auto& p : net->parameters()) p.mutable_grad() = torch::Tensor();
  torch::manual_seed(seed);  // dropout draws
  auto loss = net->loss(net->blocks->forward(net->embed(x)), y);
  loss.backward();
  std::vector<torch::Tensor> out{loss.detach()};
  for (auto& p : net->parameters()) out.push_back(p.grad().clone());
  return out;
}

Gpt build(const GptConfig& c) {
  torch::manual_seed(5);
  return Gpt(c);
}

std::pair<torch::Tensor, torch::Tensor> data(const GptConfig& c, int64_t B = 2, int64_t T = 45) {
  torch::manual_seed(9);
  auto ids = torch::randint(c.vocab, {B, T + 1}, torch::kLong);
  return {ids.slice(1, 0, T), ids.slice(1, 1, T + 1)};
}

}  // namespace

TEST(LongContext, ChunkedHeadLossAndMlpMatchTheUnchunkedGpt) {
  auto [x, y] = data(config(0, 0));  // T = 45: 4 and 7 slices do not divide it
  auto plain_net = build(config(0, 0));
  auto ref = step(plain_net, x, y);
  for (auto [lc, mc] : {std::pair<int64_t, int64_t>{4, 0}, {0, 7}, {4, 7}, {90, 45}}) {
    auto net = build(config(lc, mc));
    auto got = step(net, x, y);
    ASSERT_EQ(got.size(), ref.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_LE(rel_err(got[i], ref[i]), kRel) << "loss_chunks " << lc << " mlp_chunks " << mc << " tensor " << i;
    }
  }
}

TEST(LongContext, ChunkedMlpUnderBlockCheckpointsAndPoliciesIsBitwiseEqual) {
  // With dropout: each block's re-run replays its RNG, each slice's re-run
  // its own; the arithmetic is the same as the chunked model without block
  // checkpoints, so everything is equal bit for bit.
  const auto c = config(3, 5, /*dropout=*/0.1);
  auto [x, y] = data(c);
  auto base = build(c);
  auto ref = step(base, x, y);
  for (int variant = 0; variant < 3; ++variant) {
    auto net = build(c);
    if (variant == 0) remat::enable_checkpointing(*net, remat::select::type<remat::models::GptBlockImpl>());
    if (variant == 1) {
      remat::enable_checkpointing(*net, remat::select::type<remat::models::GptBlockImpl>(),
                                  remat::CheckpointOptions().policy(remat::models::megatron_policy()));
    }
    if (variant == 2) remat::enable_checkpointing(*net, remat::select::type<remat::models::MlpImpl>());
    auto got = step(net, x, y);
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_TRUE(torch::equal(got[i], ref[i])) << "variant " << variant << " " << i;
  }
}

TEST(LongContext, ChunkedLossStepPeaksBelowTheLogits) {
  // vocab 4096, 2 x 256 tokens: the (B, T, V) logits are 8 MiB in float32;
  // an unchunked step holds them and their gradient, a chunked one neither.
  remat::memory::enable_tracking();
  auto c = config(0, 0);
  c.vocab = 4096;
  c.seq_len = 256;
  auto [x, y] = data(c, 2, 256);
  const int64_t logits_bytes = 2 * 256 * 4096 * 4;
  auto peak_of = [&](int64_t loss_chunks) {
    c.loss_chunks = loss_chunks;
    auto net = build(c);
    step(net, x, y);  // gradients allocated, as in a later step
    remat::memory::reset_peak();
    const int64_t base = remat::memory::current_bytes();
    auto loss = net->loss(net->blocks->forward(net->embed(x)), y);
    loss.backward();
    return remat::memory::peak_bytes() - base;
  };
  const int64_t plain = peak_of(0), chunked = peak_of(16);
  EXPECT_LT(chunked, plain - logits_bytes) << "plain " << plain << " B, chunked " << chunked << " B";
}

TEST(LongContext, TrainerPredictsAndTrainsWithChunking) {
  // The trainer's step with both chunkings and block checkpoints: the loss
  // equals the unchunked run's within the bound, and the predicted peak
  // stays within 15% of the measured one.
  const std::string data_path = (std::filesystem::temp_directory_path() / "remat_long_context.txt").string();
  {
    std::ofstream out(data_path);
    for (int i = 0; i < 400; ++i) out << "the quick brown fox " << i << " jumps over the lazy dog.\n";
  }
  remat::models::TrainConfig cfg;
  cfg.data_path = data_path;
  cfg.layers = 2;
  cfg.d_model = 32;
  cfg.seq_len = 64;
  cfg.batch = 2;
  cfg.steps = 2;
  cfg.optimizer = "sgd";
  cfg.checkpoint = remat::models::Strategy::kBlock;
  auto losses = [&](int64_t lc, int64_t mc) {
    cfg.loss_chunks = lc;
    cfg.mlp_chunks = mc;
    remat::models::Trainer t(cfg);
    std::vector<double> out;
    for (const auto& s : t.run()) out.push_back(s.loss);
    return out;
  };
  auto ref = losses(0, 0), got = losses(4, 3);
  ASSERT_EQ(got.size(), 2u);
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], ref[i], 1e-5 * std::abs(ref[i])) << i;

  cfg.loss_chunks = 4;
  cfg.mlp_chunks = 3;
  remat::models::Trainer t(cfg);
  const auto predicted = t.predict_step().peak_bytes;
  t.prepare();
  const auto measured = t.step().peak_bytes;
  EXPECT_NEAR(static_cast<double>(predicted), static_cast<double>(measured), 0.15 * measured)
      << "predicted " << predicted << " B, measured " << measured << " B";
  std::filesystem::remove(data_path);
}

TEST(LongContext, NegativeChunksAreRejected) {
  auto c = config(-1, 0);
  try {
    Gpt net(c);
    FAIL() << "no error";
  } catch (const remat::Error& e) {
    EXPECT_STREQ(e.what(),
                 "[remat::models] loss_chunks and mlp_chunks must be >= 0 (0: unchunked), got -1 and 0. Fix "
                 "--loss-chunks / --mlp-chunks.");
  }
}
