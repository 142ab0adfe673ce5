// remat_demo: trains a small GPT briefly under every checkpoint strategy from
// the same seed and prints peak activation memory, median step time, overhead
// against no checkpointing and the final loss (bitwise equal across
// strategies). Writes demo.csv, a PNG chart (scripts/plot_demo.py, if the
// venv's matplotlib is there) and one Chrome-trace memory timeline per
// strategy (last step; open in ui.perfetto.dev). A strategy that fails (auto
// under a budget no plan meets, on a small model) is listed with the
// library's error after the table of those that ran.
// Exit status: 0 every strategy ran and the final losses are bitwise equal;
// 1 they ran and the losses differ; 2 bad flags, or a strategy did not run.
// Leaves out: GPU runs, statistical timing (one run, median of a few steps).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <optional>
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
  std::string error;       ///< why it did not run (the library's error, first line); empty: it ran
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
  app.footer(
      "Exit status: 0 every strategy ran and the final losses are bitwise equal; 1 the losses differ; 2 bad flags, "
      "or a strategy did not run (the table lists those that ran, then each one that did not, with its error).");
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
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "remat_demo: error: " << e.what() << " (run remat_demo --help for the flags)\n";
    return 2;
  }
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
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) {
    std::cerr << "remat_demo: error: cannot create --out folder '" << out_dir << "': " << ec.message() << "\n";
    return 2;
  }
  // Each strategy runs on its own: one that fails (auto under a budget that
  // no plan meets) is kept with its error, and the others still run.
  std::vector<Row> rows;
  std::optional<Row> none;  // the plain run, which the ratios divide by (when it ran)
  for (const auto& [s, policy] : strategies) {
    Row row;
    row.name = std::string(rm::to_string(s)) + (policy.empty() ? "" : " " + policy);
    bool announced = false;  // the "training with ..." line is out
    try {
      auto cfg = base;
      cfg.checkpoint = s;
      if (!policy.empty()) cfg.policy = policy;
      if (s == rm::Strategy::kAuto) {
        if (!none) throw remat::Error("[remat_demo] auto's budget is a fraction of none's peak, and none did not run.");
        cfg.memory_budget_bytes = static_cast<int64_t>(auto_fraction * static_cast<double>(none->peak_bytes));
        row.name += " (" + remat::format_bytes(cfg.memory_budget_bytes) + ")";
      }
      rm::Trainer trainer(cfg);
      if (s == rm::Strategy::kNone) std::cout << trainer.summary() << "\n\n";
      std::cout << "training with checkpoint " << row.name << " ..." << std::flush;
      announced = true;
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
    } catch (const std::exception& e) {
      const std::string what = e.what();
      row.error = what.substr(0, what.find('\n'));
      if (!announced) std::cout << "training with checkpoint " << row.name << " ...";
      std::cout << " did not run\n";
    }
    if (s == rm::Strategy::kNone && row.error.empty()) none = row;
    rows.push_back(row);
  }

  // The table: the strategies that ran, with ratios to none when it ran.
  auto ratio = [&](double a, double b) {
    std::ostringstream os;
    if (none) {
      os << std::fixed << std::setprecision(2) << a / b << "x";
    } else {
      os << "-";
    }
    return os.str();
  };
  std::cout << "\n"
            << std::left << std::setw(24) << "strategy" << std::right << std::setw(14) << "peak act. mem"
            << std::setw(9) << "vs none" << std::setw(15) << "step (median)" << std::setw(10) << "overhead"
            << std::setw(16) << "final loss"
            << "\n";
  bool all_equal = true, all_ran = true;
  std::optional<double> first_loss;
  for (const auto& r : rows) {
    if (!r.error.empty()) {
      all_ran = false;
      continue;
    }
    if (!first_loss) first_loss = r.final_loss;
    all_equal = all_equal && r.final_loss == *first_loss;
    std::ostringstream step, loss;
    step << std::fixed << std::setprecision(1) << r.step_ms << " ms";
    loss << std::fixed << std::setprecision(10) << r.final_loss;
    std::cout << std::left << std::setw(24) << r.name << std::right << std::setw(14)
              << remat::format_bytes(r.peak_bytes) << std::setw(9)
              << ratio(static_cast<double>(r.peak_bytes), none ? static_cast<double>(none->peak_bytes) : 1.0)
              << std::setw(15) << step.str() << std::setw(10) << ratio(r.step_ms, none ? none->step_ms : 1.0)
              << std::setw(16) << loss.str() << "\n";
  }
  if (first_loss) {
    std::cout << "\nfinal losses " << (all_equal ? "bitwise equal" : "DIFFER")
              << (all_ran ? " across strategies" : " across the strategies that ran") << " (same seed, " << base.steps
              << " steps, dropout " << base.dropout << ").\n";
  }
  if (!all_ran) {
    std::cout << "\n";
    for (const auto& r : rows) {
      if (r.error.empty()) continue;
      std::cout << "did not run: " << r.name << ": " << r.error << "\n";
      if (r.name.rfind("auto", 0) == 0 && none) {
        std::cout << "  (auto's budget is --auto-fraction " << auto_fraction
                  << " of none's peak; a small model has less to trade: raise --auto-fraction, up to 1)\n";
      }
    }
  }

  // CSV, chart, traces (of the strategies that ran).
  const auto csv = (fs::path(out_dir) / "demo.csv").string();
  {
    std::ofstream f(csv);
    f << "strategy,peak_bytes,step_ms,overhead,final_loss\n";
    for (const auto& r : rows) {
      if (!r.error.empty()) continue;
      f << r.name << "," << r.peak_bytes << "," << std::setprecision(6) << r.step_ms << ","
        << (none ? r.step_ms / none->step_ms : 1.0) << "," << std::setprecision(12) << r.final_loss << "\n";
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
  if (!first_loss) {
    std::cout << "chart:   skipped (no strategy ran)\n";
  } else if (python.empty() || !fs::exists(python)) {
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
  bool first = true;
  for (const auto& r : rows) {
    if (r.trace_path.empty() || !r.error.empty()) continue;
    std::cout << (first ? "" : "\n         ") << r.trace_path;
    first = false;
  }
  std::cout << "\n         (memory of the last step with forward/backward/optimizer spans; open in ui.perfetto.dev)\n";
  if (!all_ran) return 2;
  return all_equal ? 0 : 1;
}
