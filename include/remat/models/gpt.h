// A small decoder-only GPT for remat's trainer, tests and demo: token and
// position embeddings, N pre-LayerNorm blocks (causal multi-head
// self-attention `attn`, GELU MLP `mlp`), dropout, final LayerNorm and an
// output head tied to the token embedding. The blocks are a
// torch::nn::Sequential so any checkpoint strategy can wrap them:
//   logits = head(blocks->forward(embed(idx)))
// Attention is explicit by default (plain matmul + softmax keeps every
// activation visible); GptConfig::sdpa switches it to
// at::scaled_dot_product_attention (flash or memory-efficient kernels on CUDA).
// Leaves out: KV cache and generation, weight-decay groups.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <remat/checkpointable.h>
#include <remat/policy.h>

/** The GPT and ResNet models and the trainer behind remat-train (library
 *  remat::models). */
namespace remat::models {

/** Shape of a Gpt; validated by GptImpl's constructor. The defaults are a
 *  small character-level model. */
struct GptConfig {
  /** Number of token ids (character-level: distinct bytes of the text). */
  int64_t vocab = 256;
  /** Longest sequence (rows of the position embedding), tokens. */
  int64_t seq_len = 128;
  /** Width of the residual stream, channels. */
  int64_t d_model = 128;
  /** Attention heads; must divide d_model. */
  int64_t heads = 4;
  /** Transformer blocks. */
  int64_t layers = 8;
  /** Dropout probability on embeddings, attention weights and residual
   *  branches. Default 0. */
  double dropout = 0.0;
  /** Attention through at::scaled_dot_product_attention (is_causal) instead
   *  of the explicit scores/softmax. Default false. */
  bool sdpa = false;
  /** > 0: loss() computes the head and cross-entropy in this many slices of
   *  the tokens (remat::chunked_cross_entropy), never holding the whole
   *  (B, T, vocab) logits or their gradient. 0 (default): the full logits. */
  int64_t loss_chunks = 0;
  /** > 0: each MLP runs over this many slices of the sequence, each
   *  checkpointed (remat::chunked), so one slice's (B, T / mlp_chunks, 4C)
   *  intermediates exist at a time. 0 (default): unchunked. */
  int64_t mlp_chunks = 0;
};

/** Megatron-style selective recompute for these blocks (Korthikanti et al.
 *  2022): save the outputs of the qkv, attention-output and MLP-up linear
 *  layers by name; recompute the attention core (scores, mask, softmax,
 *  dropout, context), GELU, LayerNorm and the residual adds. */
Policy megatron_policy();

/** Causal multi-head self-attention: (B, T, C) -> (B, T, C). Names (for
 *  selective policies): attn_qkv, attn_scores, attn_probs, attn_context,
 *  attn_out (with sdpa: attn_qkv, attn_context, attn_out; the scores never
 *  exist as a tensor). Checkpointable (remat::enable_checkpointing). */
class CausalSelfAttentionImpl : public torch::nn::Module, public remat::Checkpointable {
 public:
  /** sdpa: at::scaled_dot_product_attention(q, k, v, is_causal) with the
   *  attention dropout as its dropout_p (0 in eval mode). */
  CausalSelfAttentionImpl(int64_t d_model, int64_t heads, double dropout, bool sdpa = false);
  /** attend(x) through the checkpoint switch (checkpointed()). */
  torch::Tensor forward(const torch::Tensor& x);
  /** forward() without the switch. */
  torch::Tensor attend(const torch::Tensor& x);
  /** The input projection to q, k, v (C -> 3C) and the output projection (C -> C). */
  ///@{
  torch::nn::Linear qkv{nullptr}, proj{nullptr};
  ///@}
  /** Dropout on the attention weights and on the output. */
  ///@{
  torch::nn::Dropout attn_drop{nullptr}, resid_drop{nullptr};
  ///@}

 private:
  int64_t heads_;
  bool sdpa_;
};
/** The module holder of CausalSelfAttentionImpl (a shared_ptr to it, as TORCH_MODULE makes). */
TORCH_MODULE(CausalSelfAttention);

/** GELU MLP with 4x expansion: (B, T, C) -> (B, T, C). Names: mlp_fc,
 *  mlp_act, mlp_out. Checkpointable. */
class MlpImpl : public torch::nn::Module, public remat::Checkpointable {
 public:
  /** d_model channels in and out, 4 d_model hidden; dropout on the output;
   *  chunks > 0: transform() over that many slices of dim 1 (GptConfig::mlp_chunks). */
  MlpImpl(int64_t d_model, double dropout, int64_t chunks = 0);
  /** transform(x) through the checkpoint switch (checkpointed()). */
  torch::Tensor forward(const torch::Tensor& x);
  /** forward() without the switch: drop(proj(gelu(fc(x)))), slice by
   *  slice of the sequence when built with chunks > 0. */
  torch::Tensor transform(const torch::Tensor& x);
  /** The up (C -> 4C) and down (4C -> C) projections. */
  ///@{
  torch::nn::Linear fc{nullptr}, proj{nullptr};
  ///@}
  torch::nn::Dropout drop{nullptr};  ///< dropout on the output

