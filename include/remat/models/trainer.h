// The training loop behind remat-train and the demo: builds a GPT (on a text
// file, character level or SentencePiece subwords) or a ResNet (synthetic
// images labelled by a fixed random linear teacher, so the loss can fall),
// wraps its blocks in one checkpoint strategy (or plans the whole step, auto), and runs AdamW steps with
// gradient accumulation, clipping, optional bf16 CPU autocast, per-step
// telemetry (loss, items/s, step time, peak memory) and exact save/resume.
// Leaves out: evaluation/validation splits, learning-rate schedules, data
// loaders with workers, multi-process training, GPU devices.
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <remat/models/tokenizer.h>

namespace at {
class Tensor;
}  // namespace at
namespace remat {
class AutoCheckpoint;
}  // namespace remat
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
  /** remat::auto_checkpoint over the whole step (embedding, blocks, head,
   *  loss; its units are the model's Checkpointable modules, each kept,
   *  recomputed or selective) under TrainConfig::memory_budget_bytes. Step
   *  1 is plain (warm-up), step 2 profiled (plain), steps 3 on planned. */
  kAuto,
  /** The blocks under a remat::OffloadScope: every tensor they save goes to
   *  files in TrainConfig::offload_dir (OffloadTarget::kDisk, default
   *  OffloadOptions) and is read back ahead of backward; nothing recomputed. */
  kOffload,
};

/** "none", "block", "sqrt", "selective", "auto", "offload". */
std::string_view to_string(Strategy s);
/** Inverse of to_string; throws remat::Error naming the valid values. */
Strategy parse_strategy(std::string_view name);

/** Everything a Trainer run needs (remat-train's flags): model, data,
 *  optimizer, checkpoint strategy. Defaults: a small character-level GPT,
 *  AdamW, no checkpointing. */
