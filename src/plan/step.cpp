// The whole-step model's simulator and its exact solvers: a dynamic program
// for chains (NOTE [the chain DP], NOTE [phases]), else a 0-1 integer
// program (one binary per unit and non-profiled option, a row per distinct
// memory constraint), solved by GLPK's branch and cut. Leaves out
// heuristics: GLPK proves optimality or reports its gap at the time limit.
#include "remat/plan/step.h"

#if REMAT_HAVE_GLPK
#include <glpk.h>
#endif

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <sstream>

#include "remat/plan/error.h"
#include "step_internal.h"

namespace remat::plan {
using step_detail::Deadline;
using step_detail::LeastPeak;
using step_detail::min_peak_within;
using step_detail::solve_within;
using step_detail::Unproved;
namespace {

std::string fmt_seconds(double s) {
  std::ostringstream os;
  os << s << " s";
  return os.str();
}

std::string fmt_g(double x) {
  std::ostringstream os;
  os << x;
  return os.str();
}

std::string unit_label(const StepModel& m, size_t u) {
  return "unit " + std::to_string(u) + " ('" + m.units[u].name + "')";
}

// The segment's classes for one call: 0 outside, 1 forward, 2 kept, 3
// backward, 4 kept after its release point, 5 backward after the credit.
constexpr int kClasses = 6;
int klass(const StepCall& c, int64_t s) {
  if (s >= c.forward_begin && s < c.forward_end) return 1;
  if (s >= c.forward_end && s < c.backward_begin) return c.release_begin >= 0 && s >= c.release_begin ? 4 : 2;
  if (s >= c.backward_begin && s < c.backward_end) return c.release_end >= 0 && s >= c.release_end ? 5 : 3;
  return 0;
}

bool backward_class(int cls) { return cls == 3 || cls == 5; }

int64_t delta(const StepCall& c, int cls, int k) {
  const StepCost& a = c.costs[k];
  const StepCost& b = c.costs[0];
  const int64_t released = c.release_begin >= 0 ? a.released_bytes - b.released_bytes : 0;
  switch (cls) {
    case 1: return a.forward_peak_bytes - b.forward_peak_bytes;
    case 2: return a.kept_bytes - b.kept_bytes;
    case 3: return a.backward_peak_bytes - b.backward_peak_bytes - released;
    case 4: return a.kept_bytes - b.kept_bytes - released;
    case 5: return a.backward_peak_bytes - b.backward_peak_bytes;
    default: return 0;
  }
}

double added_ms(const StepUnit& u, int k) {
  double t = 0;
  for (const StepCall& c : u.calls) t += c.costs[k].time_ms - c.costs[0].time_ms;
  return t;
}

// NOTE [inputs two calls hold]: a call's credit for an input it shares with
// an earlier call, in force in [pair_begin, backward_begin) when both
// units' options let go of it.
bool has_pair(const StepCall& c) {
  return c.pair_unit >= 0 && c.pair_bytes > 0 &&
         std::find(c.pair_lets_go.begin(), c.pair_lets_go.end(), true) != c.pair_lets_go.end() &&
         std::find(c.pair_other_lets_go.begin(), c.pair_other_lets_go.end(), true) != c.pair_other_lets_go.end();
}
bool in_pair_window(const StepCall& c, int64_t s) { return s >= c.pair_begin && s < c.backward_begin; }

// The calls with a pair credit some choice can earn: (unit, call).
std::vector<std::pair<size_t, size_t>> pairs_of(const StepModel& m) {
  std::vector<std::pair<size_t, size_t>> out;
  for (size_t u = 0; u < m.units.size(); ++u) {
    for (size_t c = 0; c < m.units[u].calls.size(); ++c) {
      if (has_pair(m.units[u].calls[c])) out.emplace_back(u, c);
    }
  }
  return out;
}

// The first unit given an option other than 0 inside an ancestor that runs
// one, and that ancestor; {-1, -1} when the choice respects the nesting.
std::pair<int64_t, int64_t> nesting_violation(const StepModel& m, const std::vector<int>& choice) {
  for (size_t u = 0; u < m.units.size(); ++u) {
    if (choice[u] == 0) continue;
    for (int64_t a = m.units[u].parent; a >= 0; a = m.units[a].parent) {
      if (choice[a] != 0) return {static_cast<int64_t>(u), a};
    }
  }
  return {-1, -1};
}

// Every unit's fastest option, each on its own (may break the nesting).
std::vector<int> fastest_choice(const StepModel& m) {
  std::vector<int> fastest(m.units.size(), 0);
  for (size_t u = 0; u < m.units.size(); ++u) {
    for (size_t k = 1; k < m.units[u].options.size(); ++k) {
      if (added_ms(m.units[u], static_cast<int>(k)) < added_ms(m.units[u], fastest[u])) {
        fastest[u] = static_cast<int>(k);
      }
    }
  }
  return fastest;
}

// One memory constraint: rhs_bytes - sum(coef * x) >= 0, where x are the
// non-profiled options of the units the segment touches.
struct Row {
  int64_t peak_bytes;                                          // the profiled segment's peak
  int64_t segment;                                             // a segment reaching it
  std::vector<std::pair<std::vector<int64_t>, size_t>> units;  // (delta per option >= 1, unit index)
  std::vector<std::pair<size_t, int64_t>> pairs;               // (index in pairs_of, bytes credited)
};

// Distinct constraints: segments touched by the same (call, class) set
// differ only in their profiled peak, so the largest one stands for all.
std::vector<Row> rows_of(const StepModel& m) {
  const int64_t n = static_cast<int64_t>(m.segment_peak_bytes.size());
  std::map<std::vector<int64_t>, size_t> seen;
  std::vector<Row> rows;
  const std::vector<std::pair<size_t, size_t>> pairs = pairs_of(m);
  for (int64_t s = 0; s < n; ++s) {
    std::vector<int64_t> key;
    for (size_t u = 0; u < m.units.size(); ++u) {
      const auto& calls = m.units[u].calls;
      for (size_t c = 0; c < calls.size(); ++c) {
        if (int cls = klass(calls[c], s)) {
          key.push_back(static_cast<int64_t>(u));
          key.push_back(static_cast<int64_t>(c) * kClasses + cls);
        }
      }
    }
    const size_t unit_keys = key.size();
    for (size_t i = 0; i < pairs.size(); ++i) {  // pair credits in force: negative entries
      if (in_pair_window(m.units[pairs[i].first].calls[pairs[i].second], s))
        key.push_back(-1 - static_cast<int64_t>(i));
    }
    auto it = seen.find(key);
    if (it != seen.end()) {
      Row& r = rows[it->second];
      if (m.segment_peak_bytes[s] > r.peak_bytes) {
        r.peak_bytes = m.segment_peak_bytes[s];
        r.segment = s;
      }
      continue;
    }
    Row r{m.segment_peak_bytes[s], s, {}, {}};
    for (size_t i = unit_keys; i < key.size(); ++i) {
      const size_t p = static_cast<size_t>(-1 - key[i]);
      r.pairs.emplace_back(p, m.units[pairs[p].first].calls[pairs[p].second].pair_bytes);
    }
    for (size_t i = 0; i < unit_keys; i += 2) {
      const size_t u = static_cast<size_t>(key[i]);
      const StepCall& c = m.units[u].calls[key[i + 1] / kClasses];
      const int cls = static_cast<int>(key[i + 1] % kClasses);
      const size_t options = m.units[u].options.size();
      if (r.units.empty() || r.units.back().second != u) r.units.push_back({std::vector<int64_t>(options - 1, 0), u});
      for (size_t k = 1; k < options; ++k) r.units.back().first[k - 1] += delta(c, cls, static_cast<int>(k));
    }
    seen.emplace(std::move(key), rows.size());
    rows.push_back(std::move(r));
  }
  return rows;
}

constexpr double kMiB = 1024.0 * 1024.0;

// GLPK's objective tolerance: it prunes a branch whose LP bound is within
// tol_obj * (1 + |best|) of the best plan found so far. Its default, 1e-7,
// let it call a plan optimal that was 0.02 ms slower in 631372 ms (3.2e-8:
// two options that hold the same bytes; step_fuzz, fuzz/FINDINGS.md).
// 1e-11 leaves GLPK's proof good to the rounding of the summed times.
constexpr double kGlpTolObj = 1e-11;

// The sums of a model's times (the step's and every option's): two
// choices' times that differ by less than kTimeRel of it are equal to
// within the rounding of adding them up.
double time_scale(const StepModel& m) {
  double scale = std::abs(m.step_time_ms);
  for (const StepUnit& u : m.units) {
    for (const StepCall& c : u.calls) {
      for (const StepCost& cost : c.costs) scale += std::abs(cost.time_ms);
    }
  }
  return std::max(scale, 1.0);
}
constexpr double kTimeRel = 1e-12;

// NOTE [GLPK in bytes]: the memory rows are in MiB, and GLPK's tolerances
// hide bytes in them. Its integer tolerance (tol_int, 1e-5): an x within
// it of 0 or 1 counts as integral and is rounded, which moves a row by up
// to 1e-5 of each coefficient (88 B of a 9 MiB option: fuzz/FINDINGS.md).
// Its presolver drops a row whose implied bound on a column is within
// 1e-3 + 1e-6 * |bound| of one it has (npp_implied_lower: 1 KiB). Its
// simplex takes a bound within 1e-7 + 1e-10 * |bound| as met, and a
// reduced cost within as much of 0 as optimal (tol_bnd, tol_dj and 1e-3
// of them, in its scaled rows): the peak program's rows are bounded by
// the peaks themselves, so its optimum, the bound on every choice's peak,
// is good to about 1e-10 of the peak only (up to 127 B high at 1.3 TB,
// 3 B at 40 GB, in a search of random steps). Its pruning: a branch within
// tol_obj * (1 + |best|) of its best (peak_tol_obj). Every choice is
// checked in integer bytes; where GLPK's is off, the program is solved
// again "exactly": no presolve and an integer tolerance that hides under
// 0.5 B per row (not below 1e-9: rows of GiBs may hide a byte or so).
// solve_step's time program is exact from its first run on small
// programs: GLPK 5.0's presolved LP of a 4-column near tie cycled in its
// primal simplex ("numerical instability") until the time limit
// (fuzz/FINDINGS.md, item 12). An
// exact program that fails numerically is solved again with GLPK's
// defaults, and its choice checked in bytes as any. A least peak is
// proved by a row no option lowers below it (least_bytes), or by an exact
// program that finds no choice a byte leaner:
// each tolerance lets more choices in, none keeps one out, so "none"
// holds in bytes (prove_least_peak). Left: the same tolerance lets in a
// choice bytes over a budget; then there is no proof (optimal false,
// relative_gap from GLPK's bound less kLpRel of the peak), and solve_step
// may refuse a budget at the least peak (TB peaks).
constexpr double kGlpTolInt = 1e-5;  // GLPK's default tol_int

// Bytes a row's columns can move it: its coefficients, summed.
double row_bytes(const Row& r) {
  double sum = 0;
  for (const auto& [deltas, u] : r.units) {
    for (int64_t d : deltas) sum += std::abs(static_cast<double>(d));
  }
  for (const auto& [i, bytes] : r.pairs) sum += static_cast<double>(bytes);
  return sum;
}

// The integer tolerance of an exact solve: the x GLPK counts as integral
// hide under 0.5 B in every row.
double exact_tol_int(const std::vector<Row>& rows) {
  double most = 1;
  for (const Row& r : rows) most = std::max(most, row_bytes(r));
  // Not below 1e-9: under that GLPK would branch on its LP's own rounding
  // (rows of a GiB and more then hide up to ~1 B each).
  return std::clamp(0.5 / most, 1e-9, kGlpTolInt);
}

// Bytes: at least |peak| of every choice, the size GLPK's LP tolerances
// are relative to in the peak program.
double peak_scale(const std::vector<Row>& rows) {
  double most = 0;
  for (const Row& r : rows) most = std::max(most, std::abs(static_cast<double>(r.peak_bytes)) + row_bytes(r));
  return most;
}
// GLPK's peak bound less kLpRel of peak_scale bounds every choice's peak:
// ten times its simplex's relative tolerance (1e-10), for the gap it
// reports when the least peak is not proved.
constexpr double kLpRel = 1e-9;

// The peak program's objective tolerance: GLPK's optimum is then a lower
// bound on every choice's peak to within 0.25 B (with the peak in MiB,
// tol_obj * (1 + |peak|) MiB), or to within 1e-14 of the peak beyond 25
// TiB (far above the LP's rounding, ~1e-16 of it: GLPK still prunes ties).
double peak_tol_obj(const std::vector<Row>& rows) {
  return std::clamp(0.25 / (kMiB + peak_scale(rows)), 1e-14, kGlpTolObj);
}

// Whether a choice's exact peak meets GLPK's bound on every choice's
// (bytes): within 0.5 B and 1e-14 of it (the rounding of sums in doubles).
// GLPK's choice is then its optimum: no exact re-solve. Not a proof: the
// bound is good to its LP's tolerance only (NOTE [GLPK in bytes]).
bool meets_bound(int64_t peak_bytes, double bound_bytes) {
  return static_cast<double>(peak_bytes) <= bound_bytes + 0.5 + 1e-14 * std::abs(bound_bytes);
}

enum class Goal { kFastest, kLeastPeak, kAnyFits };

// Options of some units, (unit, option), that no choice may take together
// (each choice that does breaks a row in bytes): a row of the program, in
// whole numbers, that GLPK's tolerances cannot blur.
using Cut = std::vector<std::pair<size_t, int>>;

struct MipResult {
  std::vector<int> choice;
  bool optimal = false;
  bool timed_out = false;   // stopped at the time limit (with or without a choice)
  bool infeasible = false;  // GLPK proved that no choice satisfies the rows
  double gap = 0;
  // The peak program's optimum less its pruning tolerance: a lower bound
  // on every choice's peak, bytes (when optimal).
  double peak_bound_bytes = 0;
  int64_t rows = 0, columns = 0;
};

// A plan for when the integer program stops at its time limit: each unit's
// option that keeps the fewest bytes to its backward (ties: the lower
// backward peak, then the faster), outer units first (a unit inside one that
// does not run option 0 runs as part of it: option 0).
std::vector<int> leanest_guess(const StepModel& m) {
  auto sum = [&](size_t u, int k, auto field) {
    int64_t b = 0;
    for (const StepCall& c : m.units[u].calls) b += c.costs[k].*field;
    return b;
  };
  std::vector<int> choice(m.units.size(), 0);
  for (size_t u = 0; u < m.units.size(); ++u) {
    for (size_t k = 1; k < m.units[u].options.size(); ++k) {
      const int a = static_cast<int>(k), b = choice[u];
      const int64_t ka = sum(u, a, &StepCost::kept_bytes), kb = sum(u, b, &StepCost::kept_bytes);
      const int64_t pa = sum(u, a, &StepCost::backward_peak_bytes), pb = sum(u, b, &StepCost::backward_peak_bytes);
      if (ka < kb || (ka == kb && (pa < pb || (pa == pb && added_ms(m.units[u], a) < added_ms(m.units[u], b))))) {
        choice[u] = a;
      }
    }
  }
  // Ancestors first: a unit whose ancestor runs an option other than 0 runs 0.
  std::vector<size_t> depth(m.units.size(), 0), order(m.units.size());
  for (size_t u = 0; u < m.units.size(); ++u) {
    order[u] = u;
    for (int64_t a = m.units[u].parent; a >= 0; a = m.units[a].parent) ++depth[u];
  }
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return depth[a] < depth[b]; });
  std::vector<int> out(m.units.size(), 0);
  for (size_t u : order) {
    bool free = true;
    for (int64_t a = m.units[u].parent; a >= 0 && free; a = m.units[a].parent) free = out[a] == 0;
    out[u] = free ? choice[u] : 0;
  }
  return out;
}

