// See NOTE [op-level interception, as built] in dispatch.h.
#include "dispatch.h"

#include <remat/error.h>

#include <torch/library.h>

#include <memory>
#include <mutex>

namespace remat::dispatch {
namespace {

constexpr c10::DispatchKey kKey = c10::DispatchKey::Fake;

thread_local Interceptor* t_current = nullptr;
thread_local std::vector<std::string>* t_log = nullptr;
thread_local uint64_t t_scopes = 0;

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  Interceptor* i = t_current;
  Suspend suspend;
  if (t_log != nullptr) t_log->push_back(op_key(op));
  if (i == nullptr) {
    run_below(op, ks, stack);
  } else {
    i->on_op(op, ks, stack);
  }
}

void install() {
  static std::once_flag once;
  static std::unique_ptr<torch::Library> lib;
  std::call_once(once, [] {
    if (c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(kKey)) {
      throw Error(
          "[remat] selective checkpointing needs the dispatcher's Fake key, but another library "
          "(Python's FakeTensor support, in a Python process) already registered a fallback on it; "
          "use remat's selective policies from a C++-only process, or checkpoint without a policy.");
    }
    lib = std::make_unique<torch::Library>(torch::Library::IMPL, "_", kKey, __FILE__, __LINE__);
    lib->fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
  });
}

}  // namespace

void run_below(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  op.redispatchBoxed(ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kKey), stack);
}

Interceptor* current() { return t_current; }
uint64_t scopes_opened() { return t_scopes; }

namespace {
Interceptor* install_and_get() {
  install();
  return t_current;
}
c10::DispatchKeySet tls_included() { return c10::impl::tls_local_dispatch_key_set().included_; }
c10::DispatchKeySet tls_excluded() { return c10::impl::tls_local_dispatch_key_set().excluded_; }
}  // namespace

Scope::Scope(Interceptor* i, std::vector<std::string>* log)
    : previous_(install_and_get()),
      previous_log_(t_log),
      keys_(tls_included() | c10::DispatchKeySet(kKey), tls_excluded() - c10::DispatchKeySet(kKey)) {
  t_current = i;
  t_log = log;
  ++t_scopes;
}

Scope::~Scope() {
  t_current = previous_;
  t_log = previous_log_;
}

Suspend::Suspend() : keys_(tls_included(), tls_excluded() | c10::DispatchKeySet(kKey)) {}

Suspend::~Suspend() = default;

std::string op_key(const c10::OperatorHandle& op) {
  const auto& n = op.operator_name();
  return n.overload_name.empty() ? n.name : n.name + "." + n.overload_name;
}

}  // namespace remat::dispatch
