// remat_demo: trains a small GPT briefly under every checkpoint strategy from
// the same seed and prints peak activation memory, median step time, overhead
// against no checkpointing and the final loss (bitwise equal across
// strategies). Writes demo.csv, a PNG chart (scripts/plot_demo.py, if the
// venv's matplotlib is there) and one Chrome-trace memory timeline per
// strategy (last step; open in ui.perfetto.dev).
// Leaves out: GPU runs, statistical timing (one run, median of a few steps).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <remat/error.h>
#include <remat/memory.h>
#include <remat/models/trainer.h>

namespace fs = std::filesystem;
namespace rm = remat::models;

namespace {

struct Row {
  std::string name;
  int64_t peak_bytes = 0;  ///< max over timed steps of the peak above the step's start
  double step_ms = 0.0;    ///< median over timed steps
  double final_loss = 0.0;
  std::string trace_path;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

fs::path default_out_dir() {
  std::error_code ec;
  auto exe = fs::read_symlink("/proc/self/exe", ec);  // build/examples/remat_demo -> build/demo
  if (ec) return fs::current_path() / "remat_demo_out";
  return exe.parent_path().parent_path() / "demo";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"remat_demo: every checkpoint strategy on a small GPT, same seed"};
  rm::TrainConfig base;
  base.model = "gpt";
  base.layers = 8;
  base.d_model = 128;
  base.heads = 4;
  base.seq_len = 128;
  base.batch = 8;
  base.steps = 16;
  base.dropout = 0.1;
  base.lr = 1e-3;
  base.seed = 1337;
  base.threads = 1;  // one intra-op thread: steady timings on a small or busy machine
  std::string out_dir = default_out_dir().string();
  double auto_fraction = 0.5;
  app.add_option("--out", out_dir, "folder for demo.csv, demo.png and the traces")->capture_default_str();
  app.add_option("--steps", base.steps,
                 "steps per strategy (the first is warm-up, auto's second profiles, the last is traced)")
      ->capture_default_str();
  app.add_option("--layers", base.layers, "GPT blocks")->capture_default_str();
  app.add_option("--d-model", base.d_model, "GPT width")->capture_default_str();
  app.add_option("--seq-len", base.seq_len, "tokens per sequence")->capture_default_str();
  app.add_option("--batch", base.batch, "sequences per step")->capture_default_str();
  app.add_option("--threads", base.threads, "torch intra-op threads")->capture_default_str();
  app.add_option("--data", base.data_path, "training text")->capture_default_str();
  app.add_option("--auto-fraction", auto_fraction,
                 "auto's budget (the whole step's peak above its start) as a fraction of none's peak")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (base.steps < 4) {
    std::cerr << "remat_demo: error: --steps must be at least 4 (warm-up, auto's profiled step, timed, traced), got "
              << base.steps << "\n";
    return 2;
  }

  // Selective: every block switched on with an op policy (remat::enable_checkpointing).
  const std::vector<std::pair<rm::Strategy, std::string>> strategies = {{rm::Strategy::kNone, ""},
                                                                        {rm::Strategy::kBlock, ""},
                                                                        {rm::Strategy::kSqrt, ""},
                                                                        {rm::Strategy::kSelective, "megatron"},
                                                                        {rm::Strategy::kSelective, "save_matmuls"},
                                                                        {rm::Strategy::kAuto, ""}};
  std::vector<Row> rows;
  try {
    fs::create_directories(out_dir);
    for (const auto& [s, policy] : strategies) {
      auto cfg = base;
      cfg.checkpoint = s;
      if (!policy.empty()) cfg.policy = policy;
      Row row{std::string(rm::to_string(s)) + (policy.empty() ? "" : " " + policy)};
      if (s == rm::Strategy::kAuto) {
        cfg.memory_budget_bytes = static_cast<int64_t>(auto_fraction * static_cast<double>(rows.front().peak_bytes));
        row.name += " (" + remat::format_bytes(cfg.memory_budget_bytes) + ")";
      }
      rm::Trainer trainer(cfg);
      if (s == rm::Strategy::kNone) std::cout << trainer.summary() << "\n\n";
      std::cout << "training with checkpoint " << row.name << " ..." << std::flush;
      std::vector<double> times_ms;
      for (int64_t i = 0; i < cfg.steps; ++i) {
        rm::StepStats st;
        if (i + 1 < cfg.steps) {
          st = trainer.step();
          // Step 1 allocates gradients and optimizer state; auto's step 2 is
          // its profiled (plain) step, planned steps start at 3.
          if (i >= (s == rm::Strategy::kAuto ? 2 : 1)) {
            times_ms.push_back(st.step_ms);
            row.peak_bytes = std::max(row.peak_bytes, st.peak_bytes);
          }
        } else {
          remat::memory::Timeline timeline;
          st = trainer.step(&timeline);
          timeline.stop();
          row.trace_path = (fs::path(out_dir) /
                            ("trace_" + std::string(rm::to_string(s)) + (policy.empty() ? "" : "_" + policy) + ".json"))
                               .string();
          timeline.write_chrome_trace(row.trace_path, "remat demo: " + row.name);
        }
        row.final_loss = st.loss;
      }
      row.step_ms = median(times_ms);
      std::cout << " " << std::fixed << std::setprecision(1) << row.step_ms << " ms/step\n";
      rows.push_back(row);
    }
  } catch (const std::exception& e) {
    std::string what = e.what();
    std::cerr << "remat_demo: error: " << what.substr(0, what.find('\n')) << "\n";
    return 2;
  }