#if REMAT_HAVE_GLPK
struct GlpProb {
  glp_prob* p = glp_create_prob();
  ~GlpProb() { glp_delete_prob(p); }
};

struct Gap {
  double gap = 0;
};
void gap_callback(glp_tree* tree, void* info) {
  if (glp_ios_reason(tree) == GLP_IBINGO || glp_ios_reason(tree) == GLP_ISELECT) {
    static_cast<Gap*>(info)->gap = glp_ios_mip_gap(tree);
  }
}

// Solves, subject to one option per unit and every row within budget (or
// within the peak variable): kFastest min sum(time * x), kLeastPeak min the
// peak variable, kAnyFits the first choice found (objective 0: a
// feasibility proof needs no time optimized). `exact`: without the
// tolerances that hide bytes (NOTE [GLPK in bytes]). Returns false when the
// program has no solution.
bool solve_mip(const StepModel& m, const std::vector<Row>& rows, int64_t budget_bytes, Goal goal, const Deadline& dl,
               MipResult* out, bool exact = false, const std::vector<Cut>& cuts = {}) {
  const bool min_peak = goal == Goal::kLeastPeak;
  GlpProb prob;
  glp_prob* p = prob.p;
  glp_set_obj_dir(p, GLP_MIN);
  // Columns: x(u, k) for k >= 1; then the peak variable.
  std::vector<int> first_col(m.units.size(), 0);
  int cols = 0;
  for (size_t u = 0; u < m.units.size(); ++u) {
    first_col[u] = cols + 1;
    cols += static_cast<int>(m.units[u].options.size()) - 1;
  }
  const int peak_col = min_peak ? cols + 1 : 0;
  if (min_peak) ++cols;
  // Pair credits (NOTE [inputs two calls hold]): z in [0, 1], at most each
  // unit's sum over the options that let go, so z is 0 unless both do.
  const std::vector<std::pair<size_t, size_t>> pairs = pairs_of(m);
  const int first_pair_col = cols + 1;
  cols += static_cast<int>(pairs.size());
  if (cols == 0) {  // nothing to choose: the profiled choice breaks a row or not
    out->infeasible = std::any_of(rows.begin(), rows.end(), [&](const Row& r) { return r.peak_bytes > budget_bytes; });
    if (out->infeasible) return false;
    out->choice.assign(m.units.size(), 0);
    out->optimal = true;
    return true;
  }
  glp_add_cols(p, cols);
  for (size_t i = 0; i < pairs.size(); ++i) {
    glp_set_col_kind(p, first_pair_col + static_cast<int>(i), GLP_CV);
    glp_set_col_bnds(p, first_pair_col + static_cast<int>(i), GLP_DB, 0, 1);
  }
  for (size_t u = 0; u < m.units.size(); ++u) {
    for (size_t k = 1; k < m.units[u].options.size(); ++k) {
      const int j = first_col[u] + static_cast<int>(k) - 1;
      glp_set_col_kind(p, j, GLP_BV);
      // The peak program minimizes the peak first; time breaks ties only
      // in the second solve (solve_step at the peak found).
      glp_set_obj_coef(p, j, goal == Goal::kFastest ? added_ms(m.units[u], static_cast<int>(k)) : 0.0);
    }
  }
  if (min_peak) {
    glp_set_col_bnds(p, peak_col, GLP_FR, 0, 0);
    glp_set_obj_coef(p, peak_col, 1.0);
  }
  std::vector<int> ia{0}, ja{0};
  std::vector<double> ar{0};
  int row = 0;
  // One option per unit.
  for (size_t u = 0; u < m.units.size(); ++u) {
    if (m.units[u].options.size() < 2) continue;
    glp_add_rows(p, 1);
    ++row;
    glp_set_row_bnds(p, row, GLP_UP, 0, 1);
    for (size_t k = 1; k < m.units[u].options.size(); ++k) {
      ia.push_back(row);
      ja.push_back(first_col[u] + static_cast<int>(k) - 1);
      ar.push_back(1);
    }
  }
  // Units inside units: sum_k x(u, k) + sum_k x(a, k) <= 1 for every
  // ancestor a (u takes an option other than 0 only while a runs option 0).
  for (size_t u = 0; u < m.units.size(); ++u) {
    if (m.units[u].options.size() < 2) continue;
    for (int64_t a = m.units[u].parent; a >= 0; a = m.units[a].parent) {
      if (m.units[a].options.size() < 2) continue;
      glp_add_rows(p, 1);
      ++row;
      glp_set_row_bnds(p, row, GLP_UP, 0, 1);
      for (size_t v : {u, static_cast<size_t>(a)}) {
        for (size_t k = 1; k < m.units[v].options.size(); ++k) {
          ia.push_back(row);
          ja.push_back(first_col[v] + static_cast<int>(k) - 1);
          ar.push_back(1);
        }
      }
    }
  }
  for (size_t i = 0; i < pairs.size(); ++i) {
    const StepCall& c = m.units[pairs[i].first].calls[pairs[i].second];
    const std::pair<size_t, const std::vector<bool>*> sides[] = {
        {pairs[i].first, &c.pair_lets_go}, {static_cast<size_t>(c.pair_unit), &c.pair_other_lets_go}};
    for (const auto& [u, lets_go] : sides) {
      glp_add_rows(p, 1);
      ++row;
      glp_set_row_bnds(p, row, GLP_UP, 0, 0);
      ia.push_back(row);
      ja.push_back(first_pair_col + static_cast<int>(i));
      ar.push_back(1);
      for (size_t k = 1; k < m.units[u].options.size(); ++k) {
        if (!(*lets_go)[k]) continue;
        ia.push_back(row);
        ja.push_back(first_col[u] + static_cast<int>(k) - 1);
        ar.push_back(-1);
      }
    }
  }
  for (const Row& r : rows) {
    glp_add_rows(p, 1);
    ++row;
    for (const auto& [i, bytes] : r.pairs) {
      ia.push_back(row);
      ja.push_back(first_pair_col + static_cast<int>(i));
      ar.push_back(-static_cast<double>(bytes) / kMiB);
    }
    if (min_peak) {
      glp_set_row_bnds(p, row, GLP_UP, 0, -static_cast<double>(r.peak_bytes) / kMiB);
      ia.push_back(row);
      ja.push_back(peak_col);
      ar.push_back(-1);
    } else {
      glp_set_row_bnds(p, row, GLP_UP, 0, static_cast<double>(budget_bytes - r.peak_bytes) / kMiB);
    }
    for (const auto& [deltas, u] : r.units) {
      for (size_t k = 0; k < deltas.size(); ++k) {
        if (deltas[k] == 0) continue;
        ia.push_back(row);
        ja.push_back(first_col[u] + static_cast<int>(k));
        ar.push_back(static_cast<double>(deltas[k]) / kMiB);
      }
    }
  }
  // A cut: sum of x(u, k) over its (u, k >= 1), less the x of every option
  // of its units at 0, stays below the count of its (u, k >= 1).
  for (const Cut& cut : cuts) {
    glp_add_rows(p, 1);
    ++row;
    double taken = 0;
    for (const auto& [u, k] : cut) {
      taken += k > 0 ? 1 : 0;
      for (size_t j = 1; j < m.units[u].options.size(); ++j) {
        if (k > 0 && static_cast<int>(j) != k) continue;
        ia.push_back(row);
        ja.push_back(first_col[u] + static_cast<int>(j) - 1);
        ar.push_back(k > 0 ? 1 : -1);
      }
    }
    glp_set_row_bnds(p, row, GLP_UP, 0, taken - 1);
  }
  if (row == 0) return false;
  glp_load_matrix(p, static_cast<int>(ia.size()) - 1, ia.data(), ja.data(), ar.data());
  glp_iocp parm;
  glp_init_iocp(&parm);
  parm.presolve = GLP_ON;
  parm.msg_lev = GLP_MSG_OFF;
  parm.tm_lim = dl.ms_left();
  parm.tol_obj = min_peak ? peak_tol_obj(rows) : kGlpTolObj;
  out->rows = row;
  out->columns = cols;
  if (exact) {  // as glp_intopt's presolver path prepares its LP: scaled by powers of 2, an advanced basis
    const int term_out = glp_term_out(GLP_OFF);  // glp_adv_basis prints
    glp_scale_prob(p, GLP_SF_GM | GLP_SF_EQ | GLP_SF_2N | GLP_SF_SKIP);
    glp_adv_basis(p, 0);
    glp_term_out(term_out);
    glp_smcp lp;
    glp_init_smcp(&lp);
    lp.msg_lev = GLP_MSG_OFF;
    lp.tm_lim = dl.ms_left();
    const int ret = glp_simplex(p, &lp);
    out->timed_out = ret == GLP_ETMLIM;
    out->infeasible = ret == 0 && glp_get_status(p) == GLP_NOFEAS;
    if (ret != 0 || glp_get_status(p) != GLP_OPT) return false;
    parm.presolve = GLP_OFF;
    parm.tol_int = exact_tol_int(rows);
    parm.tm_lim = dl.ms_left();  // what the LP left
  }
  Gap gap;
  parm.cb_func = gap_callback;
  parm.cb_info = &gap;
  const int ret = glp_intopt(p, &parm);
  const int status = glp_mip_status(p);
  if (ret != 0 && ret != GLP_ETMLIM && ret != GLP_ENOPFS && ret != GLP_ENODFS) {
    if (exact) return false;  // a check that failed (numerical trouble): no answer
    throw Error("[remat::plan] internal: GLPK's glp_intopt returned " + std::to_string(ret) +
                " on the step model; please report it with the model.");
  }
  out->timed_out = ret == GLP_ETMLIM;
  out->infeasible = ret == GLP_ENOPFS || status == GLP_NOFEAS;
  if (status != GLP_OPT && status != GLP_FEAS) return false;
  out->choice.assign(m.units.size(), 0);
  for (size_t u = 0; u < m.units.size(); ++u) {
    for (size_t k = 1; k < m.units[u].options.size(); ++k) {
      if (glp_mip_col_val(p, first_col[u] + static_cast<int>(k) - 1) > 0.5) out->choice[u] = static_cast<int>(k);
    }
  }
  if (exact && nesting_violation(m, out->choice).first >= 0) return false;  // numerical trouble: no answer
  out->optimal = status == GLP_OPT;
  out->gap = out->optimal ? 0 : gap.gap;
  const double z = glp_mip_obj_val(p);  // before rounding its x
  out->peak_bound_bytes = (z - parm.tol_obj * (1 + std::abs(z))) * kMiB;
  return true;
}

