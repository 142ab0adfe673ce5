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
#include <limits>
#include <mutex>
#include <optional>
#include <ostream>
#include <sstream>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include <remat/auto.h>
#include <remat/checkpoint.h>
#include <remat/checkpointable.h>
#include <remat/error.h>
#include <remat/memory.h>
#include <remat/models/gpt.h>
#include <remat/models/resnet.h>
#include <remat/models/tokenizer.h>
#include <remat/offload.h>
#include <remat/optim.h>
#include <remat/plan/error.h>
#include <remat/plan/solve.h>
#include <remat/profile.h>
#include <remat/selective.h>

#include "internal.h"

namespace remat::models {

namespace {

using detail::Clock;
using detail::Heartbeat;
using detail::note;
using detail::seconds;
using detail::since_s;
using detail::str;

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

/** "" when a file can be created in dir (the one test that covers
 *  permissions, read-only mounts and ACLs alike), else why not. */
std::string cannot_write_in(const std::string& dir) {
  const std::string probe =
      (dir.empty() ? std::string(".") : dir) + "/.remat-train-probe-" + std::to_string(::getpid());
  const int fd = ::open(probe.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0600);
  if (fd < 0) return std::strerror(errno);
  ::close(fd);
  ::unlink(probe.c_str());
  return "";
}

/** FNV-1a 64 of bytes, as 16 hex digits. */
std::string hash_hex(std::string_view bytes) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char ch : bytes) h = (h ^ ch) * 1099511628211ULL;
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

/** NOTE [token cache]: a file per (corpus, tokenizer): a text header
 *  (format, the corpus's hash and size, the tokenizer's fingerprint, the
 *  count), then the ids as int32. The name has the corpus's hash and the
 *  fingerprint's, and the header is compared in full on reading, so a
 *  changed corpus or tokenizer never reads another's ids. */
std::string token_cache_header(const std::string& corpus_hash, size_t corpus_bytes, const std::string& fingerprint,
                               size_t count) {
  return "remat-token-ids 1\ncorpus " + corpus_hash + " " + std::to_string(corpus_bytes) + "\ntokenizer " +
         fingerprint + "\ncount " + std::to_string(count) + "\n";
}

/** The cached ids, or nullopt when the file is missing or is not for this
 *  corpus and tokenizer. */
std::optional<std::vector<int64_t>> read_token_cache(const std::filesystem::path& file, const std::string& corpus_hash,
                                                     size_t corpus_bytes, const std::string& fingerprint) {
  std::ifstream in(file, std::ios::binary);
  if (!in) return std::nullopt;
  std::string header;
  for (int i = 0; i < 4; ++i) {
    std::string line;
    if (!std::getline(in, line)) return std::nullopt;
    header += line + "\n";
  }
  const auto at = header.rfind("count ");
  if (at == std::string::npos) return std::nullopt;
  size_t count = 0;
  try {
    count = static_cast<size_t>(std::stoull(header.substr(at + 6)));
  } catch (const std::exception&) {
    return std::nullopt;
  }
  if (header != token_cache_header(corpus_hash, corpus_bytes, fingerprint, count)) return std::nullopt;
  std::vector<int32_t> raw(count);
  if (!in.read(reinterpret_cast<char*>(raw.data()), static_cast<std::streamsize>(count * sizeof(int32_t))) ||
      in.peek() != std::char_traits<char>::eof()) {
    return std::nullopt;  // cut short or too long: not a file this code wrote whole
  }
  return std::vector<int64_t>(raw.begin(), raw.end());
}

/** Writes the ids to file atomically (file.tmp.PID, then rename); "" or why not. */
std::string write_token_cache(const std::filesystem::path& file, const std::string& corpus_hash, size_t corpus_bytes,
                              const std::string& fingerprint, const std::vector<int64_t>& ids) {
  std::error_code ec;
  std::filesystem::create_directories(file.parent_path(), ec);
  if (ec) return ec.message();
  auto tmp = file;
  tmp += ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    const std::vector<int32_t> raw(ids.begin(), ids.end());
    out << token_cache_header(corpus_hash, corpus_bytes, fingerprint, ids.size());
    out.write(reinterpret_cast<const char*>(raw.data()), static_cast<std::streamsize>(raw.size() * sizeof(int32_t)));
    out.close();
    if (!out) {
      std::filesystem::remove(tmp, ec);
      return "writing " + tmp.string() + " failed";
    }
  }
  std::filesystem::rename(tmp, file, ec);
  if (ec) {
    std::error_code ignore;
    std::filesystem::remove(tmp, ignore);
    return ec.message();
  }
  return "";
}

}  // namespace

std::string_view to_string(Strategy s) {
  switch (s) {
    case Strategy::kNone: return "none";
    case Strategy::kBlock: return "block";
    case Strategy::kSqrt: return "sqrt";
    case Strategy::kSelective: return "selective";
    case Strategy::kAuto: return "auto";
    case Strategy::kOffload: return "offload";
  }
  return "?";
}

Strategy parse_strategy(std::string_view name) {
  for (auto s : {Strategy::kNone, Strategy::kBlock, Strategy::kSqrt, Strategy::kSelective, Strategy::kAuto,
                 Strategy::kOffload}) {
    if (name == to_string(s)) return s;
  }
  throw Error("[remat::train] unknown checkpoint strategy '" + std::string(name) +
              "'. Use one of none, block, sqrt, selective, auto, offload.");
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
  // The budget's start counts state in a store as kept, so a step whose
  // activations are smaller than that state peaks under its start.
  if (s.under_start_bytes > 0)
    os << " (" << format_bytes(s.under_start_bytes)
       << " under the step's start, which counts the optimizer state in a store as kept)";
  if (s.offloaded_bytes > 0) os << "  offloaded " << format_bytes(s.offloaded_bytes);
  if (s.phase == StepPhase::kWarmup) os << "  (auto: warm-up, a plain step)";
  if (s.phase == StepPhase::kProfiled)
    os << "  (auto: profiling, a plain step that also measured every unit's options: its time and peak are the "
          "profiling's; the plan runs from the next step)";
  if (s.replanned) os << "  (auto: more than 1% over the budget; planned again for the next step)";
  if (s.state_write_failures > 0) {
    os << "  (optimizer state: " << s.state_write_failures
       << " writes to its store failed so far, each of those states kept in memory; the last: " << s.state_write_error
       << ")";
  }
  return os.str();
}

