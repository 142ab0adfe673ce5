// Shared test fixtures: small real models (MLP, residual CNN with BatchNorm,
// GPT-style transformer block) and helpers that run a step plain or
// checkpointed and compare gradients bitwise.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include <remat/remat.h>

namespace remat_test {

// One intra-op thread: OpenMP workers spin badly on 2 shared cores, and the
// bitwise comparisons want one fixed reduction order anyway.
inline const bool kOneThread = (torch::set_num_threads(1), true);

/** Causal multi-head self-attention + GELU MLP, pre-LayerNorm, dropout. */
struct GptBlockImpl : torch::nn::Module {
  GptBlockImpl(int64_t d_model, int64_t heads, double dropout = 0.0)
      : heads_(heads),
        ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})))),
        qkv(register_module("qkv", torch::nn::Linear(d_model, 3 * d_model))),
        proj(register_module("proj", torch::nn::Linear(d_model, d_model))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})))),
        fc(register_module("fc", torch::nn::Linear(d_model, 4 * d_model))),
        out(register_module("out", torch::nn::Linear(4 * d_model, d_model))),
        drop(register_module("drop", torch::nn::Dropout(dropout))) {}

  torch::Tensor forward(torch::Tensor x) {  // (B, T, C)
    const auto B = x.size(0), T = x.size(1), C = x.size(2), hd = C / heads_;
    auto qkv_out = qkv(ln1(x)).view({B, T, 3, heads_, hd}).permute({2, 0, 3, 1, 4});  // (3, B, H, T, hd)
    auto q = qkv_out[0], k = qkv_out[1], v = qkv_out[2];
    auto att = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));  // (B, H, T, T)
    auto mask = torch::ones({T, T}, torch::kBool).tril();
    att = att.masked_fill(mask.logical_not(), -1e9).softmax(-1);
    att = drop(att);
    auto y = torch::matmul(att, v).transpose(1, 2).contiguous().view({B, T, C});  // (B, T, C)
    x = x + drop(proj(y));
    return x + drop(out(torch::gelu(fc(ln2(x)))));
  }

  int64_t heads_;
  torch::nn::LayerNorm ln1;
  torch::nn::Linear qkv, proj;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc, out;
  torch::nn::Dropout drop;
};
TORCH_MODULE(GptBlock);

/** conv-BN-ReLU-conv-BN + identity, ReLU. */
struct ResBlockImpl : torch::nn::Module {
  explicit ResBlockImpl(int64_t c)
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(c, c, 3).padding(1).bias(false)))),
        bn1(register_module("bn1", torch::nn::BatchNorm2d(c))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(c, c, 3).padding(1).bias(false)))),
        bn2(register_module("bn2", torch::nn::BatchNorm2d(c))) {}
  torch::Tensor forward(torch::Tensor x) {  // (B, C, H, W)
    auto h = torch::relu(bn1(conv1(x)));
    return torch::relu(x + bn2(conv2(h)));
  }
  torch::nn::Conv2d conv1;
  torch::nn::BatchNorm2d bn1;
  torch::nn::Conv2d conv2;
  torch::nn::BatchNorm2d bn2;
};
TORCH_MODULE(ResBlock);

/** n layers of Linear(width, width) + Tanh (or GELU) as a Sequential. */
inline torch::nn::Sequential make_mlp(int64_t n, int64_t width, uint64_t seed = 0, bool gelu = false) {
  torch::manual_seed(seed);
  torch::nn::Sequential seq;
  for (int64_t i = 0; i < n; ++i) {
    seq->push_back(torch::nn::Linear(width, width));
    if (gelu) {
      seq->push_back(torch::nn::GELU());
    } else {
      seq->push_back(torch::nn::Tanh());
    }
  }
  return seq;
}

/** Gradients of every parameter, then the input's (undefined if none). */
inline std::vector<torch::Tensor> grads_of(torch::nn::Module& m, const torch::Tensor& x) {
  std::vector<torch::Tensor> g;
  for (auto& p : m.parameters()) g.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
  g.push_back(x.grad().defined() ? x.grad().clone() : torch::Tensor());
  return g;
}

inline void zero_grads(torch::nn::Module& m, torch::Tensor& x) {
  for (auto& p : m.parameters()) p.mutable_grad() = torch::Tensor();
  if (x.grad().defined()) x.mutable_grad() = torch::Tensor();
}

/** SequentialOptions for a budget taken from remat::profile(), which
 *  measures the chain's activations only: the plan leaves out the parameter
 *  gradients that these tests' backwards allocate (zero_grads sets them to
 *  none), and frees the chain's output with the last stage's backward (these
 *  tests drop it once the loss is computed), as the profile does. */
inline remat::SequentialOptions activations_only() {
  return remat::SequentialOptions().count_parameter_gradients(false).count_held_output(false);
}

/** Asserts two gradient lists are bitwise equal, naming the first mismatch. */
inline void expect_bitwise_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].defined(), b[i].defined()) << "gradient " << i;
    if (!a[i].defined()) continue;
    EXPECT_TRUE(torch::equal(a[i], b[i]))
        << "gradient " << i << " differs: max abs diff " << (a[i] - b[i]).abs().max().item<double>();
  }
}

/** Runs loss = run(x).square().mean(); backward; returns grads (params, x). */
inline std::vector<torch::Tensor> step_grads(torch::nn::Module& m, torch::Tensor x,
                                             const std::function<torch::Tensor(torch::Tensor)>& run) {
  zero_grads(m, x);
  run(x).square().mean().backward();
  return grads_of(m, x);
}

/** 6 x GptBlock(64, 4 heads, dropout p): the chain tests' GPT stack. */
inline torch::nn::Sequential six_gpt_blocks(uint64_t seed = 0, double p = 0.0) {
  torch::manual_seed(seed);
  torch::nn::Sequential s;
  for (int i = 0; i < 6; ++i) s->push_back(GptBlock(64, 4, p));
  return s;
}

/** step_grads of the plain Sequential, RNG seeded with rng_seed first. */
inline std::vector<torch::Tensor> plain_step_grads(torch::nn::Sequential& seq, torch::Tensor x, uint64_t rng_seed) {
  torch::manual_seed(rng_seed);
  return step_grads(*seq, x, [&](torch::Tensor h) { return seq->forward(h); });
}

/** A fresh, empty directory under the test's temp dir. */
inline std::string fresh_dir(const std::string& name) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

/** Entries in a directory (an offload store's files left behind). */
inline size_t files_in(const std::string& dir) {
  return static_cast<size_t>(std::distance(std::filesystem::directory_iterator(dir), {}));
}

/** The message of what fn throws ("" if nothing). */
template <class F>
std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace remat_test