struct TrainConfig {
  /** "gpt" or "resnet". Default "gpt". */
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
  /** "adamw" (default) or "sgd" (plain, no momentum: each update is
   *  lr x the gradient, so parameters compare runs' gradients directly). */
  std::string optimizer = "adamw";
  /** Learning rate. */
  double lr = 1e-3;
  /** AdamW decoupled weight decay (not used by sgd). */
  double weight_decay = 0.01;
  /** GPT dropout probability. */
  double dropout = 0.0;
  /** GPT attention through at::scaled_dot_product_attention (no (B, H, T, T)
   *  scores kept; GptConfig::sdpa). Default false: explicit attention. */
  bool sdpa = false;
  /** GPT: > 0 computes the head and loss in this many slices of the tokens
   *  (GptConfig::loss_chunks, remat::chunked_cross_entropy). Default 0. */
  int64_t loss_chunks = 0;
  /** GPT with Strategy::kAuto: the planner chooses the head and loss's
   *  chunk count (remat::AutoOptions::chunk_counts, remat::default_chunk_counts;
   *  loss_chunks is then the count as called). --loss-chunks auto. Default false. */
  bool plan_loss_chunks = false;
  /** GPT: > 0 runs each MLP over this many checkpointed slices of the
   *  sequence (GptConfig::mlp_chunks, remat::chunked). Default 0. */
  int64_t mlp_chunks = 0;
  /** Seeds parameters, dropout (global CPU generator) and data (own generator). */
  uint64_t seed = 1337;
  Strategy checkpoint = Strategy::kNone;  ///< how the blocks are checkpointed; default kNone
  /** For Strategy::kSelective: "megatron" (GPT: keep the qkv, attention-out
   *  and MLP-up linear outputs, recompute the rest; megatron_policy()),
   *  "save_matmuls", "save_nothing" (full recompute through the op path), or
   *  "attention" (no policy: full recompute of each attention module, or of
   *  each ResNet block's first conv-bn-relu). "" (default): megatron for the
   *  GPT, save_matmuls for the ResNet. */
  std::string policy;
  /** Budget for Strategy::kAuto, bytes (required there, ignored otherwise):
   *  a bound on StepStats::peak_bytes of each planned step, the peak above
   *  what is live at the step's start (parameters, gradients, optimizer
   *  state). auto_checkpoint gets this plus memory::current_bytes() at the
   *  profiled step's start (solved again if that changes); a budget no plan
   *  meets throws remat::Error from that step. */
  int64_t memory_budget_bytes = 0;
  /** Strategy::kAuto: memory_budget_bytes bounds the whole step instead,
   *  every tracked byte at the step's peak (parameters, gradients and
   *  optimizer state in memory, the data, activations; not what a state
   *  store holds on disk), and goes to auto_checkpoint as it is. Set by
   *  max_under() for FitDimension::kDModel. Default false. */
  bool memory_budget_whole_step = false;
  /** For Strategy::kOffload (and auto_offload, and optimizer_state
   *  "disk"): an existing, writable directory for the files (required
   *  there, ignored otherwise). */
  std::string offload_dir;
  /** Strategy::kAuto: the planner may also send a unit's saved activations
   *  (or, recomputing, its inputs) to files in offload_dir
   *  (AutoOptions::offload with a kDisk store), its bytes in flight planned
   *  from 256 KiB up; lossless. remat-train's --auto-offload. Default
   *  false. */
  bool auto_offload = false;
  /** GPT with a SentencePiece tokenizer: a directory where the corpus's
   *  token ids are kept between runs, one file per (corpus, tokenizer)
   *  pair, named by a hash of the corpus's bytes and the tokenizer's
   *  fingerprint (a changed corpus or tokenizer misses the cache), written
   *  atomically (a temporary file, then rename). Created when missing; a
   *  directory that cannot be used only costs the encoding. "" (default):
   *  no cache, every run encodes. */
  std::string token_cache_dir;
  /** Micro-batches per optimizer step; the loss is their mean. */
  int64_t grad_accum = 1;
  /** Max global gradient norm; 0 disables clipping. */
  double clip_norm = 0.0;
  /** Update each parameter inside backward as soon as its gradient is
   *  final (remat::StepInBackward): the gradients never all live at once;
   *  bitwise the same training. Refused with clip_norm (the global norm
   *  needs every gradient before any update). Default false. */
  bool optimizer_in_backward = false;
  /** With optimizer_in_backward, where the optimizer's state lives between
   *  a parameter's updates: "" (default) where the optimizer keeps it;
   *  "disk" (files in offload_dir, read ahead of each update, lossless);
   *  "host" (pinned host memory from a GPU; on CPU the state stays put);
   *  "bf16" (in memory, rounded to bfloat16: half the bytes, lossy);
   *  "int8" (in memory, Codec::kInt8Block: 8-bit codes with a float32
   *  scale per 256 values, 0.27 of the bytes, lossy).
   *  Under Strategy::kAuto the plan chooses which state goes there, and the
   *  budget's "start of the step" counts that state as if kept. */
  std::string optimizer_state;
  /** Forward under CPU autocast to bfloat16. */
  bool bf16 = false;
  /** Text the GPT trains on (character level unless tokenizer or vocab_size is set). */
  std::string data_path = "/usr/share/common-licenses/GPL-3";
  /** GPT tokenizer: "" (default) the character level (the distinct bytes of
   *  data_path); else a SentencePiece .model file (Tokenizer::load), or,
   *  with vocab_size > 0, where the model trained on data_path is written. */
  std::string tokenizer;
  /** GPT: > 0 trains a SentencePiece BPE model of this many pieces on
   *  data_path (Tokenizer::train_sentencepiece; saved to tokenizer when it
   *  is set, else kept in memory). Default 0: no training. */
  int64_t vocab_size = 0;
  /** torch::set_num_threads; 0 leaves torch's setting. */
  int threads = 2;
  /** Where run() saves a checkpoint at the end ("" = nowhere). */
  std::string save_path;
  /** Checkpoint to resume from in the constructor ("" = fresh start). */
  std::string resume_path;
  /** Data parallel sharding, as DistributedSampler: each micro-batch is
   *  rows [data_rank * batch, (data_rank + 1) * batch) of a global batch of
   *  batch * data_world drawn from the data generator, so data_world
   *  processes with batch B train on the same data as one with batch
   *  data_world * B. Defaults 0 and 1 (one process). */
  int64_t data_rank = 0;
  int64_t data_world = 1;  ///< processes sharing the global batch (see data_rank); default 1
};

