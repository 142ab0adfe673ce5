// The planner's model of a whole training step: the measured memory of one
// profiled step, cut into segments at the events of its units (forward
// begin and end, backward begin and end of every call of every unit), and
// per unit a menu of options with their measured costs per call. A choice
// of one option per unit changes the memory of the segments each call
// covers (its forward, the interval it keeps bytes live, its backward) and
// adds time; the solver picks the fastest choice whose predicted peak fits
// a budget, exactly: a dynamic program when the step is a chain (each unit
// called once, the later outer units' windows inside the earlier ones' kept
// intervals, as in a sequential model, and each inner unit's windows inside
// its outer unit's) or a chain per micro-batch (each unit called once per
// micro-batch, each micro-batch's windows after the one before's), an
// integer program solved by GLPK otherwise (skips across units, a unit
// called twice within one backward, as a GAN's discriminator).
// Torch-free: the auto layer (src/auto) fills a StepModel from a profiled
// step.
//
// Memory rule: under a choice, segment s peaks at
//   segment_peak_bytes[s] + sum over calls c of their unit u with option k:
//     forward_peak(k) - forward_peak(0)    for s in [forward_begin, forward_end)
//     kept(k) - kept(0)                    for s in [forward_end, backward_begin)
//     backward_peak(k) - backward_peak(0)  for s in [backward_begin, backward_end)
//   less, when the call has a release point r (release_begin >= 0),
//     released(k) - released(0)            for s in [r, e)
//   with e = release_end, or backward_end when release_end is -1
// where option 0 is the one the step was profiled with. The release is
// what an option lets go of the call's inputs once nothing else holds them
// (from r, when the profiled step saw the caller let them go). Time: the profiled
// step's time plus, per call, time(k) - time(0).
//
// Inputs two calls hold (pair_unit >= 0): an input that an earlier call
// also saves (a ResNet block's input is the output its previous block's
// ReLU saves) is freed only while both let go of it: the call's segments
// in [pair_begin, backward_begin) are pair_bytes less when its option and
// the earlier call's unit's option both do (pair_lets_go,
// pair_other_lets_go). The backward's reload of it is in each call's
// backward_peak_bytes.
//
// Units inside units: a unit whose calls run inside another unit's names it
// as its parent. Inside a recomputed or offloaded unit it runs as part of
// that unit (whose options were measured with it inside, plain), so it may
// take an option other than 0 only while its parent and every ancestor run
// option 0; the deltas then add up as above, since option 0 of every
// ancestor is the profiled one.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace remat::plan {

/** What one call of a unit costs under one option. Bytes are measured
 *  from the bytes live when the call's forward starts. */
struct StepCost {
  /** Forward plus backward time of the call (recompute, transfers
   *  included), ms. */
  double time_ms = 0;
  /** Peak during the call's forward, bytes above its start. */
  int64_t forward_peak_bytes = 0;
  /** Held from the end of its forward to the start of its backward, bytes
   *  above its start (its outputs included). */
  int64_t kept_bytes = 0;
  /** Peak during its backward, bytes above its forward's start (what it
   *  keeps, the gradients and the recompute's working set included). */
  int64_t backward_peak_bytes = 0;
  /** Bytes of the call's inputs that this option does not hold and option
   *  0 does, credited from the call's release_begin to its backward's end
   *  (nothing else holds them then; the backward's reload of them is in
   *  backward_peak_bytes). 0 without a release point. */
  int64_t released_bytes = 0;
};

/** One call of a unit in the step: where its windows lie on the segment
 *  axis (0 <= forward_begin <= forward_end <= backward_begin <=
 *  backward_end <= segments), and its cost under each option of its unit. */
struct StepCall {
  /** Segment indices where its forward, kept interval and backward start;
   *  backward_end is one past its backward's last segment. */
  ///@{
  int64_t forward_begin = 0, forward_end = 0, backward_begin = 0, backward_end = 0;
  ///@}
  /** One per option of the unit, in the unit's order. */
  std::vector<StepCost> costs;
  /** The segment from which only this call holds the inputs that options
   *  release (forward_end <= release_begin <= backward_begin), or -1: none
   *  (StepCost::released_bytes is then ignored). */
  int64_t release_begin = -1;
  /** One past the last segment of the credit: where option 0 may have let
   *  the inputs go in its backward (backward_begin <= release_end <=
   *  backward_end), or -1: the backward's end. */
  int64_t release_end = -1;
  /** Inputs this call shares with an earlier call that saves them too: that
   *  call's unit (an index into StepModel::units; -1: none) and call index. */
  ///@{
  int64_t pair_unit = -1, pair_call = 0;
  ///@}
  /** Bytes freed when both let go of them. */
  int64_t pair_bytes = 0;
  /** The segment from which only the two calls hold them (forward_end <=
   *  pair_begin <= backward_begin); the credit ends at backward_begin. */
  int64_t pair_begin = -1;
  /** Per option of this call's unit, and per option of the earlier call's
   *  unit: whether it lets go of them (never option 0, which holds them). */
  ///@{
  std::vector<bool> pair_lets_go{}, pair_other_lets_go{};
  ///@}
};

