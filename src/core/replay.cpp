// Replay of a first run's RNG, autocast and buffer state (see replay.h).
#include "replay.h"

#include <algorithm>
#include <cstring>

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace remat {
namespace {

thread_local int t_recompute_depth = 0;
// The last RNG state captured per device on this thread. Consecutive
// captures without random ops in between see the same state and share one
// copy (~5 KiB for the CPU generator) instead of keeping one each.
thread_local std::vector<std::pair<c10::Device, at::Tensor>> t_last_rng;

at::Tensor dedup_rng_state(c10::Device d, at::Tensor state) {
  for (auto& [dev, last] : t_last_rng) {
    if (dev != d) continue;
    if (last.numel() == state.numel() && last.scalar_type() == state.scalar_type() &&
        std::memcmp(last.data_ptr(), state.data_ptr(), state.numel() * state.element_size()) == 0) {
      return last;
    }
    last = state;
    return state;
  }
  t_last_rng.emplace_back(d, state);
  return state;
}

}  // namespace

namespace detail {

bool recomputing() { return t_recompute_depth > 0; }

void forget_rng_captures() { t_last_rng.clear(); }

bool is_parameter_like(const at::Tensor& t) {
  if (t.requires_grad() && t.is_leaf()) return true;
  if (t.is_view()) {
    const at::TensorBase& base = t._base();
    return base.requires_grad() && base.is_leaf();
  }
  return false;
}

AutocastState AutocastState::capture() {
  return {at::autocast::is_autocast_enabled(at::kCPU), at::autocast::is_autocast_enabled(at::kCUDA),
          at::autocast::is_autocast_cache_enabled(), at::autocast::get_autocast_dtype(at::kCPU),
          at::autocast::get_autocast_dtype(at::kCUDA)};
}

void AutocastState::apply() const {
  at::autocast::set_autocast_enabled(at::kCPU, cpu_enabled);
  at::autocast::set_autocast_enabled(at::kCUDA, cuda_enabled);
  at::autocast::set_autocast_cache_enabled(cache_enabled);
  at::autocast::set_autocast_dtype(at::kCPU, cpu_dtype);
  at::autocast::set_autocast_dtype(at::kCUDA, cuda_dtype);
}

namespace {

/** Device types whose default generator at::globalContext() can hand out
 *  (Context::getAcceleratorHooksInterface); CPU is handled apart. */
bool has_default_generator(c10::DeviceType t) {
  switch (t) {
    case c10::kCUDA:
    case c10::kXPU:
    case c10::kMPS:
    case c10::kPrivateUse1:
    case c10::kMTIA:
    case c10::kHIP:
    case c10::kHPU: return true;
    default: return false;
  }
}

}  // namespace

std::vector<c10::Device> rng_devices(const std::vector<c10::Device>& inputs, const std::vector<c10::Device>& in_use) {
  std::vector<c10::Device> out{c10::Device(c10::kCPU)};
  auto add = [&out](const c10::Device& d) {
    if (!has_default_generator(d.type())) return;
    if (std::find(out.begin(), out.end(), d) == out.end()) out.push_back(d);
  };
  for (const auto& d : inputs) add(d);
  for (const auto& d : in_use) add(d);
  return out;
}

std::vector<c10::Device> cuda_devices_in_use() {
  std::vector<c10::Device> out;
  if (!at::hasCUDA()) return out;  // CPU build, or no GPU: nothing to ask
  const auto& hooks = at::detail::getCUDAHooks();
  const int n = hooks.deviceCount();
  for (int i = 0; i < n; ++i) {
    const auto idx = static_cast<c10::DeviceIndex>(i);
    if (hooks.hasPrimaryContext(idx)) out.emplace_back(c10::kCUDA, idx);
  }
  return out;
}

std::optional<c10::Stream> stream_of(const at::Tensor& t) {
  if (!t.defined()) return std::nullopt;
  const c10::Device d = t.device();
  if (d.is_cpu() || d.is_meta() || !c10::impl::hasDeviceGuardImpl(d.type())) return std::nullopt;
  return c10::impl::VirtualGuardImpl(d.type()).getStream(d);
}

void use_on_current_stream(const at::Tensor& t, const std::optional<c10::Stream>& produced_on) {
  if (!produced_on || !t.defined()) return;
  const c10::Device d = t.device();
  const c10::impl::VirtualGuardImpl impl(d.type());
  const c10::Stream now = impl.getStream(d);
  if (now == *produced_on) return;
  c10::Event ready(d.type());
  ready.record(*produced_on);
  ready.block(now);
  impl.recordDataPtrOnStream(t.storage().data_ptr(), now);
}

c10::Device memory_device(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& parameters) {
  for (const auto* ts : {&inputs, &parameters}) {
    for (const auto& t : *ts) {
      if (t.defined() && t.is_cuda()) return t.device();
    }
  }
  return c10::Device(c10::kCPU);
}

namespace {
/** Sets each module's flag, in pre-order: train() also sets the module's
 *  descendants, which come after it and get their own. */
/** The module, or null once a descendant is freed; non-owning by address. */
std::shared_ptr<torch::nn::Module> lock(const ModuleRef& m) {
  return m.first != nullptr ? std::shared_ptr<torch::nn::Module>(std::shared_ptr<torch::nn::Module>(), m.first)
                            : m.second.lock();
}

void set_training(const std::vector<std::shared_ptr<torch::nn::Module>>& modules, const std::vector<char>& on) {
  for (size_t i = 0; i < modules.size(); ++i) {
    if (modules[i]) modules[i]->train(on[i] != 0);
  }
}
}  // namespace

ReplayState ReplayState::capture(bool preserve_rng, const std::vector<c10::Device>& devices,
                                 std::vector<at::Tensor> buffers, std::vector<ModuleRef> modules) {
  ReplayState r;
  r.autocast = AutocastState::capture();
  r.modules = std::move(modules);
  for (const auto& m : r.modules) r.training.push_back(lock(m)->is_training() ? 1 : 0);
  r.buffers = std::move(buffers);
  for (const auto& b : r.buffers) r.buffer_values.push_back(b.detach().clone());
  if (!preserve_rng) return r;
  for (const auto& d : rng_devices(devices, cuda_devices_in_use())) {
    at::Generator gen = at::globalContext().defaultGenerator(d);
    at::Tensor state;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      state = gen.get_state();
    }
    r.rng.emplace_back(gen, dedup_rng_state(d, std::move(state)));
  }
  return r;
}

ReplayGuard::ReplayGuard(const ReplayState& state, bool enable_grad)
    : rng_lock_(!state.rng.empty()),
      state_(state),
      grad_(enable_grad || at::GradMode::is_enabled()),
      autocast_now_(AutocastState::capture()) {
  // What may throw (copies that allocate) comes first, before anything is
  // swapped: a constructor that throws runs no destructor, and would leave
  // the thread with the first run's RNG, autocast and flags.
  for (auto [gen, s] : state_.rng) {
    std::lock_guard<std::mutex> lock(gen.mutex());
    RngNow now;
    if (auto* cpu = dynamic_cast<at::CPUGeneratorImpl*>(gen.unsafeGetGeneratorImpl())) {
      now.engine = cpu->engine();
      now.next_float = cpu->next_float_normal_sample();
      now.next_double = cpu->next_double_normal_sample();
    } else {
      now.state = gen.get_state();
    }
    rng_now_.push_back(std::move(now));
  }
  {
    at::NoGradGuard no_grad;
    for (const auto& b : state_.buffers) buffers_now_.push_back(b.detach().clone());
  }
  // A module switched to eval() (or back) between forward and backward
  // recomputes as its forward ran: Dropout, BatchNorm and a module's own
  // training-only branches read the flag.
  std::vector<char> now;
  for (const auto& m : state_.modules) {
    modules_.push_back(lock(m));
    now.push_back(modules_.back() && modules_.back()->is_training() ? 1 : 0);
  }
  bool differ = false;
  for (size_t i = 0; i < now.size(); ++i) differ = differ || (modules_[i] && now[i] != state_.training[i]);
  if (differ) training_now_ = std::move(now);

  for (auto [gen, s] : state_.rng) {
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(s);
  }
  state_.autocast.apply();
  if (!training_now_.empty()) set_training(modules_, state_.training);
  // Like torch.autocast's context: casts cached while the re-run is under
  // autocast are dropped when the outermost autocast region ends, else the
  // next forward would reuse casts of parameters the optimizer has since
  // changed (see ~ReplayGuard).
  if (state_.autocast.cpu_enabled || state_.autocast.cuda_enabled) at::autocast::increment_nesting();
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < state_.buffers.size(); ++i) {
    // Rewind to the first run's values: a re-run must see what it saw
    // (BatchNorm saves its running statistics for backward).
    state_.buffers[i].variable_data().copy_(state_.buffer_values[i]);
  }
  ++t_recompute_depth;  // last: the destructor, which takes it back, runs only after this
}