 private:
  torch::Tensor body(const torch::Tensor& x);
  int64_t chunks_;
};
/** The module holder of MlpImpl (a shared_ptr to it, as TORCH_MODULE makes). */
TORCH_MODULE(Mlp);

/** Pre-LayerNorm block: x = x + attn(ln1(x)); x = x + mlp(ln2(x)).
 *  Checkpointable, as are its attn and mlp. */
class GptBlockImpl : public torch::nn::Module, public remat::Checkpointable {
 public:
  /** Arguments as CausalSelfAttentionImpl's; d_model channels in and out;
   *  mlp_chunks as GptConfig::mlp_chunks. */
  GptBlockImpl(int64_t d_model, int64_t heads, double dropout, bool sdpa = false, int64_t mlp_chunks = 0);
  /** body(x) through the checkpoint switch (checkpointed()): (B, T, C) -> (B, T, C). */
  torch::Tensor forward(const torch::Tensor& x);
  /** forward() without the switch. */
  torch::Tensor body(const torch::Tensor& x);
  /** The LayerNorms before attention and before the MLP. */
  ///@{
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  ///@}
  CausalSelfAttention attn{nullptr};  ///< the attention branch
  Mlp mlp{nullptr};                   ///< the MLP branch
};
/** The module holder of GptBlockImpl (a shared_ptr to it, as TORCH_MODULE makes). */
TORCH_MODULE(GptBlock);

/** The GPT: embed(), the `blocks` Sequential, head(). Build it through its
 *  holder Gpt, e.g. `remat::models::Gpt gpt(remat::models::GptConfig{})`. */
class GptImpl : public torch::nn::Module {
 public:
  /** Validates the config (throws remat::Error) and initialises GPT-2 style
   *  (normal(0, 0.02), residual projections scaled by 1/sqrt(2 layers)). */
  explicit GptImpl(const GptConfig& config);
  /** idx (B, T) int64 with T <= seq_len -> (B, T, C). */
  torch::Tensor embed(const torch::Tensor& idx);
  /** h (B, T, C) -> logits (B, T, vocab), through the tied token embedding. */
  torch::Tensor head(const torch::Tensor& h);
  /** Mean cross-entropy of head(h) against targets (B, T) int64, in
   *  float32, by remat::chunked_cross_entropy with GptConfig::loss_chunks
   *  slices (0: through the full logits): a unit of the whole-step planner,
   *  which may choose another count (AutoOptions::chunk_counts). */
  torch::Tensor loss(const torch::Tensor& h, const torch::Tensor& targets);
  /** head(blocks->forward(embed(idx))): (B, T) -> (B, T, vocab). */
  torch::Tensor forward(const torch::Tensor& idx);
  /** The output projection: the token embedding's weight (vocab, C), shared. */
  const torch::Tensor& head_weight() const { return wte->weight; }
  /** The config it was built with. */
  const GptConfig& config() const { return config_; }

  /** Token embedding (vocab, C), tied to the head, and position embedding (seq_len, C). */
  ///@{
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  ///@}
  torch::nn::Dropout drop{nullptr};  ///< dropout on the embeddings
  /** layers GptBlock modules, each (B, T, C) -> (B, T, C). */
  torch::nn::Sequential blocks{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};  ///< the final LayerNorm, applied in head()

 private:
  GptConfig config_;
};
/** The module holder of GptImpl (a shared_ptr to it, as TORCH_MODULE makes). */
TORCH_MODULE(Gpt);

/** Stage `stage` of a GPT of `layers` blocks cut into `stages` pipeline
 *  stages: blocks [first_block, end_block) of an even cut (the first stages
 *  take the extra blocks); stage 0 also embeds (wte, wpe), the last stage
 *  has the final norm and the head, whose weight is wte (tied). Requires
 *  0 <= stage < stages <= layers. */
struct GptStage {
  int64_t first_block = 0;  ///< the stage's first block
  int64_t end_block = 0;    ///< one past its last block
  bool embeds = false;      ///< runs the embeddings (stage 0)
  bool heads = false;       ///< runs the final norm, head and loss (the last stage)
};
/** The cut of stage `stage` of `stages` over `layers` blocks (see GptStage). */
GptStage gpt_stage(int64_t layers, int stage, int stages);

/** The parameters of `gpt` that stage `s` uses, by name: its blocks', wpe
 *  on the embedding stage, ln_f on the head stage, wte on both. */
std::vector<std::pair<std::string, torch::Tensor>> gpt_stage_parameters(GptImpl& gpt, const GptStage& s);

}  // namespace remat::models
