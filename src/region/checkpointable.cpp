// The module-level switch (checkpointable.h).
#include <remat/checkpointable.h>

#include <ATen/core/grad_mode.h>
#include <fnmatch.h>

#include <sstream>
#include <typeindex>
#include <typeinfo>
#include <unordered_map>
#include <unordered_set>

#include "../offload/offload_internal.h"

namespace remat {

namespace detail {
namespace {
thread_local UnitObserver* tls_observer = nullptr;
}  // namespace
UnitObserver* unit_observer() { return tls_observer; }
UnitObserver* set_unit_observer(UnitObserver* o) { return std::exchange(tls_observer, o); }

OffloadCall::OffloadCall(const OffloadOptions& options) {
  if (is_recomputing() || !at::GradMode::is_enabled()) return;  // nothing to save, or the region's saves
  hooks_ = std::make_unique<ScopedHooks>(make_offload_hooks(OffloadStore::shared(options)));
}
OffloadCall::~OffloadCall() = default;
}  // namespace detail

namespace detail {
namespace {
void add_descendants(const torch::nn::Module& m, std::vector<ModuleRef>& out) {
  for (const auto& c : m.children()) {  // pre-order; no qualified names built
    out.emplace_back(nullptr, c);
    add_descendants(*c, out);
  }
}
}  // namespace

std::vector<ModuleRef> module_tree(const torch::nn::Module& m) {
  std::vector<ModuleRef> out{{const_cast<torch::nn::Module*>(&m), {}}};
  add_descendants(m, out);
  return out;
}
}  // namespace detail

detail::ModuleState Checkpointable::state() const {
  const auto* m = dynamic_cast<const torch::nn::Module*>(this);
  if (m == nullptr) return {};
  return {m->parameters(), m->buffers(), detail::module_tree(*m)};
}

namespace {

struct Found {
  SelectorInput in;  // at its first name
  Checkpointable* c;
  std::vector<std::string> aliases;  // the names it is reached by after the first
};

/** The checkpointable modules of a tree, in pre-order, each object once (at
 *  the first name LibTorch's named_modules() gives it; it lists a module
 *  registered twice, or shared by two parents, under every name). */
std::vector<Found> checkpointables(const torch::nn::Module& model) {
  std::vector<Found> out;
  std::unordered_map<const torch::nn::Module*, size_t> seen;
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    const torch::nn::Module* m = item.value().get();
    auto* c = dynamic_cast<Checkpointable*>(item.value().get());
    if (c == nullptr) continue;
    const auto [at, first] = seen.emplace(m, out.size());
    if (first) {
      out.push_back({SelectorInput{item.key(), m}, c, {}});
    } else {
      out[at->second].aliases.push_back(item.key());
    }
  }
  return out;
}

std::string shown(const std::string& name) { return name.empty() ? std::string("(root)") : name; }

std::string policy_of(const std::optional<CheckpointOptions>& o, const std::optional<OffloadOptions>& offload) {
  if (!o && offload) {
    return "off, saves offloaded (" + to_string(offload->target()) +
           (offload->codec() == Codec::kNone ? "" : ", " + to_string(offload->codec())) + ")";
  }
  if (!o) return "off";
  return o->policy() ? "on, policy " + o->policy()->description() : "on, full recompute";
}

}  // namespace

namespace select {

Selector all() {
  return Selector("all", [](const std::vector<SelectorInput>& in) { return std::vector<bool>(in.size(), true); });
}

Selector name(std::string glob) {
  return Selector("name " + glob, [glob](const std::vector<SelectorInput>& in) {
    std::vector<bool> out;
    for (const auto& m : in) out.push_back(fnmatch(glob.c_str(), m.name.c_str(), 0) == 0);
    return out;
  });
}

Selector predicate(std::string description, std::function<bool(const torch::nn::Module&)> pred) {
  return Selector(std::move(description), [pred = std::move(pred)](const std::vector<SelectorInput>& in) {
    std::vector<bool> out;
    for (const auto& m : in) out.push_back(pred(*m.module));
    return out;
  });
}

namespace {
Selector positional(const char* what, int64_t n, int64_t min, Selector base, bool every) {
  if (n < min) {
    throw Error(std::string("[remat::select::") + what + "] n must be at least " + std::to_string(min) + ", got " +
                std::to_string(n) + ".");
  }
  return Selector(std::string(what) + "(" + std::to_string(n) + ", " + base.description() + ")",
                  [n, base = std::move(base), every](const std::vector<SelectorInput>& in) {
                    std::vector<bool> chosen = base(in);
                    int64_t k = 0;
                    for (size_t i = 0; i < chosen.size(); ++i) {
                      if (!chosen[i]) continue;
                      chosen[i] = every ? k % n == 0 : k < n;
                      ++k;
                    }
                    return chosen;
                  });
}
}  // namespace

Selector every_n(int64_t n, Selector base) { return positional("every_n", n, 1, std::move(base), true); }
Selector first_n(int64_t n, Selector base) { return positional("first_n", n, 0, std::move(base), false); }

}  // namespace select

