// What fits under a memory cap (remat::models::max_under): the search on
// synthetic monotone peaks against brute force, then on a tiny GPT per
// strategy: the answer measured fits, the next value is predicted over the
// cap, prepare() makes step 1 measure what step 2 does; the widest d_model
// whose whole step (parameters, gradients, optimizer state) fits, and what
// the levers change there; the error messages.
// Leaves out: the reference-size figures (bench/py/what_fits.py).
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <remat/error.h>
#include <remat/models/trainer.h>

namespace rm = remat::models;
using rm::Strategy;

namespace {

rm::TrainConfig tiny_gpt(Strategy s) {
  rm::TrainConfig c;
  c.layers = 3;
  c.d_model = 32;
  c.heads = 2;
  c.batch = 2;
  c.seed = 7;
  c.checkpoint = s;
  c.memory_budget_bytes = 1 << 30;  // auto: replaced by the search's budget
  c.threads = 1;
  return c;
}

/** Brute force: the largest multiple of step <= max_value with peak <= cap (0: none). */
int64_t brute(int64_t cap, int64_t step, int64_t max_value, const std::function<int64_t(int64_t)>& peak) {
  int64_t best = 0;
  for (int64_t v = step; v <= max_value; v += step) {
    if (peak(v) <= cap) best = v;
  }
  return best;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const remat::Error& e) {
    return e.what();
  }
  return "(no error)";
}

std::pair<int, std::string> run_cli(const std::string& args) {
  const auto out =
      (std::filesystem::temp_directory_path() / ("remat_fits_cli_" + std::to_string(::getpid()) + ".txt")).string();
  const int status = std::system((std::string(REMAT_TRAIN_EXE) + " " + args + " >" + out + " 2>&1").c_str());
  std::ifstream in(out);
  std::stringstream ss;
  ss << in.rdbuf();
  std::filesystem::remove(out);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, ss.str()};
}

}  // namespace

TEST(Fits, LargestFittingMatchesBruteForce) {
  // Shapes a step's peak takes: linear (batch), quadratic (attention), with
  // a constant, and a piecewise one whose growth changes (a schedule switch).
  const std::vector<std::function<int64_t(int64_t)>> peaks = {
      [](int64_t v) { return 1000 + 37 * v; }, [](int64_t v) { return 5000 + 90 * v + 3 * v * v; },
      [](int64_t v) { return v < 300 ? 64 * v : 64 * 300 + 7 * (v - 300) * (v - 300); },
      [](int64_t v) { return (v / 16) * 1000; },  // plateaus: ties at the cap
  };
  int cases = 0;
  for (size_t f = 0; f < peaks.size(); ++f) {
    for (int64_t step : {1, 8}) {
      for (int64_t cap = 900; cap < 4'000'000; cap = cap * 3 / 2 + 7) {
        std::vector<rm::FitProbe> probes;
        int calls = 0;
        auto counted = [&](int64_t v) {
          ++calls;
          return peaks[f](v);
        };
        const int64_t got = rm::largest_fitting(cap, step, 20000, counted, &probes);
        ASSERT_EQ(got, brute(cap, step, 20000, peaks[f])) << "peak " << f << " step " << step << " cap " << cap;
        EXPECT_EQ(static_cast<int>(probes.size()), calls);  // each value predicted once
        EXPECT_LE(calls, 60) << "peak " << f << " cap " << cap;
        ++cases;
      }
    }
  }
  std::cout << cases << " (peak, step, cap) cases equal to brute force\n";
}

TEST(Fits, LargestFittingEdges) {
  auto linear = [](int64_t v) { return 100 * v; };
  EXPECT_EQ(rm::largest_fitting(99, 1, 1000, linear), 0);          // even the smallest is over
  EXPECT_EQ(rm::largest_fitting(100, 1, 1000, linear), 1);         // at the cap counts as fitting
  EXPECT_EQ(rm::largest_fitting(1 << 30, 4, 1000, linear), 1000);  // the limit, not the cap
  EXPECT_EQ(rm::largest_fitting(1 << 30, 64, 100, linear), 64);
  EXPECT_EQ(rm::largest_fitting(1 << 30, 200, 100, linear), 0);
  // An exact quadratic: the guess lands on the answer; few probes beyond the gallop.
  std::vector<rm::FitProbe> probes;
  EXPECT_EQ(rm::largest_fitting(
                1'000'000, 1, 100000, [](int64_t v) { return 17 * v * v + 5 * v; }, &probes),
            brute(1'000'000, 1, 1000, [](int64_t v) { return 17 * v * v + 5 * v; }));
  EXPECT_LE(probes.size(), 14u);
  EXPECT_EQ(error_of([] { rm::largest_fitting(1, 0, 10, [](int64_t) { return int64_t{0}; }); }),
            "[remat::train] the search step must be >= 1, got 0.");
}

