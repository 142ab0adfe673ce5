// CheckpointedSequential with a per-stage menu (ProfileOptions::
// selective_levels and offload): the planner mixes multi-level recompute,
// op-level saves and offload in one schedule. Training steps are compared
// bitwise with plain ones (parameters and BatchNorm statistics, after SGD
// steps), the measured peak against the budget and the prediction, the
// floor against the chain without a menu; offload leaves no files; errors
// are pinned.
#include "common.h"

#include <chrono>
#include <filesystem>
#include <thread>

#include <remat/plan/plan.h>
#include <remat/sequential.h>

#include "../src/offload/offload_internal.h"

using namespace remat_test;
using torch::Tensor;

namespace {

const bool kTracking = (remat::memory::enable_tracking(), true);

torch::nn::Sequential cnn(uint64_t seed) {
  torch::manual_seed(seed);
  torch::nn::Sequential s;
  for (int i = 0; i < 5; ++i) s->push_back(ResBlock(8));
  return s;
}

/** Parameters then buffers, cloned. */
std::vector<Tensor> state_of(torch::nn::Module& m) {
  std::vector<Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.detach().clone());
  for (const auto& b : m.buffers()) out.push_back(b.detach().clone());
  return out;
}

struct Case {
  const char* name;
  std::function<torch::nn::Sequential(uint64_t)> make;
  std::vector<int64_t> input;
};

/** SGD steps (dense loss), the RNG seeded alike; returns the state. The
 *  gradients are zeroed, not set to none: the chain's model leaves out
 *  parameter gradients, which then exist before every step but the first. */
std::vector<Tensor> train(torch::nn::Sequential seq, const std::function<Tensor(const Tensor&)>& forward,
                          const std::vector<Tensor>& xs, std::vector<remat::StepReport>* reports = nullptr,
                          const remat::CheckpointedSequential* net = nullptr) {
  torch::optim::SGD opt(seq->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  torch::manual_seed(11);
  for (const auto& x : xs) {
    opt.zero_grad(/*set_to_none=*/false);
    // The loss as its own statement: a temporary y would outlive the chain's
    // last backward (the model frees a_L there).
    const Tensor loss = forward(x).pow(2).mean();
    loss.backward();
    opt.step();
    if (reports && net) reports->push_back((*net)->last_step());
  }
  return state_of(*seq);
}

void expect_equal_state(const std::vector<Tensor>& a, const std::vector<Tensor>& b, const std::string& where) {
  ASSERT_EQ(a.size(), b.size()) << where;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(torch::equal(a[i], b[i]))
        << where << ": tensor " << i << " differs by up to " << (a[i] - b[i]).abs().max().item<double>();
  }
}

}  // namespace

