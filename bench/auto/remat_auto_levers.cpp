// remat_auto_levers: the whole-step planner with every lever (docs/BENCHMARKS.md,
// "Every lever: auto with the model's state and the loss head"). The step of
// remat_auto (--model gpt: the reference GPT, d_model 512, 8 blocks, T 512,
// batch 4, vocabulary 8192, AdamW lr 1e-3; --model resnet: ResNet-18 width
// 32, 32x32 images, batch 100, SGD momentum 0.9) planned by
// remat::auto_checkpoint with, beside remat_auto's menu (its selective levels,
// the GPT's Megatron and save_matmuls policies, offload of saved tensors to
// disk, max_inflight_bytes 16 MiB):
//   AutoOptions::optimizers        the optimizer steps each parameter inside
//                                  backward (its gradient freed at once);
//   AutoOptions::optimizer_state_store  each param group's optimizer state
//                                  kept or in a disk store between its updates,
//                                  as the plan says;
//   AutoOptions::chunk_counts      the GPT's head and loss
//                                  (remat::chunked_cross_entropy, called with
//                                  0: the plain logits) at 1, 2, 4, ..., 32 chunks.
// Strategies, one step each in turn for --rounds rounds (3):
//   plain          model A: no remat, the optimizer step after backward,
//                  gradients zeroed in place (zero_grad(false)), as remat_auto's plain
//   levers@i       model B (the same architecture and seed) under that
//                  planner at budget i of --budgets (8) evenly spaced from its
//                  leanest plan to its profiled (plain, in-backward) peak
// Two models, because the planner's StepInBackward stays on B's parameters
// for its life. What a step's peak covers is one model's whole step:
// remat::memory's tracked bytes at the step's peak less the other model's
// bytes at rest, counted tensor by tensor for A (parameters, gradients,
// AdamW state / SGD momentum; checked against the tracked total when B
// does not exist yet) and as the tracked total less A's for B. So a peak
// covers parameters, gradients while they live, the optimizer state in
// memory (kept, read ahead, being updated, writes in flight), activations
// and the loss. B's planner measures with A at rest beside it, so its
// budgets, predictions and profiled peaks are reported less A's bytes at
// rest (constant while B steps), as B's own. Ratios are paired with plain's step of the same round (median,
// min, max over rounds). Writes JSON lines to
// bench/results/auto-levers.json (auto-resnet-levers.json; --quick: a toy
// size, -quick.json): {"kind": "meta"}, {"kind": "profile"} (the planner's
// profile: its profiled and leanest peaks, where the leanest plan peaks, its
// explain()), one {"kind": "strategy"} per strategy (with, per timed step, what
// its backward waited on the state store, ms). Prints a table.
// Leaves out: dropout, SDPA, mixed precision, the Python anchors (those of
// remat_auto run in bench/py/auto_py.py).

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <remat/auto.h>
#include <remat/memory.h>
#include <remat/models/gpt.h>
#include <remat/models/resnet.h>
#include <remat/plan/step.h>

#include "bench.h"
#include "workload.h"

namespace {

using namespace bench::auto_step;

/** Bytes of a model at rest with its optimizer's state, each storage once:
 *  parameters, gradients, buffers, AdamW's moments or SGD's momentum. */
int64_t resting_bytes(const Net& n) {
  std::set<const void*> seen;
  int64_t bytes = 0;
  auto add = [&](const at::Tensor& t) {
    if (!t.defined() || !t.has_storage()) return;
    if (seen.insert(t.storage().unsafeGetStorageImpl()).second) bytes += static_cast<int64_t>(t.storage().nbytes());
  };
  for (const auto& p : n.module->parameters()) {
    add(p);
    add(p.grad());
  }
  for (const auto& b : n.module->buffers()) add(b);
  for (const auto& [key, state] : n.opt->state()) {
    if (auto* s = dynamic_cast<torch::optim::AdamWParamState*>(state.get())) {
      add(s->exp_avg());
      add(s->exp_avg_sq());
      add(s->max_exp_avg_sq());
    } else if (auto* s = dynamic_cast<torch::optim::SGDParamState*>(state.get())) {
      add(s->momentum_buffer());
    }
  }
  return bytes;
}

struct Record {
  std::string name, label;
  int64_t budget = 0, predicted_peak = 0, inflight = 0;
  double predicted_ms = 0;
  std::string plan;
  std::string loss;         // the loss head's option ("" without one)
  int units = 0, keep = 0;  // units of the plan, and those at "keep"
  std::vector<double> ms, time_ratios;
  std::vector<int64_t> peaks, state_in_store;
  std::vector<double> state_wait_ms;  // what each step's backward waited on the state store
};

}  // namespace

