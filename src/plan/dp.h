// The two dynamic programs behind optimal(), over a chain whose sizes are
// discretized into memory slots; not installed. See docs/planner.md, "The DP".
//  - PersistentDp: rotor's recursion (Beaumont et al.), exact over persistent
//    schedules (a checkpoint is kept until its own backward). O(L^3 M).
//  - FullDp: adds subproblems in which a checkpoint is dropped after its last
//    use as a sweep source and its range is redone from an earlier one; exact
//    over all schedules of the op model. O(L^4 M).
// Both reconstruct by re-evaluating the options of the cells on the path with
// the same arithmetic as the fill (no argmin table).
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include "remat/plan/schedule.h"

namespace remat::plan::internal {

/** The DPs' time type: float halves the tables' memory traffic (the DPs are
 *  bandwidth-bound) at a relative precision of ~6e-8 on times. */
using Cost = float;
inline constexpr Cost kInf = std::numeric_limits<Cost>::infinity();

/** out[m] = min(out[m], c + x[m] + y[m]) for m in [lo, top]: both DPs' inner
 *  loop (also compiled for AVX2, picked at load time; same IEEE sums). */
void min_sum(Cost* out, const Cost* x, const Cost* y, Cost c, int lo, int top);

/** A chain in slot units: sizes rounded up to the unit, capped at M + 1. */
struct Slots {
  int L = 0;
  int M = 0;               // slots available besides a_0
  std::vector<int32_t> a;  // |a_j|, j in [0, L]
  std::vector<int32_t> g;  // |grad_j| (Chain::grad_bytes), j in [0, L]
  /** |a_j| net of what it shares with the a_{j-1} it was computed from
   *  (Chain::new_value_bytes(j - 1)), j in [1, L]; an[0] = a[0]. */
  std::vector<int32_t> an;
  /** Some stage shares bytes with its input (FullDp then keeps two kinds of
   *  Q rows: the caller's a_{c-1} live or not). */
  bool shared = false;
  std::vector<int32_t> sv;  // saved_bytes net of shared_input_bytes (a_s is live at every forward_save)
  std::vector<int32_t> ft;  // forward_tmp_bytes (forward_save)
  std::vector<int32_t> fp;  // Stage::plain_tmp_bytes() (plain forward)
  /** A backward's own peak: saved + |grad_{s+1}| + |grad_s| + tmp - freed
   *  - shared, rounded once (so rounding stays one-sided). */
  std::vector<int32_t> bk;
  std::vector<double> f, b;  // ms
  /** A forward_save's ms when early stop cuts it: recompute_ms where
   *  profiled, else f. */
  std::vector<double> fr;
  /** A stage's other options (Stage::options), sizes as above. Only
   *  PersistentDp reads them (optimal() plans chains with options in that
   *  scope only). */
  struct Opt {
    int32_t sv, ft, bk;
    double f, b;
  };
  std::vector<std::vector<Opt>> opt;  // per stage; option k >= 1 is opt[s][k - 1]
  /** ms of a subproblem's base case, forward_save(t) then backward(t): for
   *  t < L-1 the backward has started and nothing reads a_{t+1} before
   *  backward(t) (stage t+1 is done), so the forward_save is cut short. */
  double base_ms(int t) const { return (t == L - 1 ? f[t] : fr[t]) + b[t]; }
  /** |grad_{t+1}| while stages ..t wait for their backward; 0 for t = L-1
   *  (the loss gradient appears at backward(L-1)). */
  int dst(int t) const { return t == L - 1 ? 0 : g[t + 1]; }
  /** a_j's bytes while it is live: an[j] while the a_{j-1} it was computed
   *  from is live too (then that holds the shared bytes), else a[j]. */
  int val(int j, bool pred_live) const { return pred_live ? an[j] : a[j]; }
};

class PersistentDp {
 public:
  explicit PersistentDp(const Slots& s);
  /** Bytes of the cost table for L stages and M slots. */
  static double table_bytes(int L, int M);
  /** Cell updates of the fill, about L^3 (M + 1) / 6 (an upper bound). */
  static double work(int L, int M);
  bool feasible() const;
  /** Least m (slots) at which the whole chain is feasible; M + 1 if none. */
  int need() const { return need_[row(0, d_.L - 1)]; }
  /** Least time of the whole chain within m <= M slots (kInf below need()). */
  Cost cost(int m) const { return cost_[row(0, d_.L - 1) * width_ + m]; }
  /** The schedule reaching cost(m), need() <= m <= M; schedule() is at M. */
  Schedule schedule(int m) const;
  Schedule schedule() const { return schedule(d_.M); }

 private:
  size_t row(int s, int t) const { return static_cast<size_t>(t) * (t + 1) / 2 + s; }
  /** -1 - k for option A under stage option k (the base case too), else s'. */
  int choice(int s, int t, int m) const;
  void emit(std::vector<Op>& ops, int s, int t, int m) const;

  const Slots& d_;
  size_t width_;
  std::vector<Cost> cost_;
  std::vector<int32_t> need_, sat_;
};

class FullDp {
 public:
  explicit FullDp(const Slots& s);
  /** shared: Slots::shared (twice the Q rows). */
  static double table_bytes(int L, int M, bool shared);
  /** Cell updates of the fill, about L^4 (M + 1) / 24 (an upper bound),
   *  twice that with shared. */
  static double work(int L, int M, bool shared);
  bool feasible() const;
  int need() const { return p_need_[prow(0, d_.L - 1)]; }
  Cost cost(int m) const { return p_[prow(0, d_.L - 1) * width_ + m]; }
  Schedule schedule(int m) const;
  Schedule schedule() const { return schedule(d_.M); }

 private:
  /** F(c, j, k): P(c, j) seen from a caller counting a_c (k == c), else Q.
   *  least: a lower bound of the row over every m, kept beside the rows so
   *  that pruning an option does not touch the rows (cache misses dominate). */
  struct Row {
    const Cost* v;  // indexed by m
    int need, sat;
    Cost least;
  };
  size_t prow(int s, int t) const { return static_cast<size_t>(t) * (t + 1) / 2 + s; }
  /** pl: the a_{c-1} that a_c was computed from is live (held by the
   *  caller), so a_c counts Slots::an[c]; one kind of row without sharing. */
  size_t qrow(int c, int j, int k, bool pl) const {
    const size_t u = j - c - 1, v = k - c - 1;
    return (pl && d_.shared ? qoff_[d_.L] : 0) + qoff_[c] + u * (u + 1) / 2 + v;
  }
  Row frow(int c, int j, int k, bool pl) const;
  void fill_p(int c, int j);
  void fill_q(int c, int j, int k, bool pl);
  void emit_p(std::vector<Op>& ops, int c, int j, int m) const;
  void emit_f(std::vector<Op>& ops, int c, int j, int k, bool pl, int m) const;
  void emit_q(std::vector<Op>& ops, int c, int j, int k, bool pl, int m) const;

  const Slots& d_;
  size_t width_;
  std::vector<size_t> qoff_;
  std::vector<Cost> p_;
  struct Release {
    size_t mapped_bytes;  // 0: from new[]
    void operator()(Cost* p) const;
  };
  std::unique_ptr<Cost, Release> q_{nullptr, Release{0}};  // rows filled (INF first) when computed
  std::vector<int32_t> p_need_, p_sat_, q_need_, q_sat_;
  std::vector<Cost> p_least_, q_least_;  // value at m = M: the row's least
};

}  // namespace remat::plan::internal