ReplayGuard::~ReplayGuard() {
  {
    at::NoGradGuard no_grad;
    // variable_data(): new version counter, so saved buffers stay valid.
    for (size_t i = 0; i < buffers_now_.size(); ++i) state_.buffers[i].variable_data().copy_(buffers_now_[i]);
  }
  if (!training_now_.empty()) set_training(modules_, training_now_);
  autocast_now_.apply();
  // The autocast cache maps a parameter to its cast without checking its
  // version: left filled, it would hand the next step's forward (under the
  // user's autocast) the casts of this step's weights. Python's checkpoint
  // clears it the same way when its recompute's autocast context exits.
  if ((state_.autocast.cpu_enabled || state_.autocast.cuda_enabled) && at::autocast::decrement_nesting() == 0) {
    at::autocast::clear_cache();
  }
  for (size_t i = 0; i < rng_now_.size(); ++i) {
    at::Generator gen = state_.rng[i].first;
    std::lock_guard<std::mutex> lock(gen.mutex());
    const RngNow& now = rng_now_[i];
    if (now.engine) {
      auto* cpu = static_cast<at::CPUGeneratorImpl*>(gen.unsafeGetGeneratorImpl());  // as captured above
      cpu->set_engine(*now.engine);
      cpu->set_next_float_normal_sample(now.next_float);
      cpu->set_next_double_normal_sample(now.next_double);
    } else {
      gen.set_state(now.state);
    }
  }
  --t_recompute_depth;
}

}  // namespace detail
}  // namespace remat