// The menu lowers the chain's floor and the planner uses it: at the
// leanest budget, at the floor without a menu, and halfway to store-all,
// every step is bitwise a plain step (BatchNorm statistics and dropout
// masks included), its measured peak within the budget and the prediction,
// and the disk store's files are gone after each step.
TEST(SequentialMenu, PlansMixLevelsAndOffloadBitwiseWithinBudget) {
  const std::vector<Case> cases = {
      {"CNN with BatchNorm", cnn, {8, 8, 16, 16}},
      {"GPT blocks with dropout", [](uint64_t s) { return six_gpt_blocks(s, 0.1); }, {4, 32, 64}},
  };
  int used_total = 0;
  for (const Case& c : cases) {
    const std::string dir = fresh_dir("menu_offload");
    remat::ProfileOptions popts;
    popts.selective_levels(2).offload(
        {remat::OffloadOptions(remat::OffloadTarget::kDisk).directory(dir).min_bytes(0).max_inflight_bytes(128 << 10),
         remat::OffloadOptions(remat::OffloadTarget::kMemory).codec(remat::Codec::kLz4).min_bytes(0)});
    std::vector<Tensor> xs;
    torch::manual_seed(3);
    for (int k = 0; k < 3; ++k) xs.push_back(torch::randn(c.input).requires_grad_(true));
    torch::nn::Sequential ref = c.make(1);
    const std::vector<Tensor> want = train(
        ref, [&](const Tensor& x) { return ref->forward(x); }, xs);

    // The menu, and the floors with and without it.
    torch::nn::Sequential probe_seq = c.make(1);
    const remat::plan::Chain chain = remat::profile(probe_seq, xs[0], popts);
    const remat::plan::Chain bare = remat::profile(probe_seq, xs[0]);
    int options = 0;
    for (const auto& s : chain.stages) options += static_cast<int>(s.options.size());
    ASSERT_GT(options, 0) << c.name;
    // In flight: max_inflight_bytes (no tensor saved here is larger).
    const int64_t margin = 128 << 10;
    const int64_t floor_bare = remat::plan::min_feasible_peak_bytes(bare);
    remat::plan::Chain no_disk = chain;  // plans without disk offload need no in-flight margin
    for (auto& st : no_disk.stages) {
      std::erase_if(st.options, [](const remat::plan::StageOption& o) { return o.name == "offload disk"; });
    }
    const int64_t floor_menu =
        std::min(remat::plan::min_feasible_peak_bytes(chain) + margin, remat::plan::min_feasible_peak_bytes(no_disk));
    const int64_t top = remat::plan::store_all(chain).prediction.peak_bytes;
    std::printf("  %-24s %d options; floor %s with the menu, %s without; store-all %s\n", c.name, options,
                remat::format_bytes(floor_menu).c_str(), remat::format_bytes(floor_bare).c_str(),
                remat::format_bytes(top).c_str());
    EXPECT_LE(floor_menu, floor_bare) << c.name;
    // With 128 KiB in flight, disk offload lowers the GPT blocks' floor (1.00 MiB -> 833 KiB).
    if (std::string(c.name).rfind("GPT", 0) == 0) {
      EXPECT_LT(floor_menu, floor_bare * 0.9) << c.name;
    }

    int64_t buffer_bytes = 0;
    for (const auto& b : probe_seq->buffers()) buffer_bytes += b.numel() * b.element_size();
    int used = 0;
    for (const int64_t budget :
         {floor_menu, floor_bare + (top - floor_bare) / 4, floor_bare + (top - floor_bare) / 2}) {
      const std::string where = std::string(c.name) + " at " + remat::format_bytes(budget);
      torch::nn::Sequential seq = c.make(1);
      remat::CheckpointedSequential net(seq, activations_only().memory_budget_bytes(budget).profile(popts));
      std::vector<remat::StepReport> reports;
      const std::vector<Tensor> got = train(
          seq, [&](const Tensor& x) { return net->forward(x); }, xs, &reports, &net);
      expect_equal_state(want, got, where);
      const remat::plan::Plan& p = net->plan();
      bool disk = false;
      for (const auto& op : p.schedule.ops) {
        used += op.option != 0;
        disk = disk || (op.option != 0 && net->chain().stages[op.stage].options[op.option - 1].name == "offload disk");
      }
      EXPECT_LE(p.prediction.peak_bytes, budget) << where;
      // The menu never costs time: the same profile without it is no
      // faster, in the persistent class or over all schedules.
      remat::plan::Chain stripped = net->chain();
      for (auto& st : stripped.stages) st.options.clear();
      if (budget >= remat::plan::min_feasible_peak_bytes(stripped)) {
        const remat::plan::Plan q = remat::plan::optimal(stripped, budget, 500, remat::plan::OptimalScope::kPersistent);
        const remat::plan::Plan q_all = remat::plan::optimal(stripped, budget);
        EXPECT_LE(p.prediction.time_ms, q.prediction.time_ms * 1.0001 + 1e-9) << where;
        EXPECT_LE(p.prediction.time_ms, q_all.prediction.time_ms * 1.0001 + 1e-9) << where;
        std::printf("    predicted %.3f ms with the menu; without it %.3f ms (persistent), %.3f ms (all schedules)\n",
                    p.prediction.time_ms, q.prediction.time_ms, q_all.prediction.time_ms);
      }
      // The model leaves out parameter gradients: the first step makes them.
      for (size_t k = 1; k < reports.size(); ++k) {
        const remat::StepReport& r = reports[k];
        EXPECT_LE(r.chain_peak_bytes, budget + 64 + buffer_bytes) << where << "\n" << net->explain();
        // A plan that offloads to disk may have up to the margin in flight.
        const int64_t in_flight = disk ? margin : 0;
        EXPECT_LE(r.chain_peak_bytes,
                  static_cast<int64_t>(1.02 * p.prediction.peak_bytes) + 64 + buffer_bytes + in_flight)
            << where << "\n"
            << net->explain();
      }
      EXPECT_EQ(files_in(dir), 0u) << where;
      std::printf("    budget %s: predicted %s, measured %s; %s\n", remat::format_bytes(budget).c_str(),
                  remat::format_bytes(p.prediction.peak_bytes).c_str(),
                  remat::format_bytes(reports.back().chain_peak_bytes).c_str(),
                  p.schedule.ops.empty() ? "" : remat::plan::to_string(p.schedule.ops[0]).c_str());
    }
    used_total += used;
  }
  EXPECT_GT(used_total, 0) << "no plan used an option";
}