/** What a data-parallel driver adds around each step (remat-train --nproc
 *  sets them to remat::parallel::DataParallel's calls; the trainer itself
 *  knows nothing of processes). Each may be empty. */
struct StepHooks {
  /** Before the forward of a micro-batch whose backward synchronises (the
   *  last of the step). */
  std::function<void()> before_forward;
  /** After a micro-batch's forward, before its backward: loss, and whether
   *  this backward synchronises (false for the earlier micro-batches of a
   *  grad_accum step, whose gradients accumulate locally). */
  std::function<void(const at::Tensor& loss, bool sync)> before_backward;
  /** Before the forward of every micro-batch (remat-train --shard gathers
   *  the parameters outside FullyShard's units there). */
  std::function<void()> before_every_forward;
  /** Clips the gradients to TrainConfig::clip_norm instead of
   *  torch::nn::utils::clip_grad_norm_ over the module's parameters (a
   *  sharded run: the norm over every rank's shards). */
  std::function<void(double max_norm)> clip;
  /** Replaces a micro-batch's forward and backward (remat-train --pipeline
   *  runs the pipeline's step there): the batch, the scale of its loss
   *  (1 / grad_accum), and it returns the loss (unscaled, detached). */
  std::function<at::Tensor(const at::Tensor& x, const at::Tensor& y, double scale)> forward_backward;
};

/** What Trainer::predict_step() expects one step to peak at. */
struct StepPrediction {
  /** plan::simulate of the strategy's schedule on the profiled chain
   *  embed -> blocks -> head + loss, bytes above the step's start: what
   *  StepStats::peak_bytes measures once the gradients exist (step 2 on).
   *  kAuto: the auto plan's predicted peak above the profiled step's start
   *  (with a cap: the leanest plan's, plan::min_peak_step). */
  int64_t peak_bytes = 0;
  /** Strategy::kAuto: the budget above the step's start (the cap, or
   *  memory_budget_bytes); 0 otherwise. */
  int64_t auto_budget_bytes = 0;
  /** Parameters, their gradients and both AdamW moments (sgd: none), bytes: allocated
   *  before the step, so outside peak_bytes (4 x the parameters' bytes; sgd 2 x). */
  int64_t fixed_bytes = 0;
  /** The bytes live at the step's start, as the levers leave them: the
   *  parameters, their gradients (none with optimizer_in_backward: each is
   *  freed by its update), the optimizer's state in memory (none on disk,
   *  half as bf16), the data and buffers. kAuto: measured at the profiled
   *  step's start, the state in a store counted as kept. */
  int64_t start_bytes = 0;
  /** The whole step's peak, every tracked byte at it (what
   *  StepStats::whole_peak_bytes measures): kAuto with a cap, the leanest
   *  plan's predicted peak of all tracked memory (the planner's own figure,
   *  a store's bytes in flight included); else start_bytes + peak_bytes,
   *  plus with optimizer_in_backward the largest parameter's gradient
   *  (alive until its update) and with the state on disk the states read
   *  ahead of their updates (kOffload: measured). */
  int64_t whole_peak_bytes = 0;
  /** The model's parameters (elements). */
  int64_t parameters = 0;
};

/** Which TrainConfig value max_under() searches. */
enum class FitDimension {
  kSeqLen,  ///< TrainConfig::seq_len, tokens
  kBatch,   ///< TrainConfig::batch, sequences
  /** TrainConfig::d_model (GPT), a multiple of heads: the cap is on the
   *  whole step (StepStats::whole_peak_bytes), parameters, gradients and
   *  optimizer state included, since they grow with the width too. */
  kDModel,
};