/** A unit: one decision (the same option for all its calls). */
struct StepUnit {
  std::string name;                  ///< for reports and errors ("blocks.3")
  std::vector<std::string> options;  ///< option names; [0] is the one profiled ("keep")
  std::vector<StepCall> calls;       ///< every call in the step, in forward order
  /** The unit whose calls this one's run inside (an index into
   *  StepModel::units), or -1: it may take an option other than 0 only
   *  while every ancestor runs option 0. */
  int64_t parent = -1;
};

/** The profiled step. */
struct StepModel {
  /** Peak bytes of each segment of the profiled step (everything live: the
   *  units' kept bytes, parameters, gradients, optimizer state...). */
  std::vector<int64_t> segment_peak_bytes;
  /** Optional, one per segment: what ran then ("forward of blocks.3"). */
  std::vector<std::string> segment_labels;
  /** Time of the profiled step, ms. */
  double step_time_ms = 0;
  /** The units. */
  std::vector<StepUnit> units;
};

/** Throws remat::Error naming the first inconsistency (windows out of
 *  order or range, a cost list of the wrong length, negative bytes, a
 *  non-finite time, an empty menu, a parent out of range or a cycle of
 *  parents, a shared-input credit that names no other unit's call, starts
 *  outside the call's kept interval or gives flags for the wrong number of
 *  options). */
void validate(const StepModel& model);

/** Keeps the first `count` options of unit `unit` (at least option 0):
 *  its names, every call's costs, and the shared-input flags that name its
 *  options, its own and those of the calls paired with it. Throws
 *  remat::Error for a unit out of range. */
void truncate_options(StepModel& model, size_t unit, size_t count);

/** A choice of one option per unit and what it is predicted to cost. */
struct StepPrediction {
  std::vector<int> choice;             ///< option index per unit
  int64_t peak_bytes = 0;              ///< max over segments
  int64_t peak_segment = -1;           ///< where it is reached
  double time_ms = 0;                  ///< step time
  std::vector<int64_t> segment_bytes;  ///< predicted peak of every segment
};

/** The prediction of a choice (one option index per unit). Exact under the
 *  memory rule above, in integer bytes. Throws remat::Error for a choice
 *  that gives a unit an option other than 0 inside an ancestor that runs
 *  one. */
StepPrediction simulate_step(const StepModel& model, const std::vector<int>& choice);

/** Solver settings. */
struct StepSolveOptions {
  /** Seconds for one call of solve_step or min_peak_step, all its GLPK
   *  programs together (each gets what is left, at least 1 ms); past it
   *  the call reports the gap or that it stopped. GLPK's LP relaxation
   *  after its presolver runs to its end, so a call may overrun by that
   *  much. solve_step_variants and min_peak_step_variants: one limit for
   *  all their variants together (each solve gets what is left). */
  double time_limit_s = 30;
};

/** The solver's answer. */
struct StepPlan {
  StepPrediction prediction;  ///< the choice and its cost
  int64_t budget_bytes = 0;   ///< what it was solved for
  /** "fastest fits" (every unit's fastest option fits the budget and
   *  respects the nesting), "chain DP" (every unit called once, or once
   *  per micro-batch with the micro-batches one after another; the outer
   *  units' windows nested as a chain's, inner units' inside their outer
   *  unit's: an exact dynamic program over the kept bytes, in integer
   *  bytes), "GLPK" (the 0-1 program, any structure) or "leanest options"
   *  (GLPK stopped at its time limit with nothing that fits, and each
   *  unit's option that keeps the fewest bytes does: a plan, not the
   *  fastest). */
  std::string solver;
  /** True when the solver proved the choice optimal (gap 0); for
   *  min_peak_step, its peak the least in integer bytes and its time the
   *  least at that peak. */
  bool optimal = false;
  /** (time - best bound) / best bound when stopped early; 0 when optimal;
   *  infinity when the plan is not the program's (no bound to measure it
   *  by). min_peak_step: the peak program's gap when it stopped early,
   *  or (peak - bound) / bound when its choice's exact peak, in bytes,
   *  could not be proved the least, the bound being GLPK's on every
   *  choice's peak less 1e-9 of the largest peak a choice may reach (its
   *  LP's tolerance). */
  double relative_gap = 0;
  /** True when a program stopped at the time limit before the plan was
   *  proved (optimal is then false): a longer limit may find better.
   *  False when optimal, and when only GLPK's tolerances left the plan
   *  unproved (min_peak_step at peaks of terabytes: relative_gap says by
   *  how much). */
  bool timed_out = false;
  double solve_ms = 0;  ///< wall time of the solve, ms
  /** solve_step_variants, min_peak_step_variants: the variant chosen (an
   *  index into their list); -1 elsewhere. */
  int64_t variant = -1;
  /** Rows and columns of the integer program after removing rows that
   *  every choice satisfies. */
  ///@{
  int64_t rows = 0, columns = 0;
  ///@}
};