namespace {
/** The checkpointable modules of model that selector chooses; throws, listing
 *  them all, when it chooses none. `caller` names the function in errors. */
std::vector<Found> chosen(const torch::nn::Module& model, const Selector& selector, const std::string& caller) {
  auto all = checkpointables(model);
  std::vector<SelectorInput> in;
  for (const auto& f : all) in.push_back(f.in);
  const std::vector<bool> flags = selector(in);
  std::vector<Found> out;
  for (size_t i = 0; i < all.size(); ++i) {
    if (flags.at(i)) out.push_back(all[i]);
  }
  if (out.empty()) {
    std::string have;
    for (const auto& f : all) have += "\n  " + shown(f.in.name) + "  " + f.in.module->name();
    throw Error("[remat::" + caller + "] the selector '" + selector.description() + "' chose no module of " +
                model.name() + ". " +
                (all.empty() ? std::string("The tree has no checkpointable module: derive the blocks from "
                                           "remat::Checkpointable and forward through checkpointed().")
                             : "Its checkpointable modules are:" + have));
  }
  return out;
}

std::vector<Checkpointable*> chosen_by(torch::nn::Module& model, const Selector& selector, const std::string& caller) {
  std::vector<Checkpointable*> out;
  for (const auto& f : chosen(model, selector, caller)) out.push_back(f.c);
  return out;
}
}  // namespace

std::vector<SelectorInput> selected_checkpointables(const torch::nn::Module& model, const Selector& selector,
                                                    const std::string& caller) {
  std::vector<SelectorInput> out;
  for (const auto& f : chosen(model, selector, caller)) out.push_back(f.in);
  return out;
}

int64_t enable_checkpointing(torch::nn::Module& model, const Selector& selector, const CheckpointOptions& options) {
  const auto chosen = chosen_by(model, selector, "enable_checkpointing");
  for (Checkpointable* c : chosen) c->set_checkpointing(options);
  return static_cast<int64_t>(chosen.size());
}

int64_t enable_offloading(torch::nn::Module& model, const Selector& selector, const OffloadOptions& options) {
  OffloadScope check(options);  // invalid options, or a missing directory, are refused before anything changes
  const auto chosen = chosen_by(model, selector, "enable_offloading");
  for (Checkpointable* c : chosen) c->set_offloading(options);
  return static_cast<int64_t>(chosen.size());
}

int64_t disable_checkpointing(torch::nn::Module& model) {
  int64_t n = 0;
  for (auto& f : checkpointables(model)) {
    n += f.c->checkpointing() || f.c->offloading_options().has_value();
    f.c->set_checkpointing(std::nullopt);
    f.c->set_offloading(std::nullopt);
  }
  return n;
}

std::string describe_checkpointing(const torch::nn::Module& model) {
  const auto all = checkpointables(model);
  // A module that is on bypasses the switch when no module of its type has
  // called checkpointed() although some module of the tree has (a forward
  // ran). By type, not by object: a block that was merely not called in
  // that forward (remat-train --explain-memory runs blocks.0 alone) shares
  // its forward with one that was.
  std::unordered_set<std::type_index> routed;
  for (const auto& f : all) {
    if (f.c->checkpointed_calls() > 0) routed.insert(typeid(*f.in.module));
  }
  const auto bypassed = [&routed](const Found& f) {
    return !routed.empty() && f.c->checkpointing() && routed.count(typeid(*f.in.module)) == 0;
  };
  int64_t on = 0, not_running = 0;
  for (const auto& f : all) {
    on += f.c->checkpointing();
    not_running += bypassed(f);
  }
  std::ostringstream os;
  os << model.name() << ": " << on << " of " << all.size() << " checkpointable modules on";
  if (not_running > 0) os << ", " << not_running << " of them not running through checkpointed()";
  os << "\n";
  for (const auto& f : all) {
    os << "  " << shown(f.in.name) << "  " << f.in.module->name() << "  "
       << policy_of(f.c->checkpointing_options(), f.c->offloading_options());
    if (bypassed(f)) {
      os << ", but no " << f.in.module->name()
         << " has run through checkpointed() while other modules have: its forward must call checkpointed(), or "
            "the switch does nothing";
    }
    if (!f.aliases.empty()) {
      os << " (also as ";
      for (size_t i = 0; i < f.aliases.size(); ++i) os << (i ? ", " : "") << f.aliases[i];
      os << ")";
    }
    os << "\n";
  }
  return os.str();
}

}  // namespace remat