/** What max_under() searches for and how. */
struct FitOptions {
  /** The cap, bytes: on StepStats::peak_bytes of a steady-state step (kDModel:
   *  on StepStats::whole_peak_bytes). Required, > 0. */
  int64_t cap_bytes = 0;
  FitDimension dimension = FitDimension::kSeqLen;  ///< the value searched; default kSeqLen
  /** Answers are multiples of step (tokens, sequences or widths; for
   *  kDModel of lcm(step, heads) too). Default 1 (remat-train: 64 for
   *  --max-d-model-under). */
  int64_t step = 1;
  /** Largest value tried; 0: the data's limit (its tokens - 2) for seq_len,
   *  65536 for batch, 16384 for d_model. */
  int64_t max_value = 0;
  /** Measure one real step at the answer (stepping down while it exceeds the
   *  cap) and at answer + step. Default true. */
  bool verify = true;
};

/** max_under() steps up at most this many times past the prediction's answer. */
inline constexpr int kFitMaxStepsUp = 4;

/** One prediction max_under() made while searching. */
struct FitProbe {
  int64_t value = 0;                 ///< the seq_len, batch or d_model tried
  int64_t predicted_peak_bytes = 0;  ///< its predicted step peak, bytes
};

/** What max_under() found: the answer, its predicted and measured peaks,
 *  and those of the next value up. */
struct FitResult {
  FitDimension dimension = FitDimension::kSeqLen;  ///< as in FitOptions
  int64_t cap_bytes = 0;                           ///< as in FitOptions, bytes
  int64_t step = 1;  ///< as in FitOptions (kDModel: lcm(step, heads), the step the search took)
  /** The largest multiple of step whose step fits the cap: by prediction,
   *  corrected by measurement when verified. */
  int64_t value = 0;
  /** The prediction's answer, before measurement stepped down or up. */
  int64_t predicted_value = 0;
  int64_t predicted_peak_bytes = 0;  ///< at value
  int64_t measured_peak_bytes = -1;  ///< at value; -1 when not verified
  int64_t next_value = 0;            ///< value + step
  /** Predicted peak at next_value, bytes. */
  int64_t next_predicted_peak_bytes = 0;
  /** Measured peak at next_value, bytes; -1 when not verified. */
  int64_t next_measured_peak_bytes = -1;
  /** Strategy::kAuto: no plan meets the cap at next_value (a run there would
   *  refuse it), so no step was measured there: next_measured_peak_bytes is
   *  the leanest plan's predicted peak. */
  bool next_no_plan = false;
  /** True when value is max_value (the data or the limit, not the cap, stopped the search). */
  bool at_max_value = false;
  /** Strategy::kAuto: the budget at value, above the step's start (the cap);
   *  kDModel: on the whole step, all tracked memory (the cap). */
  int64_t auto_budget_bytes = 0;
  /** StepPrediction::fixed_bytes at value (not under the cap; kDModel: under it, as the levers leave it). */
  int64_t fixed_bytes = 0;
  /** kDModel: the model's parameters (elements) at value and at next_value (0: none). */
  ///@{
  int64_t parameters = 0;
  int64_t next_parameters = 0;
  ///@}
  /** kDModel, verified: tracked bytes live at the measured step's start at
   *  value (parameters, gradients and optimizer state in memory, the data);
   *  the rest of measured_peak_bytes is the step's own. -1 otherwise. */
  int64_t start_bytes = -1;
  /** Every prediction made, in order. */
  std::vector<FitProbe> probes;
};

/** The search behind max_under(): the largest v in {step, 2 step, ...,
 *  max_value} with peak(v) <= cap_bytes, for peak nondecreasing in v; 0 when
 *  peak(step) > cap_bytes. Gallops up from step by sqrt(cap / peak), within
 *  [1.25, 2] (for a peak at most quadratic in the value, a probe then stays
 *  near the cap's size), then bisects, each round first probing where a
 *  quadratic through the last three probes meets the cap, and its
 *  neighbour. Each call of peak is recorded in probes. */
int64_t largest_fitting(int64_t cap_bytes, int64_t step, int64_t max_value, const std::function<int64_t(int64_t)>& peak,
                        std::vector<FitProbe>* probes = nullptr);

/** What a step was for the planner of Strategy::kAuto. */
enum class StepPhase {
  kNormal,    ///< any strategy's ordinary step; kAuto's planned steps
  kWarmup,    ///< kAuto's first step: plain, so that gradients and optimizer state exist
  kProfiled,  ///< kAuto's profiled step: plain, and every unit's options measured (many times a step's time)
};