void check_config(const TrainConfig& config) {
  const TrainConfig& c = config;
  if (c.model != "gpt" && c.model != "resnet") {
    throw Error("[remat::train] unknown model '" + c.model + "'. Use --model gpt or --model resnet.");
  }
  const bool gpt = c.model == "gpt";
  auto positive = [](const char* flag, int64_t v) {
    if (v <= 0) throw Error(std::string("[remat::train] ") + flag + " must be positive, got " + str(v) + ".");
  };
  positive("--batch", c.batch);
  positive("--steps", c.steps);
  positive("--grad-accum", c.grad_accum);
  positive("--seq-len", c.seq_len);
  positive("--image-size", c.image_size);
  if (c.optimizer != "adamw" && c.optimizer != "sgd") {
    throw Error("[remat::train] --optimizer '" + c.optimizer + "' is not one of adamw, sgd.");
  }
  if (c.data_world < 1 || c.data_rank < 0 || c.data_rank >= c.data_world) {
    throw Error("[remat::train] data rank " + str(c.data_rank) + " of " + str(c.data_world) +
                " processes is out of range; ranks run from 0 to world size - 1.");
  }
  if (!(c.lr > 0.0)) throw Error("[remat::train] --lr must be positive, got " + std::to_string(c.lr) + ".");
  if (c.clip_norm < 0.0) {
    throw Error("[remat::train] --clip-norm must be >= 0 (0 disables clipping), got " + std::to_string(c.clip_norm) +
                ".");
  }
  if (c.plan_loss_chunks && (c.checkpoint != Strategy::kAuto || c.model != "gpt")) {
    throw Error(
        "[remat::train] --loss-chunks auto lets the auto planner choose the GPT's loss chunks; it needs "
        "--model gpt and --checkpoint auto (got --model " +
        c.model + ", --checkpoint " + std::string(to_string(c.checkpoint)) + "). Give a number of chunks instead.");
  }
  if (!c.optimizer_state.empty() && c.optimizer_state != "disk" && c.optimizer_state != "host" &&
      c.optimizer_state != "bf16" && c.optimizer_state != "int8") {
    throw Error("[remat::train] --optimizer-state '" + c.optimizer_state + "' is not one of disk, host, bf16, int8.");
  }
  if (!c.optimizer_state.empty() && c.optimizer == "sgd") {
    throw Error(
        "[remat::train] --optimizer sgd is plain SGD (each update lr x the gradient): it keeps no state for "
        "--optimizer-state " +
        c.optimizer_state + " to move. Drop --optimizer-state, or use --optimizer adamw.");
  }
  if (!c.optimizer_state.empty() && !c.optimizer_in_backward) {
    throw Error("[remat::train] --optimizer-state " + c.optimizer_state +
                " moves each parameter's state between its updates inside backward; add --optimizer-in-backward.");
  }
  if (c.optimizer_in_backward && c.clip_norm > 0.0) {
    throw Error("[remat::train] --clip-norm " + std::to_string(c.clip_norm) +
                " cannot be combined with --optimizer-in-backward: the global gradient norm needs every gradient "
                "before any update. Drop one of the two.");
  }
  if (c.auto_offload && c.checkpoint != Strategy::kAuto) {
    throw Error(std::string("[remat::train] --auto-offload puts a disk store on the auto plan's menu, and this run "
                            "uses --checkpoint ") +
                std::string(to_string(c.checkpoint)) +
                "; use --checkpoint auto, or --checkpoint offload to send every block.");
  }
  if (c.checkpoint == Strategy::kOffload || c.optimizer_state == "disk" || c.auto_offload) {
    if (c.offload_dir.empty()) {
      const bool acts = c.checkpoint == Strategy::kOffload || c.auto_offload;
      throw Error(std::string("[remat::train] ") +
                  (c.checkpoint == Strategy::kOffload ? "--checkpoint offload"
                   : c.auto_offload                   ? "--auto-offload"
                                                      : "--optimizer-state disk") +
                  " needs --offload-dir DIR, an existing writable directory for the " +
                  (acts ? "saved activations'" : "optimizer state's") + " files (e.g. --offload-dir /tmp).");
    }
    std::error_code ec;
    const auto st = std::filesystem::status(c.offload_dir, ec);
    if (!std::filesystem::exists(st)) {
      throw Error("[remat::train] --offload-dir '" + c.offload_dir + "' does not exist. Create it (mkdir -p " +
                  c.offload_dir + ") or pass another directory.");
    }
    if (!std::filesystem::is_directory(st)) {
      throw Error("[remat::train] --offload-dir '" + c.offload_dir + "' is not a directory. Pass a directory.");
    }
    if (const std::string why = cannot_write_in(c.offload_dir); !why.empty()) {
      throw Error("[remat::train] --offload-dir '" + c.offload_dir +
                  "' is not writable (creating a file in it: " + why + "). Pass a writable directory.");
    }
  }
  if (c.checkpoint == Strategy::kAuto && c.memory_budget_bytes <= 0) {
    throw Error("[remat::train] --checkpoint auto needs a positive --memory-budget (e.g. 512MiB), got " +
                str(c.memory_budget_bytes) + ".");
  }
  if (gpt) {
    std::error_code ec;
    if (std::filesystem::is_directory(c.data_path, ec)) {
      throw Error("[remat::train] --data '" + c.data_path +
                  "' is a directory; the GPT trains on one text file. Pass a file (e.g. --data " +
                  (std::filesystem::path(c.data_path) / "input.txt").string() + ").");
    }
    std::ifstream in(c.data_path, std::ios::binary);
    if (!in) {
      throw Error("[remat::train] cannot read --data file '" + c.data_path +
                  "': " + std::error_code(errno, std::generic_category()).message() +
                  ". Pass an existing text file with --data.");
    }
    if (c.vocab_size < 0) {
      throw Error("[remat::train] --vocab-size must be >= 0 (0: no SentencePiece training), got " + str(c.vocab_size) +
                  ". Pass e.g. --vocab-size 8000, or 0 for the character level.");
    }
    const auto bytes = static_cast<int64_t>(std::filesystem::file_size(c.data_path, ec));
    if (!ec && c.vocab_size == 0 && c.tokenizer.empty() &&
        bytes < c.seq_len + 2) {  // the character level: a byte a token
      throw Error("[remat::train] --data file '" + c.data_path + "' has " + str(bytes) +
                  " bytes, fewer than seq_len + 2 = " + str(c.seq_len + 2) +
                  ". Use a longer text or a smaller --seq-len.");
    }
    if (c.vocab_size == 0 && !c.tokenizer.empty() && !std::filesystem::exists(c.tokenizer, ec)) {
      throw Error("[remat::train] --tokenizer file '" + c.tokenizer +
                  "' does not exist. Train one on --data with --vocab-size N --tokenizer " + c.tokenizer +
                  " (e.g. --vocab-size 8000), or drop --tokenizer for the character level.");
    }
  }
  if (!c.save_path.empty()) {
    // Checked now: a save that fails after training loses the run.
    const std::filesystem::path target(c.save_path);
    const std::string folder = target.parent_path().empty() ? "." : target.parent_path().string();
    std::error_code ec;
    if (std::filesystem::is_directory(target, ec)) {
      throw Error("[remat::train] --save '" + c.save_path + "' is a directory; pass a file path (e.g. --save " +
                  (target / "model.pt").string() + ").");
    }
    if (!std::filesystem::is_directory(folder, ec)) {
      throw Error("[remat::train] --save '" + c.save_path + "': the folder '" + folder +
                  "' does not exist (checked before training, so that no run is lost). Create it (mkdir -p " + folder +
                  ") or save elsewhere.");
    }
    if (const std::string why = cannot_write_in(folder); !why.empty()) {
      throw Error("[remat::train] --save '" + c.save_path + "': cannot write in the folder '" + folder + "' (" + why +
                  "; checked before training, so that no run is lost). Save to a writable folder.");
    }
  }
}

namespace {
/** The error of a checkpoint file torch cannot read (its message's first line). */
[[noreturn]] void unreadable_checkpoint(const std::string& path, const std::exception& e) {
  const std::string what = e.what();
  throw Error("[remat::train] cannot read checkpoint '" + path + "': " + what.substr(0, what.find('\n')) +
              ". Pass a file written by --save.");
}
}  // namespace

int64_t saved_steps(const std::string& checkpoint_path) {
  torch::serialize::InputArchive archive;
  torch::Tensor steps;
  try {
    archive.load_from(checkpoint_path);
  } catch (const std::exception& e) {
    unreadable_checkpoint(checkpoint_path, e);
  }
  if (!archive.try_read("steps_done", steps)) {
    // A sharded run's --save: the model's weights, as torch::save of the module.
    throw Error("[remat::train] '" + checkpoint_path +
                "' holds a model's weights only (what --save writes in a --shard run), not a training checkpoint: "
                "it has no optimizer state or step count to resume from. Pass a file that --save wrote without "
                "--shard.");
  }
  return steps.item<int64_t>();
}

/** auto_checkpoint's warm-up steps before the profiled one (AutoOptions' default). */
constexpr int kAutoWarmupSteps = 1;

