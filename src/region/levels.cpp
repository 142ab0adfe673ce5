// Selective levels (levels.h): the knapsack over measured op calls and the
// policies keeping a level's calls.
#include "levels.h"

#include <remat/error.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace remat::detail {

std::string op_signature(const std::string& key, c10::ArrayRef<c10::IValue> args) {
  std::string sig = key;
  auto shape = [&](const at::Tensor& t) {
    sig += " [";
    if (t.defined()) {
      for (int64_t d = 0; d < t.dim(); ++d) {
        if (d > 0) sig += ',';
        sig += std::to_string(t.size(d));
      }
    }
    sig += "]";
  };
  for (const auto& a : args) {
    if (a.isTensor()) {
      shape(a.toTensor());
    } else if (a.isTensorList()) {
      for (const at::Tensor& t : a.toTensorVector()) shape(t);
    }
  }
  return sig;
}

namespace {
bool saveable_by_policy(const std::string& op) {
  // In-place, view and random ops are always recomputed (policy.h); an
  // allocation (empty_like) is filled in place afterwards (dropout's mask):
  // keeping it saves nothing.
  const std::string base = op.substr(0, op.find('.'));
  if (!base.empty() && base.back() == '_') return false;
  for (const char* r : {"dropout", "bernoulli", "rand", "normal", "uniform", "multinomial", "aten::empty",
                        "aten::zeros", "aten::ones", "aten::full", "aten::new_"}) {
    if (base.find(r) != std::string::npos) return false;
  }
  return true;
}

}  // namespace

std::vector<std::vector<std::string>> knapsack_levels(const std::map<std::string, OpItem>& items, int levels) {
  std::vector<std::string> names;
  std::vector<int64_t> bytes;
  std::vector<double> ms;
  int64_t total = 0;
  for (const auto& [sig, it] : items) {
    if (it.bytes <= 0 || it.ms <= 0 || !it.saveable || !saveable_by_policy(it.key)) continue;
    names.push_back(sig);
    bytes.push_back(it.bytes);
    ms.push_back(it.ms);
    total += it.bytes;
  }
  struct Entry {
    int64_t b;
    double t;
    int32_t prev;  // index in the previous level's front
    bool take;
  };
  std::vector<std::vector<Entry>> front{{{0, 0.0, -1, false}}};
  for (size_t i = 0; i < names.size(); ++i) {
    std::vector<Entry> next;
    const auto& f = front.back();
    for (size_t e = 0; e < f.size(); ++e) {
      next.push_back({f[e].b, f[e].t, static_cast<int32_t>(e), false});
      next.push_back({f[e].b + bytes[i], f[e].t + ms[i], static_cast<int32_t>(e), true});
    }
    // Fewer bytes first; keep an entry only if it saves more time than all before it.
    std::sort(next.begin(), next.end(),
              [](const Entry& a, const Entry& b) { return a.b < b.b || (a.b == b.b && a.t > b.t); });
    std::vector<Entry> pruned;
    for (const Entry& x : next) {
      if (pruned.empty() || x.t > pruned.back().t) pruned.push_back(x);
    }
    front.push_back(std::move(pruned));
  }
  std::vector<std::vector<std::string>> out;
  for (int j = 1; j <= levels; ++j) {
    const int64_t cap = total * j / (levels + 1);
    const auto& last = front.back();
    int32_t best = -1;
    for (size_t e = 0; e < last.size(); ++e) {
      if (last[e].b <= cap && (best < 0 || last[e].t > last[best].t)) best = static_cast<int32_t>(e);
    }
    if (best < 0) continue;
    std::vector<std::string> set;
    for (size_t i = names.size(); i > 0; --i) {
      const Entry& x = front[i][best];
      if (x.take) set.push_back(names[i - 1]);
      best = x.prev;
    }
    std::sort(set.begin(), set.end());
    if (set.empty() || set.size() == names.size()) continue;
    if (std::find(out.begin(), out.end(), set) == out.end()) out.push_back(set);
  }
  return out;
}

/** A policy keeping exactly the op calls of `set` (op_signature()s). A
 *  second ask for an op whose output got a name carries no arguments: it
 *  gets this thread's last answer for that operator, given just before. */
Policy keep_calls(std::string description, std::vector<std::string> set) {
  auto keep = std::make_shared<std::vector<std::string>>(std::move(set));
  return Policy(std::move(description), [keep](const OpCall& call) {
    thread_local std::map<std::string, OpDecision> last;
    const std::string key = call.overload().empty() ? call.name() : call.name() + "." + call.overload();
    if (call.inputs().empty() && !call.tag().empty()) {
      auto it = last.find(key);
      return it == last.end() ? OpDecision::kPreferRecompute : it->second;
    }
    const std::string sig = op_signature(key, call.inputs());
    const OpDecision d =
        std::binary_search(keep->begin(), keep->end(), sig) ? OpDecision::kPreferSave : OpDecision::kPreferRecompute;
    last[key] = d;
    return d;
  });
}

std::string level_name(const std::vector<std::string>& set) {
  std::map<std::string, int> count;
  for (const auto& sig : set) {
    std::string op = sig.substr(0, sig.find(' '));
    if (op.rfind("aten::", 0) == 0) op = op.substr(6);
    ++count[op];
  }
  std::string name = "save";
  for (const auto& [op, n] : count) name += (name == "save" ? " " : ", ") + (n > 1 ? std::to_string(n) + " " : "") + op;
  return name;
}

std::vector<Policy> level_policies(const std::map<std::string, OpItem>& items, int levels) {
  std::vector<Policy> out;
  for (const auto& set : knapsack_levels(items, levels)) out.push_back(keep_calls(level_name(set), set));
  return out;
}

std::string offload_name(const OffloadOptions& o) {
  std::string name = o.target() == OffloadTarget::kDisk ? "offload disk" : "offload memory";
  if (o.codec() != Codec::kNone) {
    std::string codec = to_string(o.codec()).substr(1);  // "kZstd" -> "Zstd"
    for (char& ch : codec) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    name += " " + codec;
  }
  return name;
}

void check_menu_offload(const std::string& which, const OffloadOptions& off, bool on_cpu) {
  if (on_cpu && off.target() == OffloadTarget::kHost) {
    throw Error(which +
                ": kHost moves accelerator tensors to pinned host memory and keeps CPU tensors where they are, "
                "so it saves nothing here; use kDisk with a directory, or kMemory with a codec.");
  }
  if (off.target() == OffloadTarget::kMemory && off.codec() == Codec::kNone) {
    throw Error(which +
                ": kMemory without a codec keeps every byte in memory; give it a codec (kZstd, kLz4), or use "
                "kDisk with a directory.");
  }
  try {
    OffloadScope check(off);  // a missing or read-only directory is refused now, by name
  } catch (const Error& e) {
    throw Error(which + ": " + e.what());
  }
}

}  // namespace remat::detail