#else
bool solve_mip(const StepModel& m, const std::vector<Row>&, int64_t, Goal, const Deadline&, MipResult*, bool = false,
               const std::vector<Cut>& = {}) {
  throw Error("[remat::plan] the step's " + std::to_string(m.units.size()) +
              " units are not a chain (a unit is called more than once, or a unit's windows do not nest in the "
              "earlier ones': a skip across units), and remat was built without GLPK, which solves such steps. "
              "Install Debian's libglpk-dev and rebuild remat.");
}
#endif

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// The profiled choice's rows that some choice can break: the rest are kept
// out of the program.
std::vector<Row> binding_rows(const std::vector<Row>& rows, int64_t budget_bytes) {
  std::vector<Row> out;
  for (const Row& r : rows) {
    int64_t worst = r.peak_bytes;
    for (const auto& unit : r.units) {
      const auto& deltas = unit.first;
      int64_t most = 0;  // the profiled option adds nothing
      for (int64_t d : deltas) most = std::max(most, d);
      worst += most;
    }
    if (worst > budget_bytes) out.push_back(r);
  }
  return out;
}

// The least a row can be, bytes: its profiled peak with each unit's
// leanest option and every pair credited (nesting ignored: a bound below
// every choice's).
int64_t least_bytes(const Row& r) {
  int64_t least = r.peak_bytes;
  for (const auto& unit : r.units) {
    int64_t low = 0;  // the profiled option adds nothing
    for (int64_t d : unit.first) low = std::min(low, d);
    least += low;
  }
  for (const auto& pair : r.pairs) least -= pair.second;
  return least;
}

// GLPK decides in doubles, within its tolerances; its answers are checked
// against the exact rule: one unit's option changed at a time (the nesting
// kept), in integer bytes. A change that `better(candidate, current)`
// accepts is taken, until none is; returns whether one was (then GLPK's
// "optimal" was not).
template <typename Better>
bool descend_one_at_a_time(const StepModel& m, StepPrediction* pred, Better better) {
  bool improved = false;
  for (bool again = true; again;) {
    again = false;
    for (size_t u = 0; u < m.units.size(); ++u) {
      for (size_t k = 0; k < m.units[u].options.size(); ++k) {
        std::vector<int> c = pred->choice;
        if (c[u] == static_cast<int>(k)) continue;
        c[u] = static_cast<int>(k);
        if (nesting_violation(m, c).first >= 0) continue;
        StepPrediction p = simulate_step(m, c);
        if (better(p, *pred)) {
          *pred = std::move(p);
          improved = again = true;
        }
      }
    }
  }
  return improved;
}

// The time program's check: a change that fits the budget and is faster by
// more than rounding.
bool improve_one_at_a_time(const StepModel& m, int64_t budget_bytes, StepPrediction* pred) {
  const double eps = kTimeRel * time_scale(m);
  return descend_one_at_a_time(m, pred, [&](const StepPrediction& p, const StepPrediction& now) {
    return p.peak_bytes <= budget_bytes && p.time_ms < now.time_ms - eps;
  });
}

// The peak program's check: a change whose peak is lower.
bool lower_peak_one_at_a_time(const StepModel& m, StepPrediction* pred) {
  return descend_one_at_a_time(
      m, pred, [](const StepPrediction& p, const StepPrediction& now) { return p.peak_bytes < now.peak_bytes; });
}

// The options of `choice` that set row r's bytes: its units with more
// than one option whose deltas there are not all 0, and both units of each
// credit in force there. Every choice that takes them all gives r the same
// bytes.
Cut row_cut(const StepModel& m, const Row& r, const std::vector<int>& choice) {
  std::vector<size_t> units;
  for (const auto& [deltas, u] : r.units) {
    if (std::any_of(deltas.begin(), deltas.end(), [](int64_t d) { return d != 0; })) units.push_back(u);
  }
  const std::vector<std::pair<size_t, size_t>> pairs = pairs_of(m);
  for (const auto& [i, bytes] : r.pairs) {
    units.push_back(pairs[i].first);
    units.push_back(static_cast<size_t>(m.units[pairs[i].first].calls[pairs[i].second].pair_unit));
  }
  std::sort(units.begin(), units.end());
  units.erase(std::unique(units.begin(), units.end()), units.end());
  Cut cut;
  for (size_t u : units) {
    if (m.units[u].options.size() > 1) cut.emplace_back(u, choice[u]);
  }
  return cut;
}

