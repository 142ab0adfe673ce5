// A ResNet for remat's trainer and tests: basic (two 3x3) and bottleneck
// (1x1, 3x3, 1x1 with 4x expansion) blocks with BatchNorm, the stage counts
// of ResNet-10/18/34/50/101/152, a CIFAR-style 3x3 stem (no max-pool, for
// small images on CPU) and a configurable base width. The blocks of all four
// stages form one torch::nn::Sequential so any checkpoint strategy can wrap
// them: logits = head(blocks->forward(embed(x))).
// Leaves out: the ImageNet 7x7 stem, pretrained weights, zero-init of the
// last BatchNorm in each block.
#pragma once

#include <cstdint>
#include <tuple>

#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <remat/checkpointable.h>

namespace remat::models {

/** Shape of a ResNet; validated by ResNetImpl's constructor. The defaults
 *  are a small ResNet-18 for 10 classes. */
struct ResNetConfig {
  /** 10, 18, 34 (basic blocks) or 50, 101, 152 (bottleneck blocks). */
  int64_t depth = 18;
  /** Channels of the stem and the first stage; stages use 1x, 2x, 4x, 8x. */
  int64_t width = 16;
  /** Output classes. */
  int64_t classes = 10;
  /** Input channels. */
  int64_t in_channels = 3;
};

/** conv (no bias) -> BatchNorm -> ReLU: (B, Cin, H, W) -> (B, Cout, H/stride, W/stride). */
class ConvBnReluImpl : public torch::nn::Module, public remat::Checkpointable {
 public:
  /** in and out channels, a kernel x kernel conv with padding kernel/2. */
  ConvBnReluImpl(int64_t in, int64_t out, int64_t kernel, int64_t stride);
  /** relu(bn(conv(x))) through the checkpoint switch (checkpointed()). */
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::Conv2d conv{nullptr};     ///< the convolution (no bias)
  torch::nn::BatchNorm2d bn{nullptr};  ///< its BatchNorm
};
/** The module holder of ConvBnReluImpl (a shared_ptr to it, as TORCH_MODULE makes). */
TORCH_MODULE(ConvBnRelu);

/** A residual block (basic or bottleneck). Checkpointable, as is `first`,
 *  its leading conv-bn-relu (switch that alone to recompute only it). */
class ResBlockImpl : public torch::nn::Module, public remat::Checkpointable {
 public:
  /** Basic: first = 3x3(in, mid, stride), 3x3(mid, mid); out = mid.
   *  Bottleneck: first = 1x1(in, mid), 3x3(mid, mid, stride), 1x1(mid, 4 mid); out = 4 mid.
   *  A 1x1 conv + BatchNorm shortcut where stride or channels change. */
  ResBlockImpl(int64_t in, int64_t mid, int64_t stride, bool bottleneck);
  /** body(x) through the checkpoint switch (checkpointed()):
   *  (B, in, H, W) -> (B, out, H/stride, W/stride). */
  torch::Tensor forward(const torch::Tensor& x);
  /** forward() without the switch. */
  torch::Tensor body(const torch::Tensor& x);
  /** Output channels: mid (basic) or 4 mid (bottleneck). */
  int64_t out_channels() const { return out_; }
  ConvBnRelu first{nullptr};  ///< the leading conv-bn-relu (Checkpointable)
  /** The following convolutions; conv3 only in bottlenecks (else a null holder). */
  ///@{
  torch::nn::Conv2d conv2{nullptr}, conv3{nullptr};
  ///@}
  /** Their BatchNorms; bn3 only in bottlenecks (else a null holder). */
  ///@{
  torch::nn::BatchNorm2d bn2{nullptr}, bn3{nullptr};
  ///@}
  torch::nn::Conv2d down_conv{nullptr};     ///< 1x1 shortcut conv where stride or channels change, else a null holder
  torch::nn::BatchNorm2d down_bn{nullptr};  ///< its BatchNorm, else a null holder

