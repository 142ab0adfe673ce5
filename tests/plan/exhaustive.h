// Test-only reference: exhaustive search over schedules of the op model
// (schedule.h, NOTE [Op semantics]) with exact byte sizes, written
// independently of simulate() and of the DP. Dijkstra over every state (live
// values, live saved sets, next backward) reachable by valid ops; returns the
// optimum (minimal time under a budget, or minimal peak) and optionally one
// schedule reaching it. Practical for L <= 8.
//
// A forward_save may run under any of its stage's options (Stage::options,
// at most 3 per stage); the option of each live saved set is part of the
// state, and its backward takes that option's bytes and time.
//
// Two search spaces:
//  - kAll: every valid schedule.
//  - kPersistent: the class rotor's DP (OptimalScope::kPersistent) optimizes over. A value a_j made by a
//    forward is either transient (dropped right after forward(j) consumed it,
//    in a sweep forward(j-1), forward(j), drop(j)) or persistent (kept until
//    backward(j) has run, or covered by s_{j-1} and freed by backward(j-1)).
//    kAll can beat it: dropping a checkpoint early and recomputing it later
//    from an earlier one saves memory at the price of forwards. FullDp
//    (OptimalScope::kAll) covers that.
#pragma once

#include <cstdint>
#include <limits>
#include <queue>
#include <stdexcept>
#include <unordered_map>
#include <vector>

#include "remat/plan/chain.h"
#include "remat/plan/schedule.h"

namespace remat::plan::testing {

enum class Space { kAll, kPersistent };

class Exhaustive {
 public:
  Exhaustive(const Chain& chain, Space space) : c_(chain), L_(chain.size()), space_(space) {}

  /** Minimal time over schedules whose peak is <= budget_bytes; +inf if none. */
  double min_time_ms(int64_t budget_bytes, std::vector<Op>* schedule = nullptr) const {
    return search(budget_bytes, false, schedule);
  }
  /** Minimal peak over the space. */
  int64_t min_peak_bytes() const {
    return static_cast<int64_t>(search(std::numeric_limits<int64_t>::max(), true, nullptr));
  }

 private:
  struct State {
    uint32_t a = 0;      // bit j-1: a_j live, j in [1, L]
    uint32_t s = 0;      // bit i: s_i live
    int nb = 0;          // next stage to backward (L-1 .. -1)
    int last_f = -1;     // kPersistent: stage of the last forward of the current sweep
    int transient = -1;  // kPersistent: j whose a_j may be dropped as transient now
    uint32_t sh = 0;     // bit i: a_{i+1} shares Stage::shared_input_bytes with the live a_i it came from
    uint32_t so = 0;     // bits 2i..2i+1: the option of the live s_i (Op::option)
  };
  uint64_t key(const State& x) const {  // L <= 8: 8 bits per mask, 4 per index
    return (static_cast<uint64_t>(x.a)) | (static_cast<uint64_t>(x.s) << 8) | (static_cast<uint64_t>(x.nb + 1) << 16) |
           (static_cast<uint64_t>(x.last_f + 1) << 20) | (static_cast<uint64_t>(x.transient + 1) << 24) |
           (static_cast<uint64_t>(x.sh) << 28) | (static_cast<uint64_t>(x.so) << 36);
  }
  int option_of(const State& x, int i) const { return static_cast<int>(x.so >> (2 * i) & 3); }
  /** Stage i as its live saved set (or a forward_save under option k) runs it. */
  Stage under(int i, int k) const { return c_.stages[i].with_option(k); }
  bool live_a(const State& x, int j) const { return j == 0 || (x.a >> (j - 1) & 1); }
  bool live_s(const State& x, int i) const { return i >= 0 && i < L_ && (x.s >> i & 1); }
  int64_t A(int j) const { return c_.value_bytes(j); }
  int64_t G(int j) const { return c_.grad_bytes(j); }
  int64_t bytes(const State& x) const {
    int64_t v = c_.input_bytes;
    for (int j = 1; j <= L_; ++j)
      if (live_a(x, j) && !live_s(x, j - 1)) v += A(j);
    for (int i = 0; i < L_; ++i)
      if (live_s(x, i)) v += under(i, option_of(x, i)).saved_bytes;
    if (x.nb < L_ - 1) v += G(x.nb + 1);  // the gradient flowing back
    for (int i = 0; i < L_; ++i)
      if (x.sh >> i & 1) v -= c_.stages[i].shared_input_bytes;  // counted in a_i and again in a_{i+1}
    return v;
  }
  static uint32_t without(uint32_t mask, int bit) { return bit >= 0 ? mask & ~(1u << bit) : mask; }

