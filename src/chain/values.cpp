// Boundary values of a planned chain (see values.h).
#include "values.h"

#include <tuple>
#include <unordered_set>

#include <c10/util/Exception.h>
#include <c10/util/Type.h>

#include <remat/error.h>

namespace remat::detail {

using torch::nn::AnyValue;
using T2 = std::tuple<at::Tensor, at::Tensor>;
using T3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using T4 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

bool Values::empty() const {
  for (const auto& t : ts) {
    if (t.defined()) return false;
  }
  return true;
}

Values Values::detached() const {
  Values v(kind, ts);
  for (auto& t : v.ts) {
    if (t.defined()) t = t.detach();
  }
  return v;
}

Values Values::cloned() const {
  Values v(kind, ts);
  for (auto& t : v.ts) {
    if (t.defined()) t = t.clone();
  }
  return v;
}

int64_t Values::bytes(const Values* exclude) const {
  std::unordered_set<const c10::StorageImpl*> seen;
  if (exclude) {
    for (const auto& t : exclude->ts) {
      if (t.defined()) seen.insert(t.storage().unsafeGetStorageImpl());
    }
  }
  int64_t n = 0;
  for (const auto& t : ts) {
    if (t.defined() && seen.insert(t.storage().unsafeGetStorageImpl()).second) {
      n += static_cast<int64_t>(t.storage().nbytes());
    }
  }
  return n;
}

std::string Values::describe() const {
  const std::string n = std::to_string(ts.size());
  switch (kind) {
    case Kind::kTensor: return "Tensor";
    case Kind::kVector: return "vector of " + n + " tensors";
    default: return "tuple of " + n + " tensors";
  }
}

Values Values::from(AnyValue&& v, const std::string& who) {
  if (auto* t = v.try_get<at::Tensor>()) return Values(std::move(*t));
  if (auto* t = v.try_get<std::vector<at::Tensor>>()) return {Kind::kVector, std::move(*t)};
  if (auto* t = v.try_get<T2>()) return {Kind::kTuple2, {std::get<0>(*t), std::get<1>(*t)}};
  if (auto* t = v.try_get<T3>()) return {Kind::kTuple3, {std::get<0>(*t), std::get<1>(*t), std::get<2>(*t)}};
  if (auto* t = v.try_get<T4>()) {
    return {Kind::kTuple4, {std::get<0>(*t), std::get<1>(*t), std::get<2>(*t), std::get<3>(*t)}};
  }
  throw Error(who + " returned a " + c10::demangle(v.type_info().name()) +
              "; a planned stage must return at::Tensor, std::vector<at::Tensor> or a std::tuple of 2 to 4 "
              "tensors (wrap the module in one that returns one of those).");
}

AnyValue Values::to_any() const {
  switch (kind) {
    case Kind::kTensor: return AnyValue(at::Tensor(ts.at(0)));
    case Kind::kVector: return AnyValue(std::vector<at::Tensor>(ts));
    case Kind::kTuple2: return AnyValue(T2(ts.at(0), ts.at(1)));
    case Kind::kTuple3: return AnyValue(T3(ts.at(0), ts.at(1), ts.at(2)));
    case Kind::kTuple4: return AnyValue(T4(ts.at(0), ts.at(1), ts.at(2), ts.at(3)));
  }
  throw Error("[remat] internal: unknown boundary kind; please report this bug.");
}

Values run_module(torch::nn::AnyModule& m, const Values& v, const std::string& who) {
  AnyValue out = [&] {
    try {
      return m.any_forward(v.to_any());
    } catch (const c10::Error& e) {
      // AnyModule checks the argument's type before running forward.
      const std::string what = e.what_without_backtrace();
      if (what.find("Expected argument #0 to be of type") == std::string::npos) throw;
      throw Error(who + " does not take a " + v.describe() +
                  " (the previous stage's result, or the chain's input): " + what);
    }
  }();
  return Values::from(std::move(out), who);
}

namespace {
std::string writes_input_error(const std::string& who) {
  return who +
         " writes its input in place on this call, but did not when profiled on the first batch; a planned "
         "stage must write its input in place on every call or on none: make the in-place op unconditional, or "
         "use its out-of-place form (e.g. ReLU without inplace).";
}
}  // namespace

Values run_stage_module(torch::nn::AnyModule& m, const Values& in, bool writes_input, const std::string& who) {
  if (writes_input) return run_module(m, in.cloned(), who);  // NOTE [stages that write their input]
  std::vector<int64_t> versions(in.size(), -1);
  for (size_t k = 0; k < in.size(); ++k) {
    if (in[k].defined() && !in[k].is_inference()) versions[k] = in[k]._version();
  }
  Values y;
  try {
    y = run_module(m, in, who);
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    if (what.find("that requires grad is being used in an in-place operation") != std::string::npos) {
      throw Error(writes_input_error(who));
    }
    throw;
  }
  for (size_t k = 0; k < in.size(); ++k) {
    if (versions[k] >= 0 && in[k]._version() != versions[k]) throw Error(writes_input_error(who));
  }
  return y;
}

}  // namespace remat::detail
