// remat_auto: the whole-step planner's frontier (docs/BENCHMARKS.md, "Whole
// training step under a budget"). --model gpt (default): the reference GPT
// as a whole training step: token + position embedding, 8
// blocks (explicit attention), final LayerNorm, LM head tied to the
// embedding over an 8192-token vocabulary, mean cross-entropy, backward,
// AdamW step (lr 1e-3). --model resnet: remat's ResNet-18 (4 stages x 2
// basic blocks, BatchNorm), width 32, 32x32 images, batch 100, 10 classes,
// cross-entropy, SGD with momentum 0.9 (lr 0.01): the closest of remat's
// models to the 3-stage reference ResNet of docs/BENCHMARKS.md. Gradients zeroed in place
// (zero_grad(false)). One model and optimizer for every strategy (the
// values change neither memory nor time); data: random, a new batch per
// step.
//
// Strategies (GPT; the ResNet has no Megatron and save_matmuls rows, whose
// policies name the GPT's matmuls):
//   plain          every block plain
//   block          every block checkpointed (enable_checkpointing)
//   half           every 2nd block checkpointed
//   megatron       every block with the Megatron selective policy (saves the
//                  qkv, attention output and MLP-up projections)
//   save_matmuls   every block with policy::save_matmuls()
//   offload        every block's saved tensors to files in --offload-dir
//                  (enable_offloading; the store below)
//   block+offload  every block checkpointed, its input offloaded to the
//                  same store (CheckpointOptions().offload)
//   auto@i         remat::auto_checkpoint (the Megatron and save_matmuls
//                  policies on its menu beside its own selective levels:
//                  AutoOptions().policies; and offload to the store:
//                  AutoOptions().offload) at budget i of --budgets (default
//                  8) evenly spaced from its leanest feasible plan to the
//                  plain step's peak (one profile, replan() per budget; no
//                  replan on overrun, so the recorded peak is the plan's own)
//   auto=S        auto at the peak hand-placed strategy S measured in a warm
//                 step before the rounds (the comparison at equal memory)
// and with the optimizer step in backward (remat::StepInBackward on the same
// optimizer: each parameter updated as soon as its gradient is final, that
// gradient freed at once):
//   plain+ib       every block plain, the step in backward
//   block+ib       every block checkpointed, the step in backward
//   block+ib+disk  block+ib with the optimizer's state (AdamW's moments, SGD's
//                  momentum) in a disk store in --offload-dir between its
//                  updates (StepInBackwardOptions().state_offload, the store's
//                  options below, read ahead 2 parameters)
//   auto-offload=offload  a third planner whose units keep or offload only
//                  (AutoOptions().recompute(false), no selective levels,
//                  policies or inner units: a unit is a block, its menu keep
//                  and offload disk), at the peak offload measured: the same
//                  disk offload, with what the store holds in flight chosen
//                  by the plan (one entry, 16 MiB, 4x ... up to room for all
//                  one block sends) instead of a fixed 16 MiB
//   auto-offload@every  the same planner at the largest of 33 budgets from
//                  its leanest plan to plain whose plan still sends every
//                  block to disk: the most room in flight it gives disk
//                  offload of every block
//   auto+ib@leanest  auto at its leanest plan, profiled (and calibrated) by a
//                  second planner while a StepInBackward lives, so that it
//                  measures the step with the updates in backward
// A StepInBackward lives only around its strategy's step (one per parameter
// at a time): each such step starts with the gradients freed (set to
// none), as they are between steps in backward-stepped training, and ends
// with zeroed gradients put back, so the other strategies' steps start as
// they always do (gradients allocated, zero_grad(false)). block+ib+disk runs
// one untimed step after creating its StepInBackward, which sends the state
// to the store and learns the update order for the read-ahead (the state
// comes back into memory when it is destroyed after the timed step), so
// the timed step is a steady-state one.
// auto_checkpoint profiles once (1 plain warm-up step, 1 profiled step),
// then runs two measured steps under the leanest of 8 budgets whose plan
// offloads, which price offload by what the real step pays for it;
// then the strategies run interleaved, one step each in turn, for --rounds
// rounds (3), the 1-minute load average noted before and after each
// ("load_1min" in the meta record). Per step: wall time (zero_grad to the end of the AdamW step)
// and the peak of remat::memory's tracked CPU bytes during the step, all
// tensors counted (parameters, gradients, AdamW state, activations, the
// loss), which is what auto's budget bounds. Ratios are paired with plain's
// step of the same round (median, min, max over rounds).
// Writes JSON lines to bench/results/auto.json (--quick: a toy size,
// auto-quick.json; --out elsewhere): {"kind": "meta"} with the run-metadata
// record and the settings, {"kind": "profile"} (profile and solver figures;
// state_bytes: the tracked bytes between two steps, which every plan holds
// throughout; leanest_where: where the leanest plan's predicted peak is),
// then one {"kind": "strategy"} per strategy (with "in_backward",
// "optimizer_state" and "covers"; the StepInBackward's counters of the
// timed steps for those in backward; "profile_ib" for auto+ib's own
// profile). Prints a table.
// The offload store: OffloadTarget::kDisk in --offload-dir (default: a new
// directory under /tmp, removed at the end), max_inflight_bytes 16 MiB (what
// auto adds to a plan that offloads, so small keeps its plans lean), the
// other options at their defaults. The disk here is the machine's; a
// user's may be slower or faster.
// Leaves out: dropout, SDPA, mixed precision, the Python anchors.

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <remat/auto.h>
#include <remat/checkpointable.h>
#include <remat/memory.h>
#include <remat/models/gpt.h>
#include <remat/models/resnet.h>
#include <remat/optim.h>
#include <remat/plan/step.h>