  double search(int64_t budget, bool minimize_peak, std::vector<Op>* schedule) const {
    const double inf = std::numeric_limits<double>::infinity();
    const bool persistent = space_ == Space::kPersistent;
    struct Entry {
      double cost;
      uint64_t parent;
      Op via;
      State state;
    };
    std::unordered_map<uint64_t, Entry> best;
    using Item = std::pair<double, uint64_t>;
    std::priority_queue<Item, std::vector<Item>, std::greater<>> pq;
    State start;
    start.nb = L_ - 1;
    if (c_.input_bytes > budget) return inf;
    if (L_ > 8) throw std::logic_error("Exhaustive: at most 8 stages");
    for (const Stage& st : c_.stages)
      if (st.options.size() > 3) throw std::logic_error("Exhaustive: at most 3 options per stage");
    const double start_cost = minimize_peak ? static_cast<double>(c_.input_bytes) : 0.0;
    best[key(start)] = {start_cost, key(start), {OpKind::kDrop, -1}, start};
    pq.push({start_cost, key(start)});
    while (!pq.empty()) {
      auto [cost, k] = pq.top();
      pq.pop();
      const Entry e = best.at(k);
      if (cost > e.cost) continue;
      const State x = e.state;
      if (x.nb == -1 && x.a == 0) {
        if (schedule) {
          schedule->clear();
          for (uint64_t at = k; at != key(start); at = best.at(at).parent)
            schedule->insert(schedule->begin(), best.at(at).via);
        }
        return cost;
      }
      const int64_t cur = bytes(x);
      const bool forward_phase = x.nb == L_ - 1;
      const bool must_backward = forward_phase && live_s(x, L_ - 1);
      auto relax = [&](State y, int64_t during, double ms, Op op) {
        if (during > budget) return;
        const double c2 = minimize_peak ? std::max(cost, static_cast<double>(during)) : cost + ms;
        const uint64_t k2 = key(y);
        auto it = best.find(k2);
        if (it == best.end() || c2 < it->second.cost) {
          best[k2] = {c2, k, op, y};
          pq.push({c2, k2});
        }
      };
      if (!must_backward) {
        for (int i = 0; i <= x.nb; ++i) {  // forwards of stages whose backward is pending
          if (!live_a(x, i) || live_a(x, i + 1)) continue;
          const Stage& st = c_.stages[i];
          State y = x;
          y.a |= 1u << i;
          if (st.shared_input_bytes > 0) y.sh |= 1u << i;
          y.last_f = persistent ? i : -1;
          y.transient = persistent && x.last_f == i - 1 && i >= 1 ? i : -1;
          const int64_t shared = st.shared_input_bytes;
          relax(y, cur + A(i + 1) - shared + st.plain_tmp_bytes(), st.forward_ms, {OpKind::kForward, i});
          y.s |= 1u << i;
          y.last_f = y.transient = -1;
          for (int k = 0; k <= static_cast<int>(st.options.size()); ++k) {
            const Stage o = under(i, k);
            y.so = (x.so & ~(3u << (2 * i))) | (static_cast<uint32_t>(k) << (2 * i));
            // Once backward has started, a forward_save of the next stage to
            // backward is followed by its backward with nothing reading its
            // output (stage i+1 is done): early stop cuts it to recompute_ms.
            // Any other forward_save leaves a_{i+1} to a later forward.
            const bool cut = !forward_phase && i == x.nb && o.recompute_ms >= 0;
            relax(y, cur + o.saved_bytes - shared + o.forward_tmp_bytes, cut ? o.recompute_ms : o.forward_ms,
                  {OpKind::kForwardSave, i, k});
          }
        }
        for (int j = 1; j <= L_; ++j) {  // drops
          if (!live_a(x, j) || live_s(x, j - 1) || live_s(x, j)) continue;
          if (persistent && !(j > x.nb || j == x.transient)) continue;
          State y = x;
          y.a &= ~(1u << (j - 1));
          y.sh = without(without(y.sh, j - 1), j);  // the shared bytes stay with the neighbour
          if (persistent && j != x.transient) y.last_f = -1;
          y.transient = -1;
          relax(y, cur, 0, {OpKind::kDrop, j});
        }
      }
      if (x.nb >= 0 && live_s(x, x.nb) && live_a(x, x.nb)) {
        const int i = x.nb;
        const Stage st = under(i, option_of(x, i));
        const int64_t before = forward_phase ? cur + G(L_) : cur;
        State y = x;
        y.s &= ~(1u << i);
        y.a &= ~(1u << i);  // a_{i+1}
        y.sh = without(y.sh, i);
        y.nb = i - 1;
        y.last_f = y.transient = -1;
        y.so &= ~(3u << (2 * i));
        relax(y, before + G(i) + st.backward_tmp_bytes - st.backward_freed_bytes, st.backward_ms,
              {OpKind::kBackward, i});
      }
    }
    return inf;
  }

  const Chain& c_;
  int L_;
  Space space_;
};

}  // namespace remat::plan::testing