TEST(Fits, PrepareMakesStepOneMeasureTheSteadyState) {
  for (Strategy s : {Strategy::kNone, Strategy::kBlock, Strategy::kAuto}) {
    rm::TrainConfig c = tiny_gpt(s);
    c.memory_budget_bytes = 2 << 20;
    rm::Trainer t(c);
    t.prepare();
    const int64_t first = t.step().peak_bytes, second = t.step().peak_bytes;
    if (s != Strategy::kNone) {
      // From step 2 on the baseline holds the previous step's RNG state
      // (5056 bytes, kept for recompute): step 1 measures that much more.
      EXPECT_GE(first, second);
      EXPECT_LE(first - second, 8 << 10);
    } else {
      EXPECT_EQ(first, second) << rm::to_string(s);
    }
  }
}

TEST(Fits, PredictionMatchesMeasurementAtAFixedLength) {
  // The model (profiled chain + simulator) against one measured step, per
  // strategy, at seq_len 160: within 2%. (auto was allowed 4%: its runtime
  // kept the head's dense loss gradient through the last block's backward.)
  for (Strategy s : {Strategy::kNone, Strategy::kBlock, Strategy::kSqrt, Strategy::kSelective, Strategy::kAuto}) {
    rm::TrainConfig c = tiny_gpt(s);
    c.seq_len = 160;
    c.memory_budget_bytes = 2 << 20;
    rm::Trainer t(c);
    const rm::StepPrediction p = t.predict_step();
    t.prepare();
    const int64_t measured = t.step().peak_bytes;
    std::cout << rm::to_string(s) << ": predicted " << p.peak_bytes << " B, measured " << measured << " B\n";
    EXPECT_NEAR(static_cast<double>(p.peak_bytes), static_cast<double>(measured), 0.02 * static_cast<double>(measured))
        << rm::to_string(s);
    EXPECT_EQ(p.auto_budget_bytes, s == Strategy::kAuto ? 2 << 20 : 0);
  }
}

TEST(Fits, MaxSeqLenFitsWhenMeasuredPerStrategy) {
  const int64_t cap = 3 << 20;  // 3 MiB: seq_len in the hundreds for this model
  for (Strategy s : {Strategy::kNone, Strategy::kBlock, Strategy::kSqrt, Strategy::kSelective, Strategy::kAuto}) {
    const rm::TrainConfig c = tiny_gpt(s);
    rm::FitOptions o;
    o.cap_bytes = cap;
    o.step = 8;
    const rm::FitResult r = rm::max_under(c, o);
    std::cout << rm::format_fit(r, c);
    EXPECT_GT(r.value, 0) << rm::to_string(s);
    EXPECT_EQ(r.value % 8, 0);
    EXPECT_LE(r.measured_peak_bytes, cap) << rm::to_string(s);  // the answer fits, measured
    // ... as predicted, to 1% of the cap: auto's run may plan on its own
    // profile (other times), but only under the predicted plan's peak.
    EXPECT_LE(r.measured_peak_bytes, r.predicted_peak_bytes + cap / 100) << rm::to_string(s);
    if (s == Strategy::kAuto) {
      EXPECT_EQ(r.auto_budget_bytes, cap);  // the run's budget is the cap (both above the step's start)
    }
    EXPECT_EQ(r.next_value, r.value + 8);
    if (r.value == r.predicted_value) {
      EXPECT_LE(r.predicted_peak_bytes, cap);
      EXPECT_GT(r.next_predicted_peak_bytes, cap);  // the next one up does not, by prediction
    }
    // ... and by measurement, unless the step-ups ran out.
    if (r.value - r.predicted_value < rm::kFitMaxStepsUp * 8) {
      EXPECT_GT(r.next_measured_peak_bytes, cap);
    }
    EXPECT_LE(std::abs(r.value - r.predicted_value), 2 * 8) << rm::to_string(s);  // the prediction is close
    EXPECT_FALSE(r.at_max_value);
    EXPECT_EQ(r.auto_budget_bytes > 0, s == Strategy::kAuto);
    EXPECT_GT(r.fixed_bytes, 0);
  }
}

