// remat::models::Trainer (see include/remat/models/trainer.h): data, model,
// strategy, AdamW loop, telemetry and atomic save/resume.
#include <remat/models/trainer.h>

#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iterator>
#include <mutex>
#include <ostream>
#include <sstream>

#include <unistd.h>

#include <remat/checkpoint.h>
#include <remat/checkpointable.h>
#include <remat/error.h>
#include <remat/memory.h>
#include <remat/models/gpt.h>
#include <remat/models/resnet.h>
#include <remat/selective.h>

#include <remat/sequential.h>

namespace remat::models {

namespace {

using Clock = std::chrono::steady_clock;

std::string str(int64_t v) { return std::to_string(v); }

/** One entry of a Sequential shaped like a module holder for remat::checkpoint
 *  (forward, parameters, buffers), so the checkpoint restores its buffers
 *  (BatchNorm statistics) after a recompute, as for any module. */
class SequentialEntry {
 public:
  SequentialEntry(torch::nn::Sequential seq, size_t index) : seq_(std::move(seq)), index_(index) {}
  SequentialEntry* operator->() { return this; }
  torch::Tensor forward(const torch::Tensor& x) { return (seq_->begin() + index_)->forward(x); }
  std::vector<torch::Tensor> parameters() { return seq_->ptr(index_)->parameters(); }
  std::vector<torch::Tensor> buffers() { return seq_->ptr(index_)->buffers(); }

 private:
  torch::nn::Sequential seq_;
  size_t index_;
};

/** CPU autocast to bfloat16 for its lifetime (when on); restores the previous
 *  state and clears the cast cache when the outermost one ends. */
class Bf16Autocast {
 public:
  explicit Bf16Autocast(bool on) : on_(on) {
    if (!on_) return;
    prev_enabled_ = at::autocast::is_autocast_enabled(at::kCPU);
    prev_dtype_ = at::autocast::get_autocast_dtype(at::kCPU);
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    at::autocast::increment_nesting();
  }
  ~Bf16Autocast() {
    if (!on_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(at::kCPU, prev_enabled_);
    at::autocast::set_autocast_dtype(at::kCPU, prev_dtype_);
  }
  Bf16Autocast(const Bf16Autocast&) = delete;
  Bf16Autocast& operator=(const Bf16Autocast&) = delete;

 private:
  bool on_;
  bool prev_enabled_ = false;
  at::ScalarType prev_dtype_ = at::kBFloat16;
};

torch::Tensor generator_state(at::Generator g) {  // a handle: copies share the state
  std::lock_guard<std::mutex> lock(g.mutex());
  return g.get_state();
}

void set_generator_state(at::Generator& g, const torch::Tensor& state) {
  std::lock_guard<std::mutex> lock(g.mutex());
  g.set_state(state);
}

}  // namespace

std::string_view to_string(Strategy s) {
  switch (s) {
    case Strategy::kNone: return "none";
    case Strategy::kBlock: return "block";
    case Strategy::kSqrt: return "sqrt";
    case Strategy::kSelective: return "selective";
    case Strategy::kAuto: return "auto";
  }
  return "?";
}

Strategy parse_strategy(std::string_view name) {
  for (auto s : {Strategy::kNone, Strategy::kBlock, Strategy::kSqrt, Strategy::kSelective, Strategy::kAuto}) {
    if (name == to_string(s)) return s;
  }
  throw Error("[remat::train] unknown checkpoint strategy '" + std::string(name) +
              "'. Use one of none, block, sqrt, selective, auto.");
}

std::string format_step(const StepStats& s, int64_t total_steps, std::string_view unit) {
  const int width = static_cast<int>(std::to_string(total_steps).size());
  std::ostringstream os;
  os << "step " << std::setw(width) << s.step << "/" << total_steps << "  loss " << std::fixed << std::setprecision(6)
     << s.loss << "  ";
  if (s.items_per_s >= 1e4) {
    os << std::setprecision(1) << s.items_per_s / 1e3 << "k";
  } else {
    os << std::setprecision(1) << s.items_per_s;
  }
  os << " " << unit << "/s  " << std::setprecision(1) << s.step_ms << " ms  peak " << format_bytes(s.peak_bytes);
  return os.str();
}

struct Trainer::Impl {
  TrainConfig cfg;
  bool gpt = true;
  std::shared_ptr<torch::nn::Module> module;
  std::function<torch::Tensor(const torch::Tensor&)> embed, head;
  torch::nn::Sequential blocks{nullptr};
  std::unique_ptr<torch::optim::AdamW> optimizer;
  at::Generator data_gen;
  torch::Tensor tokens;   // (N) int64 ids of the text (GPT)
  int64_t vocab = 0;      // distinct bytes of the text (GPT)
  torch::Tensor teacher;  // (classes, 3 * 16) fixed labelling map (ResNet)
  int64_t steps_done = 0;
  int64_t params = 0;
  remat::CheckpointedSequential auto_net{nullptr};