/** One optimizer step, as run() prints it. */
struct StepStats {
  int64_t step = 0;          ///< 1-based index of the step just taken
  double loss = 0.0;         ///< mean loss over the micro-batches
  double step_ms = 0.0;      ///< wall time of forward, backward and update
  double items_per_s = 0.0;  ///< tokens (GPT) or images (ResNet) per second
  /** Peak CPU bytes above the step's start, over forward and backward (all
   *  micro-batches): activations, logits, loss, activation gradients and
   *  temporaries; from step 2 on not the parameter gradients, which stay
   *  allocated between steps (step 1, or a step after prepare(), has them).
   *  kAuto: above the start as its budget counts it, the optimizer state
   *  in a store counted as kept; 0 where the step stayed under that start
   *  (under_start_bytes says by how much). */
  int64_t peak_bytes = 0;
  /** Strategy::kOffload: bytes of the saved tensors the blocks sent to disk
   *  (all micro-batches; OffloadStats::bytes_raw), else 0. */
  int64_t offloaded_bytes = 0;
  /** kAuto: the warm-up or the profiled step (their peaks and times are the
   *  plain step's, not the plan's); else kNormal. */
  StepPhase phase = StepPhase::kNormal;
  /** Tracked bytes of the whole process when the step began: parameters,
   *  gradients and optimizer state in memory (not a state store's files),
   *  the data, buffers. */
  int64_t start_bytes = 0;
  /** The whole step's peak, bytes: the highest tracked bytes of the whole
   *  process over forward, backward and the update (start_bytes and the
   *  step's own; a state store's bytes count only while read back or in
   *  flight). What --max-d-model-under caps. */
  int64_t whole_peak_bytes = 0;
  /** kAuto: the step's peak was more than 1% over the budget and the
   *  planner solved again (AutoCheckpoint::replans() grew): the next step
   *  runs the new plan. When no plan fits, the planner warns instead. */
  bool replanned = false;
  /** kAuto: how far the step's highest tracked bytes stayed under its start
   *  as the budget counts it (then peak_bytes is 0); else 0. */
  int64_t under_start_bytes = 0;
  /** With a state store (TrainConfig::optimizer_state): writes of optimizer
   *  state that failed so far (a full disk; each such state stayed in
   *  memory and the training is the same). */
  int64_t state_write_failures = 0;
  /** The last failed write's error (with state_write_failures > 0). */
  std::string state_write_error;
};

/** Refuses what Trainer's constructor would refuse before building anything,
 *  without building anything (no model, no tokenizer training): values out
 *  of range, a missing or unreadable --data file (or a directory), a
 *  missing --tokenizer file, an unusable --offload-dir, a --save path
 *  whose folder does not exist or is not writable (checked by creating a
 *  file there), --checkpoint auto without a budget. remat-train runs it
 *  before starting ranks, so that an error prints once. Throws
 *  remat::Error naming the flag. */
void check_config(const TrainConfig& config);

/** The step count a checkpoint written by Trainer::save() holds. Throws
 *  remat::Error when path is not such a checkpoint. */
int64_t saved_steps(const std::string& checkpoint_path);

/** Builds a model, its data and optimizer from a TrainConfig and trains
 *  it; the engine of remat-train and the demo. */