TEST(SequentialMenu, ErrorsNameTheValueAndTheRemedy) {
  auto seq = cnn(2);
  auto x = torch::randn({2, 8, 8, 8});
  EXPECT_EQ(error_of([&] { remat::profile(seq, x, remat::ProfileOptions().selective_levels(-1)); }),
            "[remat::profile] selective_levels is -1; it must be >= 0 (0: no selective levels on the stages' menus).");
  EXPECT_EQ(
      error_of([&] {
        remat::profile(seq, x, remat::ProfileOptions().offload({remat::OffloadOptions(remat::OffloadTarget::kHost)}));
      }),
      "[remat::profile] offload option 0 (kHost, codec kNone): kHost moves accelerator tensors to pinned host memory "
      "and keeps CPU tensors where they are, so it saves nothing here; use kDisk with a directory, or kMemory with a "
      "codec.");
  EXPECT_EQ(
      error_of([&] {
        remat::profile(seq, x, remat::ProfileOptions().offload({remat::OffloadOptions(remat::OffloadTarget::kMemory)}));
      }),
      "[remat::profile] offload option 0 (kMemory, codec kNone): kMemory without a codec keeps every byte in memory; "
      "give it a codec (kZstd, kLz4), or use kDisk with a directory.");
  // An explicit schedule naming an option the chain was not profiled with.
  remat::plan::Schedule s;
  for (int i = 0; i < 5; ++i) s.ops.push_back({remat::plan::OpKind::kForwardSave, i, i == 0 ? 1 : 0});
  for (int i = 4; i >= 0; --i) s.ops.push_back({remat::plan::OpKind::kBackward, i});
  remat::CheckpointedSequential net(seq, remat::SequentialOptions().schedule(s));
  EXPECT_EQ(
      error_of([&] { net->forward(x); }),
      "[remat::plan] invalid schedule at op 0, forward_save(0, option 1) (stage \"0:remat_test::ResBlockImpl\"): no "
      "option 1; "
      "the stage has 0 (1..0; 0 keeps everything).");
  // The all-schedules scope applies to the chain without its menu; the
  // menu is planned in the persistent class, and the faster plan runs.
  remat::CheckpointedSequential all(seq, remat::SequentialOptions()
                                             .memory_budget_fraction(0.7)
                                             .scope(remat::plan::OptimalScope::kAll)
                                             .profile(remat::ProfileOptions().selective_levels(1)));
  EXPECT_EQ(all->forward(x).sizes(), x.sizes());
}

// count_parameter_gradients: a step whose backward allocates the parameter
// gradients (zero_grad setting them to none) is planned with them, so the
// chain's measured peak stays within the budget; a step that keeps them
// (zeroed in place) gets the plan without them, from the same profile.
TEST(SequentialMenu, ParameterGradientsCountedWhenTheBackwardAllocatesThem) {
  for (const bool set_to_none : {true, false}) {
    torch::nn::Sequential seq = six_gpt_blocks(4, 0.0);
    torch::manual_seed(5);
    const Tensor x = torch::randn({2, 16, 64}).requires_grad_(true);
    // (The output is dropped once the loss is computed: count_held_output
    // off, so that grad_bytes(0) above input_bytes means gradients.)
    // The chain as planned with the gradients allocated (from a first step
    // with every .grad undefined): a budget a third of the way from its
    // floor to its store-all peak.
    remat::plan::Chain charged;
    {
      remat::CheckpointedSequential probe(
          seq, remat::SequentialOptions().memory_budget_fraction(1.0).count_parameter_gradients(true).count_held_output(
                   false));
      for (auto& p : seq->parameters()) p.mutable_grad() = Tensor();
      probe->plan(x);
      charged = probe->chain();
    }
    const int64_t low = remat::plan::min_feasible_peak_bytes(charged);
    const int64_t budget = low + (remat::plan::store_all(charged).prediction.peak_bytes - low) / 3;
    remat::CheckpointedSequential net(
        seq, remat::SequentialOptions().memory_budget_bytes(budget).count_parameter_gradients(true).count_held_output(
                 false));
    torch::optim::SGD opt(seq->parameters(), torch::optim::SGDOptions(0.01));
    for (int step = 0; step < 3; ++step) {
      opt.zero_grad(set_to_none);
      const Tensor loss = net->forward(x).pow(2).mean();
      loss.backward();
      opt.step();
      const remat::StepReport r = net->last_step();
      const int64_t predicted = net->plan().prediction.peak_bytes;
      const bool allocated = set_to_none || step == 0;
      const std::string where = std::string(set_to_none ? "set to none" : "zeroed") + ", step " + std::to_string(step);
      EXPECT_LE(r.chain_peak_bytes, budget + 16384) << where << "\n" << net->explain();
      EXPECT_LE(predicted, budget) << where;
      // Never above the plan; below it by at most one stage's gradients
      // when they are allocated (the profile times a stage's backward with
      // one parameter gradient at a time, the plan adds them all): 13% here.
      EXPECT_LE(r.chain_peak_bytes, predicted + 16384) << where << "\n" << net->explain();
      EXPECT_GE(static_cast<double>(r.chain_peak_bytes), (allocated ? 0.85 : 0.97) * static_cast<double>(predicted))
          << where << "\n"
          << net->explain();
      std::printf("  %s: predicted %s, measured %s\n", where.c_str(), remat::format_bytes(predicted).c_str(),
                  remat::format_bytes(r.chain_peak_bytes).c_str());
      // The plan charges the gradients to the boundary gradients exactly when they are allocated.
      EXPECT_EQ(net->chain().grad_bytes(0) > net->chain().input_bytes, allocated) << where;
    }
    EXPECT_EQ(net->profiles(), 1);
  }
}

