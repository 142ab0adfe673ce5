// GPT and ResNet of remat::models (see include/remat/models/gpt.h and
// resnet.h for what they are and what they leave out).
#include <remat/models/gpt.h>
#include <remat/models/resnet.h>

#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <string>

#include <remat/checkpoint.h>
#include <remat/chunked.h>
#include <remat/error.h>
#include <remat/selective.h>

namespace remat::models {

namespace {

std::string str(int64_t v) { return std::to_string(v); }

void check_positive(const char* what, int64_t v, const char* remedy) {
  if (v <= 0) {
    throw Error(std::string("[remat::models] ") + what + " must be positive, got " + str(v) + ". " + remedy);
  }
}

/** aten::linear (addmm on the flattened input, as Python's nn.Linear runs
 *  it), not the C++ module's matmul + in-place bias: a name on the result
 *  then reaches the addmm (remat::checkpoint_name). */
torch::Tensor linear(const torch::nn::Linear& l, const torch::Tensor& x) {
  return torch::linear(x, l->weight, l->bias);
}

}  // namespace

Policy megatron_policy() { return policy::save_names({"attn_qkv", "attn_out", "mlp_fc"}); }

// --- GPT ---------------------------------------------------------------------

CausalSelfAttentionImpl::CausalSelfAttentionImpl(int64_t d_model, int64_t heads, double dropout, bool sdpa)
    : qkv(register_module("qkv", torch::nn::Linear(d_model, 3 * d_model))),
      proj(register_module("proj", torch::nn::Linear(d_model, d_model))),
      attn_drop(register_module("attn_drop", torch::nn::Dropout(dropout))),
      resid_drop(register_module("resid_drop", torch::nn::Dropout(dropout))),
      heads_(heads),
      sdpa_(sdpa) {}

torch::Tensor CausalSelfAttentionImpl::forward(const torch::Tensor& x) {
  return checkpointed([this](const torch::Tensor& h) { return attend(h); }, x);
}

torch::Tensor CausalSelfAttentionImpl::attend(const torch::Tensor& x) {  // (B, T, C)
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), hd = C / heads_;
  auto qkv_out = checkpoint_name(linear(qkv, x), "attn_qkv");                    // (B, T, 3C)
  auto qkv_bthd = qkv_out.view({B, T, 3, heads_, hd}).permute({2, 0, 3, 1, 4});  // (3, B, H, T, hd)
  auto q = qkv_bthd[0], k = qkv_bthd[1], v = qkv_bthd[2];                        // (B, H, T, hd)
  if (sdpa_) {
    const double p = is_training() ? attn_drop->options.p() : 0.0;
    auto ctx = at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, p, /*is_causal=*/true);  // (B, H, T, hd)
    auto y = checkpoint_name(ctx, "attn_context").transpose(1, 2).reshape({B, T, C});               // (B, T, C)
    return resid_drop(checkpoint_name(linear(proj, y), "attn_out"));                                // (B, T, C)
  }
  auto att = checkpoint_name(torch::matmul(q, k.transpose(-2, -1)), "attn_scores");  // (B, H, T, T)
  att = att * (1.0 / std::sqrt(static_cast<double>(hd)));
  auto future = torch::ones({T, T}, x.options().dtype(torch::kBool)).triu(1);  // (T, T)
  att = att.masked_fill(future, -std::numeric_limits<double>::infinity());
  att = attn_drop(checkpoint_name(torch::softmax(att, -1), "attn_probs"));                             // (B, H, T, T)
  auto y = checkpoint_name(torch::matmul(att, v), "attn_context").transpose(1, 2).reshape({B, T, C});  // (B, T, C)
  return resid_drop(checkpoint_name(linear(proj, y), "attn_out"));                                     // (B, T, C)
}

MlpImpl::MlpImpl(int64_t d_model, double dropout, int64_t chunks)
    : fc(register_module("fc", torch::nn::Linear(d_model, 4 * d_model))),
      proj(register_module("proj", torch::nn::Linear(4 * d_model, d_model))),
      drop(register_module("drop", torch::nn::Dropout(dropout))),
      chunks_(chunks) {}

torch::Tensor MlpImpl::forward(const torch::Tensor& x) {
  return checkpointed([this](const torch::Tensor& h) { return transform(h); }, x);
}