class Trainer {
 public:
  /** Builds data, model and optimizer (seeded), resuming from
   *  config.resume_path if set. Throws remat::Error on bad values, a missing
   *  data file or an incompatible checkpoint (check_config(), then more).
   *  With a log, it reports its long phases there, a line at a time:
   *  training the tokenizer and encoding the corpus (every few seconds),
   *  the token cache, and under Strategy::kAuto the profiled step's
   *  progress (which unit is being measured), the budget as asked and as
   *  applied, and the plan (AutoCheckpoint::explain()) once planned (not
   *  when StepHooks::forward_backward runs the steps: a pipeline's driver
   *  reports each stage's plan). */
  explicit Trainer(TrainConfig config, std::ostream* log = nullptr);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  /** Hooks run by every later step() (see StepHooks). */
  void set_step_hooks(StepHooks hooks);
  /** Makes a new optimizer (the same kind and options, fresh state) over
   *  `parameters` instead of the module's (a sharded run's shards). */
  void use_optimizer_parameters(std::vector<at::Tensor> parameters);
  /** Bytes of the optimizer's state tensors (AdamW's moments; none for sgd). */
  int64_t optimizer_state_bytes() const;
  /** The optimizer's state as a step line shows it: its bytes in memory
   *  (the optimizer's tensors, and what a state store holds there: an
   *  int8 or bf16 encoding), then what a store took out of memory, e.g.
   *  "1.23 MiB (int8-encoded, 3.27 MiB less than float32)" or
   *  "12.0 KiB (+4.50 MiB in files)". */
  std::string describe_optimizer_state_memory() const;
  /** One optimizer step (grad_accum micro-batches). With a timeline, adds
   *  "forward", "backward" and "optimizer" spans to it. */
  StepStats step(memory::Timeline* timeline = nullptr);
  /** Steps until config.steps, printing a line per step to log (if not
   *  null), then saves to config.save_path if set. Returns the steps taken.
   *  With `stop`, asks it before each step: true ends the run there,
   *  without saving (remat-train's SIGINT and SIGTERM). */
  std::vector<StepStats> run(std::ostream* log = nullptr, const std::function<bool()>& stop = {});
  /** Writes model, optimizer, step count and RNG states to path atomically
   *  (a temporary file in the same folder, then rename). */
  void save(const std::string& path) const;
  /** Restores what save() wrote; the next step continues the same curve. */
  void load(const std::string& path);

