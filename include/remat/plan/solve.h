// Checkpointing algorithms: each returns a valid Schedule for a Chain plus the
// simulator's prediction for it. optimal() also picks among each stage's
// options (Stage::options: selective levels, offload, as measured by the
// runtime); the others run every forward_save as is. The memory model is
// the one in schedule.h.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "remat/plan/chain.h"
#include "remat/plan/schedule.h"

namespace remat::plan {

/** A schedule, the algorithm that made it, and its simulated cost. */
struct Plan {
  /** "store-all", "uniform:4", "sqrt", "greedy", "revolve:3", "optimal". */
  std::string algorithm;
  Schedule schedule;  ///< the ops to run
  /** simulate(chain, schedule). */
  Prediction prediction;
  /** optimal only (-1 otherwise): a lower bound, ms, on the time of every
   *  schedule of the class optimal() searched (optimal_scope()) whose peak
   *  fits the budget. See docs/planner.md, "Discretization and its bound". */
  double lower_bound_ms = -1;
  /** optimal only (-1 otherwise): prediction.time_ms - lower_bound_ms, ms:
   *  the most this schedule can be slower than the exact optimum at the same
   *  budget (0: optimal, up to the DPs' float sums, ~1e-7 relative). */
  double optimality_gap_ms = -1;
  /** optimal only (0 otherwise): bytes per memory slot of the finest
   *  discretization solved (the sizes' gcd when the DP was exact in bytes). */
  int64_t memory_unit_bytes = 0;
  /** optimality_gap_ms / lower_bound_ms (0.01 = 1%); -1 when there is no bound. */
  double relative_gap() const {
    if (optimality_gap_ms < 0) return -1;
    return lower_bound_ms > 0 ? optimality_gap_ms / lower_bound_ms : 0;
  }
};

/** Every stage forward_save'd once, then every backward: minimal time, maximal memory. */
Plan store_all(const Chain& chain);

/** torch.utils.checkpoint.checkpoint_sequential: k segments of L/k stages
 *  (integer division; the last one takes the rest); all but the last segment
 *  run without saving and keep only their input, the last one runs plain.
 *  Requires 1 <= k; k > L is clamped to L. */
Plan uniform(const Chain& chain, int segments);

/** uniform(chain, round(sqrt(L))). */
Plan sqrt_schedule(const Chain& chain);

/** Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost", greedy
 *  segmentation: walking the chain, a stage's output becomes a segment boundary
 *  once the saved bytes since the last boundary exceed a threshold. Searches the
 *  threshold for the fastest schedule whose peak fits budget_bytes; throws
 *  Error (naming greedy's smallest peak and the smallest feasible one) if none fits. */
Plan greedy(const Chain& chain, int64_t budget_bytes);

/** Griewank & Walther, ACM TOMS Algorithm 799 (Revolve): the binomial schedule
 *  for `slots` checkpoint slots, a_0 occupying one. Uses step counts only, so it
 *  is optimal for homogeneous chains and merely valid for others. slots >= 1. */
Plan revolve(const Chain& chain, int slots);

/** Which schedules optimal() searches (docs/planner.md, "Which schedules"). */
enum class OptimalScope {
  /** kAll while its DP stays cheap (at most kOptimalAutoWork cell updates,
   *  about L^4 M / 24, and kOptimalAutoTableBytes of table: up to L = 83 at
   *  500 slots, at most about 0.3 s per DP pass here), else kPersistent. */
  kAuto,
  /** Every schedule of the op model. O(L^4 M) time, O(L^3 M) memory. */
  kAll,
  /** Rotor's class: a checkpoint is kept until its own backward.
   *  O(L^3 M) time, O(L^2 M) memory. */
  kPersistent,
};
/** kAuto's bound on the full DP's work, cell updates (1e9). */
inline constexpr double kOptimalAutoWork = 1e9;
/** kAuto's bound on the full DP's table, bytes (256 MiB). */
inline constexpr double kOptimalAutoTableBytes = 256.0 * (1 << 20);
/** optimal() refines its discretization until the bound on its gap to the
 *  exact optimum (Plan::optimality_gap_ms) is at most this fraction of the
 *  lower bound, or until the next refinement would exceed kOptimalRefineWork. */
inline constexpr double kOptimalGapTarget = 1e-3;
/** Cell updates (the DPs' work() estimates, summed over every DP solved) past
 *  which optimal() stops refining; the first discretization always runs. */
inline constexpr double kOptimalRefineWork = 1e9;

/** "auto", "all", "persistent" -> OptimalScope; throws Error naming the text. */
OptimalScope parse_optimal_scope(std::string_view text);
/** "auto", "all", "persistent". */
const char* optimal_scope_name(OptimalScope scope);

/** Minimal-time schedule under budget_bytes, multi-level included (and each
 *  forward_save's stage option, for a chain with options: persistent
 *  schedules only, see Chain's Stage::options), by a dynamic
 *  program over memory discretized into at least memory_slots units: Beaumont,
 *  Eyraud-Dubois, Herrmann, Joly, Shilova, "Optimal checkpointing for
 *  heterogeneous chains" (rotor), extended to schedules that drop a checkpoint
 *  before its backward. Exact in bytes when the sizes' gcd allows it cheaply;
 *  otherwise sizes are rounded down (a lower bound, Plan::lower_bound_ms) and
 *  up (a schedule that fits), and the discretization is refined while the gap
 *  between them exceeds kOptimalGapTarget, within kOptimalRefineWork. The
 *  simulated peak is always <= budget_bytes. Throws Error naming the smallest
 *  feasible peak if no schedule fits. */
Plan optimal(const Chain& chain, int64_t budget_bytes, int memory_slots = 500,
             OptimalScope scope = OptimalScope::kAuto);

/** The class optimal(chain, budget_bytes, memory_slots, requested) searches:
 *  kAll or kPersistent (kAll when store-all fits, which is then optimal over
 *  every schedule). */
OptimalScope optimal_scope(const Chain& chain, int64_t budget_bytes, int memory_slots = 500,
                           OptimalScope requested = OptimalScope::kAuto);

/** Smallest peak over persistent schedules (checkpoints kept until their
 *  backward; exact, no discretization). A schedule that drops a checkpoint
 *  and recomputes it later can peak lower on some chains with
 *  backward_freed_bytes (found by fuzz/solve_fuzz), so over all schedules
 *  this is an upper bound of the smallest peak; optimal() refuses budgets
 *  below it in every scope. */
int64_t min_feasible_peak_bytes(const Chain& chain);

/** A schedule reaching min_feasible_peak_bytes (fastest among those the exact
 *  min-peak recursion considers). */
Plan min_memory(const Chain& chain);

/** Where min_memory() peaks, for errors that say what sets a chain's least
 *  peak. */
struct PeakSite {
  int64_t peak_bytes = 0;  ///< min_feasible_peak_bytes(chain)
  /** The op of min_memory() at its peak (a forward, forward_save or
   *  backward of stage op.stage). */
  Op op{OpKind::kBackward, 0, 0};
  /** That stage's own bytes during the op: its input (unless it is a_0),
   *  what it saves or its output, its temporaries, and in a backward the
   *  gradients at its output and input. The rest of peak_bytes is a_0 and
   *  what other stages hold (checkpoints, saved sets). */
  int64_t stage_bytes = 0;
};
/** min_memory()'s peak op and its stage's share (PeakSite). */
PeakSite min_peak_site(const Chain& chain);

/** The algorithms solve() runs: store_all(), uniform(), sqrt_schedule(),
 *  greedy(), revolve(), optimal(). */
enum class Algorithm { kStoreAll, kUniform, kSqrt, kGreedy, kRevolve, kOptimal };

/** What solve() runs; the algorithm is required, the rest has defaults. */
struct SolveOptions {
  /** Options for algorithm; the other fields start at their defaults. */
  explicit SolveOptions(Algorithm algorithm) : algorithm(algorithm) {}
  Algorithm algorithm;  ///< which algorithm solve() runs
  /** Memory budget in bytes for greedy and optimal (required by them). */
  int64_t budget_bytes = -1;
  /** Segments for uniform (default 4); slots for revolve (default 4). */
  int param = 0;
  /** First discretization of optimal's DP (default 500); optimal() refines it (see optimal()). */
  int memory_slots = 500;
  /** Which schedules optimal searches. */
  OptimalScope scope = OptimalScope::kAuto;