torch::Tensor MlpImpl::transform(const torch::Tensor& x) {  // (B, T, C)
  if (chunks_ <= 0) return body(x);
  // A slice of dim 1 is strided when B > 1; contiguous, so that linear() is
  // one addmm (a name reaches it) rather than matmul + an in-place bias add.
  return chunked([this](const std::vector<torch::Tensor>& in) { return body(in[0].contiguous()); }, {x},
                 ChunkOptions(1, chunks_));
}

torch::Tensor MlpImpl::body(const torch::Tensor& x) {                                          // (B, T', C)
  auto h = checkpoint_name(torch::gelu(checkpoint_name(linear(fc, x), "mlp_fc")), "mlp_act");  // (B, T, 4C)
  return drop(checkpoint_name(linear(proj, h), "mlp_out"));                                    // (B, T, C)
}

GptBlockImpl::GptBlockImpl(int64_t d_model, int64_t heads, double dropout, bool sdpa, int64_t mlp_chunks)
    : ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})))),
      ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})))),
      attn(register_module("attn", CausalSelfAttention(d_model, heads, dropout, sdpa))),
      mlp(register_module("mlp", Mlp(d_model, dropout, mlp_chunks))) {}

torch::Tensor GptBlockImpl::forward(const torch::Tensor& x) {
  return checkpointed([this](const torch::Tensor& h) { return body(h); }, x);
}

torch::Tensor GptBlockImpl::body(const torch::Tensor& x) {  // (B, T, C)
  auto h = x + attn(ln1(x));                                // (B, T, C)
  return h + mlp(ln2(h));                                   // (B, T, C)
}

GptImpl::GptImpl(const GptConfig& c) : config_(c) {
  const char* fix = "Fix the GPT config (e.g. --layers, --d-model, --heads, --seq-len).";
  check_positive("vocab", c.vocab, fix);
  check_positive("seq_len", c.seq_len, fix);
  check_positive("d_model", c.d_model, fix);
  check_positive("heads", c.heads, fix);
  check_positive("layers", c.layers, fix);
  if (c.d_model % c.heads != 0) {
    throw Error("[remat::models] d_model " + str(c.d_model) + " is not divisible by heads " + str(c.heads) +
                ". Pick a head count that divides d_model.");
  }
  if (c.dropout < 0.0 || c.dropout >= 1.0) {
    throw Error("[remat::models] dropout must be in [0, 1), got " + std::to_string(c.dropout) + ".");
  }
  if (c.loss_chunks < 0 || c.mlp_chunks < 0) {
    throw Error("[remat::models] loss_chunks and mlp_chunks must be >= 0 (0: unchunked), got " + str(c.loss_chunks) +
                " and " + str(c.mlp_chunks) + ". Fix --loss-chunks / --mlp-chunks.");
  }
  wte = register_module("wte", torch::nn::Embedding(c.vocab, c.d_model));
  wpe = register_module("wpe", torch::nn::Embedding(c.seq_len, c.d_model));
  drop = register_module("drop", torch::nn::Dropout(c.dropout));
  blocks = register_module("blocks", torch::nn::Sequential());
  for (int64_t i = 0; i < c.layers; ++i)
    blocks->push_back(GptBlock(c.d_model, c.heads, c.dropout, c.sdpa, c.mlp_chunks));
  ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));

  // GPT-2 initialisation.
  torch::NoGradGuard no_grad;
  const double resid_std = 0.02 / std::sqrt(2.0 * static_cast<double>(c.layers));
  for (auto& item : named_modules("", /*include_self=*/false)) {
    if (auto* lin = item.value()->as<torch::nn::Linear>()) {
      const bool residual = item.key().size() >= 5 && item.key().compare(item.key().size() - 5, 5, ".proj") == 0;
      lin->weight.normal_(0.0, residual ? resid_std : 0.02);
      lin->bias.zero_();
    } else if (auto* emb = item.value()->as<torch::nn::Embedding>()) {
      emb->weight.normal_(0.0, 0.02);
    }
  }
}

torch::Tensor GptImpl::embed(const torch::Tensor& idx) {  // (B, T)
  const int64_t T = idx.size(1);
  if (T > config_.seq_len) {
    throw Error("[remat::models] GPT input has " + str(T) + " tokens, more than seq_len " + str(config_.seq_len) +
                ". Crop the input or build the model with a larger seq_len.");
  }
  auto pos = torch::arange(T, idx.options().dtype(torch::kLong));  // (T)
  return drop(wte(idx) + wpe(pos));                                // (B, T, C)
}

torch::Tensor GptImpl::head(const torch::Tensor& h) {  // (B, T, C)
  return torch::linear(ln_f(h), wte->weight);          // (B, T, vocab)
}