TEST(Fits, ResNetAutoMaxBatchFitsWhenMeasured) {
  rm::TrainConfig c;
  c.model = "resnet";
  c.layers = 10;
  c.d_model = 8;
  c.image_size = 16;
  c.threads = 1;
  c.checkpoint = Strategy::kAuto;
  c.memory_budget_bytes = 4 << 20;
  rm::FitOptions o;
  o.dimension = rm::FitDimension::kBatch;
  o.cap_bytes = 4 << 20;
  o.step = 4;
  o.max_value = 256;
  const rm::FitResult r = rm::max_under(c, o);
  std::cout << rm::format_fit(r, c);
  EXPECT_GT(r.value, 0);
  EXPECT_LE(r.measured_peak_bytes, o.cap_bytes);
  EXPECT_LE(r.predicted_peak_bytes, o.cap_bytes);
  EXPECT_EQ(r.auto_budget_bytes, o.cap_bytes);
  EXPECT_LE(std::abs(r.value - r.predicted_value), 2 * 4);
}

// Offload is not modeled (its bytes in flight follow the disk): every probe
// of the search is a measured step, so the answer and answer + step are
// measured, on both sides of the cap, with no step-up or step-down.
TEST(Fits, OffloadIsSearchedByMeasurement) {
  rm::TrainConfig c = tiny_gpt(Strategy::kOffload);
  const auto dir = std::filesystem::temp_directory_path() / ("remat_fits_offload_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  c.offload_dir = dir.string();
  rm::FitOptions o;
  o.cap_bytes = 3 << 20;
  o.step = 8;
  std::ostringstream log;
  const rm::FitResult r = rm::max_under(c, o, &log);
  std::cout << log.str() << rm::format_fit(r, c);
  EXPECT_GT(r.value, 0);
  EXPECT_EQ(r.value, r.predicted_value);
  EXPECT_LE(r.measured_peak_bytes, o.cap_bytes);
  EXPECT_EQ(r.predicted_peak_bytes, r.measured_peak_bytes);  // the "prediction" is that measurement
  EXPECT_EQ(r.next_value, r.value + 8);
  EXPECT_GT(r.next_measured_peak_bytes, o.cap_bytes);
  EXPECT_EQ(log.str().find("  predict "), std::string::npos) << log.str();
  EXPECT_NE(log.str().find("  measure --seq-len 8: peak "), std::string::npos) << log.str();
  const std::string fit = rm::format_fit(r, c);
  EXPECT_NE(fit.find(" measured steps (offload is searched by measurement)"), std::string::npos) << fit;
  EXPECT_NE(fit.find("  seq_len " + std::to_string(r.value) + ": measured peak "), std::string::npos) << fit;
  EXPECT_EQ(fit.find("predicted"), std::string::npos) << fit;
  EXPECT_GT(r.fixed_bytes, 0);
  EXPECT_TRUE(std::filesystem::is_empty(dir));  // no file outlives its step
  std::filesystem::remove_all(dir);
}

TEST(Fits, MaxBatchFitsWhenMeasured) {
  rm::TrainConfig c = tiny_gpt(Strategy::kBlock);
  c.seq_len = 64;
  rm::FitOptions o;
  o.cap_bytes = 4 << 20;
  o.dimension = rm::FitDimension::kBatch;
  const rm::FitResult r = rm::max_under(c, o);
  std::cout << rm::format_fit(r, c);
  EXPECT_GT(r.value, 1);
  EXPECT_LE(r.measured_peak_bytes, o.cap_bytes);
  EXPECT_GT(r.next_measured_peak_bytes, o.cap_bytes);
  if (r.value == r.predicted_value) {
    EXPECT_GT(r.next_predicted_peak_bytes, o.cap_bytes);
  }
}

TEST(Fits, Errors) {
  rm::FitOptions o;
  o.cap_bytes = 1 << 10;
  // The peak's figure follows the profiler's byte accounting; the rest is pinned.
  auto pinned = [](const std::string& got, const std::string& head, const std::string& tail) {
    EXPECT_EQ(got.substr(0, head.size()), head) << got;
    ASSERT_GE(got.size(), tail.size()) << got;
    EXPECT_EQ(got.substr(got.size() - tail.size()), tail) << got;
    EXPECT_NE(got.find(" KiB with --checkpoint"), std::string::npos) << got;
  };
  pinned(error_of([&] { rm::max_under(tiny_gpt(Strategy::kNone), o); }),
         "[remat::train] --max-seq-len-under 1.00 KiB: even --seq-len 1 is predicted to peak at ",
         " with --checkpoint none. Raise the cap, lower --batch, --d-model or --layers, or use --checkpoint block or "
         "auto.");
  o.dimension = rm::FitDimension::kBatch;
  pinned(error_of([&] { rm::max_under(tiny_gpt(Strategy::kAuto), o); }),
         "[remat::train] --max-batch-under 1.00 KiB: even --batch 1 is predicted to peak at ",
         " with --checkpoint auto. Raise the cap, lower --seq-len, --d-model or --layers.");
  o.cap_bytes = 0;
  EXPECT_EQ(error_of([&] { rm::max_under(tiny_gpt(Strategy::kNone), o); }),
            "[remat::train] --max-batch-under must be a positive size (e.g. 1GiB), got 0 bytes.");
  o.cap_bytes = 1 << 20;
  o.step = 0;
  EXPECT_EQ(error_of([&] { rm::max_under(tiny_gpt(Strategy::kNone), o); }),
            "[remat::train] --fit-step must be >= 1, got 0.");
  o.step = 1;
  rm::TrainConfig resnet;
  resnet.model = "resnet";
  EXPECT_EQ(error_of([&] { rm::max_under(resnet, o); }),
            "[remat::train] --max-batch-under needs --model gpt (it profiles the GPT's embed -> blocks -> head "
            "chain), or for the ResNet --max-batch-under with --checkpoint auto; got --model resnet. Otherwise "
            "measure with remat-train --batch N and read the 'peak' column.");
  resnet.checkpoint = Strategy::kAuto;
  resnet.memory_budget_bytes = 1 << 20;
  o.dimension = rm::FitDimension::kSeqLen;
  EXPECT_EQ(error_of([&] { rm::max_under(resnet, o); }),
            "[remat::train] --max-seq-len-under needs --model gpt (it profiles the GPT's embed -> blocks -> head "
            "chain), or for the ResNet --max-batch-under with --checkpoint auto; got --model resnet. Otherwise "
            "measure with remat-train --batch N and read the 'peak' column.");
  o.dimension = rm::FitDimension::kBatch;
  rm::TrainConfig resumed = tiny_gpt(Strategy::kNone);
  resumed.resume_path = "/tmp/x.pt";
  EXPECT_EQ(error_of([&] { rm::max_under(resumed, o); }),
            "[remat::train] --max-batch-under trains fresh models, one per value it tries; drop --resume /tmp/x.pt.");
  rm::TrainConfig saving = tiny_gpt(Strategy::kNone);
  saving.save_path = "/tmp/x.pt";  // it wrote nothing and said nothing
  EXPECT_EQ(error_of([&] { rm::max_under(saving, o); }),
            "[remat::train] --max-batch-under trains fresh models, one per value it tries, and keeps none; drop "
            "--save /tmp/x.pt (train at the value it finds, with --save, afterwards).");
  rm::TrainConfig resnet_block;
  resnet_block.model = "resnet";
  resnet_block.checkpoint = Strategy::kBlock;
  resnet_block.threads = 1;
  EXPECT_EQ(error_of([&] { rm::Trainer(resnet_block).predict_step(); }),
            "[remat::train] predicting a step's peak needs the GPT (its embed -> blocks -> head chain) or "
            "--checkpoint auto; got --model resnet. Use --model gpt or --checkpoint auto, or measure ResNet steps "
            "with remat-train --batch N (the 'peak' column).");
  rm::TrainConfig attention = tiny_gpt(Strategy::kSelective);
  attention.policy = "attention";
  EXPECT_EQ(error_of([&] { rm::Trainer(attention).predict_step(); }),
            "[remat::train] predicting a step's peak models op policies only, not --policy attention (a module "
            "switch); use --policy megatron, save_matmuls or save_nothing.");
}

TEST(Fits, CliErrors) {
  const std::string model = "--layers 2 --d-model 32 --heads 2 --threads 1 ";
  auto [rc, out] = run_cli(model + "--max-seq-len-under 2XB");
  EXPECT_EQ(rc, 2);
  EXPECT_NE(out.find("remat-train: error: [remat::train] --max-seq-len-under: [remat::plan] bytes: cannot parse "
                     "\"2XB\"; expected a size like 536870912, 512MiB, 2GiB or 1.5GB."),
            std::string::npos)
      << out;
  std::tie(rc, out) = run_cli(model + "--max-seq-len-under 1GiB --max-batch-under 1GiB");
  EXPECT_EQ(rc, 2);
  EXPECT_NE(out.find("remat-train: error: [remat::train] give one of --max-seq-len-under, --max-batch-under and "
                     "--max-d-model-under (the other values stay fixed); got --max-seq-len-under 1GiB and "
                     "--max-batch-under 1GiB. Run one search at a time."),
            std::string::npos)
      << out;
  std::tie(rc, out) = run_cli(model + "--checkpoint auto --memory-budget 1MiB --max-seq-len-under 1GiB");
  EXPECT_EQ(rc, 2);
  EXPECT_NE(out.find("remat-train: error: [remat::train] --memory-budget is chosen by --max-*-under"),
            std::string::npos)
      << out;
  std::tie(rc, out) = run_cli("--model resnet --max-batch-under 1GiB --threads 1");
  EXPECT_EQ(rc, 2);
  EXPECT_NE(out.find("remat-train: error: [remat::train] --max-batch-under needs --model gpt"), std::string::npos)
      << out;
  std::tie(rc, out) = run_cli(model + "--max-seq-len-under 1KiB");
  EXPECT_EQ(rc, 2);
  EXPECT_NE(out.find("remat-train: error: [remat::train] --max-seq-len-under 1.00 KiB: even --seq-len 1 is predicted"),
            std::string::npos)
      << out;
  // A success prints the answer and both peaks.
  std::tie(rc, out) = run_cli(model + "--checkpoint block --max-seq-len-under 2MiB --fit-step 16");
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("max seq_len under 2.00 MiB with checkpoint block: "), std::string::npos) << out;
  EXPECT_NE(out.find(", measured "), std::string::npos) << out;
}