  // The table.
  const auto& none = rows.front();
  std::cout << "\n"
            << std::left << std::setw(24) << "strategy" << std::right << std::setw(14) << "peak act. mem"
            << std::setw(9) << "vs none" << std::setw(15) << "step (median)" << std::setw(10) << "overhead"
            << std::setw(16) << "final loss"
            << "\n";
  bool all_equal = true;
  for (const auto& r : rows) {
    all_equal = all_equal && r.final_loss == none.final_loss;
    std::ostringstream vs, step, overhead, loss;
    vs << std::fixed << std::setprecision(2) << static_cast<double>(r.peak_bytes) / static_cast<double>(none.peak_bytes)
       << "x";
    step << std::fixed << std::setprecision(1) << r.step_ms << " ms";
    overhead << std::fixed << std::setprecision(2) << r.step_ms / none.step_ms << "x";
    loss << std::fixed << std::setprecision(10) << r.final_loss;
    std::cout << std::left << std::setw(24) << r.name << std::right << std::setw(14)
              << remat::format_bytes(r.peak_bytes) << std::setw(9) << vs.str() << std::setw(15) << step.str()
              << std::setw(10) << overhead.str() << std::setw(16) << loss.str() << "\n";
  }
  std::cout << "\nfinal losses " << (all_equal ? "bitwise equal" : "DIFFER") << " across strategies (same seed, "
            << base.steps << " steps, dropout " << base.dropout << ").\n";

  // CSV, chart, traces.
  const auto csv = (fs::path(out_dir) / "demo.csv").string();
  {
    std::ofstream f(csv);
    f << "strategy,peak_bytes,step_ms,overhead,final_loss\n";
    for (const auto& r : rows) {
      f << r.name << "," << r.peak_bytes << "," << std::setprecision(6) << r.step_ms << "," << r.step_ms / none.step_ms
        << "," << std::setprecision(12) << r.final_loss << "\n";
    }
  }
  std::cout << "\ntable:   " << csv << "\n";
  const auto png = (fs::path(out_dir) / "demo.png").string();
  std::string python;
  if (const char* p = std::getenv("REMAT_PYTHON")) {
    python = p;
  } else if (const char* home = std::getenv("HOME")) {
    python = std::string(home) + "/.cache/remat/venv/bin/python";
  }
  const std::string script = std::string(REMAT_SOURCE_DIR) + "/scripts/plot_demo.py";
  if (python.empty() || !fs::exists(python)) {
    std::cout << "chart:   skipped (no python at '" << python << "'; set REMAT_PYTHON)\n";
  } else {
    const std::string cmd = "'" + python + "' '" + script + "' --csv '" + csv + "' --out '" + png + "'";
    const int rc = std::system(cmd.c_str());
    if (rc == 0) {
      std::cout << "chart:   " << png << "\n";
    } else {
      std::cout << "chart:   skipped (" << script << " failed; is matplotlib installed in " << python << "?)\n";
    }
  }
  std::cout << "traces:  ";
  for (size_t i = 0; i < rows.size(); ++i) std::cout << (i ? "\n         " : "") << rows[i].trace_path;
  std::cout << "\n         (memory of the last step with forward/backward/optimizer spans; open in ui.perfetto.dev)\n";
  return all_equal ? 0 : 1;
}
