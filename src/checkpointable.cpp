// The module-level switch (checkpointable.h).
#include <remat/checkpointable.h>

#include <fnmatch.h>

#include <sstream>

namespace remat {

detail::ModuleState Checkpointable::state() const {
  const auto* m = dynamic_cast<const torch::nn::Module*>(this);
  if (m == nullptr) return {};
  return {m->parameters(), m->buffers()};
}

namespace {

/** The checkpointable modules of a tree, in pre-order, with their names. */
std::vector<std::pair<SelectorInput, Checkpointable*>> checkpointables(const torch::nn::Module& model) {
  std::vector<std::pair<SelectorInput, Checkpointable*>> out;
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    if (auto* c = dynamic_cast<Checkpointable*>(item.value().get())) {
      out.push_back({SelectorInput{item.key(), item.value().get()}, c});
    }
  }
  return out;
}

std::string policy_of(const std::optional<CheckpointOptions>& o) {
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

int64_t enable_checkpointing(torch::nn::Module& model, const Selector& selector, const CheckpointOptions& options) {
  auto all = checkpointables(model);
  std::vector<SelectorInput> in;
  for (const auto& [s, c] : all) in.push_back(s);
  const std::vector<bool> chosen = selector(in);
  int64_t n = 0;
  for (size_t i = 0; i < all.size(); ++i) n += chosen.at(i);
  if (n == 0) {
    std::string have;
    for (const auto& [s, c] : all) {
      have += "\n  " + (s.name.empty() ? std::string("(root)") : s.name) + "  " + s.module->name();
    }
    throw Error("[remat::enable_checkpointing] the selector '" + selector.description() + "' chose no module of " +
                model.name() + ". " +
                (all.empty() ? std::string("The tree has no checkpointable module: derive the blocks from "
                                           "remat::Checkpointable and forward through checkpointed().")
                             : "Its checkpointable modules are:" + have));
  }
  for (size_t i = 0; i < all.size(); ++i) {
    if (chosen[i]) all[i].second->set_checkpointing(options);
  }
  return n;
}

int64_t disable_checkpointing(torch::nn::Module& model) {
  int64_t n = 0;
  for (auto& [s, c] : checkpointables(model)) {
    n += c->checkpointing();
    c->set_checkpointing(std::nullopt);
  }
  return n;
}

std::string describe_checkpointing(const torch::nn::Module& model) {
  std::ostringstream os;
  const auto all = checkpointables(model);
  int64_t on = 0;
  for (const auto& [s, c] : all) on += c->checkpointing();
  os << model.name() << ": " << on << " of " << all.size() << " checkpointable modules on\n";
  for (const auto& [s, c] : all) {
    os << "  " << (s.name.empty() ? std::string("(root)") : s.name) << "  " << s.module->name() << "  "
       << policy_of(c->checkpointing_options()) << "\n";
  }
  return os.str();
}

}  // namespace remat