// Whether every choice peaks at best->peak_bytes or more, in bytes: an
// exact program finds no choice a byte leaner (NOTE [GLPK in bytes]: an
// infeasible program is a proof, GLPK's bound is not). Its LP takes a
// row bytes over as met, so a choice it finds that breaks rows in bytes
// is cut off (row_cut: the options that set each row it breaks) and the
// program solved again; a leaner choice replaces *best (GLPK's optimum was
// off) and is asked about in turn. Before: the choice lowered one option
// at a time and, when its peak is off GLPK's *bound_bytes (GLPK's choice
// is not its optimum), the peak program solved again exactly. Returns
// false, *best the leanest found, after kProofTries programs or at the
// deadline.
constexpr int kProofTries = 16;
// Programs solve_within runs at most: the first, then one per round of cuts.
constexpr int kFitTries = 16;
// Columns up to which solve_within's first program is exact (no presolve).
// Both forms take milliseconds there; beyond, the presolver saves time
// (remat_step_solve, units called twice, 100 units, 500 columns, a quarter
// of the way from the least peak: 2.7 s with it, 4.2 s without, one run
// each on this 2-core machine).
constexpr int64_t kExactFirstColumns = 100;
bool prove_least_peak(const StepModel& m, const std::vector<Row>& rows, const Deadline& dl, StepPrediction* best,
                      double* bound_bytes, bool* timed_out) {
  lower_peak_one_at_a_time(m, best);
  if (!meets_bound(best->peak_bytes, *bound_bytes)) {
    MipResult again;
    const bool solved = solve_mip(m, rows, 0, Goal::kLeastPeak, dl, &again, /*exact=*/true);
    *timed_out = *timed_out || again.timed_out;
    if (solved && again.optimal) {
      StepPrediction p = simulate_step(m, again.choice);
      lower_peak_one_at_a_time(m, &p);
      if (p.peak_bytes < best->peak_bytes) *best = std::move(p);
      *bound_bytes = std::max(*bound_bytes, again.peak_bound_bytes);
    }
  }
  std::vector<Cut> cuts;  // each stays valid below a leaner best: its row stays broken
  for (int tries = 0; tries < kProofTries; ++tries) {
    const int64_t less = best->peak_bytes - 1;
    const std::vector<Row> lean_rows = binding_rows(rows, less);
    MipResult leaner;
    const bool found = solve_mip(m, lean_rows, less, Goal::kAnyFits, dl, &leaner, /*exact=*/true, cuts);
    *timed_out = *timed_out || leaner.timed_out;
    if (!found) return leaner.infeasible;
    StepPrediction q = simulate_step(m, leaner.choice);
    if (q.peak_bytes <= less) {
      lower_peak_one_at_a_time(m, &q);
      *best = std::move(q);
      continue;
    }
    for (const Row& r : lean_rows) {
      if (q.segment_bytes[r.segment] <= less) continue;
      cuts.push_back(row_cut(m, r, q.choice));
      if (cuts.back().empty()) return true;  // no option moves the row: every choice breaks it
    }
  }
  return false;
}

// NOTE [the chain DP]: when the outermost units (parent -1) are each
// called once and, in forward order, each one's windows lie inside the kept
// interval of every one before it (forward_end_i <= forward_begin_j and
// backward_end_j <= backward_begin_i for i < j), the outer units whose kept
// interval covers a segment are a prefix 0..q-1 of that order, and at most
// one outer unit (q) has a window there. Units inside an outer unit (called
// once, windows inside its windows) make it a block: its options are the
// outer unit's options other than keep, and keep with every valid
// combination of its inner units' options. Every constraint then reads
// P_q + need_q(o) <= cap, where P_q is the sum of the first q blocks'
// kept-byte deltas and need_q(o) the highest segment of block q's windows
// under its option o. A dynamic program over the blocks in order keeps the
// Pareto front of (P, time) pairs: a pair with both more kept bytes and
// more time than another can never be better. Exact in integer bytes; the
// front stays small in practice (its size is capped, beyond which GLPK
// takes over, as it does for blocks with too many combinations). Before it
// runs, a min-max pass from the last block back gives, per block, the
// least headroom the blocks from it on need above their prefix (their
// floor): an entry whose prefix plus that floor exceeds the budget can
// never finish and is never kept, and the first block's floor is the
// step's least peak.
struct BlockOption {
  std::vector<int> choice;  // one option per member of the block
  int64_t kept = 0;         // kept-byte delta from the block's release point to its backward begin
  // Highest segment of its forward window, of its backward window, and of
  // its kept interval before its release point (min: no such segment).
  int64_t fwd = 0, bwd = 0, early = 0;
  // Its outer unit's pair credit (NOTE [inputs two calls hold]): whether
  // it lets go of the input it shares with the block before (then `credit`
  // bytes, if that block lets go too), whether it lets go of the output it
  // shares with the block after, and the highest early segment from the
  // credit's start on (before the credit).
  bool in = false, out = false;
  int64_t credit = 0, early_pair = 0;
  double ms = 0;  // time added
};
struct ChainCaps {
  std::vector<size_t> order;                      // outer units in forward order
  std::vector<std::vector<size_t>> members;       // per block: its outer unit, then its inner units
  std::vector<std::vector<BlockOption>> options;  // per block
  std::vector<int64_t> between;                   // per prefix length q = 0..n: max peak of segments with no window
  // Per block: where its members' kept deltas become final (the latest
  // release point of a member or its pair credit's start, or the outer
  // unit's forward end). The segments before it in the block's kept
  // interval are its `early` need.
  std::vector<int64_t> settled;
};

constexpr size_t kMaxBlockOptions = 1 << 14;

std::optional<ChainCaps> chain_structure(const StepModel& m) {
  const int64_t none = std::numeric_limits<int64_t>::min();
  ChainCaps c;
  std::vector<int64_t> block_of(m.units.size(), -1);  // outer unit of each unit
  for (size_t u = 0; u < m.units.size(); ++u) {
    if (m.units[u].calls.size() != 1) return std::nullopt;
    int64_t top = static_cast<int64_t>(u);
    while (m.units[top].parent >= 0) top = m.units[top].parent;
    block_of[u] = top;
    if (static_cast<size_t>(top) == u) c.order.push_back(u);
  }
  const size_t n = c.order.size();
  std::sort(c.order.begin(), c.order.end(),
            [&](size_t a, size_t b) { return m.units[a].calls[0].forward_begin < m.units[b].calls[0].forward_begin; });
  for (size_t i = 0; i + 1 < n; ++i) {
    const StepCall& a = m.units[c.order[i]].calls[0];
    const StepCall& b = m.units[c.order[i + 1]].calls[0];
    if (a.forward_end > b.forward_begin || b.backward_end > a.backward_begin) return std::nullopt;
  }
  std::vector<size_t> position(m.units.size(), 0);
  c.members.resize(n);
  for (size_t j = 0; j < n; ++j) {
    position[c.order[j]] = j;
    c.members[j].push_back(c.order[j]);
  }
  for (size_t u = 0; u < m.units.size(); ++u) {
    const size_t top = static_cast<size_t>(block_of[u]);
    if (top == u) continue;
    // An inner unit's windows lie inside its block's: its kept interval then
    // covers the block's, and it has no window outside the block's.
    const StepCall& b = m.units[top].calls[0];
    const StepCall& i = m.units[u].calls[0];
    if (i.forward_begin < b.forward_begin || i.forward_end > b.forward_end || i.backward_begin < b.backward_begin ||
        i.backward_end > b.backward_end) {
      return std::nullopt;
    }
    c.members[position[top]].push_back(u);
  }
  // NOTE [released inputs in the chain DP]: a member's kept delta drops at
  // its release point. The DP needs each block's delta constant wherever a
  // later block or a between segment sees it, so a block's last release
  // must come before the next block's forward; the segments before it are
  // the block's own `early` need.
  // A pair credit (NOTE [inputs two calls hold]) is the DP's only between
  // an outer unit and the one before it; its start settles the block too.
  for (size_t u = 0; u < m.units.size(); ++u) {
    const StepCall& call = m.units[u].calls[0];
    if (!has_pair(call)) continue;
    if (static_cast<size_t>(block_of[u]) != u || position[u] == 0 ||
        static_cast<size_t>(call.pair_unit) != c.order[position[u] - 1] || call.pair_call != 0) {
      return std::nullopt;
    }
  }
  c.settled.assign(n, 0);
  for (size_t j = 0; j < n; ++j) {
    const StepCall& outer = m.units[c.order[j]].calls[0];
    int64_t r = has_pair(outer) ? std::max(outer.forward_end, outer.pair_begin) : outer.forward_end;
    for (size_t u : c.members[j]) {
      const StepCall& call = m.units[u].calls[0];
      if (call.release_begin >= 0) r = std::max(r, call.release_begin);
    }
    if (j + 1 < n && r > m.units[c.order[j + 1]].calls[0].forward_begin) return std::nullopt;
    c.settled[j] = r;
  }
  c.between.assign(n + 1, none);
  const int64_t segments = static_cast<int64_t>(m.segment_peak_bytes.size());
  for (int64_t s = 0; s < segments; ++s) {
    size_t q = 0;  // outer units whose kept interval covers s: a prefix
    while (q < n) {
      const StepCall& c0 = m.units[c.order[q]].calls[0];
      if (!(c0.forward_end <= s && s < c0.backward_begin)) break;
      ++q;
    }
    for (size_t i = q; i < n; ++i) {  // the prefix property, checked
      const StepCall& ci = m.units[c.order[i]].calls[0];
      if (ci.forward_end <= s && s < ci.backward_begin) return std::nullopt;
    }
    const int window = q < n ? klass(m.units[c.order[q]].calls[0], s) : 0;
    if (q > 0 && s < c.settled[q - 1]) continue;  // block q-1's early need
    if (window != 1 && !backward_class(window)) c.between[q] = std::max(c.between[q], m.segment_peak_bytes[s]);
  }
  // Each block's options: every valid combination of its members' options.
  c.options.resize(n);
  for (size_t j = 0; j < n; ++j) {
    const std::vector<size_t>& mem = c.members[j];
    size_t combos = 1;
    for (size_t u : mem) {
      combos *= m.units[u].options.size();
      if (combos > kMaxBlockOptions) return std::nullopt;
    }
    const StepCall& outer = m.units[mem[0]].calls[0];
    const bool paired = has_pair(outer);
    const StepCall* after =
        j + 1 < n && has_pair(m.units[c.order[j + 1]].calls[0]) ? &m.units[c.order[j + 1]].calls[0] : nullptr;
    std::vector<int> pick(mem.size(), 0), full(m.units.size(), 0);
    for (size_t x = 0; x < combos; ++x) {
      size_t r = x;
      for (size_t i = 0; i < mem.size(); ++i) {
        pick[i] = static_cast<int>(r % m.units[mem[i]].options.size());
        r /= m.units[mem[i]].options.size();
        full[mem[i]] = pick[i];
      }
      if (nesting_violation(m, full).first >= 0) continue;
      BlockOption o;
      o.choice = pick;
      o.fwd = o.bwd = o.early = o.early_pair = none;
      o.in = paired && outer.pair_lets_go[pick[0]];
      o.credit = o.in ? outer.pair_bytes : 0;
      o.out = after != nullptr && after->pair_other_lets_go[pick[0]];
      for (size_t i = 0; i < mem.size(); ++i) {
        const StepCall& call = m.units[mem[i]].calls[0];
        o.ms += call.costs[pick[i]].time_ms - call.costs[0].time_ms;
        // Every member's kept interval covers the block's: from the settled
        // point on, each member is kept and past its release point, if any.
        o.kept += delta(call, call.release_begin >= 0 ? 4 : 2, pick[i]);
      }
      const int64_t settled = c.settled[j];
      for (int64_t s = outer.forward_begin; s < outer.backward_end; ++s) {
        const int w = klass(outer, s);
        const bool early = (w == 2 || w == 4) && s < settled;
        if (w != 1 && !backward_class(w) && !early) continue;
        int64_t bytes = m.segment_peak_bytes[s];
        for (size_t i = 0; i < mem.size(); ++i)
          bytes += delta(m.units[mem[i]].calls[0], klass(m.units[mem[i]].calls[0], s), pick[i]);
        int64_t& need = early ? (paired && s >= outer.pair_begin ? o.early_pair : o.early) : w == 1 ? o.fwd : o.bwd;
        need = std::max(need, bytes);
      }
      c.options[j].push_back(std::move(o));
    }
    for (size_t i = 0; i < mem.size(); ++i) full[mem[i]] = 0;
  }
  return c;
}