  /** Sets budget_bytes (bytes); returns *this. */
  SolveOptions& with_budget_bytes(int64_t v) {
    budget_bytes = v;
    return *this;
  }
  /** Sets param (uniform's segments, revolve's slots); returns *this. */
  SolveOptions& with_param(int v) {
    param = v;
    return *this;
  }
  /** Sets memory_slots; returns *this. */
  SolveOptions& with_memory_slots(int v) {
    memory_slots = v;
    return *this;
  }
  /** Sets scope; returns *this. */
  SolveOptions& with_scope(OptimalScope v) {
    scope = v;
    return *this;
  }
};

/** Parses "optimal", "greedy", "sqrt", "store-all", "uniform:K", "revolve:S"
 *  (budget left unset). Throws Error naming the text. */
SolveOptions parse_algorithm(std::string_view spec);

/** Dispatches to the algorithm; throws Error if a needed budget is missing. */
Plan solve(const Chain& chain, const SolveOptions& options);
/** solve(chain, parse_algorithm(spec).with_budget_bytes(budget_bytes)). */
Plan solve(const Chain& chain, std::string_view spec, int64_t budget_bytes = -1);

/** One point of pareto(): a budget and the optimal plan under it. */
struct ParetoPoint {
  int64_t budget_bytes;  ///< the budget solved for, bytes
  Plan plan;             ///< optimal()'s plan for it (its peak may be lower)
};

/** The time/peak frontier of optimal(): budgets from min_feasible_peak_bytes to
 *  the store-all peak (`points` of them, evenly spaced); only points not
 *  dominated (lower peak or lower time than every other) are returned, by
 *  increasing peak. */
std::vector<ParetoPoint> pareto(const Chain& chain, int points = 24, int memory_slots = 500,
                                OptimalScope scope = OptimalScope::kAuto);

/** Revolve's model as a Chain: `steps` unit stages (forward 1 ms, backward
 *  0 ms) in which a boundary value costs 1 byte and a saved set `slots + 1`
 *  bytes, plus the budget (2 * slots + 4 bytes) under which the feasible
 *  schedules are exactly those keeping at most `slots` checkpoints (a_0
 *  included) besides the state being advanced. See docs/planner.md. */
struct HomogeneousProblem {
  Chain chain;           ///< `steps` unit stages, a_0 of 1 byte
  int64_t budget_bytes;  ///< 2 * slots + 4
};
/** The HomogeneousProblem of `steps` stages and `slots` slots (both >= 1;
 *  throws Error otherwise). */
HomogeneousProblem homogeneous_problem(int steps, int slots);

}  // namespace remat::plan
