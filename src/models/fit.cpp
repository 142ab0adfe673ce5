// What fits under a memory cap (see include/remat/models/trainer.h): the
// search over predicted peaks (largest_fitting), max_under() and its checks
// (predictions from fresh Trainers, then measured steps), and format_fit().
// The cap is on the peak above the step's start for --seq-len and --batch,
// and on the whole step (parameters, gradients, optimizer state included)
// for --d-model. Leaves out: the predictions themselves
// (Trainer::predict_step, trainer.cpp) and the command line (remat-train).
#include <remat/models/trainer.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <numeric>
#include <ostream>
#include <set>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include <remat/error.h>
#include <remat/models/tokenizer.h>

#include "internal.h"

namespace remat::models {

namespace {

using detail::Heartbeat;
using detail::note;
using detail::seconds;
using detail::str;

const char* flag_of(FitDimension d) {
  switch (d) {
    case FitDimension::kSeqLen: return "--max-seq-len-under";
    case FitDimension::kBatch: return "--max-batch-under";
    case FitDimension::kDModel: return "--max-d-model-under";
  }
  return "--max-*-under";
}

/** The flag of the value searched: "--seq-len", "--batch", "--d-model". */
const char* value_flag_of(FitDimension d) {
  switch (d) {
    case FitDimension::kSeqLen: return "--seq-len";
    case FitDimension::kBatch: return "--batch";
    case FitDimension::kDModel: return "--d-model";
  }
  return "";
}

/** "1.2M" parameters (or "8.3k", "512"). */
std::string count(int64_t n) {
  char b[32];
  if (n >= 1'000'000) {
    std::snprintf(b, sizeof b, "%.2fM", static_cast<double>(n) / 1e6);
  } else if (n >= 1000) {
    std::snprintf(b, sizeof b, "%.1fk", static_cast<double>(n) / 1e3);
  } else {
    std::snprintf(b, sizeof b, "%lld", static_cast<long long>(n));
  }
  return b;
}

}  // namespace

int64_t largest_fitting(int64_t cap_bytes, int64_t step, int64_t max_value, const std::function<int64_t(int64_t)>& peak,
                        std::vector<FitProbe>* probes) {
  if (step < 1) throw Error("[remat::train] the search step must be >= 1, got " + str(step) + ".");
  const int64_t kmax = max_value / step;  // values are k * step, k in [1, kmax]
  if (kmax < 1) return 0;
  std::map<int64_t, int64_t> seen;  // k -> peak bytes
  std::vector<int64_t> order;       // k, most recent last
  auto eval = [&](int64_t k) {
    if (auto it = seen.find(k); it != seen.end()) return it->second;
    const int64_t p = peak(k * step);
    seen.emplace(k, p);
    order.push_back(k);
    if (probes) probes->push_back({k * step, p});
    return p;
  };
  if (eval(1) > cap_bytes) return 0;
  int64_t lo = 1, hi = 0;  // peak(lo) fits; peak(hi) does not
  while (hi == 0) {
    if (lo == kmax) return lo * step;
    // The peak is at most quadratic in the value (T; linear in the batch), so
    // growing by sqrt(cap / peak) keeps the probe itself near the cap's size.
    const double grow = std::clamp(
        std::sqrt(static_cast<double>(cap_bytes) / static_cast<double>(std::max<int64_t>(1, seen[lo]))), 1.25, 2.0);
    const int64_t next =
        std::min(kmax, std::max(lo + 1, static_cast<int64_t>(std::floor(static_cast<double>(lo) * grow))));
    if (eval(next) <= cap_bytes) {
      lo = next;
    } else {
      hi = next;
    }
  }
  // Where the quadratic through the last three probes meets the cap, or -1.
  auto guess = [&]() -> int64_t {
    if (order.size() < 3) return -1;
    double xs[3], ys[3];
    for (int i = 0; i < 3; ++i) {
      const int64_t k = order[order.size() - 3 + static_cast<size_t>(i)];
      xs[i] = static_cast<double>(k);
      ys[i] = static_cast<double>(seen[k]);
    }
    if (xs[0] == xs[1] || xs[1] == xs[2] || xs[0] == xs[2]) return -1;
    // Newton form: y = y0 + d01 (x - x0) + d012 (x - x0)(x - x1).
    const double d01 = (ys[1] - ys[0]) / (xs[1] - xs[0]), d12 = (ys[2] - ys[1]) / (xs[2] - xs[1]);
    const double d012 = (d12 - d01) / (xs[2] - xs[0]);
    const double a = d012, b = d01 - d012 * (xs[0] + xs[1]), c = ys[0] - d01 * xs[0] + d012 * xs[0] * xs[1];
    const double target = static_cast<double>(cap_bytes) - c;
    double x = -1;
    if (std::abs(a) < 1e-12 * std::max(1.0, std::abs(b))) {
      if (b > 0) x = target / b;
    } else {
      const double disc = b * b + 4 * a * target;
      if (disc >= 0) {
        const double r1 = (-b + std::sqrt(disc)) / (2 * a), r2 = (-b - std::sqrt(disc)) / (2 * a);
        const double l = static_cast<double>(lo), h = static_cast<double>(hi);
        x = (r1 >= l && r1 < h) ? r1 : r2;
      }
    }
    if (!std::isfinite(x)) return -1;
    // Clamped into the bracket: a guess at lo means "lo is the answer",
    // which lo + 1 confirms.
    return std::clamp(static_cast<int64_t>(std::floor(std::clamp(x, -1.0, 9e18))), lo + 1, hi - 1);
  };
  auto probe = [&](int64_t k) {
    if (eval(k) <= cap_bytes) {
      lo = k;
      return true;
    }
    hi = k;
    return false;
  };
  while (hi - lo > 1) {
    // A guess and its neighbour (an exact model ends the search there),
    // then a bisection step: the bracket halves at least every 3 probes.
    if (const int64_t g = guess(); g > 0) {
      const int64_t n = probe(g) ? g + 1 : g - 1;
      if (n > lo && n < hi) probe(n);
    }
    if (hi - lo > 1) probe(lo + (hi - lo) / 2);
  }
  return lo * step;
}

void check_fit(const TrainConfig& config, const FitOptions& options) {
  const FitDimension dim = options.dimension;
  const std::string flag = flag_of(dim);
  if (dim == FitDimension::kDModel && config.model != "gpt") {
    throw Error(
        "[remat::train] --max-d-model-under needs --model gpt (it searches the GPT's width, a multiple of "
        "--heads); got --model " +
        config.model + ". For a ResNet, measure base widths with remat-train --model " + config.model +
        " --d-model N and read the 'peak' column.");
  }
  if (config.model != "gpt" && (dim == FitDimension::kSeqLen || config.checkpoint != Strategy::kAuto)) {
    throw Error("[remat::train] " + flag +
                " needs --model gpt (it profiles the GPT's embed -> blocks -> head chain), or for the ResNet "
                "--max-batch-under with --checkpoint auto; got --model " +
                config.model + ". Otherwise measure with remat-train --batch N and read the 'peak' column.");
  }
  if (options.cap_bytes <= 0) {
    throw Error("[remat::train] " + flag + " must be a positive size (e.g. 1GiB), got " + str(options.cap_bytes) +
                " bytes.");
  }
  if (options.step < 1) {
    throw Error("[remat::train] --fit-step must be >= 1, got " + str(options.step) + ".");
  }
  if (!config.resume_path.empty()) {
    throw Error("[remat::train] " + flag + " trains fresh models, one per value it tries; drop --resume " +
                config.resume_path + ".");
  }
  if (!config.save_path.empty()) {
    throw Error("[remat::train] " + flag +
                " trains fresh models, one per value it tries, and keeps none; drop --save " + config.save_path +
                " (train at the value it finds, with --save, afterwards).");
  }
  if (dim != FitDimension::kDModel) return;
  if (config.heads < 1) {
    throw Error("[remat::train] --max-d-model-under searches multiples of --heads; got --heads " + str(config.heads) +
                ". Pass --heads >= 1.");
  }
  if (config.checkpoint == Strategy::kOffload) {
    throw Error(
        "[remat::train] --max-d-model-under with --checkpoint offload: offload's bytes in flight follow the disk's "
        "pace and are not predicted for the whole step; use --checkpoint none, block, sqrt, selective or auto.");
  }
  const int64_t step = std::lcm(options.step, config.heads);
  if (options.max_value > 0 && step > options.max_value) {
    throw Error("[remat::train] --max-d-model-under: the smallest width tried, lcm(--fit-step " + str(options.step) +
                ", --heads " + str(config.heads) + ") = " + str(step) + ", is above the search's limit " +
                str(options.max_value) + ". Lower --fit-step or --heads, or raise --fit-max.");
  }
}

FitResult max_under(const TrainConfig& config, const FitOptions& options, std::ostream* log) {
  const FitDimension dim = options.dimension;
  const bool seq = dim == FitDimension::kSeqLen;
  const bool width = dim == FitDimension::kDModel;
  const std::string flag = flag_of(dim);
  const std::string what = value_flag_of(dim);
  check_fit(config, options);
  // A width must divide into heads: the search steps by a multiple of both.
  const int64_t step = width ? std::lcm(options.step, config.heads) : options.step;
  int64_t max_value = options.max_value;
  if (max_value <= 0) {
    if (seq) {
      std::error_code ec;
      const auto size = std::filesystem::file_size(config.data_path, ec);
      if (ec) {
        throw Error("[remat::train] cannot read --data file '" + config.data_path + "': " + ec.message() +
                    ". Pass an existing text file with --data.");
      }
      max_value = static_cast<int64_t>(size) - 2;  // a window needs seq_len + 1 tokens, load_text seq_len + 2
    } else {
      max_value = width ? 16384 : 65536;
    }
  }
  // The probes load one SentencePiece model, trained here once, instead of
  // training one each: into config.tokenizer, or a temporary file removed
  // on return.
  TrainConfig base = config;
  struct RemoveOnReturn {
    std::filesystem::path path;
    ~RemoveOnReturn() {
      std::error_code ignore;
      if (!path.empty()) std::filesystem::remove(path, ignore);
    }
  } temp_model;
  if (config.vocab_size > 0) {
    if (base.tokenizer.empty()) {
      temp_model.path =
          std::filesystem::temp_directory_path() / ("remat-tokenizer-" + std::to_string(::getpid()) + ".model");
      base.tokenizer = temp_model.path.string();
    }
    const std::string what = "tokenizer: training SentencePiece BPE " + str(config.vocab_size) + " on " +
                             config.data_path + " (once, for every probe)";
    note(log, what);
    Heartbeat beat(log, what);
    Tokenizer::train_sentencepiece(config.data_path, config.vocab_size, base.tokenizer);
    note(log, "tokenizer: trained in " + seconds(beat.elapsed_s()));
    base.vocab_size = 0;
  }
  if (options.max_value <= 0 && seq && !base.tokenizer.empty()) {
    std::ifstream in(config.data_path, std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    max_value = static_cast<int64_t>(Tokenizer::load(base.tokenizer).encode(text).size()) - 2;  // tokens, not bytes
  }
  auto config_at = [&](int64_t v, int64_t budget) {
    TrainConfig c = base;
    (seq ? c.seq_len : width ? c.d_model : c.batch) = v;
    c.save_path.clear();
    if (c.checkpoint == Strategy::kAuto) {
      c.memory_budget_bytes = budget;
      c.memory_budget_whole_step = width;  // the planner's budget is then the cap on all tracked memory
    }
    return c;
  };
  // The figure under the cap: the peak above the step's start, or for the
  // width the whole step's (the parameters grow with it too).
  auto capped = [&](const StepPrediction& p) { return width ? p.whole_peak_bytes : p.peak_bytes; };
  std::map<int64_t, StepPrediction> predicted;
  std::map<int64_t, int64_t> measured, measured_start;
  std::set<int64_t> no_plan;   // kAuto: values where no plan meets the cap (nothing measured)
  std::vector<FitProbe> made;  // every prediction, in order (FitResult::probes)
  // kOffload's "prediction" is a measured step (predict_step): the search
  // then measures, and verification reuses those steps.
  const bool by_measurement = config.checkpoint == Strategy::kOffload;
  auto predict = [&](int64_t v) {
    if (auto it = predicted.find(v); it != predicted.end()) return it->second;
    Trainer t(config_at(v, options.cap_bytes));
    const StepPrediction p = t.predict_step(options.cap_bytes);
    if (log) {
      *log << (by_measurement ? "  measure " : "  predict ") << what << " " << v << ": "
           << (width ? "whole-step peak " : "peak ") << format_bytes(capped(p))
           << (width ? " (" + count(p.parameters) + " parameters)" : std::string())
           << (capped(p) <= options.cap_bytes ? " (fits)" : " (over)") << std::endl;
    }
    if (by_measurement) measured.emplace(v, p.peak_bytes);
    made.push_back({v, capped(p)});  // the search's and the verification's, in order
    return predicted.emplace(v, p).first->second;
  };
  auto measure = [&](int64_t v) {
    if (auto it = measured.find(v); it != measured.end()) return it->second;
    const StepPrediction& p = predict(v);
    if (config.checkpoint == Strategy::kAuto && capped(p) > options.cap_bytes) {
      // No auto plan meets the cap here (a run would refuse it): over, by the leanest plan's peak.
      if (log) {
        *log << "  measure " << what << " " << v << ": no auto plan fits (its leanest plan is predicted to peak at "
             << format_bytes(capped(p)) << "; not measured)" << std::endl;
      }
      measured.emplace(v, capped(p));
      no_plan.insert(v);
      return capped(p);
    }
    Trainer t(config_at(v, p.auto_budget_bytes));
    t.prepare();
    // The whole step counts the optimizer's state, which the first update
    // creates (auto's warm-up step has made it already).
    if (width && config.checkpoint != Strategy::kAuto) t.step();
    const StepStats s = t.step();
    const int64_t peak = width ? s.whole_peak_bytes : s.peak_bytes;
    if (log) {
      *log << "  measure " << what << " " << v << ": " << (width ? "whole-step peak " : "peak ") << format_bytes(peak)
           << (peak <= options.cap_bytes ? " (fits)" : " (over)") << std::endl;
    }
    measured.emplace(v, peak);
    measured_start.emplace(v, s.start_bytes);
    return peak;
  };
  auto too_small = [&](int64_t peak, const char* how) {
    if (width) {
      std::string more;
      if (!config.optimizer_in_backward && config.clip_norm <= 0.0) more += ", add --optimizer-in-backward";
      if (config.optimizer != "sgd" && config.optimizer_state != "disk") {
        more += config.optimizer_in_backward ? ", add --optimizer-state disk" : " (then --optimizer-state disk)";
      }
      if (config.checkpoint != Strategy::kAuto) more += ", or use --checkpoint auto";
      return Error("[remat::train] --max-d-model-under " + format_bytes(options.cap_bytes) + ": even --d-model " +
                   str(step) + " " + how + " at " + format_bytes(peak) +
                   " for the whole step (parameters, gradients, optimizer state, activations) with --checkpoint " +
                   std::string(to_string(config.checkpoint)) +
                   ". Raise the cap, lower --layers, --batch or --seq-len, or --fit-step or --heads" + more + ".");
    }
    const std::string more = config.checkpoint == Strategy::kAuto    ? ""
                             : config.checkpoint == Strategy::kBlock ? ", or use --checkpoint auto"
                                                                     : ", or use --checkpoint block or auto";
    return Error("[remat::train] " + flag + " " + format_bytes(options.cap_bytes) + ": even " + what + " " + str(step) +
                 " " + how + " at " + format_bytes(peak) + " with --checkpoint " +
                 std::string(to_string(config.checkpoint)) + ". Raise the cap, lower " +
                 (seq ? "--batch" : "--seq-len") + ", --d-model or --layers" + more + ".");
  };

  FitResult r;
  r.dimension = dim;
  r.cap_bytes = options.cap_bytes;
  r.step = step;
  r.value = largest_fitting(
      options.cap_bytes, step, max_value, [&](int64_t v) { return capped(predict(v)); }, nullptr);
  if (r.value == 0) throw too_small(capped(predict(step)), by_measurement ? "measures a peak" : "is predicted to peak");
  r.predicted_value = r.value;
  if (options.verify) {
    r.measured_peak_bytes = measure(r.value);
    while (r.measured_peak_bytes > options.cap_bytes) {
      if (r.value <= step) throw too_small(r.measured_peak_bytes, "measures a peak");
      r.value -= step;
      r.measured_peak_bytes = measure(r.value);
    }
  }
  // A conservative prediction leaves room the measurement shows: step up
  // while answer + step measures under the cap too (a few times at most).
  int ups = 0;
  const bool stepped_down = r.value < r.predicted_value;  // then answer + step measured over already
  while (r.value + step <= max_value) {
    r.next_value = r.value + step;
    r.next_predicted_peak_bytes = capped(predict(r.next_value));
    if (!options.verify) break;
    r.next_measured_peak_bytes = measure(r.next_value);
    if (r.next_measured_peak_bytes > options.cap_bytes || ups == kFitMaxStepsUp || stepped_down) break;
    ++ups;
    r.value = r.next_value;
    r.measured_peak_bytes = r.next_measured_peak_bytes;
    r.next_value = 0;
    r.next_measured_peak_bytes = -1;
  }
  r.at_max_value = r.value + step > max_value;
  if (r.at_max_value) r.next_value = 0;
  r.next_no_plan = r.next_value > 0 && no_plan.count(r.next_value) > 0;
  const StepPrediction& at = predict(r.value);
  r.predicted_peak_bytes = capped(at);
  r.auto_budget_bytes = at.auto_budget_bytes;
  r.fixed_bytes = at.fixed_bytes;
  if (width) {
    r.parameters = at.parameters;
    if (r.next_value > 0) r.next_parameters = predict(r.next_value).parameters;
    if (auto it = measured_start.find(r.value); it != measured_start.end()) r.start_bytes = it->second;
  }
  r.probes = std::move(made);
  return r;
}

std::string format_fit(const FitResult& r, const TrainConfig& config) {
  const bool seq = r.dimension == FitDimension::kSeqLen;
  const bool width = r.dimension == FitDimension::kDModel;
  const char* what = seq ? "seq_len" : width ? "d_model" : "batch";
  std::ostringstream os;
  const bool by_measurement = config.checkpoint == Strategy::kOffload;  // the "prediction" is a measurement
  auto peaks = [&](int64_t v, int64_t predicted, int64_t measured, int64_t parameters, bool no_plan = false) {
    os << "  " << what << " " << v << ": ";
    if (width) os << parameters << " parameters (" << count(parameters) << "), whole-step ";
    if (by_measurement) os << "measured peak " << format_bytes(measured >= 0 ? measured : predicted);
    else os << "predicted peak " << format_bytes(predicted);
    if (no_plan) os << ", no auto plan fits it (a run would refuse it; not measured)";
    else if (measured >= 0 && !by_measurement) os << ", measured " << format_bytes(measured);
    os << ((measured >= 0 ? measured : predicted) <= r.cap_bytes ? " (fits)" : " (over)") << "\n";
  };
  os << "max " << what << " under " << format_bytes(r.cap_bytes) << " with checkpoint " << to_string(config.checkpoint)
     << ": " << r.value;
  if (r.at_max_value)
    os << " (the largest tried: the " << (seq ? "data's length" : "search's limit") << ", not the cap)";
  if (r.value < r.predicted_value) os << " (predicted " << r.predicted_value << ", stepped down by measurement)";
  if (r.value > r.predicted_value) os << " (predicted " << r.predicted_value << ", stepped up by measurement)";
  os << "\n";
  peaks(r.value, r.predicted_peak_bytes, r.measured_peak_bytes, r.parameters);
  if (r.next_value > 0)
    peaks(r.next_value, r.next_predicted_peak_bytes, r.next_measured_peak_bytes, r.next_parameters, r.next_no_plan);
  if (width) {
    if (config.checkpoint == Strategy::kAuto)
      os << "  auto's budget (the whole step, all tracked memory): " << format_bytes(r.auto_budget_bytes) << "\n";
    os << "  " << r.probes.size() << " predictions, widths in steps of " << r.step
       << " (a multiple of --heads); the cap is on the whole step: every tracked byte at its peak, the "
          "parameters, their gradients"
       << (config.optimizer_in_backward ? " (each freed by its update in backward)" : "")
       << (config.optimizer == "sgd"          ? ""
           : config.optimizer_state == "disk" ? ", the AdamW moments read back from disk (not those on disk)"
           : config.optimizer_state == "bf16" ? ", the AdamW moments (as bfloat16)"
           : config.optimizer_state == "int8" ? ", the AdamW moments (as 8-bit codes in blocks)"
                                              : ", the AdamW moments")
       << ", the data, and the activations, logits and temporaries";
    if (r.start_bytes >= 0 && r.measured_peak_bytes >= 0) {
      os << "; at d_model " << r.value << ", " << format_bytes(r.start_bytes) << " live at the step's start, "
         << format_bytes(r.measured_peak_bytes - r.start_bytes) << " above it";
    }
    os << " (parameters, gradients and AdamW moments all in memory would be " << format_bytes(r.fixed_bytes) << ")\n";
    return os.str();
  }
  if (config.checkpoint == Strategy::kAuto)
    os << "  auto's budget (the whole step, above its start): " << format_bytes(r.auto_budget_bytes) << "\n";
  os << "  " << r.probes.size()
     << (by_measurement ? " measured steps (offload is searched by measurement)" : " predictions")
     << "; the cap is on the step's peak above its start (activations, "
     << "activation gradients, logits, temporaries); parameters, gradients and AdamW moments add "
     << format_bytes(r.fixed_bytes) << " outside it\n";
  return os.str();
}

}  // namespace remat::models