// NOTE [phases]: a step run for several micro-batches (gradient
// accumulation) calls every unit once per micro-batch, the first
// micro-batch's forward and backward before the second's forward. Each
// micro-batch is then a phase: a range of segments where every unit has
// exactly one call, the calls a chain as above (NOTE [the chain DP]). One
// choice serves all phases, so the DP carries one kept-byte prefix per
// phase and keeps the entries no other entry beats on every prefix and on
// time. When every call of a unit costs the same bytes in every phase (the
// micro-batches have one shape), the prefixes are equal and the front is
// as small as one phase's.
struct StepChain {
  std::vector<ChainCaps> phases;  // the same blocks, in the same order, in each
  // Per phase, per block j (0..n) and per whether block j-1 lets go of the
  // output block j's pair credit shares: the least, over every choice of
  // blocks j.., of the highest segment they reach above the kept-byte
  // prefix P_j (min: none). P_j + floor > budget: no choice of blocks j..
  // fits. With one phase, floor[0][0][0] (with between[0]) is the step's
  // least peak.
  std::vector<std::vector<std::array<int64_t, 2>>> floor;
};

constexpr int64_t kNone = std::numeric_limits<int64_t>::min();
constexpr size_t kMaxPhases = 32;  // the DP's entries hold one bit per phase

int64_t plus(int64_t need, int64_t bytes) { return need == kNone ? kNone : need + bytes; }

// The suffix floors of one phase (see StepChain::floor), blocks last to
// first: a min-max over each block's options, exact for one phase.
std::vector<std::array<int64_t, 2>> floors_of(const ChainCaps& c) {
  const size_t n = c.order.size();
  std::vector<std::array<int64_t, 2>> f(n + 1, {kNone, kNone});
  for (size_t j = n; j-- > 0;) {
    for (int x = 0; x < 2; ++x) {
      int64_t best = std::numeric_limits<int64_t>::max();
      for (const BlockOption& o : c.options[j]) {
        const int64_t credit = x != 0 && o.in ? o.credit : 0;
        const int64_t kept = o.kept - credit;
        const int64_t need = std::max({o.fwd, o.bwd, o.early, plus(o.early_pair, -credit), plus(c.between[j + 1], kept),
                                       plus(f[j + 1][o.out ? 1 : 0], kept)});
        best = std::min(best, need);
      }
      f[j][x] = best;
    }
  }
  return f;
}

// The step's chain structure: one phase when every unit is called once,
// else one per micro-batch (NOTE [phases]); nullopt when it is neither.
std::optional<StepChain> chain_of(const StepModel& m) {
  StepChain out;
  const size_t phases = m.units.empty() ? 1 : m.units[0].calls.size();
  if (phases == 1) {
    std::optional<ChainCaps> c = chain_structure(m);
    if (!c) return std::nullopt;
    out.phases.push_back(std::move(*c));
  } else {
    if (phases == 0 || phases > kMaxPhases) return std::nullopt;
    for (const StepUnit& u : m.units) {
      if (u.calls.size() != phases) return std::nullopt;
    }
    // Phase p runs from the first forward of its calls to the next phase's;
    // its calls' backwards end before that.
    const int64_t segments = static_cast<int64_t>(m.segment_peak_bytes.size());
    std::vector<int64_t> begin(phases + 1, segments);
    begin[0] = 0;
    for (size_t p = 1; p < phases; ++p) {
      for (const StepUnit& u : m.units) begin[p] = std::min(begin[p], u.calls[p].forward_begin);
    }
    for (size_t p = 0; p < phases; ++p) {
      for (const StepUnit& u : m.units) {
        if (u.calls[p].forward_begin < begin[p] || u.calls[p].backward_end > begin[p + 1]) return std::nullopt;
      }
    }
    for (size_t p = 0; p < phases; ++p) {
      StepModel sub;
      sub.segment_peak_bytes.assign(m.segment_peak_bytes.begin() + begin[p],
                                    m.segment_peak_bytes.begin() + begin[p + 1]);
      sub.units.resize(m.units.size());
      for (size_t u = 0; u < m.units.size(); ++u) {
        sub.units[u].options.resize(m.units[u].options.size());
        sub.units[u].parent = m.units[u].parent;
        StepCall c = m.units[u].calls[p];
        for (int64_t* s : {&c.forward_begin, &c.forward_end, &c.backward_begin, &c.backward_end}) *s -= begin[p];
        for (int64_t* s : {&c.release_begin, &c.release_end, &c.pair_begin}) {
          if (*s >= 0) *s -= begin[p];
        }
        // A credit with another micro-batch's call of the unit before is
        // the same to the memory rule (one choice serves both): call 0.
        if (has_pair(c)) c.pair_call = 0;
        sub.units[u].calls.push_back(std::move(c));
      }
      std::optional<ChainCaps> c = chain_structure(sub);
      if (!c) return std::nullopt;
      const ChainCaps& first = out.phases.empty() ? *c : out.phases[0];
      if (c->order != first.order || c->members != first.members) return std::nullopt;
      out.phases.push_back(std::move(*c));
    }
  }
  for (const ChainCaps& c : out.phases) out.floor.push_back(floors_of(c));
  return out;
}

// A lower bound on every choice's peak: exact with one phase (each phase's
// least peak, the phases' choices taken apart, otherwise). 0 for a step
// with no segments, as simulate_step says; below 0 where the deltas say so.
int64_t chain_floor(const StepChain& sc) {
  int64_t low = kNone;
  for (size_t p = 0; p < sc.phases.size(); ++p) {
    low = std::max({low, sc.phases[p].between[0], sc.floor[p][0][0]});
  }
  return low == kNone ? 0 : low;
}

constexpr size_t kMaxFront = 200000;
// Dominance checks per entry against the entries kept before it: exact for
// one phase (the last one decides) and for equal prefixes; beyond it a
// dominated entry may stay, which costs time, not exactness.
constexpr size_t kDominanceWindow = 32;