namespace {

/** A GPT whose whole step is mostly parameters, gradients and AdamW state
 *  (short sequences), so that the width's search is about them. */
rm::TrainConfig narrow_gpt(Strategy s) {
  rm::TrainConfig c = tiny_gpt(s);
  c.layers = 2;
  c.seq_len = 32;
  return c;
}

/** The steady-state step of c (its second: the optimizer's state exists). */
rm::StepStats steady_step(const rm::TrainConfig& c) {
  rm::Trainer t(c);
  t.prepare();
  t.step();
  return t.step();
}

rm::FitOptions width_cap(int64_t cap_bytes) {
  rm::FitOptions o;
  o.dimension = rm::FitDimension::kDModel;
  o.cap_bytes = cap_bytes;
  o.step = 16;
  return o;
}

}  // namespace

// The whole step's figure counts every tracked byte: AdamW's two moments add
// twice the parameters' bytes to SGD's (which keeps no state), at the step's
// start and at its peak; the peak holds parameters, gradients and moments.
TEST(FitsDModel, WholeStepPeakCountsParametersGradientsAndAdamW) {
  rm::TrainConfig adamw = narrow_gpt(Strategy::kNone);
  adamw.d_model = 64;
  rm::TrainConfig sgd = adamw;
  sgd.optimizer = "sgd";
  // Scoped: the figures are the whole process's, and a Trainer left alive would count.
  const rm::StepPrediction p = rm::Trainer(adamw).predict_step();
  const int64_t params = 4 * p.parameters;  // float32
  const rm::StepStats a = steady_step(adamw), s = steady_step(sgd);
  std::cout << "parameters " << params << " B; whole-step peak adamw " << a.whole_peak_bytes << " B (start "
            << a.start_bytes << "), sgd " << s.whole_peak_bytes << " B (start " << s.start_bytes << ")\n";
  EXPECT_GE(a.start_bytes, 4 * params);              // parameters, gradients, two moments
  EXPECT_LT(a.start_bytes, 4 * params + (1 << 20));  // ... and the data, little else
  EXPECT_NEAR(static_cast<double>(a.start_bytes - s.start_bytes), 2.0 * static_cast<double>(params), 1024.0);
  EXPECT_NEAR(static_cast<double>(a.whole_peak_bytes - s.whole_peak_bytes), 2.0 * static_cast<double>(params),
              0.02 * static_cast<double>(params));
  EXPECT_GE(a.whole_peak_bytes - a.start_bytes, a.peak_bytes);  // the step's own peak is inside it
  // The prediction counts the same parts.
  EXPECT_EQ(p.fixed_bytes, 4 * params);
  EXPECT_GE(p.start_bytes, 4 * params);
  EXPECT_NEAR(static_cast<double>(p.whole_peak_bytes), static_cast<double>(a.whole_peak_bytes),
              0.05 * static_cast<double>(a.whole_peak_bytes));
}