  void load_text() {
    std::ifstream in(cfg.data_path, std::ios::binary);
    if (!in) {
      throw Error("[remat::train] cannot read --data file '" + cfg.data_path +
                  "': " + std::error_code(errno, std::generic_category()).message() +
                  ". Pass an existing text file with --data.");
    }
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (static_cast<int64_t>(text.size()) < cfg.seq_len + 2) {
      throw Error("[remat::train] --data file '" + cfg.data_path + "' has " + str(static_cast<int64_t>(text.size())) +
                  " bytes, fewer than seq_len + 2 = " + str(cfg.seq_len + 2) +
                  ". Use a longer text or a smaller --seq-len.");
    }
    std::array<int64_t, 256> id;
    id.fill(-1);
    for (unsigned char ch : text) id[ch] = 0;
    vocab = 0;
    for (auto& v : id) {
      if (v == 0) v = vocab++;
    }
    std::vector<int64_t> ids(text.size());
    for (size_t i = 0; i < text.size(); ++i) ids[i] = id[static_cast<unsigned char>(text[i])];
    tokens = torch::tensor(ids, torch::kLong);  // (N)
  }

  /** (inputs, targets): GPT (B, T) and (B, T) ids; ResNet (B, 3, S, S) and (B). */
  std::pair<torch::Tensor, torch::Tensor> batch() {
    torch::NoGradGuard no_grad;
    if (gpt) {
      const int64_t T = cfg.seq_len;
      auto start = torch::randint(tokens.size(0) - T - 1, {cfg.batch, 1}, data_gen, torch::kLong);  // (B, 1)
      auto chunk = tokens.index({start + torch::arange(T + 1, torch::kLong)});                      // (B, T + 1)
      return {chunk.slice(1, 0, T), chunk.slice(1, 1, T + 1)};
    }
    const int64_t S = cfg.image_size;
    auto x = torch::randn({cfg.batch, 3, S, S}, data_gen, torch::kFloat);  // (B, 3, S, S)
    auto pooled = torch::adaptive_avg_pool2d(x, {4, 4}).flatten(1);        // (B, 48)
    auto y = torch::matmul(pooled, teacher.t()).argmax(1);                 // (B)
    return {x, y};
  }

  torch::Tensor run_blocks(torch::Tensor h) {
    switch (cfg.checkpoint) {
      case Strategy::kNone:
      case Strategy::kSelective:  // the blocks are switched on (enable_checkpointing)
        return blocks->forward(h);
      case Strategy::kBlock:
        for (size_t i = 0; i < blocks->size(); ++i) h = remat::checkpoint(SequentialEntry(blocks, i), h);
        return h;
      case Strategy::kSqrt: {
        const auto n = static_cast<double>(blocks->size());
        const auto segments = std::clamp<int64_t>(std::llround(std::sqrt(n)), 1, static_cast<int64_t>(n));
        return remat::checkpoint_sequential(blocks, segments, h);
      }
      case Strategy::kAuto: return auto_net->forward(h);
    }
    throw Error("[remat::train] internal: unknown strategy");
  }

  /** Mean cross-entropy of one micro-batch. */
  torch::Tensor loss_of(const torch::Tensor& x, const torch::Tensor& y) {
    Bf16Autocast autocast(cfg.bf16);
    auto logits = head(run_blocks(embed(x)));  // GPT (B, T, V), ResNet (B, classes)
    if (gpt) return torch::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}).to(torch::kFloat), y.reshape({-1}));
    return torch::cross_entropy_loss(logits.to(torch::kFloat), y);
  }

  std::string fingerprint() const {
    std::ostringstream os;
    os << cfg.model << " layers=" << cfg.layers << " d_model=" << cfg.d_model;
    if (gpt) {
      os << " heads=" << cfg.heads << " seq_len=" << cfg.seq_len << " vocab=" << vocab;
    } else {
      os << " classes=" << cfg.classes;
    }
    return os.str();
  }
};

