// The training loop behind remat-train and the demo: builds a GPT (character-
// level on a text file) or a ResNet (synthetic images labelled by a fixed
// random linear teacher, so the loss can fall), wraps its blocks in one
// checkpoint strategy, and runs AdamW steps with gradient accumulation,
// clipping, optional bf16 CPU autocast, per-step telemetry (loss, items/s,
// step time, peak memory) and exact save/resume.
// Leaves out: evaluation/validation splits, learning-rate schedules, data
// loaders with workers, multi-process training, GPU devices.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace torch::nn {
class Module;
}  // namespace torch::nn
namespace remat::memory {
class Timeline;
}  // namespace remat::memory

namespace remat::models {

/** How the model's blocks are checkpointed. */
enum class Strategy {
  kNone,       ///< plain autograd, every activation kept
  kBlock,      ///< remat::checkpoint around every block
  kSqrt,       ///< remat::checkpoint_sequential with round(sqrt(blocks)) segments
  kSelective,  ///< every block switched on (remat::enable_checkpointing) with TrainConfig::policy
  kAuto,       ///< remat::CheckpointedSequential with a memory budget (planner)
};

/** "none", "block", "sqrt", "selective", "auto". */
std::string_view to_string(Strategy s);
/** Inverse of to_string; throws remat::Error naming the valid values. */
Strategy parse_strategy(std::string_view name);

struct TrainConfig {
  /** "gpt" or "resnet". */
  std::string model = "gpt";
  /** GPT: transformer blocks (0: 6). ResNet: depth 10/18/34/50/101/152 (0: 18). */
  int64_t layers = 0;
  /** GPT: residual width (0: 128). ResNet: base width, channels (0: 16). */
  int64_t d_model = 0;
  /** GPT attention heads. */
  int64_t heads = 4;
  /** GPT context length, tokens. */
  int64_t seq_len = 128;
  /** ResNet input images are image_size x image_size pixels, 3 channels. */
  int64_t image_size = 32;
  /** ResNet classes (and teacher outputs). */
  int64_t classes = 10;
  /** Sequences (or images) per micro-batch. */
  int64_t batch = 8;
  /** Optimizer steps run() goes up to (counting resumed steps). */
  int64_t steps = 20;
  /** AdamW learning rate. */
  double lr = 1e-3;
  /** AdamW decoupled weight decay. */
  double weight_decay = 0.01;
  /** GPT dropout probability. */
  double dropout = 0.0;
  /** Seeds parameters, dropout (global CPU generator) and data (own generator). */
  uint64_t seed = 1337;
  Strategy checkpoint = Strategy::kNone;
  /** For Strategy::kSelective: "megatron" (GPT: keep the qkv, attention-out
   *  and MLP-up linear outputs, recompute the rest; megatron_policy()),
   *  "save_matmuls", "save_nothing" (full recompute through the op path), or
   *  "attention" (no policy: full recompute of each attention module, or of
   *  each ResNet block's first conv-bn-relu). "" (default): megatron for the
   *  GPT, save_matmuls for the ResNet. */
  std::string policy;
  /** Budget for Strategy::kAuto, bytes (required there, ignored otherwise). */
  int64_t memory_budget_bytes = 0;
  /** Micro-batches per optimizer step; the loss is their mean. */
  int64_t grad_accum = 1;
  /** Max global gradient norm; 0 disables clipping. */
  double clip_norm = 0.0;
  /** Forward under CPU autocast to bfloat16. */
  bool bf16 = false;
  /** Text the GPT trains on (character level). */
  std::string data_path = "/usr/share/common-licenses/GPL-3";
  /** torch::set_num_threads; 0 leaves torch's setting. */
  int threads = 2;
  /** Where run() saves a checkpoint at the end ("" = nowhere). */
  std::string save_path;
  /** Checkpoint to resume from in the constructor ("" = fresh start). */
  std::string resume_path;
};

/** One optimizer step, as run() prints it. */
struct StepStats {
  int64_t step = 0;          ///< 1-based index of the step just taken
  double loss = 0.0;         ///< mean loss over the micro-batches
  double step_ms = 0.0;      ///< wall time of forward, backward and update
  double items_per_s = 0.0;  ///< tokens (GPT) or images (ResNet) per second
  int64_t peak_bytes = 0;    ///< peak CPU bytes above the step's start, over forward and backward
};

class Trainer {
 public:
  /** Builds data, model and optimizer (seeded), resuming from
   *  config.resume_path if set. Throws remat::Error on bad values, a missing
   *  data file or an incompatible checkpoint. */
  explicit Trainer(TrainConfig config);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  /** One optimizer step (grad_accum micro-batches). With a timeline, adds
   *  "forward", "backward" and "optimizer" spans to it. */
  StepStats step(memory::Timeline* timeline = nullptr);
  /** Steps until config.steps, printing a line per step to log (if not
   *  null), then saves to config.save_path if set. Returns the steps taken. */
  std::vector<StepStats> run(std::ostream* log = nullptr);
  /** Writes model, optimizer, step count and RNG states to path atomically
   *  (a temporary file in the same folder, then rename). */
  void save(const std::string& path) const;
  /** Restores what save() wrote; the next step continues the same curve. */
  void load(const std::string& path);

  /** Steps taken so far (including resumed ones). */
  int64_t steps_done() const;
  /** The model (a GptImpl or ResNetImpl). */
  std::shared_ptr<torch::nn::Module> module() const;
  /** One line: model, size, data, strategy, threads. */
  std::string summary() const;
  /** With --checkpoint auto after a step: forward executions per block in
   *  the last step (the plan's count; > 1 where a block was recomputed).
   *  Empty for the other strategies. */
  std::vector<int> auto_forwards_per_block() const;
  const TrainConfig& config() const;
  /** What one block saves for backward on a batch (remat::saved_residuals,
   *  with the selective policy when there is one), and the switch's state. */
  std::string explain_memory();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/** "step   3/20  loss 2.813402  12.3k tok/s  84.1 ms  peak 14.25 MiB". */
std::string format_step(const StepStats& s, int64_t total_steps, std::string_view unit);

}  // namespace remat::models
