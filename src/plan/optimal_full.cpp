// FullDp: the dynamic program that is exact over all schedules of the op model
// (at the DP's discretization). See docs/planner.md, "All schedules".
//
// NOTE [Canonical schedules]
// Drop every value right after its last read (this never raises memory or
// time). A phase (the ops up to the next backward) sweeps from the largest
// live value at or below its stage; if values are made only by the sweep of
// the phase that first needs them, the live checkpoints form a stack, a value
// is read only while it is the top, and it is popped either right after the
// first forward of a sweep it starts, or after its own backward. (That premise
// is argued, not proven; tests/plan compare against an exhaustive search over
// every schedule.) Two subproblems follow (m: memory units the
// subproblem may use; grad_{j+1} live at the start, grad_k at the end):
//  P(c, j, m): a_c held by the caller (not counted). Phases j..c.
//    base (j == c) / A: forward_save(c), P(c+1, j, m - |s_c|), backward(c).
//    B(k2), c < k2 <= j: forward(c), F(c+1, j, k2, m), P(c, k2-1, m).
//  Q(c, j, k, m), c < k <= j: a_c counted here and popped here. Phases j..k.
//    pop:     forward(c), drop(c), F(c+1, j, k, m).
//    keep(k2), k < k2 <= j: forward(c), F(c+1, j, k2, m - |a_c|), Q(c, k2-1, k, m).
//  F(c, j, k, m) = P(c, j, m - |a_c|) then drop(c) if k == c, else Q(c, j, k, m).
// rotor's P (Beaumont et al.) is the special case where every Q pops at once
// along a sweep and ends in a P (k == the sweep's end).
// Shared bytes (Stage::shared_input_bytes): a value computed from a live
// predecessor counts Slots::an while that predecessor lives. P's caller and a
// keep hold a_c through F(c+1, ...), so those F see a_{c+1} at an[c+1]; a pop
// drops a_c first, so its F sees a[c+1]. Q rows come in both kinds (pl).
#include <algorithm>
#include <string>

#include <sys/mman.h>

#include "dp.h"
#include "remat/plan/error.h"