/** The fastest choice whose predicted peak is <= budget_bytes. Throws
 *  remat::Error when none fits: the message gives the smallest feasible
 *  peak and the unit whose window sets it; or, when GLPK stopped at the time
 *  limit before it found a choice that fits (and each unit's leanest option
 *  does not fit either), an error that says so, with the remedy. */
StepPlan solve_step(const StepModel& model, int64_t budget_bytes, const StepSolveOptions& options = {});

/** The choice with the smallest predicted peak (the fastest among those).
 *  When GLPK stops at the time limit, the leaner of what it found and each
 *  unit's leanest option, with optimal false: a leaner choice may exist. */
StepPlan min_peak_step(const StepModel& model, const StepSolveOptions& options = {});

/** One variant of a step: the same units with some options withheld,
 *  every segment's bytes shifted and time added. remat's whole-step
 *  planner makes one per placement of the optimizers' state (its bytes off
 *  each segment, less what its store holds in flight there) and per tier
 *  of offload (the options that send to a store withheld, or the stores'
 *  in-flight bytes added). */
struct StepVariant {
  /** Per unit, how many of its options it offers, from option 0 (which it
   *  always offers); a missing entry or 0: all. */
  std::vector<size_t> options_offered;
  /** Per segment, bytes added to its peak (below 0: taken off); empty:
   *  none. A shift takes off at most what every choice leaves there (the
   *  state of an optimizer is there whatever the units do). */
  std::vector<int64_t> segment_shift_bytes;
  /** Added to the step's time, ms. */
  double time_ms = 0;
  /** Per unit, per option: ms added to the step's time when the unit takes
   *  that option (below 0: taken off; a disk store's options cost less
   *  where it may hold more in flight); a missing entry: none. */
  std::vector<std::vector<double>> option_time_ms;
};

/** The step model of one variant: its options withheld (truncate_options),
 *  its shifts added to segment_peak_bytes, its time to step_time_ms and its
 *  option times to the options' costs (of each unit's first call).
 *  Throws remat::Error for a shift list whose length is neither 0 nor the
 *  number of segments, more offered counts or option-time lists than
 *  units, more option times than a unit has options, a time that is not
 *  finite, or option times for a unit with no calls. */
StepModel apply_variant(const StepModel& model, const StepVariant& variant);

/** The fastest plan over every variant, each solved as solve_step solves
 *  apply_variant(model, variant) under budget_bytes, within one time
 *  limit for them all; the earlier variant among equally fast ones.
 *  StepPlan::variant names the one chosen, and the prediction is that
 *  variant's (its shifts and time included); optimal only when every
 *  variant's solve was (timed_out: one stopped at the time limit).
 *  Throws remat::Error for an empty list and, when no variant has a plan
 *  that fits, solve_step's error for the variant whose least peak is
 *  smallest. */
StepPlan solve_step_variants(const StepModel& model, const std::vector<StepVariant>& variants, int64_t budget_bytes,
                             const StepSolveOptions& options = {});

/** The choice with the smallest predicted peak over every variant
 *  (min_peak_step of each), the fastest among equal peaks;
 *  StepPlan::variant names its variant. Throws remat::Error for an empty
 *  list. */
StepPlan min_peak_step_variants(const StepModel& model, const std::vector<StepVariant>& variants,
                                const StepSolveOptions& options = {});

/** Where segment s lies: "in the forward of unit 'blocks.3' (call 2 of 3)",
 *  "in the backward of ...", "in " + its label, or "outside every unit". */
std::string describe_segment(const StepModel& model, int64_t segment);

}  // namespace remat::plan
