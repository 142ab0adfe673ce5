// Internal: how the whole-step planner (auto) sees and drives a
// CheckpointedSequential. A chain is one unit of the step; its options are
// schedules of its own planner (store-all, then the optimal schedule at
// several budgets between its leanest feasible peak and store-all), so the
// stage-level DP, with the stages' selective and offload levers, runs
// inside the whole-step plan.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <remat/checkpointable.h>
#include <remat/plan/schedule.h>
#include <remat/sequential.h>

namespace remat::detail {

/** One schedule a chain offers: a name for explain(), the schedule, and
 *  the chain planner's prediction of it (peak includes the chain's input). */
struct ChainOption {
  std::string name;
  plan::Schedule schedule;
  plan::Prediction predicted;
};

/** Runs the chain's call again on `inputs` (its tensors, flattened) under a
 *  schedule (nullopt: store-all), returning the result's tensors. Valid
 *  only while ChainObserver::begin runs. */
using ChainRun =
    std::function<std::vector<at::Tensor>(const std::optional<plan::Schedule>&, const std::vector<at::Tensor>&)>;
/** The chain's options for this call's input shape (profiling the chain
 *  first if needed): store-all first, then the distinct optimal schedules
 *  at `budgets` budgets spread from the leanest feasible peak up. */
using ChainMenu = std::function<std::vector<ChainOption>(int budgets)>;

/** Sees every call of a CheckpointedSequential on this thread while
 *  installed (the whole-step profiler), as UnitObserver sees Checkpointables. */
class ChainObserver {
 public:
  virtual ~ChainObserver() = default;
  /** Before the chain's call runs; nullptr lets it run unobserved. */
  virtual std::unique_ptr<UnitObserver::Call> begin(CheckpointedSequentialImpl& chain,
                                                    const std::vector<at::Tensor>& inputs, const ChainRun& run,
                                                    const ChainMenu& menu) = 0;
};

/** This thread's chain observer, or nullptr. */
ChainObserver* chain_observer();
/** Installs `o` on this thread (nullptr removes it); returns the previous one. */
ChainObserver* set_chain_observer(ChainObserver* o);

/** The schedule the whole-step planner sets on a chain, overriding its own
 *  options' plan for every later call: store-all (its "keep"), or a given
 *  schedule (checked against each call's profiled chain). */
struct ForcedSchedule {
  bool store_all = true;
  plan::Schedule schedule;  // when !store_all
};

/** What auto may reach inside a chain (a friend of the chain). */
struct ChainAccess {
  /** nullptr: the chain runs its own options' plan again. */
  static void force(CheckpointedSequentialImpl& chain, std::shared_ptr<const ForcedSchedule> forced);
  /** The schedule forced on it now (nullptr: none), to be given back. */
  static std::shared_ptr<const ForcedSchedule> forced(CheckpointedSequentialImpl& chain);
  /** Its step budget (SequentialOptions::step_memory_budget_bytes), which
   *  a whole-step plan would contradict. */
  static int64_t step_budget(const CheckpointedSequentialImpl& chain) {
    return chain.options().step_memory_budget_bytes();
  }
};

}  // namespace remat::detail