namespace remat::plan::internal {

// Not under TSan: the clone's ifunc resolver runs while the dynamic loader
// relocates, before TSan's runtime exists, and its instrumented prologue
// crashes every binary that links this file (make test-tsan).
#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__) && !defined(__SANITIZE_THREAD__)
__attribute__((target_clones("avx2", "default")))
#endif
void min_sum(Cost* out, const Cost* x, const Cost* y, Cost c, int lo, int top) {
  for (int m = lo; m <= top; ++m) {
    const Cost v = c + x[m] + y[m];
    out[m] = v < out[m] ? v : out[m];
  }
}

double FullDp::table_bytes(int L, int M, bool shared) {
  const double l = L, rows = l * (l + 1) / 2 + (shared ? 2 : 1) * (l - 2) * (l - 1) * l / 6;
  return rows * (static_cast<double>(M) + 1) * sizeof(Cost);
}

double FullDp::work(int L, int M, bool shared) {
  const double l = L;
  return (shared ? 2 : 1) * l * l * l * l / 24 * (static_cast<double>(M) + 1);
}

namespace {
/** Tables from 32 MiB up (to ~1 GB) are anonymous maps asking for transparent
 *  huge pages: their one pass otherwise page-faults every 4 KiB, a third of
 *  the DP's time at L = 128. Smaller ones come from new[]. Not filled here:
 *  fill_q writes each row, INF first. */
constexpr size_t kMapFrom = size_t{32} << 20;

Cost* map_table(size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    throw Error("[remat::plan] optimal: cannot map " + format_bytes(static_cast<int64_t>(bytes)) +
                " for the DP table; lower memory_slots or use OptimalScope::kPersistent.");
#ifdef MADV_HUGEPAGE
  madvise(p, bytes, MADV_HUGEPAGE);
#endif
  return static_cast<Cost*>(p);
}
}  // namespace

void FullDp::Release::operator()(Cost* p) const {
  if (!p) return;
  if (mapped_bytes > 0) munmap(p, mapped_bytes);
  else delete[] p;
}

FullDp::FullDp(const Slots& s) : d_(s), width_(static_cast<size_t>(s.M) + 1) {
  const int L = d_.L;
  qoff_.assign(L + 1, 0);
  for (int c = 0; c < L; ++c) {
    // Layer c holds Q(c, j, k) for c < k <= j <= L-1; a_0 is never popped.
    const size_t n = c == 0 ? 0 : static_cast<size_t>(L - 1 - c) * (L - c) / 2;
    qoff_[c + 1] = qoff_[c] + n;
  }
  const size_t prows = static_cast<size_t>(L) * (L + 1) / 2, qrows = qoff_[L] * (d_.shared ? 2 : 1);
  p_.assign(prows * width_, kInf);
  const size_t q_bytes = std::max<size_t>(1, qrows * width_) * sizeof(Cost);
  if (q_bytes >= kMapFrom) q_ = std::unique_ptr<Cost, Release>(map_table(q_bytes), Release{q_bytes});
  else q_ = std::unique_ptr<Cost, Release>(new Cost[q_bytes / sizeof(Cost)], Release{0});
  p_need_.assign(prows, d_.M + 1);
  p_sat_.assign(prows, 0);
  p_least_.assign(prows, kInf);
  q_need_.assign(qrows, d_.M + 1);
  q_sat_.assign(qrows, 0);
  q_least_.assign(qrows, kInf);
  for (int c = L - 1; c >= 0; --c)
    for (int j = c; j < L; ++j) {
      fill_p(c, j);
      if (c > 0)
        for (int k = c + 1; k <= j; ++k) {
          fill_q(c, j, k, false);
          if (d_.shared) fill_q(c, j, k, true);
        }
    }
}

FullDp::Row FullDp::frow(int c, int j, int k, bool pl) const {
  if (k == c) {
    const size_t r = prow(c, j);
    const int ac = d_.val(c, pl);
    return {&p_[r * width_] - ac, p_need_[r] + ac, p_sat_[r] + ac, p_least_[r]};
  }
  const size_t r = qrow(c, j, k, pl);
  return {&q_.get()[r * width_], q_need_[r], q_sat_[r], q_least_[r]};
}

namespace {
int first_finite(const Cost* v, int M) {
  int m = 0;
  while (m <= M && v[m] == kInf) ++m;
  return m;
}

/** First m in [lo, hi + 1) with out[m] <= bound; out is nonincreasing in m
 *  (every option is, being a sum of nonincreasing rows). */
int first_at_most(const Cost* out, int lo, int hi, Cost bound) {
  // Most options are pruned outright or not at all: test the ends first.
  if (lo > hi || out[lo] <= bound) return lo;
  if (out[hi] > bound) return hi + 1;
  while (lo <= hi) {
    const int mid = lo + (hi - lo) / 2;
    if (out[mid] <= bound) hi = mid - 1;
    else lo = mid + 1;
  }
  return lo;
}
}  // namespace

void FullDp::fill_p(int c, int j) {
  const int M = d_.M, D = d_.dst(j);
  const size_t r = prow(c, j);
  Cost* out = &p_[r * width_];
  // base / A. From m = sat on, store-all of c..j fits: each stage runs forward
  // and backward once, which no option can beat, so the others stop there.
  int lo = std::max(D + d_.sv[c] + d_.ft[c], d_.bk[c]);
  const Cost fb = static_cast<Cost>(d_.f[c] + d_.b[c]);
  if (j == c) {
    p_sat_[r] = lo;
    const Cost base = static_cast<Cost>(d_.base_ms(c));
    for (int m = lo; m <= M; ++m) out[m] = base;
  } else {
    const size_t rc = prow(c + 1, j);
    p_sat_[r] = std::max(lo, d_.sv[c] + p_sat_[rc]);
    lo = std::max(lo, p_need_[rc] + d_.sv[c]);
    const Cost* child = &p_[rc * width_] - d_.sv[c];
    for (int m = lo; m <= M; ++m) out[m] = fb + child[m];
  }
  const int hi = std::min(M, p_sat_[r] - 1);
  const int fwd = d_.an[c + 1] + d_.fp[c] + D;
  const Cost fc = static_cast<Cost>(d_.f[c]);
  for (int k2 = c + 1; k2 <= j; ++k2) {
    const Row right = frow(c + 1, j, k2, true);
    const size_t rl = prow(c, k2 - 1);
    const Cost* left = &p_[rl * width_];
    const Cost* rv = right.v;
    const int lo = std::max({fwd, right.need, p_need_[rl]});
    if (lo > hi) continue;
    // The option is >= fc + the rows' least values, so it can only improve
    // the m where out (nonincreasing in m) is still above that. The least
    // values sit beside the rows: pruning touches no row (misses dominate).
    const int top = first_at_most(out, lo, hi, fc + right.least + p_least_[rl]) - 1;
    min_sum(out, rv, left, fc, lo, top);
  }
  p_need_[r] = first_finite(out, M);
  p_least_[r] = out[M];
}

void FullDp::fill_q(int c, int j, int k, bool pl) {
  const int M = d_.M;
  const size_t r = qrow(c, j, k, pl);
  Cost* out = &q_.get()[r * width_];
  const int ac = d_.val(c, pl);
  const int fwd = ac + d_.an[c + 1] + d_.fp[c] + d_.dst(j);
  const Cost fc = static_cast<Cost>(d_.f[c]);
  const Row pop = frow(c + 1, j, k, false);
  // From m = sat on, popping at once and storing all of k..j fits: every stage
  // of c..j forwarded once and k..j backwarded once, the least possible.
  q_sat_[r] = std::max(fwd, pop.sat);
  const int pop_lo = std::max(fwd, pop.need);
  int need = std::min(pop_lo, M + 1);
  std::fill(out, out + need, kInf);
  for (int m = need; m <= M; ++m) out[m] = fc + pop.v[m];
  const int hi = std::min(M, q_sat_[r] - 1);
  for (int k2 = k + 1; k2 <= j; ++k2) {
    const Row right = frow(c + 1, j, k2, true);
    const size_t rl = qrow(c, k2 - 1, k, pl);
    const int lo = std::max({fwd, right.need + ac, q_need_[rl]});
    if (lo > hi) continue;
    const int top = first_at_most(out, lo, hi, fc + right.least + q_least_[rl]) - 1;
    if (top < lo) continue;
    const Cost* rv = right.v - ac;
    const Cost* left = &q_.get()[rl * width_];
    min_sum(out, rv, left, fc, lo, top);
    need = std::min(need, lo);  // rows are finite from their need on
  }
  q_need_[r] = need;
  q_least_[r] = out[M];
}

bool FullDp::feasible() const { return p_need_[prow(0, d_.L - 1)] <= d_.M; }

Schedule FullDp::schedule(int m) const {
  Schedule s;
  emit_p(s.ops, 0, d_.L - 1, m);
  return s;
}

namespace {
[[noreturn]] void no_option() {
  throw Error("[remat::plan] optimal: internal error: no option reproduces the DP value.");
}
}  // namespace

// The emitters re-evaluate each option with fill_p / fill_q's arithmetic in
// the same order, so the option the fill kept matches exactly.
void FullDp::emit_p(std::vector<Op>& ops, int c, int j, int m) const {
  while (true) {
    const Cost target = p_[prow(c, j) * width_ + m];
    const int D = d_.dst(j);
    const int lo = std::max(D + d_.sv[c] + d_.ft[c], d_.bk[c]);
    const Cost fb = static_cast<Cost>(d_.f[c] + d_.b[c]);
    if (j == c) {
      if (m < lo || static_cast<Cost>(d_.base_ms(c)) != target) no_option();
      ops.push_back({OpKind::kForwardSave, c});
      ops.push_back({OpKind::kBackward, c});
      return;
    }
    const size_t rc = prow(c + 1, j);
    if (m >= lo && m - d_.sv[c] >= p_need_[rc] && fb + p_[rc * width_ + (m - d_.sv[c])] == target) {
      ops.push_back({OpKind::kForwardSave, c});
      emit_p(ops, c + 1, j, m - d_.sv[c]);
      ops.push_back({OpKind::kBackward, c});
      return;
    }
    const int fwd = d_.an[c + 1] + d_.fp[c] + D;
    const Cost fc = static_cast<Cost>(d_.f[c]);
    int pick = -1;
    for (int k2 = c + 1; k2 <= j && pick < 0; ++k2) {
      const Row right = frow(c + 1, j, k2, true);
      const size_t rl = prow(c, k2 - 1);
      if (m >= std::max({fwd, right.need, p_need_[rl]}) && fc + right.v[m] + p_[rl * width_ + m] == target) pick = k2;
    }
    if (pick < 0) no_option();
    ops.push_back({OpKind::kForward, c});
    emit_f(ops, c + 1, j, pick, true, m);
    j = pick - 1;  // a_c still held: P(c, pick - 1, m)
  }
}

void FullDp::emit_f(std::vector<Op>& ops, int c, int j, int k, bool pl, int m) const {
  if (k > c) return emit_q(ops, c, j, k, pl, m);
  emit_p(ops, c, j, m - d_.val(c, pl));
  ops.push_back({OpKind::kDrop, c});
}

void FullDp::emit_q(std::vector<Op>& ops, int c, int j, int k, bool pl, int m) const {
  while (true) {
    const Cost target = q_.get()[qrow(c, j, k, pl) * width_ + m];
    const int ac = d_.val(c, pl);
    const int fwd = ac + d_.an[c + 1] + d_.fp[c] + d_.dst(j);
    const Cost fc = static_cast<Cost>(d_.f[c]);
    const Row pop = frow(c + 1, j, k, false);
    ops.push_back({OpKind::kForward, c});
    if (m >= std::max(fwd, pop.need) && fc + pop.v[m] == target) {
      ops.push_back({OpKind::kDrop, c});
      return emit_f(ops, c + 1, j, k, false, m);
    }
    int pick = -1;
    for (int k2 = k + 1; k2 <= j && pick < 0; ++k2) {
      const Row right = frow(c + 1, j, k2, true);
      const size_t rl = qrow(c, k2 - 1, k, pl);
      if (m >= std::max({fwd, right.need + ac, q_need_[rl]}) &&
          fc + right.v[m - ac] + q_.get()[rl * width_ + m] == target)
        pick = k2;
    }
    if (pick < 0) no_option();
    emit_f(ops, c + 1, j, pick, true, m - ac);
    j = pick - 1;  // a_c still live: Q(c, pick - 1, k, m)
  }
}

}  // namespace remat::plan::internal