int main(int argc, char** argv) {
  using namespace bench;
  const Settings st =
      settings(argc, argv, "remat_auto_levers", "bench/results/auto-levers", "bench/results/auto-resnet-levers");
  const bool quick = st.quick, gpt_model = st.gpt_model;
  const std::string model_name = gpt_model ? "gpt" : "resnet";
  const Size size = st.size;
  const ImageSize isize = st.isize;
  const int rounds = st.rounds, nbudgets = st.budgets;
  const std::string& out_path = st.out_path;
  const ScratchDir scratch(argc, argv, "remat_auto_levers");
  const auto store = disk_store(argc, argv, scratch.path());
  remat::memory::enable_tracking();

  Net a = make_net(gpt_model, size, isize, 7);
  a.step();  // A's gradients and optimizer state exist from here on
  const int64_t a_rest = resting_bytes(a);
  const int64_t tracked = remat::memory::current_bytes();
  std::printf("model A at rest: %s counted tensor by tensor, %s tracked in all\n", remat::format_bytes(a_rest).c_str(),
              remat::format_bytes(tracked).c_str());
  if (std::llabs(tracked - a_rest) > a_rest / 100) {
    std::fprintf(stderr, "remat_auto_levers: model A's count (%lld B) misses the tracked bytes (%lld B) by over 1%%\n",
                 static_cast<long long>(a_rest), static_cast<long long>(tracked));
    return 1;
  }

  Net b = make_net(gpt_model, size, isize, 7);
  auto options = remat::AutoOptions()
                     .memory_budget_fraction(1.0)
                     .replan_on_overrun(false)
                     .profile_repeats(2)
                     .offload({store})
                     .optimizers({b.opt.get()})
                     .optimizer_state_store(store)
                     .chunk_counts(remat::default_chunk_counts());
  if (gpt_model) options.policies({remat::models::megatron_policy(), remat::policy::save_matmuls()});
  const auto p0 = Clock::now();
  auto planner = remat::auto_checkpoint(*b.module, options);
  planner.step(b.step);  // warm-up
  planner.step(b.step);  // profiled
  const double profile_s = secs_since(p0);
  // Calibration, as remat_auto's: two steps under the leanest of 8 budgets
  // whose plan offloads saved tensors, so that offload is priced by a real step.
  // Before it, three steps at the whole budget (a plan that sends and adds
  // nothing): the last two measure the plain step the predictions add to
  // (NOTE [plain time calibrated]).
  planner.replan(planner.profiled_peak_bytes());
  for (int i = 0; i < 3; ++i) planner.step(b.step);
  std::printf("plain step: profiled %.0f ms, as the planned steps measure it %.0f ms\n", planner.profiled_time_ms(),
              planner.plain_time_ms());
  int calibration_steps = 0;
  for (int i = 0; i < 8 && calibration_steps == 0; ++i) {
    const int64_t lo = planner.leanest_peak_bytes(), hi = planner.profiled_peak_bytes();
    planner.replan(lo + (hi - lo) * i / 7);
    bool offloads = false;
    for (const auto& u : planner.units()) offloads |= u.options[u.choice].rfind("offload", 0) == 0;
    if (!offloads) continue;
    for (; calibration_steps < 2; ++calibration_steps) planner.step(b.step);
  }
  const int64_t low = planner.leanest_peak_bytes(), high = planner.profiled_peak_bytes();
  planner.replan(low);
  // B's own figures: the planner's (which count A at rest beside B) less A's bytes at rest.
  const int64_t a_beside = resting_bytes(a);
  auto own = [&](int64_t bytes) { return bytes - a_beside; };
  const std::string leanest_where =
      remat::plan::describe_segment(planner.step_model(), planner.plan().prediction.peak_segment);
  const std::string leanest_explain = planner.explain();
  std::printf("the leanest plan:\n%s", leanest_explain.c_str());
  std::printf("profile: %.1f s, profiled peak %s, leanest plan %s (B's own: model A's %s at rest taken off)\n",
              profile_s, remat::format_bytes(own(high)).c_str(), remat::format_bytes(own(low)).c_str(),
              remat::format_bytes(a_beside).c_str());
  std::fflush(stdout);

  std::vector<Record> recs(1);
  recs[0].name = "plain";
  recs[0].label = "plain";
  for (int i = 0; i < nbudgets; ++i) {
    Record r;
    r.name = "levers@" + std::to_string(i);
    r.budget = low + (nbudgets > 1 ? (high - low) * i / (nbudgets - 1) : 0);
    r.label = "auto, every lever, at " + remat::format_bytes(own(r.budget));
    recs.push_back(r);
  }
  // One step of a strategy: its peak less the other model's bytes at rest.
  auto run = [&](Record& r, bool timed) {
    const bool on_b = r.budget > 0;
    if (on_b) {
      planner.replan(r.budget);
      r.predicted_peak = planner.plan().prediction.peak_bytes;
      r.inflight = planner.inflight_bytes();
      r.predicted_ms = planner.plan().prediction.time_ms;
      r.plan.clear();
      r.units = r.keep = 0;
      for (const auto& u : planner.units()) {
        r.plan += (r.plan.empty() ? "" : ", ") + u.name + ": " + u.options[u.choice];
        if (u.name == "chunked_cross_entropy") {
          r.loss = u.options[u.choice];
          continue;
        }
        ++r.units;
        r.keep += u.choice == 0 ? 1 : 0;
      }
    }
    const int64_t a_now = resting_bytes(a);
    const int64_t other = on_b ? a_now : remat::memory::current_bytes() - a_now;
    remat::memory::reset_peak();
    const auto t0 = Clock::now();
    if (on_b) {
      planner.step(b.step);
    } else {
      a.step();
    }
    const double ms = ms_since(t0);
    const int64_t peak = remat::memory::peak_bytes() - other;
    if (timed) {
      r.ms.push_back(ms);
      r.peaks.push_back(peak);
      if (on_b) {
        r.state_in_store.push_back(planner.optimizer_state_in_store_bytes());
        r.state_wait_ms.push_back(planner.optimizer_state_wait_ms());
      }
    }
  };
  for (auto& r : recs) run(r, false);  // each plan's first step (the state goes to the store, the read-ahead learns)
  std::vector<double> load;
  auto note_load = [&] {
    double l[1] = {0};
    if (getloadavg(l, 1) == 1) load.push_back(l[0]);
  };
  note_load();
  for (int round = 0; round < rounds; ++round) {
    for (auto& r : recs) {
      run(r, true);
      std::printf("round %d %-10s %9.1f ms  peak %s\n", round, r.name.c_str(), r.ms.back(),
                  remat::format_bytes(r.peaks.back()).c_str());
      std::fflush(stdout);
    }
    note_load();
  }
  const std::string state_name = gpt_model ? "AdamW state" : "SGD momentum";
  const Record& plain = recs[0];
  std::ofstream out(out_path);
  out << "{\"kind\": \"meta\", \"meta\": " << metadata(argc, argv) << ", \"model\": " << quoted(model_name);
  write_size(out, gpt_model, size, isize);
  out << ", \"rounds\": " << rounds << ", \"quick\": " << (quick ? "true" : "false")
      << ", \"load_1min\": " << json_list(load, 2)
      << ", \"offload\": {\"target\": \"kDisk\", \"max_inflight_bytes\": " << store.max_inflight_bytes() << "}"
      << ", \"optimizer\": " << quoted(gpt_model ? "AdamW" : "SGD momentum 0.9")
      << ", \"chunk_counts\": " << json_list(remat::default_chunk_counts()) << "}\n";
  out << "{\"kind\": \"profile\", \"profile_s\": " << num(profile_s) << ", \"calibration_steps\": " << calibration_steps
      << ", \"profiled_peak\": " << own(high) << ", \"profiled_ms\": " << num(planner.profiled_time_ms())
      << ", \"plain_ms\": " << num(planner.plain_time_ms()) << ", \"leanest_peak\": " << own(low)
      << ", \"leanest_where\": " << quoted(leanest_where) << ", \"model_a_rest\": " << a_rest
      << ", \"explain\": " << quoted(leanest_explain) << "}\n";
  std::printf("\n%-10s %10s %8s %14s %10s %12s %12s\n", "strategy", "step ms", "x plain", "peak", "x plain", "budget",
              "predicted");
  for (auto& r : recs) {
    for (int i = 0; i < rounds; ++i) r.time_ratios.push_back(r.ms[i] / plain.ms[i]);
    const int64_t peak = *std::max_element(r.peaks.begin(), r.peaks.end());
    const double peak_ratio = static_cast<double>(peak) / static_cast<double>(plain.peaks[0]);
    std::printf("%-10s %10.1f %8.3f %14s %10.3f %12s %12s\n", r.name.c_str(), median(r.ms), median(r.time_ratios),
                remat::format_bytes(peak).c_str(), peak_ratio,
                r.budget ? remat::format_bytes(own(r.budget)).c_str() : "-",
                r.budget ? remat::format_bytes(own(r.predicted_peak)).c_str() : "-");
    out << "{\"kind\": \"strategy\", \"name\": " << quoted(r.name) << ", \"label\": " << quoted(r.label)
        << ", \"ms\": " << json_list(r.ms) << ", \"peaks\": " << json_list(r.peaks)
        << ", \"time_ratio\": {\"median\": " << num(median(r.time_ratios))
        << ", \"min\": " << num(*std::min_element(r.time_ratios.begin(), r.time_ratios.end()))
        << ", \"max\": " << num(*std::max_element(r.time_ratios.begin(), r.time_ratios.end()))
        << "}, \"peak\": " << peak << ", \"peak_ratio\": " << num(peak_ratio) << ", \"covers\": "
        << quoted(r.budget == 0
                      ? "parameters, gradients (alive throughout the step), " + state_name + ", activations, the loss"
                      : "parameters, the " + state_name +
                            " in memory (kept, read ahead, being updated, writes in flight), gradients "
                            "from their accumulation to their parameter's update, activations, the loss");
    if (r.budget) {
      out << ", \"budget\": " << own(r.budget) << ", \"predicted_peak\": " << own(r.predicted_peak)
          << ", \"inflight\": " << r.inflight << ", \"predicted_ms\": " << num(r.predicted_ms)
          << ", \"plan\": " << quoted(r.plan) << ", \"loss_option\": " << quoted(r.loss) << ", \"units\": " << r.units
          << ", \"units_keep\": " << r.keep << ", \"state_in_store\": " << json_list(r.state_in_store)
          << ", \"state_wait_ms\": " << json_list(r.state_wait_ms);
    }
    out << "}\n";
  }
  std::printf("wrote %s\n", out_path.c_str());
  return 0;
}