// NOTE [chain offload priced by the step]: steps whose disk offload runs
// far slower than profiled (writers held back here, as a slow disk would)
// reprice the disk options, two in a row, and the next forward
// solves again; training stays bitwise a plain run's.
TEST(SequentialMenu, SlowDiskRepricesOffloadFromTheMeasuredStep) {
  const std::string dir = fresh_dir("menu_reprice");
  const auto popts = remat::ProfileOptions().offload(
      {remat::OffloadOptions(remat::OffloadTarget::kDisk).directory(dir).min_bytes(0).max_inflight_bytes(128 << 10)});
  torch::manual_seed(3);
  std::vector<Tensor> xs;
  for (int k = 0; k < 4; ++k) xs.push_back(torch::randn({4, 32, 64}).requires_grad_(true));
  torch::nn::Sequential ref = six_gpt_blocks(1, 0.1);
  const std::vector<Tensor> want = train(
      ref, [&](const Tensor& x) { return ref->forward(x); }, xs);

  // The leanest budget: only plans that offload to disk fit.
  torch::nn::Sequential probe_seq = six_gpt_blocks(1, 0.1);
  const remat::plan::Chain chain = remat::profile(probe_seq, xs[0], popts);
  const int64_t budget = remat::plan::min_feasible_peak_bytes(chain) + (128 << 10);
  torch::nn::Sequential seq = six_gpt_blocks(1, 0.1);
  remat::CheckpointedSequential net(seq, activations_only().memory_budget_bytes(budget).profile(popts));
  // The first two steps stall the disk writers for three times the
  // profile's predicted step (and 150 ms more): far over the prediction
  // however loaded the machine, whose profile is slow too. The next two run
  // at the disk's own speed, far under the repriced prediction.
  std::vector<double> predicted, measured;
  double stall_ms = 0, slow_step_ms = 0;
  std::string how;
  const std::vector<Tensor> got = train(
      seq,
      [&](const Tensor& x) {
        if (!predicted.empty()) measured.push_back(net->last_step().chain_ms);
        predicted.push_back(net->plan(x).prediction.time_ms);
        if (predicted.size() == 1) stall_ms = 3 * predicted[0] + 150;
        if (predicted.size() == 3) {
          how = net->explain();
          slow_step_ms = net->last_step().chain_ms;
        }
        if (predicted.size() <= 2) {
          remat::detail::pause_offload_writers(true);
          std::thread resume([stall_ms] {
            std::this_thread::sleep_for(std::chrono::microseconds(static_cast<int64_t>(1000 * stall_ms)));
            remat::detail::pause_offload_writers(false);
          });
          resume.detach();
        }
        Tensor y = net->forward(x);
        return y;
      },
      xs);
  expect_equal_state(want, got, "slow disk");
  // Two slow steps in a row charge the excess and the next forward solves
  // again at the new prices.
  ASSERT_EQ(predicted.size(), 4u);
  EXPECT_EQ(predicted[1], predicted[0]);     // one slow step charges nothing
  EXPECT_GE(slow_step_ms, 0.95 * stall_ms);  // the stall's thread starts just before the chain's clock
  EXPECT_GT(predicted[2], 1.5 * predicted[0]);
  EXPECT_NE(how.find("disk offload repriced 1x from measured steps"), std::string::npos) << how;
  EXPECT_EQ(predicted[3], predicted[2]) << net->explain();  // one fast step gives nothing back
  // The disk recovers: two steps in a row well under the repriced
  // prediction give the surcharge back, never below the profile's prices.
  measured.push_back(net->last_step().chain_ms);
  const double recovered = net->plan(xs[0]).prediction.time_ms;
  std::string how2 = net->explain() + "\nsteps (predicted / measured ms):";
  for (size_t k = 0; k < measured.size(); ++k)
    how2 += " " + std::to_string(predicted[k]) + " / " + std::to_string(measured[k]);
  std::printf("%s\n", how2.c_str());
  EXPECT_LT(recovered, predicted[2]) << how2;
  EXPECT_GE(recovered, predicted[0] * (1 - 1e-9)) << how2;
  EXPECT_NE(how2.find("disk offload repriced 2x from measured steps"), std::string::npos) << how2;
  EXPECT_EQ(files_in(dir), 0u);
}