struct Trainer::Impl {
  TrainConfig cfg;
  bool gpt = true;
  std::shared_ptr<torch::nn::Module> module;
  std::function<torch::Tensor(const torch::Tensor&)> embed, head;
  /** Mean cross-entropy of head(h) against the targets (the GPT's loss(), chunked or not). */
  std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)> loss;
  torch::nn::Sequential blocks{nullptr};
  std::unique_ptr<torch::optim::Optimizer> optimizer;  // AdamW, or SGD (TrainConfig::optimizer)
  std::unique_ptr<StepInBackward> in_backward;         // TrainConfig::optimizer_in_backward
  at::Generator data_gen;
  torch::Tensor tokens;   // (N) int64 ids of the text (GPT)
  int64_t vocab = 0;      // tok->vocab_size() (GPT)
  torch::Tensor teacher;  // (classes, 3 * 16) fixed labelling map (ResNet)
  /** GPT: from TrainConfig::tokenizer and vocab_size, else the characters. */
  std::optional<Tokenizer> tok;
  int64_t steps_done = 0;
  int64_t params = 0;
  /** Strategy::kAuto: the whole-step planner (made by the first step), and
   *  the bytes live at the start of the step its budget was set at. */
  std::optional<AutoCheckpoint> auto_ck;
  int64_t auto_start_bytes = -1;
  std::optional<OffloadOptions> offload;  // Strategy::kOffload
  int64_t offloaded_bytes = 0;            // this step's, so far
  StepHooks hooks;
  std::ostream* log = nullptr;  // progress and the plan (Trainer's constructor)
  /** Strategy::kAuto: steps auto_ck ran (warm-up, profiled, planned); while
   *  the profiled step runs, when it began; whether the plan is printed. */
  int64_t auto_steps = 0;
  std::optional<Clock::time_point> profiling_since;
  bool print_plan = true;

  /** "auto: profiling ..., 3.2 s so far" while the profiled step runs. */
  void profiling_note(const std::string& what) {
    if (profiling_since) note(log, "auto: profiling " + what + ", " + seconds(since_s(*profiling_since)) + " so far");
  }

  void load_text() {
    std::ifstream in(cfg.data_path, std::ios::binary);
    if (!in) {
      throw Error("[remat::train] cannot read --data file '" + cfg.data_path +
                  "': " + std::error_code(errno, std::generic_category()).message() +
                  ". Pass an existing text file with --data.");
    }
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (cfg.vocab_size > 0) {
      const std::string what = "tokenizer: training SentencePiece BPE " + str(cfg.vocab_size) + " on " + cfg.data_path +
                               " (" + format_bytes(static_cast<int64_t>(text.size())) + ")";
      note(log, what + (cfg.tokenizer.empty() ? "" : ", to " + cfg.tokenizer) + "; pass --tokenizer " +
                    (cfg.tokenizer.empty() ? "PATH" : cfg.tokenizer) +
                    " without --vocab-size next time to load it instead");
      Heartbeat beat(log, what);
      tok = Tokenizer::train_sentencepiece(cfg.data_path, cfg.vocab_size, cfg.tokenizer);
      note(log, "tokenizer: trained in " + seconds(beat.elapsed_s()));
    } else if (!cfg.tokenizer.empty()) {
      tok = Tokenizer::load(cfg.tokenizer);
    } else {
      if (static_cast<int64_t>(text.size()) < cfg.seq_len + 2) {
        throw Error("[remat::train] --data file '" + cfg.data_path + "' has " + str(static_cast<int64_t>(text.size())) +
                    " bytes, fewer than seq_len + 2 = " + str(cfg.seq_len + 2) +
                    ". Use a longer text or a smaller --seq-len.");
      }
      tok = Tokenizer::characters(text);  // ids by byte value of the distinct bytes
    }
    const std::vector<int64_t> ids = encode(text);
    if (static_cast<int64_t>(ids.size()) < cfg.seq_len + 2) {
      throw Error("[remat::train] --data file '" + cfg.data_path + "' has " + str(static_cast<int64_t>(ids.size())) +
                  " tokens (" + tok->describe() + "), fewer than seq_len + 2 = " + str(cfg.seq_len + 2) +
                  ". Use a longer text or a smaller --seq-len.");
    }
    vocab = tok->vocab_size();
    tokens = torch::tensor(ids, torch::kLong);  // (N)
  }

  /** The text's ids: from the token cache (NOTE [token cache]) when it has
   *  them, else encoded (with progress) and then cached. */
  std::vector<int64_t> encode(const std::string& text) {
    if (tok->is_characters()) return tok->encode(text);  // a table lookup per byte: nothing to cache
    std::filesystem::path file;
    std::string corpus_hash;
    const std::string fingerprint = tok->fingerprint();
    if (!cfg.token_cache_dir.empty()) {
      corpus_hash = hash_hex(text);
      file = std::filesystem::path(cfg.token_cache_dir) /
             ("ids-" + corpus_hash + "-" + hash_hex(fingerprint).substr(0, 8) + ".bin");
      const auto t0 = Clock::now();
      if (auto ids = read_token_cache(file, corpus_hash, text.size(), fingerprint)) {
        note(log, "tokenizer: " + str(static_cast<int64_t>(ids->size())) + " token ids of " + cfg.data_path +
                      " read from the cache " + file.string() + " in " + seconds(since_s(t0)));
        return std::move(*ids);
      }
    }
    const auto t0 = Clock::now();
    auto last = t0;
    const std::string what = "tokenizer: encoding " + cfg.data_path + " (" +
                             format_bytes(static_cast<int64_t>(text.size())) + ") with " + tok->describe();
    note(log, what);
    std::vector<int64_t> ids = tok->encode(text, [&](int64_t done_bytes) {
      if (log == nullptr || since_s(last) < 2.0) return;
      last = Clock::now();
      char pct[16];
      std::snprintf(pct, sizeof pct, "%.0f%%",
                    100.0 * static_cast<double>(done_bytes) / static_cast<double>(std::max<size_t>(1, text.size())));
      note(log, what + ": " + pct + ", " + seconds(since_s(t0)) + " so far");
    });
    std::string cached;
    if (!file.empty()) {
      const std::string why = write_token_cache(file, corpus_hash, text.size(), fingerprint, ids);
      cached = why.empty() ? "; cached in " + file.string()
                           : "; not cached (" + cfg.token_cache_dir + ": " + why + "), the next run encodes again";
    }
    note(log, "tokenizer: " + str(static_cast<int64_t>(ids.size())) + " tokens in " + seconds(since_s(t0)) + cached);
    return ids;
  }

  /** (inputs, targets): GPT (B, T) and (B, T) ids; ResNet (B, 3, S, S) and (B). */
  std::pair<torch::Tensor, torch::Tensor> batch() {
    torch::NoGradGuard no_grad;
    if (gpt) {
      const int64_t T = cfg.seq_len;
      // The global batch's starts (data_world * B, 1), then this rank's rows.
      auto start = torch::randint(tokens.size(0) - T - 1, {cfg.batch * cfg.data_world, 1}, data_gen, torch::kLong)
                       .slice(0, cfg.data_rank * cfg.batch, (cfg.data_rank + 1) * cfg.batch);  // (B, 1)
      auto chunk = tokens.index({start + torch::arange(T + 1, torch::kLong)});                 // (B, T + 1)
      return {chunk.slice(1, 0, T), chunk.slice(1, 1, T + 1)};
    }
    const int64_t S = cfg.image_size;
    auto x = torch::randn({cfg.batch * cfg.data_world, 3, S, S}, data_gen, torch::kFloat)
                 .slice(0, cfg.data_rank * cfg.batch, (cfg.data_rank + 1) * cfg.batch)
                 .contiguous();                                      // (B, 3, S, S)
    auto pooled = torch::adaptive_avg_pool2d(x, {4, 4}).flatten(1);  // (B, 48)
    auto y = torch::matmul(pooled, teacher.t()).argmax(1);           // (B)
    return {x, y};
  }

  /** Blocks [lo, hi) (hi < 0: to the end) under the strategy. */
  torch::Tensor run_blocks(torch::Tensor h, int64_t lo = 0, int64_t hi = -1) {
    const bool all = lo == 0 && (hi < 0 || hi == static_cast<int64_t>(blocks->size()));
    if (hi < 0) hi = static_cast<int64_t>(blocks->size());
    switch (cfg.checkpoint) {
      case Strategy::kNone:
      case Strategy::kAuto:       // auto_ck sets the blocks' switches (and the other units')
      case Strategy::kSelective:  // the blocks are switched on (enable_checkpointing)
        if (all && !profiling_since) return blocks->forward(h);
        for (int64_t i = lo; i < hi; ++i) {
          // The profiled step measures each unit's options where it is called: say which.
          profiling_note("blocks." + str(i) + " (block " + str(i - lo + 1) + " of " + str(hi - lo) +
                         (blocks->size() != static_cast<size_t>(hi - lo) ? " on this stage" : "") + ")");
          h = (blocks->begin() + i)->forward(h);
        }
        return h;
      case Strategy::kBlock:
        for (int64_t i = lo; i < hi; ++i) h = remat::checkpoint(SequentialEntry(blocks, i), h);
        return h;
      case Strategy::kSqrt: {
        if (!all) {
          throw Error(
              "[remat::train] --checkpoint sqrt segments the whole block stack, and a pipeline stage runs part of "
              "it; use block, selective, auto or offload.");
        }
        const auto n = static_cast<double>(blocks->size());
        const auto segments = std::clamp<int64_t>(std::llround(std::sqrt(n)), 1, static_cast<int64_t>(n));
        return remat::checkpoint_sequential(blocks, segments, h);
      }
      case Strategy::kOffload: {
        // Backward reads the files back after the scope ends (the saved
        // tensors' hooks keep the store alive); only the blocks offload.
        OffloadScope scope(*offload);
        for (int64_t i = lo; i < hi; ++i) h = (blocks->begin() + i)->forward(h);
        offloaded_bytes += scope.stats().bytes_raw;  // counted at save time, before any write
        return h;
      }
    }
    throw Error("[remat::train] internal: unknown strategy");
  }

  /** Mean cross-entropy of one micro-batch. */
  torch::Tensor loss_of(const torch::Tensor& x, const torch::Tensor& y) {
    Bf16Autocast autocast(cfg.bf16);
    if (gpt) return loss(run_blocks(embed(x)), y);  // head + loss: (B, T, C) -> ()
    auto logits = head(run_blocks(embed(x)));       // (B, classes)
    return torch::cross_entropy_loss(logits.to(torch::kFloat), y);
  }

  /** Runs f with every Checkpointable of the model switched off (plain
   *  forwards), then puts each switch back as it was. */
  template <class F>
  void with_switches_off(const std::shared_ptr<torch::nn::Module>& root, F&& f) {
    std::vector<std::pair<Checkpointable*, std::optional<CheckpointOptions>>> saved;
    for (auto& mod : root->modules(/*include_self=*/true)) {
      if (auto* c = dynamic_cast<Checkpointable*>(mod.get())) {
        saved.emplace_back(c, c->checkpointing_options());
        c->set_checkpointing(std::nullopt);
      }
    }
    struct PutBack {
      decltype(saved)& s;
      ~PutBack() {
        for (auto& [c, o] : s) c->set_checkpointing(o);
      }
    } put_back{saved};
    f();
  }

  /** The auto levers this run leaves off, as flags ("" when none): each
   *  can lower what a plan reaches. */
  std::string levers_off() const {
    std::vector<std::string> off;
    if (!cfg.optimizer_in_backward)
      off.push_back(cfg.clip_norm > 0 ? "--optimizer-in-backward (with --clip-norm 0)" : "--optimizer-in-backward");
    if (cfg.optimizer_in_backward && cfg.optimizer_state.empty() && cfg.optimizer != "sgd")
      off.push_back("--optimizer-state disk|bf16|int8");
    if (!cfg.auto_offload) off.push_back("--auto-offload (with --offload-dir)");
    if (gpt && !cfg.plan_loss_chunks) off.push_back("--loss-chunks auto");
    std::string out;
    for (size_t i = 0; i < off.size(); ++i) out += (i == 0 ? "" : i + 1 == off.size() ? " or " : ", ") + off[i];
    return out.empty() ? out : " This run leaves off auto's levers " + out + ", which can plan lower.";
  }

  /** Solves auto_ck again for --memory-budget above start_bytes (the bytes
   *  live at a step's start); a budget no plan meets throws, naming the
   *  smallest peak above the start that a plan reaches. */
  void set_auto_budget(int64_t start_bytes) {
    if (cfg.memory_budget_whole_step) {
      // The budget bounds all tracked memory already: the planner's as it is.
      const int64_t leanest = auto_ck->leanest_peak_bytes();
      if (leanest > cfg.memory_budget_bytes) {
        throw Error("[remat::train] the whole-step budget " + format_bytes(cfg.memory_budget_bytes) +
                    " (all tracked memory at the step's peak) is below what any auto plan reaches: " +
                    format_bytes(leanest) + " (" + str(leanest) + " bytes), " + format_bytes(start_bytes) +
                    " of it live at the step's start. Raise the cap, or lower --d-model, --layers, --batch or " +
                    (gpt ? "--seq-len." : "--image-size.") + levers_off());
      }
      auto_ck->replan(cfg.memory_budget_bytes);
      auto_start_bytes = start_bytes;
      return;
    }
    const int64_t leanest = auto_ck->leanest_peak_bytes() - start_bytes;
    if (leanest > cfg.memory_budget_bytes) {
      throw Error("[remat::train] --memory-budget " + format_bytes(cfg.memory_budget_bytes) +
                  " (the step's peak above its start) is below what any auto plan reaches: " + format_bytes(leanest) +
                  " (" + str(leanest) + " bytes) above the " + format_bytes(start_bytes) +
                  " live at the step's start. Raise --memory-budget to at least that, or lower --batch, " +
                  (gpt ? "--seq-len, " : "--image-size, ") + "--d-model or --layers." + levers_off());
    }
    auto_ck->replan(start_bytes + cfg.memory_budget_bytes);
    auto_start_bytes = start_bytes;
  }

  std::string fingerprint() const {
    std::ostringstream os;
    os << cfg.model << " layers=" << cfg.layers << " d_model=" << cfg.d_model;
    if (gpt) {
      os << " heads=" << cfg.heads << " seq_len=" << cfg.seq_len << " vocab=" << vocab;
      // The character level adds nothing (checkpoints from before tokenizers match).
      if (tok && !tok->is_characters()) os << " tokenizer=" << tok->fingerprint();
    } else {
      os << " classes=" << cfg.classes;
    }
    if (cfg.optimizer != "adamw") os << " optimizer=" << cfg.optimizer;
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

namespace {

/** Where --optimizer-state puts the state between updates; nullopt: kept. */
std::optional<OffloadOptions> state_store_options(const TrainConfig& c) {
  if (c.optimizer_state == "disk") return OffloadOptions(OffloadTarget::kDisk).directory(c.offload_dir);
  if (c.optimizer_state == "host") return OffloadOptions(OffloadTarget::kHost);
  if (c.optimizer_state == "bf16") return OffloadOptions(OffloadTarget::kMemory).codec(Codec::kBFloat16).min_bytes(0);
  if (c.optimizer_state == "int8") return OffloadOptions(OffloadTarget::kMemory).codec(Codec::kInt8Block).min_bytes(0);
  return std::nullopt;
}

}  // namespace

Trainer::Trainer(TrainConfig config, std::ostream* log) : impl_(std::make_unique<Impl>()) {
  auto& m = *impl_;
  m.cfg = std::move(config);
  m.log = log;
  auto& c = m.cfg;
  memory::enable_tracking();
  check_config(c);
  m.gpt = c.model == "gpt";
  if (c.layers == 0) c.layers = m.gpt ? 6 : 18;
  if (c.d_model == 0) c.d_model = m.gpt ? 128 : 16;
  if (c.checkpoint == Strategy::kOffload) {
    m.offload = OffloadOptions(OffloadTarget::kDisk).directory(c.offload_dir);
    try {
      OffloadScope check(*m.offload);  // what check_config() tested, now with the store itself
    } catch (const Error& e) {
      // The store's reason without its remedy, which names the C++ API.
      std::string what = e.what();
      what = what.substr(0, what.find(". "));
      throw Error("[remat::train] --offload-dir '" + c.offload_dir + "' cannot be used (" +
                  what.substr(std::min(what.size(), what.find(']') + 2)) + "). Pass another directory.");
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
    g.sdpa = c.sdpa;
    g.loss_chunks = c.loss_chunks;
    g.mlp_chunks = c.mlp_chunks;
    Gpt net(g);
    m.module = net.ptr();
    m.blocks = net->blocks;
    m.embed = [net](const torch::Tensor& x) mutable { return net->embed(x); };
    m.head = [net](const torch::Tensor& h) mutable { return net->head(h); };
    m.loss = [net](const torch::Tensor& h, const torch::Tensor& y) mutable { return net->loss(h, y); };
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
  use_optimizer_parameters(m.module->parameters());
  if (c.checkpoint == Strategy::kAuto) {
    // Step 1 plain (warm-up: gradients and AdamW state appear), step 2
    // profiled (plain), then replanned for --memory-budget above step 2's
    // start (Trainer::step). --optimizer-in-backward: the planner updates in
    // backward, and places the state (--optimizer-state) as its plan says.
    AutoOptions ao = AutoOptions().memory_budget_fraction(1.0).warmup_steps(kAutoWarmupSteps);
    if (c.optimizer_in_backward) {
      ao.optimizers({m.optimizer.get()}).zero_grad_set_to_none(false);  // step() zeroes in place
      if (auto store = state_store_options(c)) ao.optimizer_state_store(*store);
    }
    if (c.plan_loss_chunks) ao.chunk_counts(default_chunk_counts());
    // Activations to files: the plan sets the bytes in flight, from 256 KiB
    // (what the leanest plans hold, or one larger tensor) up where the
    // budget has room.
    if (c.auto_offload)
      ao.offload({OffloadOptions(OffloadTarget::kDisk).directory(c.offload_dir).max_inflight_bytes(256 << 10)});
    m.auto_ck.emplace(auto_checkpoint(*m.module, ao));
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

void Trainer::set_step_hooks(StepHooks hooks) { impl_->hooks = std::move(hooks); }

void Trainer::use_optimizer_parameters(std::vector<at::Tensor> parameters) {
  auto& m = *impl_;
  const auto& c = m.cfg;
  if (m.auto_ck && c.optimizer_in_backward) {
    throw Error(
        "[remat::train] --optimizer-in-backward under --checkpoint auto plans the optimizer the trainer was built "
        "with, and this run replaces it (--shard or a pipeline); drop --optimizer-in-backward, or use another "
        "--checkpoint.");
  }
  m.in_backward.reset();  // its hooks go with the optimizer they step
  if (c.optimizer == "sgd") {
    m.optimizer = std::make_unique<torch::optim::SGD>(std::move(parameters), torch::optim::SGDOptions(c.lr));
  } else {
    m.optimizer = std::make_unique<torch::optim::AdamW>(std::move(parameters),
                                                        torch::optim::AdamWOptions(c.lr).weight_decay(c.weight_decay));
  }
  if (c.optimizer_in_backward && c.checkpoint != Strategy::kAuto) {  // under auto, the planner makes it
    StepInBackwardOptions o;
    o.zero_grad_set_to_none(false);  // step() zeroes gradients in place
    if (auto store = state_store_options(c)) o.state_offload(*store);
    m.in_backward = std::make_unique<StepInBackward>(*m.optimizer, o);
  }
}

int64_t Trainer::optimizer_state_bytes() const {
  int64_t bytes = 0;
  auto add = [&](const at::Tensor& t) {
    if (t.defined()) bytes += t.numel() * static_cast<int64_t>(t.element_size());
  };
  for (const auto& [key, state] : impl_->optimizer->state()) {
    if (const auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(state.get())) {
      add(s->exp_avg());
      add(s->exp_avg_sq());
      add(s->max_exp_avg_sq());
    }
  }
  return bytes;
}

std::string Trainer::describe_optimizer_state_memory() const {
  const auto& m = *impl_;
  int64_t in_memory = optimizer_state_bytes(), moved = 0;
  auto add = [&](const StepInBackwardStats& s) {
    in_memory += s.state_held_in_store_bytes;
    moved += s.state_offloaded_bytes;
  };
  if (m.in_backward) add(m.in_backward->stats());
  if (m.auto_ck) {
    for (const auto& s : m.auto_ck->optimizer_stats()) add(s);
  }
  std::string d = format_bytes(in_memory);
  if (moved == 0) return d;
  const std::string& where = m.cfg.optimizer_state;
  if (where == "disk") return d + " (+" + format_bytes(moved) + " in files)";
  if (where == "host") return d + " (+" + format_bytes(moved) + " in pinned host memory)";
  return d + " (" + where + "-encoded, " + format_bytes(moved) + " less than float32)";
}

StepStats Trainer::step(memory::Timeline* timeline) {
  auto& m = *impl_;
  // The whole step's tracked bytes (forward, backward, update, and auto's
  // own work around them): what --max-d-model-under caps.
  memory::Probe whole;
  m.module->train();
  m.optimizer->zero_grad(/*set_to_none=*/false);  // gradients stay allocated: the step's peak is activations
  const auto t0 = Clock::now();
  m.offloaded_bytes = 0;
  double loss = 0.0;
  int64_t peak_bytes = 0, peak_abs = 0;
  auto body = [&] {
    {
      memory::Probe probe;
      for (int64_t k = 0; k < m.cfg.grad_accum; ++k) {
        auto [x, y] = m.batch();
        const bool sync = k + 1 == m.cfg.grad_accum;
        // Micro-batches before the last keep their gradients; the last one's
        // backward updates (optimizer_in_backward).
        std::optional<StepInBackward::Accumulating> accumulating;
        std::vector<StepInBackward::Accumulating> auto_accumulating;
        if (m.in_backward && !sync) accumulating.emplace(m.in_backward->accumulate());
        if (m.auto_ck && !sync) auto_accumulating = m.auto_ck->accumulate();
        const double f0 = timeline ? timeline->now_us() : 0.0;
        if (m.hooks.before_every_forward) m.hooks.before_every_forward();
        if (sync && m.hooks.before_forward) m.hooks.before_forward();
        if (m.hooks.forward_backward) {
          // A pipeline: its step runs every stage's forwards and backwards.
          loss += m.hooks.forward_backward(x, y, 1.0 / static_cast<double>(m.cfg.grad_accum)).item<double>() /
                  static_cast<double>(m.cfg.grad_accum);
          if (timeline) timeline->add_span("forward and backward", f0, timeline->now_us());
          continue;
        }
        auto l = m.loss_of(x, y);
        m.profiling_note(m.cfg.grad_accum > 1
                             ? "the backward of micro-batch " + str(k + 1) + " of " + str(m.cfg.grad_accum)
                             : std::string("the backward"));
        if (m.hooks.before_backward) m.hooks.before_backward(l, sync);
        const double b0 = timeline ? timeline->now_us() : 0.0;
        (m.cfg.grad_accum == 1 ? l : l / static_cast<double>(m.cfg.grad_accum)).backward();
        if (timeline) {
          timeline->add_span("forward", f0, b0);
          timeline->add_span("backward", b0, timeline->now_us());
        }
        loss += l.item<double>() / static_cast<double>(m.cfg.grad_accum);
      }
      peak_bytes = probe.peak_bytes();
      peak_abs = probe.baseline_bytes() + probe.peak_bytes();
    }
    const double o0 = timeline ? timeline->now_us() : 0.0;
    if (m.cfg.clip_norm > 0.0) {
      if (m.hooks.clip) {
        m.hooks.clip(m.cfg.clip_norm);
      } else {
        torch::nn::utils::clip_grad_norm_(m.module->parameters(), m.cfg.clip_norm);
      }
    }
    m.optimizer->step();
    if (timeline) timeline->add_span("optimizer", o0, timeline->now_us());
  };
  StepPhase phase = StepPhase::kNormal;
  bool replanned = false;
  int64_t start = -1;  // auto: the step's start as its budget counts it, bytes
  if (m.auto_ck) {
    // The budget is --memory-budget above the step's start: what is live
    // then (parameters, gradients, optimizer state) is added to it, the
    // optimizer state the plan keeps in a store counted as if kept (else
    // moving it would only lower the budget by as much, and buy nothing).
    start = memory::current_bytes() + m.auto_ck->optimizer_state_in_store_bytes();
    if (m.auto_ck->planned() && start != m.auto_start_bytes) m.set_auto_budget(start);
    const bool was_planned = m.auto_ck->planned();
    if (!was_planned) phase = m.auto_steps < kAutoWarmupSteps ? StepPhase::kWarmup : StepPhase::kProfiled;
    struct EndProfiling {
      std::optional<Clock::time_point>& since;
      ~EndProfiling() { since.reset(); }
    } end_profiling{m.profiling_since};
    if (phase == StepPhase::kProfiled && m.log != nullptr) {
      note(m.log, "auto: step " + str(m.steps_done + 1) +
                      " is the profiled step: a plain step that also runs every unit's options (keep, recompute, "
                      "selective, ...) where the unit is called, to measure their bytes and times; it takes many "
                      "times a plain step");
      m.profiling_since = Clock::now();
    }
    const int replans = m.auto_ck->replans();
    m.auto_ck->step(body);
    replanned = m.auto_ck->replans() > replans;
    ++m.auto_steps;
    if (!was_planned && m.auto_ck->planned()) {  // just profiled
      m.profiling_note("done; solving for the budget");
      m.set_auto_budget(start);
      // A pipeline's driver (StepHooks::forward_backward) reports each stage's plan itself.
      if (m.log != nullptr && m.print_plan && !m.hooks.forward_backward) {
        note(m.log, describe_auto_budget());
        *m.log << m.auto_ck->explain() << std::flush;
      }
    }
  } else {
    body();
  }
  // Under auto, the peak above the step's start as the budget counts that
  // start (set_auto_budget): the bytes live then, and the optimizer state
  // the plan keeps in a store as if kept. The state is outside the budget
  // wherever it lives, and its bytes read back are in it; a re-plan at
  // the step's start that moves state between memory and the store
  // changes neither.
  int64_t under_start = 0;
  if (start >= 0) {
    peak_bytes = std::max<int64_t>(0, peak_abs - start);
    under_start = std::max<int64_t>(0, start - peak_abs);
  }
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  const double items = static_cast<double>(m.cfg.batch * m.cfg.grad_accum * (m.gpt ? m.cfg.seq_len : 1));
  // A state store whose writes fail keeps those states in memory: the
  // training is the same, the memory is not what the store promised.
  int64_t write_failures = 0;
  std::string write_error;
  auto failed = [&](const StepInBackwardStats& st) {
    write_failures += st.state_write_failures;
    if (!st.last_state_error.empty()) write_error = st.last_state_error;
  };
  if (m.in_backward) failed(m.in_backward->stats());
  if (m.auto_ck) {
    for (const auto& st : m.auto_ck->optimizer_stats()) failed(st);
  }
  return StepStats{++m.steps_done,
                   loss,
                   ms,
                   items / (ms / 1e3),
                   peak_bytes,
                   m.offloaded_bytes,
                   phase,
                   whole.baseline_bytes(),
                   whole.baseline_bytes() + whole.peak_bytes(),
                   replanned,
                   under_start,
                   write_failures,
                   write_error};
}

std::vector<StepStats> Trainer::run(std::ostream* log, const std::function<bool()>& stop) {
  std::vector<StepStats> out;
  if (log) *log << summary() << "\n";
  const char* unit = impl_->gpt ? "tok" : "img";
  while (impl_->steps_done < impl_->cfg.steps) {
    if (stop && stop()) return out;
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
  // The state in a store is written as read back, and stays there (NOTE
  // [saving stored state]: LibTorch's optimizers, which the trainer's are).
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
    unreadable_checkpoint(path, e);
  }
  if (config.toStringRef() != m.fingerprint()) {
    // " vocab=N[ tokenizer=...]" up to the next field: another vocabulary
    // with the same architecture gets its own remedy.
    auto split = [](const std::string& f) {
      const auto at = f.find(" vocab=");
      if (at == std::string::npos) return std::pair<std::string, std::string>{f, ""};
      const auto end = std::min(f.size(), f.find(" optimizer=", at));
      return std::pair<std::string, std::string>{f.substr(0, at) + f.substr(end), f.substr(at + 1, end - at - 1)};
    };
    const auto [theirs_rest, theirs_vocab] = split(config.toStringRef());
    const auto [ours_rest, ours_vocab] = split(m.fingerprint());
    if (m.gpt && theirs_rest == ours_rest && theirs_vocab != ours_vocab) {
      throw Error("[remat::train] checkpoint '" + path + "' was trained with another vocabulary ('" + theirs_vocab +
                  "'); this run's is '" + ours_vocab + "', " + m.tok->describe() +
                  ". Resume with the tokenizer it was trained with: the same --tokenizer PATH (none for the "
                  "character level) and --data.");
    }
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
const Tokenizer* Trainer::tokenizer() const { return impl_->tok ? &*impl_->tok : nullptr; }
std::shared_ptr<torch::nn::Module> Trainer::module() const { return impl_->module; }

namespace {

void check_stage(bool gpt, int64_t L, int stage, int stages) {
  if (!gpt) {
    throw Error(
        "[remat::train] pipeline stages cut the GPT's blocks; the ResNet is not cut into stages (use --model gpt).");
  }
  if (stages < 1 || stage < 0 || stage >= stages) {
    throw Error("[remat::train] pipeline stage " + str(stage) + " of " + str(stages) + " does not exist.");
  }
  if (stages > L) {
    throw Error("[remat::train] --pipeline " + str(stages) + " is more stages than the GPT's " + str(L) +
                " blocks; give at most " + str(L) + " (or more --layers).");
  }
}

}  // namespace

std::vector<at::Tensor> Trainer::pipeline_stage(int stage, int stages, const std::vector<at::Tensor>& inputs) {
  auto& m = *impl_;
  const int64_t L = static_cast<int64_t>(m.blocks->size());
  check_stage(m.gpt, L, stage, stages);
  const auto s = gpt_stage(L, stage, stages);
  Bf16Autocast autocast(m.cfg.bf16);
  auto h = s.embeds ? m.embed(inputs.at(0)) : inputs.at(0);
  h = m.run_blocks(h, s.first_block, s.end_block);
  // Under autocast the blocks' output may be bfloat16: stages pass float.
  return {h.to(torch::kFloat)};
}

at::Tensor Trainer::pipeline_loss(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& targets) {
  auto& m = *impl_;
  Bf16Autocast autocast(m.cfg.bf16);
  return m.loss(outputs.at(0), targets.at(0));
}

std::vector<at::Tensor> Trainer::pipeline_parameters(int stage, int stages) const {
  const auto& m = *impl_;
  const int64_t L = static_cast<int64_t>(m.blocks->size());
  check_stage(m.gpt, L, stage, stages);
  std::vector<at::Tensor> out;
  for (auto& [name, p] : gpt_stage_parameters(*m.module->as<GptImpl>(), gpt_stage(L, stage, stages))) {
    out.push_back(p);
  }
  return out;
}

const AutoCheckpoint* Trainer::planner() const { return impl_->auto_ck ? &*impl_->auto_ck : nullptr; }

std::string Trainer::describe_auto_budget() const {
  const auto& m = *impl_;
  if (!m.auto_ck || !m.auto_ck->planned() || m.auto_start_bytes < 0) return "";
  int64_t params = 0, grads = 0;
  for (const auto& p : m.module->parameters()) {
    params += static_cast<int64_t>(p.nbytes());
    if (p.grad().defined()) grads += static_cast<int64_t>(p.grad().nbytes());
  }
  // The state in a store is part of the start as if kept (the step's start
  // as the budget counts it); a compressed store's encoding is in memory.
  const int64_t in_store = m.auto_ck->optimizer_state_in_store_bytes();
  const int64_t state = optimizer_state_bytes() + in_store;
  const int64_t start = m.auto_start_bytes, other = start - params - grads - state;
  const bool encoded = m.cfg.optimizer_state == "bf16" || m.cfg.optimizer_state == "int8";
  std::string parts =
      "parameters " + format_bytes(params) + ", their gradients " + format_bytes(grads) + ", " +
      (m.cfg.optimizer == "sgd" ? "no optimizer state (sgd)" : "the optimizer's state " + format_bytes(state));
  if (in_store > 0) parts += " (" + format_bytes(in_store) + " of it out of memory in its store, counted as kept)";
  if (other > 0) {
    parts += ", the rest " + format_bytes(other) + " (the data, buffers" +
             (encoded && in_store > 0 ? ", the stored state's " + m.cfg.optimizer_state + " encoding" : "") + ")";
  }
  if (m.cfg.memory_budget_whole_step) {
    return "auto: budget " + format_bytes(m.cfg.memory_budget_bytes) +
           " on the whole step (all tracked memory at its peak), applied to the planner as it is; " +
           format_bytes(start) + " of it live at the step's start (the state in a store counted as kept): " + parts;
  }
  return "auto: budget " + format_bytes(m.cfg.memory_budget_bytes) +
         " as asked (--memory-budget: the step's peak above its start), " + format_bytes(m.auto_ck->budget_bytes()) +
         " as applied to the planner (all tracked memory), which adds the " + format_bytes(start) +
         " live at the step's start that it must cover: " + parts;
}

at::Tensor Trainer::tied_embedding() const {
  const auto& m = *impl_;
  if (!m.gpt) return {};
  return m.module->named_parameters()["wte.weight"];
}
const TrainConfig& Trainer::config() const { return impl_->cfg; }

std::vector<int> Trainer::auto_forwards_per_block() const {
  if (!impl_->auto_ck || !impl_->auto_ck->planned()) return {};
  std::vector<int> out;
  for (const AutoUnit& u : impl_->auto_ck->units()) {
    if (u.name.rfind("blocks.", 0) != 0) continue;  // the blocks, in order ("blocks.0", ...), then inner units
    const std::string& o = u.options.at(static_cast<size_t>(u.choice));
    // keep and offload run the forward once; recompute and selective run it
    // again in backward; nested recompute runs the inner units' a third time
    const int runs = o == "keep" || o.rfind("offload", 0) == 0 ? 1 : o == "recompute, inner units too" ? 3 : 2;
    const bool inner = u.name.find('.', 7) != std::string::npos;  // "blocks.3.attn"
    if (!inner) {
      out.push_back(runs);
    } else if (!out.empty()) {
      out.back() = std::max(out.back(), runs);  // an inner unit of the last block (units come in tree order)
    }
  }
  return out;
}

void Trainer::prepare() {
  auto& m = *impl_;
  m.module->train();
  {
    torch::NoGradGuard no_grad;
    for (auto& p : m.module->parameters()) {
      if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
    }
  }
  // The warm-up and profiled steps: real steps (counted), after which the
  // plan is in force.
  while (m.auto_ck && !m.auto_ck->planned()) step();
}

namespace {

/** blocks_schedule (on the L-stage blocks chain) as a schedule of the chain
 *  embed (stage 0) -> blocks (1..L) -> head + loss (L + 1): the embed's
 *  output is the blocks' input, and the head runs (saving) and backwards
 *  as soon as the last block's output first exists, before any recompute. */
plan::Schedule around_blocks(const plan::Schedule& blocks_schedule, int blocks) {
  using plan::Op;
  using plan::OpKind;
  plan::Schedule out;
  out.ops.push_back({OpKind::kForwardSave, 0});
  bool head_done = false;
  for (const Op& op : blocks_schedule.ops) {
    out.ops.push_back({op.kind, op.stage + 1});  // drop(j) shifts too: a_j of the blocks is a_{j+1} here
    const bool last_block = (op.kind == OpKind::kForward || op.kind == OpKind::kForwardSave) && op.stage == blocks - 1;
    if (last_block && !head_done) {
      out.ops.push_back({OpKind::kForwardSave, blocks + 1});
      out.ops.push_back({OpKind::kBackward, blocks + 1});
      head_done = true;
    }
  }
  out.ops.push_back({OpKind::kBackward, 0});
  return out;
}

/** What remat::checkpoint around every block does, in the op model: each
 *  block's forward keeps only its output, and before its backward the block
 *  runs again, saving (its original output was freed by the next block's
 *  backward). Not expressible on the blocks alone: their forward part ends
 *  without saving, and only the head saves. */
plan::Schedule per_block_schedule(int blocks) {
  using plan::OpKind;
  plan::Schedule s;
  for (int i = 0; i < blocks; ++i) s.ops.push_back({OpKind::kForward, i});
  for (int i = blocks - 1; i >= 0; --i) {
    s.ops.push_back({OpKind::kDrop, i + 1});
    s.ops.push_back({OpKind::kForwardSave, i});
    s.ops.push_back({OpKind::kBackward, i});
  }
  return s;
}

}  // namespace

StepPrediction Trainer::predict_step(int64_t cap_bytes) {
  auto& m = *impl_;
  StepPrediction out;
  const bool adamw = m.cfg.optimizer != "sgd";
  const int64_t copies = adamw ? 4 : 2;  // parameters, gradients (and AdamW's two moments)
  int64_t param_bytes = 0, largest_bytes = 0;
  for (const auto& p : m.module->parameters()) {
    param_bytes += static_cast<int64_t>(p.nbytes());
    largest_bytes = std::max(largest_bytes, static_cast<int64_t>(p.nbytes()));
  }
  out.fixed_bytes = copies * param_bytes;
  out.parameters = m.params;
  // NOTE [whole-step prediction]: what lives at the step's start as the
  // levers leave it, then what the step adds. In backward an updated
  // parameter's gradient lives until its update (the largest, the tied
  // embedding, through the whole backward); a state on disk is in memory
  // while read ahead (state_prefetch, default 2 parameters), updated and
  // written back: about 3 parameters' states at once, bounded by the largest.
  const bool in_backward = m.cfg.optimizer_in_backward;
  const std::string& where = m.cfg.optimizer_state;
  // int8: a byte per value and a float32 per 256 values, 65/256 of float32.
  const int64_t state_bytes = !adamw            ? 0
                              : where == "disk" ? 0
                              : where == "bf16" ? param_bytes
                              : where == "int8" ? 2 * param_bytes * 65 / 256
                                                : 2 * param_bytes;
  int64_t other_bytes = m.tokens.defined() ? static_cast<int64_t>(m.tokens.nbytes()) : 0;
  if (m.teacher.defined()) other_bytes += static_cast<int64_t>(m.teacher.nbytes());
  for (const auto& b : m.module->buffers()) other_bytes += static_cast<int64_t>(b.nbytes());
  const int64_t start_bytes = param_bytes + (in_backward ? 0 : param_bytes) + state_bytes + other_bytes;
  const int64_t step_extra_bytes =
      (in_backward ? largest_bytes : 0) + (adamw && where == "disk" ? 3 * 2 * largest_bytes : 0);
  auto finish = [&] {
    out.start_bytes = start_bytes;
    out.whole_peak_bytes = start_bytes + out.peak_bytes + step_extra_bytes;
    return out;
  };
  if (m.cfg.checkpoint == Strategy::kAuto) {
    // The smallest peak any plan of the profiled step reaches, above the
    // profiled step's start; the budget is the cap (or --memory-budget).
    out.auto_budget_bytes = cap_bytes > 0 ? cap_bytes : m.cfg.memory_budget_bytes;
    struct Restore {  // --memory-budget back, also when prepare() throws
      int64_t& budget;
      int64_t value;
      ~Restore() { budget = value; }
    } restore{m.cfg.memory_budget_bytes, m.cfg.memory_budget_bytes};
    m.cfg.memory_budget_bytes = std::numeric_limits<int64_t>::max() / 4;  // profile without refusing a budget
    prepare();
    m.cfg.memory_budget_bytes = restore.value;
    const int64_t leanest = m.auto_ck->leanest_peak_bytes() - m.auto_start_bytes;
    out.start_bytes = m.auto_start_bytes;  // measured (the state in a store counted as kept)
    if (cap_bytes > 0) {
      out.peak_bytes = leanest;
      out.whole_peak_bytes = m.auto_ck->leanest_peak_bytes();  // all tracked memory, as the planner counts it
      m.auto_start_bytes = -1;  // the next step plans for --memory-budget again, not the profile's unbounded one
    } else {
      m.set_auto_budget(m.auto_start_bytes);  // throws when no plan meets --memory-budget
      out.peak_bytes = m.auto_ck->plan().prediction.peak_bytes - m.auto_start_bytes;
      out.whole_peak_bytes = m.auto_ck->plan().prediction.peak_bytes;
    }
    return out;
  }
  if (!m.gpt) {
    throw Error(
        "[remat::train] predicting a step's peak needs the GPT (its embed -> blocks -> head chain) or "
        "--checkpoint auto; got --model " +
        m.cfg.model +
        ". Use --model gpt or --checkpoint auto, or measure ResNet steps with remat-train --batch N "
        "(the 'peak' column).");
  }
  if (m.cfg.checkpoint == Strategy::kOffload) {
    // Not modeled: the store's bytes (writes in flight, reads ahead) follow
    // the disk's pace. One measured steady-state step instead.
    prepare();
    out.peak_bytes = step().peak_bytes;
    return finish();
  }
  m.module->train();
  const auto state = generator_state(m.data_gen).clone();
  auto [x, y] = m.batch();  // (B, T), (B, T): views of one (B, T + 1) window
  set_generator_state(m.data_gen, state);
  torch::nn::Sequential chain_seq;
  chain_seq->push_back("embed", torch::nn::Functional([&m](const torch::Tensor& idx) { return m.embed(idx); }));
  chain_seq->extend(*m.blocks);
  const int64_t accum = m.cfg.grad_accum;
  chain_seq->push_back("head_loss", torch::nn::Functional([&m, y = y, accum](const torch::Tensor& h) {
                         auto l = m.loss(h, y);  // head + cross-entropy, chunked or not
                         return accum == 1 ? l : l / static_cast<double>(accum);
                       }));
  const bool selective = m.cfg.checkpoint == Strategy::kSelective;
  if (selective && m.cfg.policy == "attention") {
    throw Error(
        "[remat::train] predicting a step's peak models op policies only, not --policy attention (a module "
        "switch); use --policy megatron, save_matmuls or save_nothing.");
  }
  const int L = static_cast<int>(m.blocks->size());
  plan::Chain chain;
  int64_t recomputed_bytes = 0;  // selective: what one block's policy leaves to recompute
  m.with_switches_off(m.module, [&] {
    Bf16Autocast autocast(m.cfg.bf16);
    // One run per stage: the bytes are the same every run, only the times
    // (which auto's choice among fitting schedules uses) get noisier.
    chain = profile(chain_seq, x, ProfileOptions().repeats(1).warmup(0));
    if (!selective) return;
    torch::Tensor h;
    {
      torch::NoGradGuard no_grad;
      h = m.embed(x);
    }
    h.requires_grad_(true);
    auto run = [seq = m.blocks](const torch::Tensor& in) mutable { return seq->begin()->forward(in); };
    const SavedResiduals r = saved_residuals(selective_policy(m.cfg.policy, true), run, h);
    recomputed_bytes = std::max<int64_t>(0, r.recomputable_bytes - r.policy_bytes);
  });
  // NOTE [selective in the op model]: a switched-on block keeps what its
  // policy saves; the rest is recomputed when its backward starts and lives
  // through it (an upper bound: the runtime frees each tensor once used).
  for (int i = 1; selective && i <= L; ++i) {
    auto& st = chain.stages[static_cast<size_t>(i)];
    st.saved_bytes = std::max(st.output_bytes, st.saved_bytes - recomputed_bytes);
    st.backward_tmp_bytes += recomputed_bytes;
  }
  plan::Chain blocks;
  blocks.input_bytes = chain.stages[0].output_bytes;
  blocks.stages.assign(chain.stages.begin() + 1, chain.stages.begin() + 1 + L);

  auto whole = [&](const plan::Schedule& s) { return plan::simulate(chain, around_blocks(s, L)).peak_bytes; };
  switch (m.cfg.checkpoint) {
    case Strategy::kOffload:  // measured above
    case Strategy::kNone:
    case Strategy::kSelective: out.peak_bytes = whole(plan::store_all(blocks).schedule); break;
    case Strategy::kBlock: out.peak_bytes = whole(per_block_schedule(L)); break;
    case Strategy::kSqrt: out.peak_bytes = whole(plan::sqrt_schedule(blocks).schedule); break;
    case Strategy::kAuto: break;  // handled above
  }
  return finish();
}

std::string Trainer::explain_memory() {
  auto& m = *impl_;
  if (m.auto_ck) {
    // The switches are the plan's: profile and plan first (two real steps).
    m.print_plan = false;
    struct PrintPlan {
      bool& print;
      ~PrintPlan() { print = true; }
    } put_back{m.print_plan};
    prepare();
    return "the auto plan for this step (after the warm-up and profiled steps):\n" + describe_auto_budget() + "\n" +
           m.auto_ck->explain() + describe_checkpointing(*m.module);
  }
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
  // Plain forward of the block: the switch must not checkpoint it here.
  m.with_switches_off(block, [&] { os << (p ? saved_residuals(*p, run, h) : saved_residuals(run, h)).to_string(); });
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
       << ", vocab " << m.vocab << ", " << static_cast<double>(m.params) / 1e6 << "M params; data " << c.data_path;
    if (m.tok->is_characters()) {
      os << " (" << m.tokens.size(0) << " chars)";
    } else {
      os << " (" << m.tokens.size(0) << " tokens); tokenizer " << m.tok->describe();
    }
  } else {
    os << "resnet" << c.layers << ": width " << c.d_model << ", " << c.classes << " classes, " << c.image_size << "x"
       << c.image_size << " synthetic images, " << static_cast<double>(m.params) / 1e6 << "M params";
  }
  os << "; batch " << c.batch;
  if (c.grad_accum > 1) os << " x " << c.grad_accum << " accumulated";
  os << "; checkpoint " << to_string(c.checkpoint);
  if (c.checkpoint == Strategy::kSelective) os << " (policy " << c.policy << ")";
  if (c.checkpoint == Strategy::kAuto)
    os << " (budget " << format_bytes(c.memory_budget_bytes)
       << (c.memory_budget_whole_step ? " on the whole step)" : " above the step's start)");
  if (c.checkpoint == Strategy::kOffload) os << " (files in " << c.offload_dir << ")";
  if (c.auto_offload) os << "; the plan may send activations to files in " << c.offload_dir;
  if (m.gpt && c.sdpa) os << "; sdpa attention";
  if (m.gpt && c.plan_loss_chunks) os << "; head + loss chunks chosen by the auto plan";
  if (m.gpt && !c.plan_loss_chunks && c.loss_chunks > 0) os << "; head + loss in " << c.loss_chunks << " chunks";
  if (m.gpt && c.mlp_chunks > 0) os << "; MLP in " << c.mlp_chunks << " chunks";
  if (c.bf16) os << "; bf16 autocast";
  if (c.optimizer_in_backward) {
    os << "; optimizer step in backward";
    if (!c.optimizer_state.empty())
      os << " (state between updates: " << c.optimizer_state
         << (c.optimizer_state == "disk" ? " in " + c.offload_dir : std::string())
         << (c.optimizer_state == "host" ? ": pinned host memory for a GPU's state; on this CPU it stays where it is"
                                         : "")
         << (c.checkpoint == Strategy::kAuto ? ", where the plan says" : "") << ")";
  }
  const int threads = torch::get_num_threads();
  os << "; " << threads << (threads == 1 ? " thread" : " threads");
  if (m.steps_done > 0) os << "; resumed at step " << m.steps_done;
  return os.str();
}

}  // namespace remat::models