// The chain DP: false when no choice fits (or the front outgrew kMaxFront:
// *too_big is then set).
// Each level's front is grouped by `out` (which outputs the last block lets
// go of, per phase), each group sorted by its kept-byte prefixes
// (lexicographically, phase by phase) then time. A block option adds the
// same bytes to every entry of a group, which keeps that order: the
// candidates of one group and option are a sorted stream, and the next
// front is a merge of streams (a heap), pruned as it is drawn.
bool solve_chain(const StepModel& m, const StepChain& sc, int64_t budget, std::vector<int>* choice, bool* too_big) {
  struct Entry {
    double t;
    int32_t prev;
    int32_t option;
    uint32_t out;  // per phase: its last block lets go of the output the next block's pair credit shares
  };
  struct Stream {
    size_t pos, end;  // its group's entries still to draw
    int32_t option;   // the block option it adds
    uint32_t out;     // that option's `out`
    double ms;        // its time added
    size_t bytes;     // into `deltas` and `limits`: f each
  };
  const size_t f = sc.phases.size();
  const size_t n = sc.phases[0].order.size();
  for (size_t p = 0; p < f; ++p) {
    if (sc.phases[p].between[0] > budget || plus(sc.floor[p][0][0], 0) > budget) return false;
  }
  // Per level: the entries; the last level's kept-byte prefixes (f per
  // entry: the walk back needs only the entries).
  std::vector<std::vector<Entry>> levels;
  std::vector<int64_t> fp(f, 0);
  levels.push_back({{0.0, -1, -1, 0}});
  std::vector<Stream> streams;
  std::vector<int64_t> deltas, limits;
  std::vector<size_t> heap;
  for (size_t j = 0; j < n; ++j) {
    const std::vector<Entry>& front = levels.back();
    const size_t options = sc.phases[0].options[j].size();
    if (front.size() * options * f > 16 * kMaxFront) {  // bounds the time per level; GLPK takes over
      *too_big = true;
      return false;
    }
    // One stream per group of the front and option: what the option adds
    // to each phase's prefix, and the most each prefix may hold for every
    // window of the option and the floor of the blocks after it to fit.
    streams.clear();
    deltas.clear();
    limits.clear();
    for (size_t g = 0; g < front.size();) {
      size_t ge = g;
      while (ge < front.size() && front[ge].out == front[g].out) ++ge;
      for (size_t k = 0; k < options; ++k) {
        Stream s{g, ge, static_cast<int32_t>(k), 0, 0, deltas.size()};
        for (size_t p = 0; p < f; ++p) {
          const BlockOption& o = sc.phases[p].options[j][k];
          const int64_t credit = (front[g].out >> p & 1u) != 0 && o.in ? o.credit : 0;
          const int64_t kept = o.kept - credit;
          const int64_t need =
              std::max({o.fwd, o.bwd, o.early, plus(o.early_pair, -credit), plus(sc.phases[p].between[j + 1], kept),
                        plus(sc.floor[p][j + 1][o.out ? 1 : 0], kept)});
          deltas.push_back(kept);
          const int64_t most = std::numeric_limits<int64_t>::max();
          limits.push_back(need == kNone || (need < 0 && budget > most + need) ? most : budget - need);
          if (o.out) s.out |= 1u << p;
          s.ms += o.ms;
        }
        streams.push_back(s);
      }
      g = ge;
    }
    const auto fits = [&](const Stream& s) {
      for (size_t p = 0; p < f; ++p) {
        if (fp[s.pos * f + p] > limits[s.bytes + p]) return false;
      }
      return true;
    };
    // Moves a stream to its next candidate that fits (with one phase, the
    // first that does not ends it: prefixes grow along a group).
    const auto settle = [&](Stream& s) {
      while (s.pos < s.end && !fits(s)) s.pos = f == 1 ? s.end : s.pos + 1;
    };
    // Candidate order: prefixes, then time (a > b: b first).
    const auto later = [&](size_t a, size_t b) {
      const Stream& x = streams[a];
      const Stream& y = streams[b];
      for (size_t p = 0; p < f; ++p) {
        const int64_t qx = fp[x.pos * f + p] + deltas[x.bytes + p];
        const int64_t qy = fp[y.pos * f + p] + deltas[y.bytes + p];
        if (qx != qy) return qx > qy;
      }
      return front[x.pos].t + x.ms > front[y.pos].t + y.ms;
    };
    std::vector<Entry> next;
    std::vector<int64_t> next_p;
    std::vector<std::pair<size_t, size_t>> groups;  // [begin, end) into next, by `out` ascending
    std::vector<uint32_t> masks;
    for (const Stream& s : streams) masks.push_back(s.out);
    std::sort(masks.begin(), masks.end());
    masks.erase(std::unique(masks.begin(), masks.end()), masks.end());
    for (uint32_t mask : masks) {
      heap.clear();
      for (size_t i = 0; i < streams.size(); ++i) {
        if (streams[i].out != mask) continue;
        settle(streams[i]);
        if (streams[i].pos < streams[i].end) heap.push_back(i);
      }
      std::make_heap(heap.begin(), heap.end(), later);
      const size_t from = next.size();
      while (!heap.empty()) {
        std::pop_heap(heap.begin(), heap.end(), later);
        Stream& s = streams[heap.back()];
        const double t = front[s.pos].t + s.ms;
        // Dominated by an entry drawn before it (no more bytes in the first
        // phase, by the order): the last decides with one phase.
        bool dominated = false;
        for (size_t y = next.size(), w = 0; y > from && w < kDominanceWindow && !dominated; --y, ++w) {
          dominated = next[y - 1].t <= t;
          for (size_t p = 0; p < f && dominated; ++p) {
            dominated = next_p[(y - 1) * f + p] <= fp[s.pos * f + p] + deltas[s.bytes + p];
          }
        }
        if (!dominated) {
          next.push_back({t, static_cast<int32_t>(s.pos), s.option, mask});
          for (size_t p = 0; p < f; ++p) next_p.push_back(fp[s.pos * f + p] + deltas[s.bytes + p]);
        }
        ++s.pos;
        settle(s);
        if (s.pos < s.end) {
          std::push_heap(heap.begin(), heap.end(), later);
        } else {
          heap.pop_back();
        }
      }
      if (next.size() > from) groups.push_back({from, next.size()});
    }
    if (next.empty()) return false;
    // Across groups: an entry is dropped when one that lets go of more
    // outputs (letting go may pay later) has no more bytes in any phase and
    // no more time; checked at the entries of that group with no more bytes
    // in the first phase (sorted so: a walk).
    const auto beats = [&](size_t y, size_t x) {
      if (next[y].t > next[x].t) return false;
      for (size_t p = 0; p < f; ++p) {
        if (next_p[y * f + p] > next_p[x * f + p]) return false;
      }
      return true;
    };
    std::vector<char> gone(next.size(), 0);
    for (const auto& [gb, ge] : groups) {
      for (const auto& [hb, he] : groups) {
        const uint32_t a = next[gb].out, b = next[hb].out;
        if (a == b || (a & b) != a) continue;
        size_t y = hb;  // one past the last entry of the other group with first prefix <= x's
        for (size_t x = gb; x < ge; ++x) {
          while (y < he && next_p[y * f] <= next_p[x * f]) ++y;
          for (size_t z = y, w = 0; z > hb && w < kDominanceWindow; --z, ++w) {
            if (beats(z - 1, x)) {
              gone[x] = 1;
              break;
            }
          }
        }
      }
    }
    std::vector<Entry> pruned;
    std::vector<int64_t> pruned_p;
    pruned.reserve(next.size());
    pruned_p.reserve(next_p.size());
    for (size_t x = 0; x < next.size(); ++x) {
      if (gone[x] != 0) continue;
      pruned.push_back(next[x]);
      pruned_p.insert(pruned_p.end(), next_p.begin() + x * f, next_p.begin() + (x + 1) * f);
    }
    if (pruned.size() > kMaxFront) {
      *too_big = true;
      return false;
    }
    levels.push_back(std::move(pruned));
    fp = std::move(pruned_p);
  }
  // The fastest at the end; walk back.
  const auto& last = levels.back();
  size_t best = 0;
  for (size_t e = 1; e < last.size(); ++e) {
    if (last[e].t < last[best].t) best = e;
  }
  const ChainCaps& c = sc.phases[0];
  choice->assign(m.units.size(), 0);
  int32_t at = static_cast<int32_t>(best);
  for (size_t j = n; j > 0; --j) {
    const Entry& x = levels[j][at];
    const BlockOption& o = c.options[j - 1][static_cast<size_t>(x.option)];
    for (size_t i = 0; i < o.choice.size(); ++i) (*choice)[c.members[j - 1][i]] = o.choice[i];
    at = x.prev;
  }
  return true;
}

}  // namespace

StepPlan least_or_throw(const StepModel& m, int64_t budget_bytes, const Deadline& dl);

void validate(const StepModel& m) {
  const int64_t n = static_cast<int64_t>(m.segment_peak_bytes.size());
  if (!m.segment_labels.empty() && static_cast<int64_t>(m.segment_labels.size()) != n) {
    throw Error("[remat::plan] the step model has " + std::to_string(m.segment_labels.size()) + " segment labels for " +
                std::to_string(n) + " segments; give one per segment or none.");
  }
  for (int64_t s = 0; s < n; ++s) {
    if (m.segment_peak_bytes[s] < 0) {
      throw Error("[remat::plan] segment " + std::to_string(s) + " of the step model peaks at " +
                  std::to_string(m.segment_peak_bytes[s]) + " bytes; peaks must be >= 0.");
    }
  }
  if (!std::isfinite(m.step_time_ms) || m.step_time_ms < 0) {
    throw Error("[remat::plan] the step model's step_time_ms is " + std::to_string(m.step_time_ms) +
                "; it must be finite and >= 0.");
  }
  const int64_t units = static_cast<int64_t>(m.units.size());
  for (size_t u = 0; u < m.units.size(); ++u) {
    const StepUnit& unit = m.units[u];
    if (unit.options.empty()) {
      throw Error("[remat::plan] " + unit_label(m, u) + " has no options; give at least the profiled one.");
    }
    if (unit.parent < -1 || unit.parent >= units || unit.parent == static_cast<int64_t>(u)) {
      throw Error("[remat::plan] " + unit_label(m, u) + " has parent " + std::to_string(unit.parent) +
                  "; give the index of another of the " + std::to_string(units) + " units, or -1 for none.");
    }
    int64_t steps = 0;
    for (int64_t a = unit.parent; a >= 0; a = m.units[a].parent) {
      if (++steps > units) {
        throw Error("[remat::plan] the parents of " + unit_label(m, u) +
                    " form a cycle; a unit cannot run inside itself.");
      }
    }
    for (size_t c = 0; c < unit.calls.size(); ++c) {
      const StepCall& call = unit.calls[c];
      const std::string where = unit_label(m, u) + " call " + std::to_string(c);
      if (!(0 <= call.forward_begin && call.forward_begin <= call.forward_end &&
            call.forward_end <= call.backward_begin && call.backward_begin <= call.backward_end &&
            call.backward_end <= n)) {
        throw Error("[remat::plan] " + where + " has windows [" + std::to_string(call.forward_begin) + ", " +
                    std::to_string(call.forward_end) + ", " + std::to_string(call.backward_begin) + ", " +
                    std::to_string(call.backward_end) + "]; they must be ordered and within the " + std::to_string(n) +
                    " segments.");
      }
      if (call.release_begin != -1 &&
          !(call.forward_end <= call.release_begin && call.release_begin <= call.backward_begin)) {
        throw Error("[remat::plan] " + where + " has its release point at segment " +
                    std::to_string(call.release_begin) + ", outside its kept interval [" +
                    std::to_string(call.forward_end) + ", " + std::to_string(call.backward_begin) +
                    "]; give -1 (none) or a segment in it.");
      }
      if (call.release_end != -1 &&
          !(call.backward_begin <= call.release_end && call.release_end <= call.backward_end)) {
        throw Error("[remat::plan] " + where + " has its release end at segment " + std::to_string(call.release_end) +
                    ", outside its backward [" + std::to_string(call.backward_begin) + ", " +
                    std::to_string(call.backward_end) + "]; give -1 (the backward's end) or a segment in it.");
      }
      if (call.pair_unit != -1) {
        if (call.pair_unit < 0 || call.pair_unit >= units || call.pair_unit == static_cast<int64_t>(u) ||
            call.pair_call < 0 || call.pair_call >= static_cast<int64_t>(m.units[call.pair_unit].calls.size())) {
          throw Error("[remat::plan] " + where + " shares its inputs with unit " + std::to_string(call.pair_unit) +
                      " call " + std::to_string(call.pair_call) +
                      "; give a call of another unit, or pair_unit -1 for none.");
        }
        if (!(call.forward_end <= call.pair_begin && call.pair_begin <= call.backward_begin) || call.pair_bytes < 0) {
          throw Error("[remat::plan] " + where + " has its shared inputs' credit of " +
                      std::to_string(call.pair_bytes) + " bytes from segment " + std::to_string(call.pair_begin) +
                      "; give bytes >= 0 from a segment in its kept interval [" + std::to_string(call.forward_end) +
                      ", " + std::to_string(call.backward_begin) + "].");
        }
        if (call.pair_lets_go.size() != unit.options.size() ||
            call.pair_other_lets_go.size() != m.units[call.pair_unit].options.size() || call.pair_lets_go[0] ||
            call.pair_other_lets_go[0]) {
          throw Error("[remat::plan] " + where +
                      " gives which options let go of its shared inputs for the wrong number of options, or says "
                      "option 0 does; give one flag per option of each unit, false for option 0.");
        }
      }
      if (call.costs.size() != unit.options.size()) {
        throw Error("[remat::plan] " + where + " has " + std::to_string(call.costs.size()) + " costs for " +
                    std::to_string(unit.options.size()) + " options; give one per option.");
      }
      for (size_t k = 0; k < call.costs.size(); ++k) {
        const StepCost& cost = call.costs[k];
        if (!std::isfinite(cost.time_ms) || cost.forward_peak_bytes < 0 || cost.kept_bytes < 0 ||
            cost.backward_peak_bytes < 0 || cost.released_bytes < 0) {
          throw Error("[remat::plan] " + where + " option '" + unit.options[k] +
                      "' has a non-finite time or negative bytes.");
        }
      }
    }
  }
}