torch::Tensor GptImpl::loss(const torch::Tensor& h, const torch::Tensor& targets) {  // (B, T, C), (B, T)
  // loss_chunks 0 is the plain head and loss (the whole logits); either way
  // the call is a unit of the whole-step planner, which may chunk it
  // (AutoOptions::chunk_counts).
  return chunked_cross_entropy(ln_f(h), wte->weight, targets, ChunkedCrossEntropyOptions(config_.loss_chunks));
}

torch::Tensor GptImpl::forward(const torch::Tensor& idx) { return head(blocks->forward(embed(idx))); }

GptStage gpt_stage(int64_t layers, int stage, int stages) {
  const int64_t base = layers / stages, extra = layers % stages;
  GptStage s;
  s.first_block = stage * base + std::min<int64_t>(stage, extra);
  s.end_block = s.first_block + base + (stage < extra ? 1 : 0);
  s.embeds = stage == 0;
  s.heads = stage == stages - 1;
  return s;
}

std::vector<std::pair<std::string, torch::Tensor>> gpt_stage_parameters(GptImpl& gpt, const GptStage& s) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& p : gpt.named_parameters()) {
    const std::string& n = p.key();
    bool mine = false;
    if (n.rfind("blocks.", 0) == 0) {
      const int64_t b = std::stoll(n.substr(7, n.find('.', 7) - 7));
      mine = b >= s.first_block && b < s.end_block;
    } else if (n.rfind("wte.", 0) == 0) {
      mine = s.embeds || s.heads;  // the embedding, tied to the head
    } else if (n.rfind("wpe.", 0) == 0) {
      mine = s.embeds;
    } else {
      mine = s.heads;  // ln_f
    }
    if (mine) out.emplace_back(n, p.value());
  }
  return out;
}

// --- ResNet ------------------------------------------------------------------

ConvBnReluImpl::ConvBnReluImpl(int64_t in, int64_t out, int64_t kernel, int64_t stride)
    : conv(register_module(
          "conv",
          torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, kernel).stride(stride).padding(kernel / 2).bias(false)))),
      bn(register_module("bn", torch::nn::BatchNorm2d(out))) {}

torch::Tensor ConvBnReluImpl::forward(const torch::Tensor& x) {
  return checkpointed([this](const torch::Tensor& h) { return torch::relu(bn(conv(h))); }, x);
}

ResBlockImpl::ResBlockImpl(int64_t in, int64_t mid, int64_t stride, bool bottleneck) : bottleneck_(bottleneck) {
  auto conv = [](int64_t i, int64_t o, int64_t k, int64_t s) {
    return torch::nn::Conv2d(torch::nn::Conv2dOptions(i, o, k).stride(s).padding(k / 2).bias(false));
  };
  if (bottleneck) {
    out_ = 4 * mid;
    first = register_module("first", ConvBnRelu(in, mid, 1, 1));
    conv2 = register_module("conv2", conv(mid, mid, 3, stride));
    bn2 = register_module("bn2", torch::nn::BatchNorm2d(mid));
    conv3 = register_module("conv3", conv(mid, out_, 1, 1));
    bn3 = register_module("bn3", torch::nn::BatchNorm2d(out_));
  } else {
    out_ = mid;
    first = register_module("first", ConvBnRelu(in, mid, 3, stride));
    conv2 = register_module("conv2", conv(mid, mid, 3, 1));
    bn2 = register_module("bn2", torch::nn::BatchNorm2d(mid));
  }
  if (stride != 1 || in != out_) {
    down_conv = register_module("down_conv", conv(in, out_, 1, stride));
    down_bn = register_module("down_bn", torch::nn::BatchNorm2d(out_));
  }
}

torch::Tensor ResBlockImpl::forward(const torch::Tensor& x) {
  return checkpointed([this](const torch::Tensor& h) { return body(h); }, x);
}

namespace {
// The two halves of a block, shared by ResBlock and the split stages.
torch::Tensor shortcut(torch::nn::Conv2d& down_conv, torch::nn::BatchNorm2d& down_bn, const torch::Tensor& x) {
  return down_conv ? down_bn(down_conv(x)) : x;  // (B, out, H/s, W/s)
}
torch::Tensor finish(torch::nn::Conv2d& conv2, torch::nn::BatchNorm2d& bn2, torch::nn::Conv2d& conv3,
                     torch::nn::BatchNorm2d& bn3, const torch::Tensor& first_out, const torch::Tensor& skip) {
  auto h = bn2(conv2(first_out));
  if (conv3) h = bn3(conv3(torch::relu(h)));  // bottleneck: (B, out, H/s, W/s)
  return torch::relu(h + skip);
}
}  // namespace