TEST(FitsDModel, MaxDModelFitsTheWholeStepPerStrategy) {
  const int64_t cap = 4 << 20;  // 4 MiB: d_model about 100 for this model
  for (Strategy s : {Strategy::kNone, Strategy::kBlock, Strategy::kAuto}) {
    const rm::TrainConfig c = narrow_gpt(s);
    std::ostringstream log;
    const rm::FitResult r = rm::max_under(c, width_cap(cap), &log);
    std::cout << log.str() << rm::format_fit(r, c);
    EXPECT_GT(r.value, 0) << rm::to_string(s);
    EXPECT_EQ(r.step, 16);
    EXPECT_EQ(r.value % 16, 0);
    EXPECT_EQ(r.value % c.heads, 0);
    EXPECT_LE(r.measured_peak_bytes, cap) << rm::to_string(s);  // the answer fits, measured
    EXPECT_EQ(r.next_value, r.value + 16);
    if (r.value - r.predicted_value < rm::kFitMaxStepsUp * 16) {
      EXPECT_GT(r.next_measured_peak_bytes, cap) << rm::to_string(s);  // the next width does not
    }
    EXPECT_LE(std::abs(r.value - r.predicted_value), 2 * 16) << rm::to_string(s);  // the prediction is close
    // Parameters, gradients and both moments are inside the measured figure:
    // 16 bytes a parameter, at the step's start already.
    EXPECT_GT(r.parameters, 0);
    EXPECT_GT(r.next_parameters, r.parameters);
    EXPECT_GE(r.start_bytes, 16 * r.parameters) << rm::to_string(s);
    EXPECT_GT(r.measured_peak_bytes, r.start_bytes);
    EXPECT_EQ(r.fixed_bytes, 16 * r.parameters);
    EXPECT_EQ(r.auto_budget_bytes, s == Strategy::kAuto ? cap : 0);  // auto plans for the cap on all tracked memory
    const std::string fit = rm::format_fit(r, c);
    EXPECT_NE(fit.find("max d_model under 4.00 MiB with checkpoint " + std::string(rm::to_string(s)) + ": "),
              std::string::npos)
        << fit;
    EXPECT_NE(fit.find("the cap is on the whole step: every tracked byte at its peak"), std::string::npos) << fit;
    EXPECT_NE(fit.find("), whole-step predicted peak "), std::string::npos) << fit;
    EXPECT_NE(log.str().find("  measure --d-model "), std::string::npos) << log.str();
    // auto: a width no plan fits is not run, and the answer says so.
    EXPECT_EQ(fit.find(", no auto plan fits it (a run would refuse it; not measured)") != std::string::npos,
              r.next_no_plan);
    if (s != Strategy::kAuto) {
      EXPECT_FALSE(r.next_no_plan);
    }
    // The summary counts every prediction the log shows, the verification's
    // too (it counted the search's only: "5 predictions" under 6 lines).
    size_t lines = 0;
    for (size_t at = log.str().find("  predict --d-model "); at != std::string::npos;
         at = log.str().find("  predict --d-model ", at + 1)) {
      ++lines;
    }
    EXPECT_EQ(r.probes.size(), lines) << log.str();
    EXPECT_NE(fit.find("  " + std::to_string(lines) + " predictions, widths in steps of 16"), std::string::npos) << fit;
    if (r.next_no_plan) {  // the line that skips the measurement gives the prediction that skips it
      EXPECT_NE(log.str().find(": no auto plan fits (its leanest plan is predicted to peak at "), std::string::npos)
          << log.str();
    }
  }
}