void truncate_options(StepModel& m, size_t unit, size_t count) {
  if (unit >= m.units.size()) {
    throw Error("[remat::plan] truncate_options: unit " + std::to_string(unit) + " of a step model with " +
                std::to_string(m.units.size()) + " units; give an index below that.");
  }
  StepUnit& u = m.units[unit];
  const size_t n = std::max<size_t>(1, std::min(count, u.options.size()));
  u.options.resize(n);
  for (StepCall& c : u.calls) {
    c.costs.resize(std::min(n, c.costs.size()));
    if (c.pair_unit >= 0) c.pair_lets_go.resize(std::min(n, c.pair_lets_go.size()));
  }
  for (StepUnit& other : m.units) {
    for (StepCall& c : other.calls) {
      if (c.pair_unit == static_cast<int64_t>(unit))
        c.pair_other_lets_go.resize(std::min(n, c.pair_other_lets_go.size()));
    }
  }
}

StepPrediction simulate_step(const StepModel& m, const std::vector<int>& choice) {
  validate(m);
  if (choice.size() != m.units.size()) {
    throw Error("[remat::plan] a choice of " + std::to_string(choice.size()) + " options for " +
                std::to_string(m.units.size()) + " units; give one option index per unit.");
  }
  StepPrediction out;
  out.choice = choice;
  out.segment_bytes = m.segment_peak_bytes;
  out.time_ms = m.step_time_ms;
  for (size_t u = 0; u < m.units.size(); ++u) {
    const int k = choice[u];
    if (k < 0 || k >= static_cast<int>(m.units[u].options.size())) {
      throw Error("[remat::plan] option " + std::to_string(k) + " of " + unit_label(m, u) + ", which has " +
                  std::to_string(m.units[u].options.size()) + " options.");
    }
  }
  if (const auto [u, a] = nesting_violation(m, choice); u >= 0) {
    const auto uu = static_cast<size_t>(u), aa = static_cast<size_t>(a);
    throw Error("[remat::plan] " + unit_label(m, uu) + " has option '" + m.units[uu].options[choice[uu]] + "' inside " +
                unit_label(m, aa) + ", which runs option '" + m.units[aa].options[choice[aa]] +
                "': a unit inside a recomputed or offloaded unit runs as part of it; give it option 0.");
  }
  for (size_t u = 0; u < m.units.size(); ++u) {
    const int k = choice[u];
    if (k == 0) continue;
    out.time_ms += added_ms(m.units[u], k);
    for (const StepCall& c : m.units[u].calls) {
      for (int64_t s = c.forward_begin; s < c.backward_end; ++s) out.segment_bytes[s] += delta(c, klass(c, s), k);
    }
  }
  for (const auto& [u, ci] : pairs_of(m)) {
    const StepCall& c = m.units[u].calls[ci];
    if (!c.pair_lets_go[choice[u]] || !c.pair_other_lets_go[choice[c.pair_unit]]) continue;
    for (int64_t s = c.pair_begin; s < c.backward_begin; ++s) out.segment_bytes[s] -= c.pair_bytes;
  }
  out.peak_bytes = 0;
  for (size_t s = 0; s < out.segment_bytes.size(); ++s) {
    if (out.peak_segment < 0 || out.segment_bytes[s] > out.peak_bytes) {
      out.peak_bytes = out.segment_bytes[s];
      out.peak_segment = static_cast<int64_t>(s);
    }
  }
  return out;
}

std::string describe_segment(const StepModel& m, int64_t s) {
  // The innermost window: the shortest forward or backward window holding s.
  int64_t best = std::numeric_limits<int64_t>::max();
  std::string what;
  for (size_t u = 0; u < m.units.size(); ++u) {
    const auto& calls = m.units[u].calls;
    for (size_t c = 0; c < calls.size(); ++c) {
      const int cls = klass(calls[c], s);
      if (cls != 1 && !backward_class(cls)) continue;
      const int64_t len =
          cls == 1 ? calls[c].forward_end - calls[c].forward_begin : calls[c].backward_end - calls[c].backward_begin;
      if (len < best) {
        best = len;
        what =
            std::string(cls == 1 ? "in the forward" : "in the backward") + " of unit '" + m.units[u].name + "'" +
            (calls.size() > 1 ? " (call " + std::to_string(c + 1) + " of " + std::to_string(calls.size()) + ")" : "");
      }
    }
  }
  if (!what.empty()) return what;
  if (s >= 0 && s < static_cast<int64_t>(m.segment_labels.size()) && !m.segment_labels[s].empty()) {
    return "in " + m.segment_labels[s];
  }
  return "outside every unit";
}

void step_detail::check_limit(const StepSolveOptions& opt) {
  if (!(opt.time_limit_s > 0)) {
    throw Error("[remat::plan] StepSolveOptions::time_limit_s is " + fmt_g(opt.time_limit_s) +
                "; give a positive number of seconds (the default is 30).");
  }
}

StepPlan min_peak_step(const StepModel& m, const StepSolveOptions& opt) {
  validate(m);
  step_detail::check_limit(opt);
  return min_peak_within(m, Deadline(opt));
}

StepPlan step_detail::min_peak_within(const StepModel& m, const Deadline& dl, LeastPeak* how) {
  LeastPeak unused;
  if (how == nullptr) how = &unused;
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<int> choice(m.units.size(), 0);
  if (const std::optional<StepChain> chain = chain_of(m)) {
    // The least budget the DP fits: its floor with one phase; else by
    // bisection in whole bytes from the floor (each phase's least peak).
    int64_t hi = simulate_step(m, choice).peak_bytes;  // fits (the profiled choice)
    int64_t lo = chain_floor(*chain) - 1;              // does not
    std::vector<int> c;
    bool too_big = false;
    if (solve_chain(m, *chain, lo + 1, &c, &too_big)) {
      hi = lo + 1;
    } else {
      ++lo;
    }
    while (hi - lo > 1 && !too_big) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (solve_chain(m, *chain, mid, &c, &too_big)) {
        hi = mid;
      } else {
        lo = mid;
      }
    }
    if (!too_big) {
      StepPlan plan = solve_within(m, hi, dl);
      how->proved = true;  // the DP is exact in bytes
      plan.solve_ms = ms_since(t0);
      return plan;
    }
  }
  const std::vector<Row> rows = rows_of(m);
  MipResult r;
  const bool found = solve_mip(m, rows, 0, Goal::kLeastPeak, dl, &r);
  // Stopped at the time limit: the leaner of what it found and the guess.
  const std::vector<int> guess = leanest_guess(m);
  StepPrediction best = simulate_step(m, found ? r.choice : guess);
  if (!(found && r.optimal)) {
    if (StepPrediction g = simulate_step(m, guess); g.peak_bytes < best.peak_bytes) best = std::move(g);
  }
  double bound = r.peak_bound_bytes;
  how->timed_out = r.timed_out;
  // A row no choice lowers below this peak proves it, in bytes, whatever
  // GLPK reached (a segment outside every option's reach sets the floor).
  int64_t row_floor = std::numeric_limits<int64_t>::min();
  for (const Row& row : rows) row_floor = std::max(row_floor, least_bytes(row));
  const bool proved = best.peak_bytes <= row_floor ||
                      (found && r.optimal && prove_least_peak(m, rows, dl, &best, &bound, &how->timed_out));
  if (proved) how->timed_out = false;
  how->proved = proved;
  // The fastest choice at that peak (the peak program ignores time).
  const int64_t peak = best.peak_bytes;
  StepPlan plan;
  try {
    plan = solve_within(m, peak, dl);
  } catch (const Error& e) {  // the time program stopped too: the choice itself
    plan.prediction = std::move(best);
    plan.budget_bytes = peak;
    plan.solver = "GLPK";
    plan.optimal = false;
    const auto* u = dynamic_cast<const Unproved*>(&e);
    plan.timed_out = u != nullptr && u->timed_out;
    plan.relative_gap = std::numeric_limits<double>::infinity();
  }
  if (!proved) {
    plan.optimal = false;
    plan.timed_out = plan.timed_out || how->timed_out;
    if (found && r.optimal) {  // the peak's gap to GLPK's bound, less its LP's tolerance
      const double low = bound - kLpRel * peak_scale(rows);
      plan.relative_gap =
          std::max(0.0, static_cast<double>(plan.prediction.peak_bytes) - low) / std::max(std::abs(low), 1.0);
    } else {
      plan.relative_gap = found ? r.gap : std::numeric_limits<double>::infinity();
    }
  }
  plan.solve_ms = ms_since(t0);
  return plan;
}