Policy selective_policy(const std::string& name, bool gpt) {
  if (name == "megatron") {
    if (!gpt) {
      throw Error(
          "[remat::train] --policy megatron names GPT tensors; for the ResNet use save_matmuls, "
          "save_nothing or attention.");
    }
    return megatron_policy();
  }
  if (name == "save_matmuls") return policy::save_matmuls();
  if (name == "save_nothing") return policy::save_nothing();
  throw Error("[remat::train] unknown --policy '" + name +
              "'. Use megatron (GPT), save_matmuls, save_nothing or attention.");
}

Trainer::Trainer(TrainConfig config) : impl_(std::make_unique<Impl>()) {
  auto& m = *impl_;
  m.cfg = std::move(config);
  auto& c = m.cfg;
  memory::enable_tracking();
  if (c.model != "gpt" && c.model != "resnet") {
    throw Error("[remat::train] unknown model '" + c.model + "'. Use --model gpt or --model resnet.");
  }
  m.gpt = c.model == "gpt";
  if (c.layers == 0) c.layers = m.gpt ? 6 : 18;
  if (c.d_model == 0) c.d_model = m.gpt ? 128 : 16;
  auto positive = [](const char* flag, int64_t v) {
    if (v <= 0) throw Error(std::string("[remat::train] ") + flag + " must be positive, got " + str(v) + ".");
  };
  positive("--batch", c.batch);
  positive("--steps", c.steps);
  positive("--grad-accum", c.grad_accum);
  positive("--seq-len", c.seq_len);
  positive("--image-size", c.image_size);
  if (!(c.lr > 0.0)) throw Error("[remat::train] --lr must be positive, got " + std::to_string(c.lr) + ".");
  if (c.clip_norm < 0.0) {
    throw Error("[remat::train] --clip-norm must be >= 0 (0 disables clipping), got " + std::to_string(c.clip_norm) +
                ".");
  }
  if (c.checkpoint == Strategy::kAuto) {
    if (c.memory_budget_bytes <= 0) {
      throw Error("[remat::train] --checkpoint auto needs a positive --memory-budget (e.g. 512MiB), got " +
                  str(c.memory_budget_bytes) + ".");
    }
  }
  if (c.threads > 0) torch::set_num_threads(c.threads);

  m.data_gen = at::detail::createCPUGenerator(c.seed ^ 0x9e3779b97f4a7c15ULL);
  torch::manual_seed(c.seed);
  if (m.gpt) {
    m.load_text();
    GptConfig g;
    g.vocab = m.vocab;
    g.seq_len = c.seq_len;
    g.d_model = c.d_model;
    g.heads = c.heads;
    g.layers = c.layers;
    g.dropout = c.dropout;
    Gpt net(g);
    m.module = net.ptr();
    m.blocks = net->blocks;
    m.embed = [net](const torch::Tensor& x) mutable { return net->embed(x); };
    m.head = [net](const torch::Tensor& h) mutable { return net->head(h); };
  } else {
    ResNetConfig r;
    r.depth = c.layers;
    r.width = c.d_model;
    r.classes = c.classes;
    ResNet net(r);
    m.module = net.ptr();
    m.blocks = net->blocks;
    m.embed = [net](const torch::Tensor& x) mutable { return net->embed(x); };
    m.head = [net](const torch::Tensor& h) mutable { return net->head(h); };
    auto teacher_gen = at::detail::createCPUGenerator(c.seed + 1);
    m.teacher = torch::randn({c.classes, 3 * 16}, teacher_gen, torch::kFloat);  // (classes, 48)
  }
  if (c.policy.empty()) c.policy = m.gpt ? "megatron" : "save_matmuls";
  if (c.checkpoint == Strategy::kSelective) {
    const Selector blocks = m.gpt ? select::type<GptBlockImpl>() : select::type<ResBlockImpl>();
    if (c.policy == "attention") {  // full recompute of the attention module (GPT) or first conv-bn-relu (ResNet)
      enable_checkpointing(*m.module, m.gpt ? select::type<CausalSelfAttentionImpl>() : select::name("blocks.*.first"));
    } else {
      enable_checkpointing(*m.module, blocks, CheckpointOptions().policy(selective_policy(c.policy, m.gpt)));
    }
  }
  for (auto& p : m.module->parameters()) m.params += p.numel();
  m.optimizer = std::make_unique<torch::optim::AdamW>(m.module->parameters(),
                                                      torch::optim::AdamWOptions(c.lr).weight_decay(c.weight_decay));
  if (c.checkpoint == Strategy::kAuto) {
    m.auto_net =
        remat::CheckpointedSequential(m.blocks, remat::SequentialOptions().memory_budget_bytes(c.memory_budget_bytes));
  }
  if (c.bf16) {
    try {
      Bf16Autocast autocast(true);
      auto probe = torch::matmul(torch::ones({2, 2}), torch::ones({2, 2}));
      if (probe.scalar_type() != torch::kBFloat16) throw std::runtime_error("matmul did not run in bfloat16");
    } catch (const std::exception& e) {
      std::string what = e.what();
      throw Error("[remat::train] --bf16: CPU autocast to bfloat16 is not supported here (" +
                  what.substr(0, what.find('\n')) + "). Run without --bf16.");
    }
  }
  if (!c.resume_path.empty()) load(c.resume_path);
}