torch::Tensor ResBlockImpl::body(const torch::Tensor& x) {  // (B, in, H, W)
  auto h = first(x);                                        // (B, mid, ., .)
  return finish(conv2, bn2, conv3, bn3, h, shortcut(down_conv, down_bn, x));
}

ResBlockHeadImpl::ResBlockHeadImpl(const ResBlock& block) : first(register_module("first", block->first)) {}

std::tuple<torch::Tensor, torch::Tensor> ResBlockHeadImpl::forward(const torch::Tensor& x) { return {first(x), x}; }

ResBlockTailImpl::ResBlockTailImpl(const ResBlock& block)
    : conv2(register_module("conv2", block->conv2)), bn2(register_module("bn2", block->bn2)) {
  if (block->conv3) {
    conv3 = register_module("conv3", block->conv3);
    bn3 = register_module("bn3", block->bn3);
  }
  if (block->down_conv) {
    down_conv = register_module("down_conv", block->down_conv);
    down_bn = register_module("down_bn", block->down_bn);
  }
}

torch::Tensor ResBlockTailImpl::forward(std::tuple<torch::Tensor, torch::Tensor> h_x) {
  return finish(conv2, bn2, conv3, bn3, std::get<0>(h_x), shortcut(down_conv, down_bn, std::get<1>(h_x)));
}

torch::nn::Sequential split_blocks(const torch::nn::Sequential& blocks) {
  torch::nn::Sequential out;
  const auto names = blocks->named_children().keys();
  for (size_t i = 0; i < blocks->size(); ++i) {
    auto block = blocks->ptr(i);
    auto impl = std::dynamic_pointer_cast<ResBlockImpl>(block);
    if (!impl) {
      throw Error("[remat::models] split_blocks: module " + names[i] + " (" + block->name() +
                  ") is not a ResBlock. Pass a Sequential of ResBlocks only, as ResNet::blocks.");
    }
    ResBlock b(impl);
    out->push_back(names[i] + "_head", ResBlockHead(b));
    out->push_back(names[i] + "_tail", ResBlockTail(b));
  }
  return out;
}

ResNetImpl::ResNetImpl(const ResNetConfig& c) : config_(c) {
  std::vector<int64_t> counts;
  bool bottleneck = c.depth >= 50;
  switch (c.depth) {
    case 10: counts = {1, 1, 1, 1}; break;
    case 18: counts = {2, 2, 2, 2}; break;
    case 34: counts = {3, 4, 6, 3}; break;
    case 50: counts = {3, 4, 6, 3}; break;
    case 101: counts = {3, 4, 23, 3}; break;
    case 152: counts = {3, 8, 36, 3}; break;
    default:
      throw Error("[remat::models] ResNet depth " + str(c.depth) +
                  " is not supported. Use 10, 18 or 34 (basic blocks) or 50, 101 or 152 (bottleneck blocks).");
  }
  const char* fix = "Fix the ResNet config (--d-model is the base width).";
  check_positive("width", c.width, fix);
  check_positive("classes", c.classes, fix);
  check_positive("in_channels", c.in_channels, fix);
  stem = register_module("stem", ConvBnRelu(c.in_channels, c.width, 3, 1));
  blocks = register_module("blocks", torch::nn::Sequential());
  int64_t in = c.width;
  for (int64_t stage = 0; stage < 4; ++stage) {
    const int64_t mid = c.width << stage;
    for (int64_t i = 0; i < counts[stage]; ++i) {
      ResBlock block(in, mid, (stage > 0 && i == 0) ? 2 : 1, bottleneck);
      in = block->out_channels();
      blocks->push_back(block);
    }
  }
  fc = register_module("fc", torch::nn::Linear(in, c.classes));
}

torch::Tensor ResNetImpl::embed(const torch::Tensor& x) { return stem(x); }  // (B, width, H, W)

torch::Tensor ResNetImpl::head(const torch::Tensor& h) {        // (B, C, h, w)
  return fc(torch::adaptive_avg_pool2d(h, {1, 1}).flatten(1));  // (B, classes)
}

torch::Tensor ResNetImpl::forward(const torch::Tensor& x) { return head(blocks->forward(embed(x))); }

}  // namespace remat::models
