// See NOTE [op-level interception, as built] in dispatch.h.
#include "dispatch.h"

#include <remat/error.h>

#include <torch/library.h>

#include <memory>
#include <mutex>

namespace remat::dispatch {
namespace {

constexpr c10::DispatchKey kKey = c10::DispatchKey::Fake;

/** One pushed Scope: its interceptor (nullptr: logs only) and log. */
struct Level {
  Interceptor* interceptor;
  std::vector<std::string>* log;
};
thread_local std::vector<Level> t_levels;  // outermost first
// While an op passes down the stack: how many levels are still below the
// one handling it (run_below hands the op to level t_below - 1).
thread_local size_t t_below = 0;
thread_local uint64_t t_scopes = 0;

/** Hands op to the next level below the current one, or to the kernels. */
void pass_down(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  while (t_below > 0) {
    const Level level = t_levels[--t_below];
    if (level.log != nullptr) level.log->push_back(op_key(op));
    if (level.interceptor != nullptr) {
      level.interceptor->on_op(op, ks, stack);
      return;
    }
  }
  op.redispatchBoxed(ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kKey), stack);
}

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  Suspend suspend;
  struct Restore {
    size_t below = t_below;
    ~Restore() { t_below = below; }
  } restore;
  t_below = t_levels.size();
  pass_down(op, ks, stack);
}

void install() {
  static std::once_flag once;
  static std::unique_ptr<torch::Library> lib;
  std::call_once(once, [] {
    if (c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(kKey)) {
      throw Error(
          "[remat] checkpoint regions need the dispatcher's Fake key (they see the ops they run), but another "
          "library (Python's FakeTensor support, in a Python process) already registered a fallback on it; "
          "use remat from a C++-only process.");
    }
    lib = std::make_unique<torch::Library>(torch::Library::IMPL, "_", kKey, __FILE__, __LINE__);
    lib->fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
  });
}

}  // namespace

void run_below(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  // The level that calls this is t_levels[t_below]; what it hands on goes
  // to the levels below it only, and the next op starts from the top again.
  const size_t me = t_below;
  pass_down(op, ks, stack);
  t_below = me;
}

Interceptor* current() {
  for (auto it = t_levels.rbegin(); it != t_levels.rend(); ++it) {
    if (it->interceptor != nullptr) return it->interceptor;
  }
  return nullptr;
}

void tag(const at::Tensor& t, const std::string& name) {
  if (t_levels.empty()) return;
  Suspend suspend;
  const std::vector<Level> levels = t_levels;  // an on_tag may not push or pop, but be safe
  for (auto it = levels.rbegin(); it != levels.rend(); ++it) {
    if (it->interceptor != nullptr) it->interceptor->on_tag(t, name);
  }
}

uint64_t scopes_opened() { return t_scopes; }

namespace {
c10::DispatchKeySet tls_included() { return c10::impl::tls_local_dispatch_key_set().included_; }
c10::DispatchKeySet tls_excluded() { return c10::impl::tls_local_dispatch_key_set().excluded_; }
int install_once() {
  install();
  return 0;
}
}  // namespace

Scope::Scope(Interceptor* i, std::vector<std::string>* log)
    : depth_((install_once(), t_levels.size())),
      keys_(tls_included() | c10::DispatchKeySet(kKey), tls_excluded() - c10::DispatchKeySet(kKey)) {
  t_levels.push_back({i, log});
  ++t_scopes;
}

Scope::~Scope() {
  // Scopes nest (RAII on one thread); one that outlived an inner one drops
  // the inner's level too rather than leave a dangling interceptor.
  if (t_levels.size() > depth_) t_levels.resize(depth_);
}

Suspend::Suspend() : keys_(tls_included(), tls_excluded() | c10::DispatchKeySet(kKey)) {}

Suspend::~Suspend() = default;

std::string op_key(const c10::OperatorHandle& op) {
  const auto& n = op.operator_name();
  return n.overload_name.empty() ? n.name : n.name + "." + n.overload_name;
}

}  // namespace remat::dispatch