Trainer::~Trainer() = default;

StepStats Trainer::step(memory::Timeline* timeline) {
  auto& m = *impl_;
  m.module->train();
  m.optimizer->zero_grad(/*set_to_none=*/false);  // gradients stay allocated: the step's peak is activations
  const auto t0 = Clock::now();
  double loss = 0.0;
  int64_t peak_bytes = 0;
  {
    memory::Probe probe;
    for (int64_t k = 0; k < m.cfg.grad_accum; ++k) {
      auto [x, y] = m.batch();
      const double f0 = timeline ? timeline->now_us() : 0.0;
      auto l = m.loss_of(x, y);
      const double b0 = timeline ? timeline->now_us() : 0.0;
      (m.cfg.grad_accum == 1 ? l : l / static_cast<double>(m.cfg.grad_accum)).backward();
      if (timeline) {
        timeline->add_span("forward", f0, b0);
        timeline->add_span("backward", b0, timeline->now_us());
      }
      loss += l.item<double>() / static_cast<double>(m.cfg.grad_accum);
    }
    peak_bytes = probe.peak_bytes();
  }
  const double o0 = timeline ? timeline->now_us() : 0.0;
  if (m.cfg.clip_norm > 0.0) torch::nn::utils::clip_grad_norm_(m.module->parameters(), m.cfg.clip_norm);
  m.optimizer->step();
  if (timeline) timeline->add_span("optimizer", o0, timeline->now_us());
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  const double items = static_cast<double>(m.cfg.batch * m.cfg.grad_accum * (m.gpt ? m.cfg.seq_len : 1));
  return StepStats{++m.steps_done, loss, ms, items / (ms / 1e3), peak_bytes};
}

std::vector<StepStats> Trainer::run(std::ostream* log) {
  std::vector<StepStats> out;
  if (log) *log << summary() << "\n";
  const char* unit = impl_->gpt ? "tok" : "img";
  while (impl_->steps_done < impl_->cfg.steps) {
    out.push_back(step());
    if (log) *log << format_step(out.back(), impl_->cfg.steps, unit) << std::endl;
  }
  if (!impl_->cfg.save_path.empty()) {
    save(impl_->cfg.save_path);
    if (log) *log << "saved step " << impl_->steps_done << " to " << impl_->cfg.save_path << "\n";
  }
  return out;
}

void Trainer::save(const std::string& path) const {
  const auto& m = *impl_;
  torch::serialize::OutputArchive archive, model, optim;
  m.module->save(model);
  m.optimizer->save(optim);
  archive.write("model", model);
  archive.write("optimizer", optim);
  archive.write("config", c10::IValue(m.fingerprint()));
  archive.write("steps_done", torch::tensor(m.steps_done, torch::kLong));
  archive.write("rng_cpu", generator_state(at::detail::getDefaultCPUGenerator()));
  archive.write("rng_data", generator_state(m.data_gen));
  const std::filesystem::path target(path);
  auto tmp = target;
  tmp += ".tmp." + std::to_string(::getpid());
  try {
    archive.save_to(tmp.string());
    std::filesystem::rename(tmp, target);
  } catch (const std::exception& e) {
    std::error_code ignore;
    std::filesystem::remove(tmp, ignore);
    std::string what = e.what();
    throw Error("[remat::train] cannot save checkpoint to '" + path + "': " + what.substr(0, what.find('\n')) +
                ". Check that the folder exists and is writable.");
  }
}