#include "bench.h"
#include "workload.h"

namespace {

using remat::models::GptBlockImpl;
using namespace bench::auto_step;

struct Record {
  std::string name, label;
  int64_t budget = 0;          // auto only
  int64_t predicted_peak = 0;  // auto only
  int64_t inflight = 0;        // auto only: room kept above the prediction for disk writes and reads in flight
  double predicted_ms = 0;     // auto only (profiled plain step + the plan's added time)
  std::string plan;            // auto only: option per unit
  bool in_backward = false;    // the optimizer step inside backward (a StepInBackward around the step)
  bool state_disk = false;     // in_backward: the optimizer's state in the disk store between its updates
  remat::AutoCheckpoint* planner = nullptr;  // auto+ib: its own planner (apply() sets its plan)
  std::vector<int64_t> state_offloaded;      // in_backward: state bytes in the store at the end of each timed step
  std::vector<int64_t> state_misses;         // in_backward: states read when needed in each timed step
  std::vector<double> ms;
  std::vector<int64_t> peaks;
  std::vector<double> time_ratios;
};

}  // namespace

int main(int argc, char** argv) {
  using namespace bench;
  const Settings st = settings(argc, argv, "remat_auto", "bench/results/auto", "bench/results/auto-resnet");
  const bool quick = st.quick, gpt_model = st.gpt_model;
  const std::string model_name = gpt_model ? "gpt" : "resnet";
  const Size size = st.size;
  const ImageSize isize = st.isize;
  const int rounds = st.rounds, nbudgets = st.budgets;
  const std::string& out_path = st.out_path;
  const ScratchDir scratch(argc, argv, "remat_auto");
  const auto store = disk_store(argc, argv, scratch.path());
  remat::memory::enable_tracking();
  Net workload = make_net(gpt_model, size, isize, 7);
  std::shared_ptr<torch::nn::Module> net = workload.module;
  std::unique_ptr<torch::optim::Optimizer> opt = std::move(workload.opt);
  const std::function<void()> step = workload.step;
  const remat::Selector blocks =
      gpt_model ? remat::select::type<GptBlockImpl>() : remat::select::type<remat::models::ResBlockImpl>();

  // One profile; every auto budget is a replan() of it.
  const auto p0 = Clock::now();
  auto options =
      remat::AutoOptions().memory_budget_fraction(1.0).replan_on_overrun(false).profile_repeats(2).offload({store});
  if (gpt_model) options.policies({remat::models::megatron_policy(), remat::policy::save_matmuls()});
  auto planner = remat::auto_checkpoint(*net, options);
  planner.step(step);  // warm-up
  planner.step(step);  // profiled
  const double profile_s = secs_since(p0);
  // What every step holds from its start to its end, whatever the plan:
  // parameters, gradients (kept: zero_grad(false)), optimizer state and
  // buffers, all of the tracked bytes between two steps.
  const int64_t state_bytes = remat::memory::current_bytes();
  // Calibration: two measured steps under the plan of the leanest budget
  // (of 8 evenly spaced ones) that offloads what units save ("offload
  // disk"), so that auto prices offload by what a real step pays for it
  // (NOTE [offload priced by the step]). A plan that only sends inputs
  // ("recompute, inputs to disk") writes too little to show the disk's pace.
  // First three steps at the whole budget, whose plan sends nothing and
  // adds nothing: the last two measure the plain step that the predictions
  // add to (the profile's steps, the process's first, run slower; NOTE
  // [plain time calibrated]).
  auto calibrate = [&](remat::AutoCheckpoint& pl) {
    pl.replan(pl.profiled_peak_bytes());
    for (int i = 0; i < 3; ++i) pl.step(step);
    std::printf("plain step: profiled %.0f ms, as the planned steps measure it %.0f ms\n", pl.profiled_time_ms(),
                pl.plain_time_ms());
    int steps = 0;
    for (int i = 0; i < 8 && steps == 0; ++i) {
      const int64_t lo = pl.leanest_peak_bytes(), hi = pl.profiled_peak_bytes();
      pl.replan(lo + (hi - lo) * i / 7);
      bool offloads = false;
      for (const auto& u : pl.units()) offloads |= u.options[u.choice].rfind("offload", 0) == 0;
      if (!offloads) continue;
      for (; steps < 2; ++steps) pl.step(step);
      std::printf("%s", pl.explain().c_str());
    }
    return steps;
  };
  const int calibration_steps = calibrate(planner);
  const auto& model = planner.step_model();
  const auto l0 = Clock::now();
  const int64_t low = planner.leanest_peak_bytes(), high = planner.profiled_peak_bytes();
  const double leanest_ms = ms_since(l0);
  planner.replan(low);  // where the leanest plan peaks: what sets the floor of the menu
  const std::string leanest_where = remat::plan::describe_segment(model, planner.plan().prediction.peak_segment);
  std::printf("the leanest plan:\n%s", planner.explain().c_str());
  std::printf("between steps (parameters, gradients, optimizer state): %s (%.3f of the profiled peak)\n",
              remat::format_bytes(state_bytes).c_str(), static_cast<double>(state_bytes) / static_cast<double>(high));
  std::fflush(stdout);
  std::printf("profile: %.1f s (2 steps), profiled peak %s, leanest plan %s (%.3f of it), %zu units\n", profile_s,
              remat::format_bytes(high).c_str(), remat::format_bytes(low).c_str(),
              static_cast<double>(low) / static_cast<double>(high), model.units.size());

  std::vector<std::pair<std::string, std::string>> hand_names = {
      {"plain", "plain"}, {"block", "every block checkpointed"}, {"half", "every 2nd block checkpointed"}};
  if (gpt_model) {
    hand_names.push_back({"megatron", "selective: Megatron policy"});
    hand_names.push_back({"save_matmuls", "selective: save_matmuls"});
  }
  hand_names.push_back({"offload", "every block offloaded to disk"});
  hand_names.push_back({"block+offload", "every block checkpointed, its input on disk"});
  const std::string state_name = gpt_model ? "AdamW state" : "SGD momentum";
  hand_names.push_back({"plain+ib", "plain, optimizer step in backward"});
  hand_names.push_back({"block+ib", "every block checkpointed, optimizer step in backward"});
  hand_names.push_back(
      {"block+ib+disk", "every block checkpointed, optimizer step in backward, " + state_name + " on disk"});
  std::vector<Record> recs;
  for (const auto& [name, label] : hand_names) {
    Record r;
    r.name = name;
    r.label = label;
    r.in_backward = name.find("+ib") != std::string::npos;
    r.state_disk = name == "block+ib+disk";
    recs.push_back(r);
  }
  // The step in backward (NOTE in the file comment): gradients freed before
  // a StepInBackward's step, zeroed ones put back after it.
  auto free_grads = [&] {
    for (auto& p : net->parameters()) p.mutable_grad() = at::Tensor();
  };
  auto restore_grads = [&] {
    torch::NoGradGuard no_grad;
    for (auto& p : net->parameters()) {
      if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
    }
  };
  auto ib_options = [&](const Record& r) {
    remat::StepInBackwardOptions o;
    if (r.state_disk) o.state_offload(store);
    return o;
  };
  // A planner's plan at r.budget, as the record shows it (replanned there).
  auto note_plan = [](Record& r, remat::AutoCheckpoint& pl) {
    pl.replan(r.budget);
    r.predicted_peak = pl.plan().prediction.peak_bytes;
    r.inflight = pl.inflight_bytes();
    r.predicted_ms = pl.plan().prediction.time_ms;
    r.plan.clear();
    for (const auto& u : pl.units()) r.plan += (r.plan.empty() ? "" : ", ") + u.name + ": " + u.options[u.choice];
  };
  auto configure = [&](Record& r) {
    remat::disable_checkpointing(*net);
    if (r.planner != nullptr) {  // auto+ib, auto-offload: their own planner's plan
      if (r.planner->budget_bytes() != r.budget) {
        r.planner->replan(r.budget);  // applies it
      } else {
        r.planner->apply();
      }
      return;
    }
    if (r.name == "block" || r.name == "block+ib" || r.name == "block+ib+disk") {
      remat::enable_checkpointing(*net, blocks);
    }
    if (r.name == "half") remat::enable_checkpointing(*net, remat::select::every_n(2, blocks));
    if (r.name == "megatron") {
      remat::enable_checkpointing(*net, blocks, remat::CheckpointOptions().policy(remat::models::megatron_policy()));
    }
    if (r.name == "save_matmuls") {
      remat::enable_checkpointing(*net, blocks, remat::CheckpointOptions().policy(remat::policy::save_matmuls()));
    }
    if (r.name == "offload") remat::enable_offloading(*net, blocks, store);
    if (r.name == "block+offload") remat::enable_checkpointing(*net, blocks, remat::CheckpointOptions().offload(store));
    if (r.budget > 0) note_plan(r, planner);
  };
  // Auto at budgets evenly spaced from its leanest plan to plain, and at
  // each hand-placed strategy's own peak (the second of two warm steps
  // measures it):
  // the comparison at equal memory.
  const size_t hand = recs.size();
  for (int i = 0; i < nbudgets; ++i) {
    Record r;
    r.name = "auto@" + std::to_string(i);
    r.budget = low + (nbudgets > 1 ? (high - low) * i / (nbudgets - 1) : 0);
    r.label = "auto at " + remat::format_bytes(r.budget);
    recs.push_back(r);
  }
  int64_t offload_peak = 0;  // the hand-placed offload's, for auto-offload (below)
  for (size_t h = 1; h < hand; ++h) {
    if (recs[h].in_backward) continue;  // auto's plans step after backward
    configure(recs[h]);
    step();  // the first step of a strategy may differ (an offload store's writers starting)
    remat::memory::reset_peak();
    step();
    const int64_t peak = remat::memory::peak_bytes();
    if (recs[h].name == "offload") offload_peak = peak;
    if (peak < low) continue;  // leaner than any plan of auto's menu
    Record r;
    r.name = "auto=" + recs[h].name;
    r.budget = peak;
    r.label = "auto at " + recs[h].name + "'s peak";
    recs.push_back(r);
  }
  // auto+ib: a second planner, profiled (warm-up, profiled step,
  // calibration) while a StepInBackward lives, so that its profile is the
  // step with the updates in backward; its leanest plan runs in the rounds.
  std::optional<remat::AutoCheckpoint> planner_ib;
  double profile_ib_s = 0;
  int calibration_ib = 0;
  int64_t low_ib = 0, high_ib = 0, state_ib = 0;
  std::string where_ib;
  {
    remat::disable_checkpointing(*net);
    free_grads();
    remat::StepInBackward in_backward(*opt);
    const auto t0 = Clock::now();
    planner_ib.emplace(remat::auto_checkpoint(*net, options));
    planner_ib->step(step);  // warm-up
    planner_ib->step(step);  // profiled
    profile_ib_s = secs_since(t0);
    state_ib = remat::memory::current_bytes();  // between steps: parameters, optimizer state, no gradients
    calibration_ib = calibrate(*planner_ib);
    low_ib = planner_ib->leanest_peak_bytes();
    high_ib = planner_ib->profiled_peak_bytes();
    planner_ib->replan(low_ib);
    where_ib = remat::plan::describe_segment(planner_ib->step_model(), planner_ib->plan().prediction.peak_segment);
    std::printf("auto+ib, the leanest plan (profiled with the step in backward):\n%s", planner_ib->explain().c_str());
    std::printf("auto+ib profile: %.1f s, profiled peak %s, leanest plan %s, between steps %s\n", profile_ib_s,
                remat::format_bytes(high_ib).c_str(), remat::format_bytes(low_ib).c_str(),
                remat::format_bytes(state_ib).c_str());
    std::fflush(stdout);
  }
  restore_grads();
  {
    Record r;
    r.name = "auto+ib@leanest";
    r.label = "auto at its leanest, optimizer step in backward";
    r.in_backward = true;
    r.planner = &*planner_ib;
    r.budget = low_ib;
    note_plan(r, *planner_ib);
    recs.push_back(r);
  }
  // auto-offload: a third planner whose units only keep or offload
  // (recompute(false), no inner units: a unit is a block), at the
  // hand-placed offload's peak: every block's saves to disk as that row,
  // with the bytes in flight the plan's to choose.
  std::optional<remat::AutoCheckpoint> planner_off;
  double profile_off_s = 0;
  int calibration_off = 0;
  int64_t low_off = 0;
  {
    remat::disable_checkpointing(*net);
    const auto t0 = Clock::now();
    planner_off.emplace(remat::auto_checkpoint(
        *net, remat::AutoOptions(options).policies({}).selective_levels(0).inner_units(false).recompute(false)));
    planner_off->step(step);  // warm-up
    planner_off->step(step);  // profiled
    profile_off_s = secs_since(t0);
    calibration_off = calibrate(*planner_off);
    low_off = planner_off->leanest_peak_bytes();
    Record r;
    r.name = "auto-offload=offload";
    r.label = "auto, keep or offload only, at offload's peak";
    r.planner = &*planner_off;
    r.budget = std::max(low_off, offload_peak);
    note_plan(r, *planner_off);
    std::printf("auto-offload at offload's peak:\n%s", planner_off->explain().c_str());
    std::fflush(stdout);
    recs.push_back(r);
    // And at the most memory with which its plan still sends every block's
    // saves to disk (32 budgets up to plain's peak scanned): the room in
    // flight the planner gives disk offload of every block.
    const int64_t high_off = planner_off->profiled_peak_bytes();
    int64_t every = 0;
    for (int i = 0; i <= 32; ++i) {
      const int64_t b = low_off + (high_off - low_off) * i / 32;
      planner_off->replan(b);
      bool all = true;
      for (const auto& u : planner_off->units()) all &= u.options[u.choice].rfind("offload", 0) == 0;
      if (all) every = b;
    }
    if (every > r.budget) {
      Record e;
      e.name = "auto-offload@every";
      e.label = "auto, keep or offload only, the most room with every block offloaded";
      e.planner = &*planner_off;
      e.budget = every;
      note_plan(e, *planner_off);
      std::printf("auto-offload at %s, the most with every block offloaded:\n%s", remat::format_bytes(every).c_str(),
                  planner_off->explain().c_str());
      recs.push_back(e);
    }
  }
  // One step of a strategy: a StepInBackward around it for those in
  // backward (block+ib+disk: one untimed step first, see the file comment).
  auto run = [&](Record& r, bool timed) {
    configure(r);
    std::optional<remat::StepInBackward> in_backward;
    if (r.in_backward) {
      free_grads();
      in_backward.emplace(*opt, ib_options(r));
      if (r.state_disk) step();
    }
    const int64_t misses0 = in_backward ? in_backward->stats().state_misses : 0;
    remat::memory::reset_peak();
    const auto t0 = Clock::now();
    step();
    const double ms = ms_since(t0);
    const int64_t peak = remat::memory::peak_bytes();
    if (in_backward) {
      const auto st = in_backward->stats();
      if (timed) {
        r.state_offloaded.push_back(st.state_offloaded_bytes);
        r.state_misses.push_back(st.state_misses - misses0);
      }
      in_backward.reset();  // hooks removed, offloaded state back in the optimizer
      restore_grads();
    }
    if (timed) {
      r.ms.push_back(ms);
      r.peaks.push_back(peak);
    }
    return std::make_pair(ms, peak);
  };
  for (auto& r : recs) {  // one untimed step of each strategy in backward (the others had theirs above)
    if (r.in_backward) run(r, false);
  }
  // The machine's 1-minute load average before the rounds and after each:
  // other processes on the cores show in the time ratios' ranges.
  std::vector<double> load;
  auto note_load = [&] {
    double l[1] = {0};
    if (getloadavg(l, 1) == 1) load.push_back(l[0]);
  };
  note_load();
  for (int round = 0; round < rounds; ++round) {
    for (auto& r : recs) {
      run(r, true);
      std::printf("round %d %-16s %9.1f ms  peak %s\n", round, r.name.c_str(), r.ms.back(),
                  remat::format_bytes(r.peaks.back()).c_str());
      std::fflush(stdout);
    }
    note_load();
  }
  const Record& plain = recs[0];
  std::ofstream out(out_path);
  out << "{\"kind\": \"meta\", \"meta\": " << metadata(argc, argv) << ", \"model\": " << quoted(model_name);
  write_size(out, gpt_model, size, isize);
  out << ", \"rounds\": " << rounds << ", \"quick\": " << (quick ? "true" : "false")
      << ", \"load_1min\": " << json_list(load, 2)
      << ", \"offload\": {\"target\": \"kDisk\", \"max_inflight_bytes\": " << store.max_inflight_bytes() << "}"
      << ", \"optimizer\": " << quoted(gpt_model ? "AdamW" : "SGD momentum 0.9")
      << ", \"state_offload\": {\"target\": \"kDisk\", \"max_inflight_bytes\": " << store.max_inflight_bytes()
      << ", \"state_prefetch\": " << remat::StepInBackwardOptions().state_prefetch() << "}"
      << ", \"peak\": "
      << quoted(
             "the step's peak of remat::memory's tracked CPU bytes, everything alive counted (see "
             "each strategy's covers)")
      << "}\n";
  out << "{\"kind\": \"profile\", \"profile_s\": " << num(profile_s) << ", \"calibration_steps\": " << calibration_steps
      << ", \"units\": " << model.units.size() << ", \"segments\": " << model.segment_peak_bytes.size()
      << ", \"profiled_peak\": " << high << ", \"profiled_ms\": " << num(planner.profiled_time_ms())
      << ", \"plain_ms\": " << num(planner.plain_time_ms()) << ", \"leanest_peak\": " << low
      << ", \"leanest_solve_ms\": " << num(leanest_ms) << ", \"leanest_where\": " << quoted(leanest_where)
      << ", \"state_bytes\": " << state_bytes << "}\n";
  out << "{\"kind\": \"profile_ib\", \"profile_s\": " << num(profile_ib_s)
      << ", \"calibration_steps\": " << calibration_ib << ", \"profiled_peak\": " << high_ib
      << ", \"profiled_ms\": " << num(planner_ib->profiled_time_ms())
      << ", \"plain_ms\": " << num(planner_ib->plain_time_ms()) << ", \"leanest_peak\": " << low_ib
      << ", \"leanest_where\": " << quoted(where_ib) << ", \"state_bytes\": " << state_ib << "}\n";
  out << "{\"kind\": \"profile_offload\", \"profile_s\": " << num(profile_off_s)
      << ", \"calibration_steps\": " << calibration_off << ", \"leanest_peak\": " << low_off
      << ", \"offload_peak\": " << offload_peak << "}\n";
  std::printf("\n%-16s %10s %8s %14s %10s %10s\n", "strategy", "step ms", "x plain", "peak", "x plain", "budget");
  for (auto& r : recs) {
    for (int i = 0; i < rounds; ++i) r.time_ratios.push_back(r.ms[i] / plain.ms[i]);
    const int64_t peak = *std::max_element(r.peaks.begin(), r.peaks.end());
    const double peak_ratio = static_cast<double>(peak) / static_cast<double>(plain.peaks[0]);
    std::printf("%-16s %10.1f %8.3f %14s %10.3f %10s\n", r.name.c_str(), median(r.ms), median(r.time_ratios),
                remat::format_bytes(peak).c_str(), peak_ratio, r.budget ? remat::format_bytes(r.budget).c_str() : "-");
    out << "{\"kind\": \"strategy\", \"name\": " << quoted(r.name) << ", \"label\": " << quoted(r.label)
        << ", \"ms\": " << json_list(r.ms) << ", \"peaks\": " << json_list(r.peaks)
        << ", \"time_ratio\": {\"median\": " << num(median(r.time_ratios))
        << ", \"min\": " << num(*std::min_element(r.time_ratios.begin(), r.time_ratios.end()))
        << ", \"max\": " << num(*std::max_element(r.time_ratios.begin(), r.time_ratios.end()))
        << "}, \"peak\": " << peak << ", \"peak_ratio\": " << num(peak_ratio)
        << ", \"in_backward\": " << (r.in_backward ? "true" : "false")
        << ", \"optimizer_state\": " << quoted(r.state_disk ? "disk" : "memory") << ", \"covers\": "
        << quoted(!r.in_backward
                      ? "parameters, gradients (alive throughout the step), " + state_name + ", activations, the loss"
                  : !r.state_disk ? "parameters, " + state_name +
                                        " (in memory), gradients from their accumulation to their parameter's update, "
                                        "activations, the loss"
                                  : "parameters, the " + state_name +
                                        " in memory (read ahead, being updated, writes in flight), gradients from "
                                        "their accumulation to their parameter's update, activations, the loss");
    if (r.in_backward) {
      out << ", \"state_offloaded\": " << json_list(r.state_offloaded)
          << ", \"state_misses\": " << json_list(r.state_misses);
    }
    if (r.budget) {
      out << ", \"budget\": " << r.budget << ", \"predicted_peak\": " << r.predicted_peak
          << ", \"inflight\": " << r.inflight << ", \"predicted_ms\": " << num(r.predicted_ms)
          << ", \"plan\": " << quoted(r.plan);
    }
    out << "}\n";
  }
  std::printf("wrote %s\n", out_path.c_str());
  return 0;
}