void step_detail::check_budget(int64_t budget_bytes) {
  if (budget_bytes <= 0) {
    throw Error("[remat::plan] budget_bytes is " + std::to_string(budget_bytes) + "; give a positive budget.");
  }
}

StepPlan solve_step(const StepModel& m, int64_t budget_bytes, const StepSolveOptions& opt) {
  validate(m);
  step_detail::check_limit(opt);
  step_detail::check_budget(budget_bytes);
  return solve_within(m, budget_bytes, Deadline(opt));
}

StepPlan step_detail::solve_within(const StepModel& m, int64_t budget_bytes, const Deadline& dl) {
  const auto t0 = std::chrono::steady_clock::now();
  StepPlan plan;
  plan.budget_bytes = budget_bytes;
  if (const std::vector<int> fastest = fastest_choice(m); nesting_violation(m, fastest).first < 0) {
    // The fastest option of every unit, when it fits, is the answer.
    StepPrediction pred = simulate_step(m, fastest);
    if (pred.peak_bytes <= budget_bytes) {
      plan.prediction = std::move(pred);
      plan.solver = "fastest fits";
      plan.optimal = true;
      plan.solve_ms = ms_since(t0);
      return plan;
    }
  }
  if (const std::optional<StepChain> chain = chain_of(m)) {
    std::vector<int> choice;
    bool too_big = false;
    if (solve_chain(m, *chain, budget_bytes, &choice, &too_big)) {
      plan.prediction = simulate_step(m, choice);
      if (plan.prediction.peak_bytes > budget_bytes) {
        throw Error("[remat::plan] internal: the chain DP's choice peaks at " +
                    format_bytes(plan.prediction.peak_bytes) + " over the budget of " + format_bytes(budget_bytes) +
                    "; please report it with the model.");
      }
      plan.solver = "chain DP";
      plan.optimal = true;
      plan.solve_ms = ms_since(t0);
      return plan;
    }
    if (!too_big) return least_or_throw(m, budget_bytes, dl);
  }
  plan.solver = "GLPK";
  // GLPK works in doubles: a choice it accepts within its tolerances is
  // checked in integer bytes and, if over, the options that set each row it
  // breaks are cut off (row_cut: every choice with those options breaks
  // that row too) and the program is solved again exactly (NOTE [GLPK in
  // bytes]). The cuts remove only choices that do not fit, so each
  // program's optimum bounds every plan that fits: the plan returned is
  // optimal when it is as fast as the highest such bound.
  const std::vector<Row> rows = binding_rows(rows_of(m), budget_bytes);
  if (std::any_of(rows.begin(), rows.end(), [&](const Row& r) { return least_bytes(r) > budget_bytes; })) {
    return least_or_throw(m, budget_bytes, dl);  // every choice breaks that row, in bytes: no program needed
  }
  std::vector<Cut> cuts;
  bool timed_out = false;
  std::optional<double> bound;  // the highest optimum, ms, GLPK proved at the budget
  int64_t columns = static_cast<int64_t>(pairs_of(m).size());
  for (const StepUnit& u : m.units) columns += static_cast<int64_t>(u.options.size()) - 1;
  const bool small = columns <= kExactFirstColumns;
  for (int attempt = 0; attempt < kFitTries; ++attempt) {
    MipResult r;
    bool found;
    if (rows.empty() && nesting_violation(m, fastest_choice(m)).first < 0) {
      // Every choice fits: the fastest option of each unit, independently.
      r.choice = fastest_choice(m);
      r.optimal = true;
      found = true;
    } else {
      // A small program is exact from its first run: GLPK's presolved LP
      // can cycle until the time limit (fuzz/FINDINGS.md, item 12: 4
      // columns). A large one gains from the presolver (kExactFirstColumns).
      found = solve_mip(m, rows, budget_bytes, Goal::kFastest, dl, &r, /*exact=*/attempt > 0 || small, cuts);
      timed_out = timed_out || r.timed_out;
      if (!found && (attempt > 0 || small) && !r.timed_out && !r.infeasible) {
        // The exact program ran into numerical trouble: the same rows with
        // GLPK's defaults, whose choice is checked in bytes as any.
        found = solve_mip(m, rows, budget_bytes, Goal::kFastest, dl, &r, /*exact=*/false, cuts);
        timed_out = timed_out || r.timed_out;
      }
    }
    if (!found) break;
    StepPrediction pred = simulate_step(m, r.choice);
    if (r.optimal) bound = std::max(bound.value_or(pred.time_ms), pred.time_ms);
    if (pred.peak_bytes <= budget_bytes) {
      const bool improved = improve_one_at_a_time(m, budget_bytes, &pred);
      if (r.optimal && (improved || attempt > 0)) {
        // Optimal only as fast as the bound at the budget; else the gap
        // to it, less GLPK's objective tolerance.
        r.optimal = !improved && bound && pred.time_ms <= *bound + kTimeRel * time_scale(m);
        if (!r.optimal && bound) {
          const double low = *bound - kGlpTolObj * (1 + std::abs(*bound - m.step_time_ms));
          r.gap = std::max(0.0, pred.time_ms - low) / std::max(std::abs(low), 1e-300);
        } else if (!r.optimal) {
          r.gap = std::numeric_limits<double>::infinity();
        }
      }
      plan.prediction = std::move(pred);
      plan.optimal = r.optimal;
      plan.timed_out = timed_out && !r.optimal;
      plan.relative_gap = r.gap;
      plan.rows = r.rows;
      plan.columns = r.columns;
      plan.solve_ms = ms_since(t0);
      return plan;
    }
    bool movable = true;  // some option moves each row the choice breaks
    for (const Row& row : rows) {
      if (pred.segment_bytes[row.segment] <= budget_bytes) continue;
      cuts.push_back(row_cut(m, row, r.choice));
      movable = movable && !cuts.back().empty();
    }
    if (!movable) break;  // every choice breaks that row: none fits
  }
  // The program found nothing that fits (stopped at its time limit, or
  // within GLPK's tolerance): each unit's leanest option, if that fits.
  if (StepPrediction guess = simulate_step(m, leanest_guess(m)); guess.peak_bytes <= budget_bytes) {
    plan.prediction = std::move(guess);
    plan.solver = "leanest options";
    plan.optimal = false;
    plan.timed_out = timed_out;
    plan.relative_gap = std::numeric_limits<double>::infinity();
    plan.solve_ms = ms_since(t0);
    return plan;
  }
  if (timed_out) {
    throw Unproved("[remat::plan] the solver stopped at its time limit of " + fmt_seconds(dl.limit_s()) +
                       " before it found a plan of the step's " + std::to_string(m.units.size()) + " units within " +
                       format_bytes(budget_bytes) + " (not a chain: GLPK's integer program). Raise the time limit (" +
                       "StepSolveOptions::time_limit_s, AutoOptions::solver_time_limit_s), or the budget.",
                   /*timed_out=*/true);
  }
  // No program proved that nothing fits (infeasible, or a row no option
  // moves) when the tries ran out or GLPK ran into numerical trouble: the
  // least peak says.
  StepPlan least = least_or_throw(m, budget_bytes, dl);
  least.solve_ms = ms_since(t0);
  return least;
}

// Nothing fit at the budget: throws, saying how low the step can go and
// who sets that floor; or, when the least peak fits after all (the
// programs at the budget gave up), returns that plan, not proved the
// fastest. min_peak_step solves at the floor it finds, which could land
// here again (GLPK's tolerance): that inner call throws a short error,
// which min_peak_step catches.
StepPlan least_or_throw(const StepModel& m, int64_t budget_bytes, const Deadline& dl) {
  thread_local bool inside = false;
  if (inside) throw Error("[remat::auto] no plan of the step fits in " + format_bytes(budget_bytes) + ".");
  struct Guard {
    Guard() { inside = true; }
    ~Guard() { inside = false; }
  } guard;
  LeastPeak how;
  StepPlan lean = min_peak_within(m, dl, &how);  // what is left of the caller's time
  if (lean.prediction.peak_bytes <= budget_bytes) {
    lean.budget_bytes = budget_bytes;
    lean.optimal = false;
    lean.timed_out = lean.timed_out || how.timed_out;
    lean.relative_gap = std::numeric_limits<double>::infinity();
    return lean;
  }
  const StepPrediction& low = lean.prediction;
  std::string why;  // why a leaner plan may exist
  if (!how.proved && how.timed_out) {
    why = " (the solver stopped at its time limit of " + fmt_seconds(dl.limit_s()) +
          ": a longer one may find a leaner plan)";
  } else if (!how.proved) {
    why = " (not proved the least: GLPK's tolerances blur bytes at this size; a leaner plan may exist" +
          (std::isfinite(lean.relative_gap) ? ", within a relative " + fmt_g(lean.relative_gap) : std::string()) + ")";
  }
  const std::string what = "[remat::auto] no plan of the step fits in " + format_bytes(budget_bytes) +
                           "; the smallest " + (how.proved ? "feasible peak is " : "peak found is ") +
                           format_bytes(low.peak_bytes) + ", reached " + describe_segment(m, low.peak_segment) + why +
                           ". Raise the memory budget to at least that, or make what runs there smaller (fewer "
                           "tokens or images per step).";
  if (!how.proved) throw Unproved(what, how.timed_out);
  throw Error(what);
}

}  // namespace remat::plan