void Trainer::load(const std::string& path) {
  auto& m = *impl_;
  torch::serialize::InputArchive archive, model, optim;
  c10::IValue config;
  torch::Tensor steps, rng_cpu, rng_data;
  try {
    archive.load_from(path);
    archive.read("config", config);
  } catch (const std::exception& e) {
    std::string what = e.what();
    throw Error("[remat::train] cannot read checkpoint '" + path + "': " + what.substr(0, what.find('\n')) +
                ". Pass a file written by --save.");
  }
  if (config.toStringRef() != m.fingerprint()) {
    throw Error("[remat::train] checkpoint '" + path + "' is for '" + config.toStringRef() + "', this run is '" +
                m.fingerprint() + "'. Resume with the same model flags and data.");
  }
  archive.read("model", model);
  archive.read("optimizer", optim);
  archive.read("steps_done", steps);
  archive.read("rng_cpu", rng_cpu);
  archive.read("rng_data", rng_data);
  m.module->load(model);
  m.optimizer->load(optim);
  m.steps_done = steps.item<int64_t>();
  auto cpu = at::detail::getDefaultCPUGenerator();
  set_generator_state(cpu, rng_cpu);
  set_generator_state(m.data_gen, rng_data);
}

int64_t Trainer::steps_done() const { return impl_->steps_done; }
std::shared_ptr<torch::nn::Module> Trainer::module() const { return impl_->module; }
const TrainConfig& Trainer::config() const { return impl_->cfg; }

std::vector<int> Trainer::auto_forwards_per_block() const {
  if (!impl_->auto_net) return {};
  return impl_->auto_net->last_step().forwards_per_stage;
}

std::string Trainer::explain_memory() {
  auto& m = *impl_;
  auto x = m.batch().first;
  torch::Tensor h;
  {
    torch::NoGradGuard no_grad;
    h = m.embed(x);
  }
  h.requires_grad_(true);
  auto block = m.blocks->ptr(0);
  auto run = [seq = m.blocks](const torch::Tensor& in) mutable { return seq->begin()->forward(in); };
  std::ostringstream os;
  os << "saved for backward by one block (blocks.0, " << block->name() << ") on a batch of " << m.cfg.batch << ":\n";
  std::optional<Policy> p;
  if (m.cfg.checkpoint == Strategy::kSelective && m.cfg.policy != "attention")
    p = selective_policy(m.cfg.policy, m.gpt);
  {
    // Plain forward of the block: the switch must not checkpoint it here.
    std::vector<std::pair<Checkpointable*, std::optional<CheckpointOptions>>> saved;
    for (auto& mod : block->modules(/*include_self=*/true)) {
      if (auto* c = dynamic_cast<Checkpointable*>(mod.get())) {
        saved.emplace_back(c, c->checkpointing_options());
        c->set_checkpointing(std::nullopt);
      }
    }
    const SavedResiduals r = p ? saved_residuals(*p, run, h) : saved_residuals(run, h);
    for (auto& [c, o] : saved) c->set_checkpointing(o);
    os << r.to_string();
  }
  os << describe_checkpointing(*m.module);
  return os.str();
}

std::string Trainer::summary() const {
  const auto& m = *impl_;
  const auto& c = m.cfg;
  std::ostringstream os;
  os << std::fixed << std::setprecision(2);
  if (m.gpt) {
    os << "gpt: " << c.layers << " layers, d_model " << c.d_model << ", " << c.heads << " heads, seq " << c.seq_len
       << ", vocab " << m.vocab << ", " << static_cast<double>(m.params) / 1e6 << "M params; data " << c.data_path
       << " (" << m.tokens.size(0) << " chars)";
  } else {
    os << "resnet" << c.layers << ": width " << c.d_model << ", " << c.classes << " classes, " << c.image_size << "x"
       << c.image_size << " synthetic images, " << static_cast<double>(m.params) / 1e6 << "M params";
  }
  os << "; batch " << c.batch;
  if (c.grad_accum > 1) os << " x " << c.grad_accum << " accumulated";
  os << "; checkpoint " << to_string(c.checkpoint);
  if (c.checkpoint == Strategy::kSelective) os << " (policy " << c.policy << ")";
  if (c.checkpoint == Strategy::kAuto) os << " (budget " << format_bytes(c.memory_budget_bytes) << ")";
  if (c.bf16) os << "; bf16 autocast";
  const int threads = torch::get_num_threads();
  os << "; " << threads << (threads == 1 ? " thread" : " threads");
  if (m.steps_done > 0) os << "; resumed at step " << m.steps_done;
  return os.str();
}

}  // namespace remat::models