 private:
  bool bottleneck_;
  int64_t out_;
};
/** The module holder of ResBlockImpl (a shared_ptr to it, as TORCH_MODULE makes). */
TORCH_MODULE(ResBlock);

/** A residual block's first stage in a split chain (split_blocks):
 *  x -> (first(x), x). Registers the block's `first` (the same module, not
 *  a copy). The block's input is passed on as is (its storage, not a
 *  copy), for the tail's shortcut. */
class ResBlockHeadImpl : public torch::nn::Module {
 public:
  /** The head of block, sharing its `first`. */
  explicit ResBlockHeadImpl(const ResBlock& block);
  /** x -> (first(x), x). */
  std::tuple<torch::Tensor, torch::Tensor> forward(const torch::Tensor& x);
  ConvBnRelu first{nullptr};  ///< the block's `first` (the same module)
};
/** The module holder of ResBlockHeadImpl (a shared_ptr to it, as TORCH_MODULE makes). */
TORCH_MODULE(ResBlockHead);

/** The block's second stage: (h, x) -> relu(bn2(conv2(h)) + shortcut(x)),
 *  the bottleneck's conv3 and bn3 and the projection shortcut included.
 *  Registers the block's own modules. The shortcut runs here, not in the
 *  head, so that its result is a temporary of the tail, freed after the
 *  add as in the whole block; as a boundary value it would stay live with
 *  the plan's stored boundaries (store-all measured 4.5% above plain on
 *  the reference ResNet, equal to it now). */
class ResBlockTailImpl : public torch::nn::Module {
 public:
  /** The tail of block, sharing its modules after `first`. */
  explicit ResBlockTailImpl(const ResBlock& block);
  /** (h, x) -> the block's output, from the head's (first(x), x). */
  torch::Tensor forward(std::tuple<torch::Tensor, torch::Tensor> h_x);
  /** The block's conv2 and conv3 (the same modules; conv3 only in bottlenecks). */
  ///@{
  torch::nn::Conv2d conv2{nullptr}, conv3{nullptr};
  ///@}
  /** The block's bn2 and bn3 (bn3 only in bottlenecks). */
  ///@{
  torch::nn::BatchNorm2d bn2{nullptr}, bn3{nullptr};
  ///@}
  torch::nn::Conv2d down_conv{nullptr};     ///< the block's shortcut conv, where it has one
  torch::nn::BatchNorm2d down_bn{nullptr};  ///< its BatchNorm
};
/** The module holder of ResBlockTailImpl (a shared_ptr to it, as TORCH_MODULE makes). */
TORCH_MODULE(ResBlockTail);

/** `blocks` (a Sequential of ResBlocks, as ResNet::blocks) as a chain of
 *  twice as many stages, a ResBlockHead and a ResBlockTail per block, that
 *  share the blocks' modules and give the same values. A chain of whole
 *  blocks is cut only between blocks, and its floor is close to per-block
 *  checkpointing; split, a plan can keep a block's first half and recompute
 *  only its second (on the reference ResNet of bench/compare the smallest
 *  feasible peak falls from 0.544 to 0.484 of plain).
 *  Plan it with `remat::CheckpointedSequential({split_blocks(net->blocks)},
 *  opts)`: that constructor registers nothing, so the model's parameter
 *  names stay, and like any chain built so, it cannot be cloned (clone the
 *  model and split its blocks again). Each head passes the block's input
 *  on unchanged: the profile records it as the head's
 *  Stage::shared_input_bytes, so the planner counts it once where a plan
 *  keeps both boundaries (store-all on that ResNet was predicted 11% high
 *  before), and the gradient of a chain input passed on as the head's
 *  Stage::output_grad_bytes. Store-all on the split chain peaks as plain
 *  does (216.88 against 216.87 MB on the reference ResNet).
 *  The halves do not call ResBlock::forward, so a checkpoint switch set
 *  on a whole block (enable_checkpointing) does not apply to them; one
 *  set on its `first` (a Checkpointable too) still does.
 *  Throws remat::Error naming the first module that is not a ResBlock. */
torch::nn::Sequential split_blocks(const torch::nn::Sequential& blocks);

/** The ResNet: embed() (the stem), the `blocks` Sequential, head(). Build
 *  it through its holder ResNet. */
class ResNetImpl : public torch::nn::Module {
 public:
  /** Validates the config (throws remat::Error naming the valid depths). */
  explicit ResNetImpl(const ResNetConfig& config);
  /** x (B, in_channels, H, W) -> (B, width, H, W). */
  torch::Tensor embed(const torch::Tensor& x);
  /** h (B, C, h, w) -> logits (B, classes): global average pool + linear. */
  torch::Tensor head(const torch::Tensor& h);
  /** head(blocks->forward(embed(x))): (B, in_channels, H, W) -> (B, classes). */
  torch::Tensor forward(const torch::Tensor& x);
  /** The config it was built with. */
  const ResNetConfig& config() const { return config_; }

  ConvBnRelu stem{nullptr};  ///< 3x3 conv-bn-relu, in_channels -> width, stride 1
  /** All residual blocks of the four stages, in order. */
  torch::nn::Sequential blocks{nullptr};
  torch::nn::Linear fc{nullptr};  ///< the classifier, (C of the last stage) -> classes

 private:
  ResNetConfig config_;
};
/** The module holder of ResNetImpl (a shared_ptr to it, as TORCH_MODULE makes). */
TORCH_MODULE(ResNet);

}  // namespace remat::models