// The levers move bytes out of the whole step: with the optimizer in
// backward the gradients never all live; with the state on disk the moments
// are not in memory between updates (only those read back are). Each lets
// a wider model fit the same cap.
TEST(FitsDModel, OptimizerStateOnDiskFitsAWiderModel) {
  const auto dir = std::filesystem::temp_directory_path() / ("remat_fits_dmodel_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const int64_t cap = 8 << 20;  // d_model over 100: the parameters' share grows with the width
  rm::TrainConfig plain = narrow_gpt(Strategy::kNone);
  rm::TrainConfig in_backward = plain;
  in_backward.optimizer_in_backward = true;
  rm::TrainConfig disk = in_backward;
  disk.optimizer_state = "disk";
  disk.offload_dir = dir.string();
  const rm::FitResult p = rm::max_under(plain, width_cap(cap));
  const rm::FitResult ib = rm::max_under(in_backward, width_cap(cap));
  const rm::FitResult d = rm::max_under(disk, width_cap(cap));
  std::cout << rm::format_fit(p, plain) << rm::format_fit(ib, in_backward) << rm::format_fit(d, disk);
  EXPECT_GE(ib.value, p.value);  // no gradients between steps
  EXPECT_GT(d.value, ib.value);  // no moments in memory between updates
  EXPECT_GT(d.value, p.value);
  EXPECT_LE(d.measured_peak_bytes, cap);
  EXPECT_GT(d.next_measured_peak_bytes, cap);
  EXPECT_GE(d.start_bytes, 4 * d.parameters);  // the parameters stay in memory
  EXPECT_NE(rm::format_fit(d, disk).find("the AdamW moments read back from disk (not those on disk)"),
            std::string::npos);
  // At one width: the moments on disk are not counted between steps (the
  // start), and the step with them read back peaks lower than with them kept.
  plain.d_model = in_backward.d_model = disk.d_model = d.value;
  const rm::StepStats sp = steady_step(plain), si = steady_step(in_backward), sd = steady_step(disk);
  std::cout << "d_model " << d.value << ": start / whole-step peak, plain " << sp.start_bytes << " / "
            << sp.whole_peak_bytes << " B, in backward " << si.start_bytes << " / " << si.whole_peak_bytes
            << " B, state on disk " << sd.start_bytes << " / " << sd.whole_peak_bytes << " B\n";
  const int64_t params = 4 * d.parameters;
  EXPECT_NEAR(static_cast<double>(sp.start_bytes - si.start_bytes), static_cast<double>(params),
              0.01 * static_cast<double>(params));     // the gradients
  EXPECT_LT(sd.start_bytes, si.start_bytes - params);  // most of the 2x parameters of moments left memory
  EXPECT_LT(sd.whole_peak_bytes, si.whole_peak_bytes);
  EXPECT_LT(si.whole_peak_bytes, sp.whole_peak_bytes);
  std::filesystem::remove_all(dir);
}

TEST(FitsDModel, AutoWithEveryLeverFitsWiderThanPlain) {
  const auto dir = std::filesystem::temp_directory_path() / ("remat_fits_dmodel_auto_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const int64_t cap = 4 << 20;
  rm::TrainConfig c = narrow_gpt(Strategy::kAuto);
  c.optimizer_in_backward = true;
  c.optimizer_state = "disk";
  c.offload_dir = dir.string();
  c.loss_chunks = 4;
  std::ostringstream log;
  const rm::FitResult r = rm::max_under(c, width_cap(cap), &log);
  const rm::FitResult p = rm::max_under(narrow_gpt(Strategy::kNone), width_cap(cap));
  std::cout << log.str() << rm::format_fit(r, c);
  EXPECT_LE(r.measured_peak_bytes, cap);
  EXPECT_GT(r.value, p.value);
  EXPECT_EQ(r.auto_budget_bytes, cap);
  std::filesystem::remove_all(dir);
}

TEST(FitsDModel, Errors) {
  rm::FitOptions o = width_cap(1 << 10);
  const std::string got = error_of([&] { rm::max_under(narrow_gpt(Strategy::kNone), o); });
  const std::string head = "[remat::train] --max-d-model-under 1.00 KiB: even --d-model 16 is predicted to peak at ";
  const std::string tail =
      " for the whole step (parameters, gradients, optimizer state, activations) with --checkpoint none. Raise the "
      "cap, lower --layers, --batch or --seq-len, or --fit-step or --heads, add --optimizer-in-backward (then "
      "--optimizer-state disk), or use --checkpoint auto.";
  EXPECT_EQ(got.substr(0, head.size()), head) << got;
  ASSERT_GE(got.size(), tail.size()) << got;
  EXPECT_EQ(got.substr(got.size() - tail.size()), tail) << got;
  o.cap_bytes = 1 << 20;
  rm::TrainConfig resnet;
  resnet.model = "resnet";
  resnet.checkpoint = Strategy::kAuto;
  resnet.memory_budget_bytes = 1 << 20;
  EXPECT_EQ(error_of([&] { rm::max_under(resnet, o); }),
            "[remat::train] --max-d-model-under needs --model gpt (it searches the GPT's width, a multiple of "
            "--heads); got --model resnet. For a ResNet, measure base widths with remat-train --model resnet "
            "--d-model N and read the 'peak' column.");
  rm::TrainConfig resumed = narrow_gpt(Strategy::kNone);
  resumed.resume_path = "/tmp/x.pt";
  EXPECT_EQ(error_of([&] { rm::max_under(resumed, o); }),
            "[remat::train] --max-d-model-under trains fresh models, one per value it tries; drop --resume "
            "/tmp/x.pt.");
  rm::TrainConfig offload = narrow_gpt(Strategy::kOffload);
  offload.offload_dir = "/tmp";
  EXPECT_EQ(error_of([&] { rm::max_under(offload, o); }),
            "[remat::train] --max-d-model-under with --checkpoint offload: offload's bytes in flight follow the "
            "disk's pace and are not predicted for the whole step; use --checkpoint none, block, sqrt, selective "
            "or auto.");
  o.max_value = 8;
  EXPECT_EQ(error_of([&] { rm::max_under(narrow_gpt(Strategy::kNone), o); }),
            "[remat::train] --max-d-model-under: the smallest width tried, lcm(--fit-step 16, --heads 2) = 16, is "
            "above the search's limit 8. Lower --fit-step or --heads, or raise --fit-max.");
}

TEST(FitsDModel, CliErrorsAndAnswer) {
  const std::string model = "--layers 2 --heads 2 --seq-len 32 --batch 2 --threads 1 ";
  auto [rc, out] = run_cli(model + "--max-d-model-under 1KiB --fit-step 16");
  EXPECT_EQ(rc, 2);
  EXPECT_NE(out.find("remat-train: error: [remat::train] --max-d-model-under 1.00 KiB: even --d-model 16 is "
                     "predicted to peak at "),
            std::string::npos)
      << out;
  std::tie(rc, out) = run_cli(model + "--max-d-model-under 4MiB --max-batch-under 1GiB");
  EXPECT_EQ(rc, 2);
  EXPECT_NE(out.find("remat-train: error: [remat::train] give one of --max-seq-len-under, --max-batch-under and "
                     "--max-d-model-under (the other values stay fixed); got --max-batch-under 1GiB and "
                     "--max-d-model-under 4MiB. Run one search at a time."),
            std::string::npos)
      << out;
  std::tie(rc, out) = run_cli("--model resnet --max-d-model-under 1GiB --threads 1");
  EXPECT_EQ(rc, 2);
  EXPECT_NE(out.find("remat-train: error: [remat::train] --max-d-model-under needs --model gpt"), std::string::npos)
      << out;
  // Refused before anything is built: the checkpoint need not exist.
  std::tie(rc, out) = run_cli(model + "--max-d-model-under 4MiB --resume /nonexistent/ck.pt");
  EXPECT_EQ(rc, 2);
  EXPECT_NE(out.find("remat-train: error: [remat::train] --max-d-model-under trains fresh models, one per value it "
                     "tries; drop --resume /nonexistent/ck.pt."),
            std::string::npos)
      << out;
  // The default step is 64 (a multiple of --heads 2): the answer is one of them.
  std::tie(rc, out) = run_cli(model + "--max-d-model-under 8MiB");
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("max d_model under 8.00 MiB with checkpoint none: "), std::string::npos) << out;
  EXPECT_NE(out.find("widths in steps of 64"), std::string::npos) << out;
  EXPECT_NE(out.find("), whole-step predicted peak "), std::string::npos) << out;
}