  /** Steps taken so far (including resumed ones). */
  int64_t steps_done() const;
  /** The model (a GptImpl or ResNetImpl). */
  std::shared_ptr<torch::nn::Module> module() const;
  /** One line: model, size, data, tokenizer, strategy, threads. */
  std::string summary() const;
  /** The GPT's tokenizer (its vocab_size() is the model's vocabulary);
   *  nullptr for the ResNet. */
  const Tokenizer* tokenizer() const;
  /** With --checkpoint auto once planned (step 2 on): per block (GPT block
   *  or ResNet block, in order), forward runs per call of its most-run part
   *  under the plan in force: 1 when the block and its inner units keep
   *  (or offload), 2 when it or an inner unit recomputes or is selective
   *  (that forward runs again, wholly or in part, in backward), 3 when it
   *  recomputes with its inner units checkpointed inside (their forwards
   *  run a third time). Empty before the plan and for the other
   *  strategies. */
  std::vector<int> auto_forwards_per_block() const;
  /** A pipeline's stage `stage` of `stages` (GPT only): blocks cut evenly
   *  (the first stages take the extra ones), stage 0 with the embedding, the
   *  last with the head and loss. pipeline_stage runs it on its inputs
   *  (the tokens on stage 0, else the previous stage's output) under the
   *  config's strategy and autocast, and returns float activations;
   *  pipeline_loss is the last stage's loss of its outputs and targets;
   *  pipeline_parameters the parameters the stage uses (the embedding on
   *  the first and last, tied to the head: tied_embedding()). Throw
   *  remat::Error for the ResNet, a stage that does not exist, more stages
   *  than blocks, or --checkpoint sqrt (which segments the whole stack). */
  ///@{
  std::vector<at::Tensor> pipeline_stage(int stage, int stages, const std::vector<at::Tensor>& inputs);
  at::Tensor pipeline_loss(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& targets);
  std::vector<at::Tensor> pipeline_parameters(int stage, int stages) const;
  at::Tensor tied_embedding() const;
  ///@}
  /** Strategy::kAuto: the whole-step planner (its explain(), plan and
   *  figures); nullptr for the other strategies. */
  const AutoCheckpoint* planner() const;
  /** Strategy::kAuto once planned: the budget as asked (--memory-budget,
   *  above the step's start) and as applied to the planner (the bytes of
   *  tracked memory it bounds), and what makes up the difference: what is
   *  live at the step's start (parameters, their gradients, the
   *  optimizer's state, the rest). One line; "" before a plan. */
  std::string describe_auto_budget() const;
  /** The config, with defaults resolved (e.g. layers 0 -> 6 for the GPT). */
  const TrainConfig& config() const;
  /** Allocates the parameter gradients (zeros) and, with Strategy::kAuto,
   *  runs the warm-up and profiled steps (real steps: they update the
   *  parameters and count in steps_done()), so that the next step() measures
   *  what a later step would (no gradient allocation, no profiling). */
  void prepare();
  /** Predicts the peak of one step (GPT only): profiles the chain embed ->
   *  blocks -> head + loss once (remat::profile, one run per stage) on a
   *  batch, then plan::simulate's the strategy's schedule on it (none and
   *  selective: store-all, the selective blocks profiled switched on; block:
   *  every block recomputed before its backward; sqrt: plan::uniform, as
   *  checkpoint_sequential runs). kAuto (GPT or ResNet): prepare() (the
   *  warm-up and profiled steps of auto_checkpoint), then with cap_bytes > 0
   *  the smallest peak any plan reaches (plan::min_peak_step on
   *  step_model()), with cap_bytes 0 the plan for config().memory_budget_bytes,
   *  each minus the bytes live at the profiled step's start.
   *  kOffload is not modeled (what the store holds, writes in flight and
   *  reads ahead, depends on the disk's pace): prepare() and one measured
   *  step() on this Trainer give peak_bytes instead.
   *  Throws remat::Error for the ResNet (but kAuto) or an infeasible budget. */
  StepPrediction predict_step(int64_t cap_bytes = 0);
  /** What one block saves for backward on a batch (remat::saved_residuals,
   *  with the selective policy when there is one), and the switch's state.
   *  Strategy::kAuto: prepare() (the warm-up and profiled steps), then the
   *  budget (describe_auto_budget()), the plan (AutoCheckpoint::explain())
   *  and the switches as the plan sets them. */
  std::string explain_memory();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/** The longest seq_len (or largest batch, or widest d_model) of config
 *  whose steady-state step peaks at or under options.cap_bytes:
 *  largest_fitting() over Trainer::predict_step() (a fresh Trainer per
 *  value, same seed; for kOffload each probe is a measured step, so the
 *  answer is measured), then, with options.verify, one measured step (after
 *  prepare(); kDModel: after one more step, so that the optimizer's state
 *  exists) at the answer, stepping down by the step while it exceeds the
 *  cap, and one at answer + step; when that fits too (a conservative
 *  prediction), steps up, at most kFitMaxStepsUp times, until answer + step
 *  measures over the cap. kSeqLen and kBatch cap StepStats::peak_bytes (above
 *  the step's start); kDModel caps the whole step, StepPrediction::
 *  whole_peak_bytes predicted and StepStats::whole_peak_bytes measured, and
 *  kAuto's budget is then the cap on all tracked memory
 *  (TrainConfig::memory_budget_whole_step). Logs each probe and measurement
 *  to log (if not null). Throws remat::Error for what check_fit() refuses,
 *  or a cap that even the smallest value exceeds (naming its peak and
 *  remedies). */
FitResult max_under(const TrainConfig& config, const FitOptions& options, std::ostream* log = nullptr);

/** What max_under() refuses before building anything (remat-train runs it
 *  before its summary): a ResNet (but --max-batch-under with kAuto), a cap
 *  <= 0, a step < 1, a resume path; for kDModel also a d_model step whose
 *  multiple of heads exceeds max_value. Throws remat::Error naming the flag. */
void check_fit(const TrainConfig& config, const FitOptions& options);

/** "--max-seq-len-under 1.00 GiB, checkpoint block: seq_len 1536 ..." (several lines). */
std::string format_fit(const FitResult& r, const TrainConfig& config);

/** "step   3/20  loss 2.813402  12.3k tok/s  84.1 ms  peak 14.25 MiB", and
 *  for kAuto's warm-up and profiled steps what they were (s.phase). */
std::string format_step(const StepStats& s, int64_t total_steps, std::string_view unit);

}  // namespace remat::models
