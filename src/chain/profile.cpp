// The profiler (see profile.h): one forward and backward per stage on its
// own, timed, with saved tensors counted through remat's hooks and
// temporaries through remat::memory; everything it changes is put back, and
// the real parameters' gradients and hooks are never reached. Every run of
// a stage here goes through a write guard (NOTE [recompute side effects]),
// as the runtime's re-runs do: state the stage writes that is not its own
// registered buffers (a BatchNorm owned elsewhere, called from a lambda) is
// put back after each run; its own buffers are put back at the end.
#include <remat/profile.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <unordered_set>

#include <ATen/Context.h>
#include <ATen/SequenceNumber.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/modules/container/sequential.h>

#include <remat/error.h>
#include <remat/hooks.h>
#include <remat/memory.h>
#include <remat/plan/json.h>

#include "../core/dispatch.h"
#include "../core/replay.h"
#include "../core/write_guard.h"
#include "../region/levels.h"
#include "early_stop.h"
#include "grad_edges.h"
#include "levers.h"
#include "values.h"

namespace remat {
namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

/** Waits for the device's queued work (CUDA kernels run asynchronously: a
 *  stage is timed from a synchronized start to a synchronized end). */
void synchronize(c10::Device d) {
  if (!d.is_cpu()) c10::impl::VirtualGuardImpl(d.type()).synchronizeDevice(d.index());
}

int64_t storage_bytes(const at::Tensor& t) { return static_cast<int64_t>(t.storage().nbytes()); }

/** Puts back buffers and the RNG states (CPU, and the CUDA devices of the
 *  chain or in use: NOTE [RNG devices] in core/replay.h). */
class Restore {
 public:
  Restore(torch::nn::Sequential& seq, c10::Device device) : buffers_(seq->buffers()) {
    for (auto& b : buffers_) buffer_values_.push_back(b.detach().clone());
    for (const auto& d : detail::rng_devices({device}, detail::cuda_devices_in_use())) {
      at::Generator gen = at::globalContext().defaultGenerator(d);
      std::lock_guard<std::mutex> lock(gen.mutex());
      rng_.emplace_back(gen, gen.get_state());
    }
  }
  ~Restore() {
    at::NoGradGuard g;
    for (size_t i = 0; i < buffers_.size(); ++i) buffers_[i].variable_data().copy_(buffer_values_[i]);
    for (auto& [gen, state] : rng_) {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(state);
    }
  }

 private:
  std::vector<at::Tensor> buffers_, buffer_values_;
  std::vector<std::pair<at::Generator, at::Tensor>> rng_;
};

}  // namespace

namespace detail {

namespace {

/** One profiling run's write guard: push scope() around the stage's ops;
 *  the writes are undone when it is destroyed (after the run's backward:
 *  undoing bumps version counters that the run's graph checks). The
 *  Sequential's buffers are Restore's. */
class RunWrites {
 public:
  explicit RunWrites(const std::vector<at::Tensor>& buffers) : interceptor_(make_write_guard_interceptor(&guard_)) {
    for (const auto& b : buffers) guard_.adopt(b);
  }
  ~RunWrites() {
    dispatch::Suspend own;  // remat's own work: no interceptor sees the restore
    guard_.restore();
  }
  RunWrites(const RunWrites&) = delete;
  RunWrites& operator=(const RunWrites&) = delete;
  dispatch::Interceptor* interceptor() const { return interceptor_.get(); }

 private:
  WriteGuard guard_;
  std::unique_ptr<dispatch::Interceptor> interceptor_;
};

/** The stage's recompute as early stop cuts it (NOTE [early stop in planned
 *  recomputes]): a recording run, then `repeats` timed ones; median ms, or
 *  -1 when the stage is never cut (its forward time applies). */
double cut_recompute_ms(torch::nn::AnyModule& module, const Values& h, const std::string& who, int repeats,
                        const c10::Device& device, bool writes_input, const std::vector<at::Tensor>& buffers) {
  if (!early_stop_available()) return -1;
  auto input = [&] {
    Values in = h.detached();
    for (auto& t : in.ts) {
      if (t.defined() && differentiable(t)) t.requires_grad_(true);
    }
    return in;
  };
  std::shared_ptr<const StopRecord> rec;
  std::vector<WeakStorage> after_cut;
  {
    RunWrites writes(buffers);
    Values in = input();
    const uint64_t seq0 = at::sequence_number::peek();
    dispatch::Scope ops(writes.interceptor());
    StopRecorder recorder;
    Values y = run_stage_module(module, in, writes_input, who);
    rec = recorder.finish(y.ts, seq0);
    if (rec->usable) after_cut = recorder.after_cut();
  }
  // The run's outputs and graph are gone: a storage made after the cut point
  // that is still alive is kept by the stage (NOTE [early stop in planned
  // recomputes], "Kept state"); the runtime never cuts it either.
  if (!rec->usable || any_alive(after_cut)) return -1;
  std::vector<double> ms;
  for (int r = 0; r < repeats; ++r) {
    Values in = input();
    try {
      RunWrites writes(buffers);
      dispatch::Scope ops(writes.interceptor());
      StopReplay replay(rec);
      synchronize(device);
      const auto t0 = Clock::now();
      Values y = run_stage_module(module, in, writes_input, who);
      synchronize(device);
      ms.push_back(ms_since(t0));
      if (replay.diverged()) return -1;
    } catch (const Diverged&) {
      return -1;
    }
  }
  return median(ms);
}

/** The stage's input as a forward_save gets it: a detached leaf that
 *  requires grad where differentiable. */
Values grad_input(const Values& h) {
  Values in = h.detached();
  for (auto& t : in.ts) {
    if (t.defined() && differentiable(t)) t.requires_grad_(true);
  }
  return in;
}

/** The stage's menu (ProfileOptions::selective_levels, offload): its
 *  selective levels from one run under an op timer, then the offload
 *  options, those to disk last (Levers). */
std::vector<StageLever> stage_menu(torch::nn::AnyModule& module, const Values& h, bool writes, const std::string& who,
                                   const std::vector<at::Tensor>& buffers, const ProfileOptions& options) {
  std::vector<StageLever> menu;
  if (options.selective_levels() > 0) {
    OpTimer timer;
    {
      RunWrites run_writes(buffers);
      Values in = grad_input(h);
      dispatch::Scope ops(run_writes.interceptor());
      dispatch::Scope timed(&timer);
      Values out = run_stage_module(module, in, writes, who);
    }
    for (Policy& p : level_policies(timer.items(), options.selective_levels())) {
      StageLever l;
      l.region = CheckpointOptions().policy(std::move(p));
      menu.push_back(std::move(l));
    }
  }
  for (bool disk : {false, true}) {
    for (const OffloadOptions& o : options.offload()) {
      if ((o.target() == OffloadTarget::kDisk) != disk) continue;
      StageLever l;
      l.offload = o;
      menu.push_back(std::move(l));
    }
  }
  return menu;
}

/** One option of the stage measured as the stage is (bytes kept, forward
 *  and backward temporaries, median times), its times raised to at least
 *  the stage's own (noise; plan::Chain::validate). nullopt: it keeps
 *  hardly fewer bytes than keeping everything. */
std::optional<plan::StageOption> measure_lever(torch::nn::AnyModule& module, const Values& h, const StageLever& lever,
                                               const plan::Stage& stage, bool writes, const std::string& who,
                                               const c10::Device& dev, const std::vector<at::Tensor>& buffers,
                                               const ProfileOptions& options) {
  plan::StageOption opt;
  opt.name = lever.offload ? offload_name(*lever.offload) : lever.region->policy()->description();
  std::vector<double> forward_ms, backward_ms;
  for (int r = 0; r < options.warmup() + options.repeats(); ++r) {
    RunWrites run_writes(buffers);  // undone after the backward
    Values in = grad_input(h);
    Values out;
    uint64_t seq0 = 0;
    int64_t kept = 0, tmp = 0;
    Clock::time_point t0;
    {
      memory::Probe probe(dev);
      seq0 = at::sequence_number::peek();
      dispatch::Scope ops(run_writes.interceptor());
      synchronize(dev);
      t0 = Clock::now();
      out = run_stage_under(module, in, writes, who, &lever, /*trial=*/true);
      synchronize(dev);
      kept = probe.delta_bytes();
      tmp = std::max<int64_t>(0, probe.peak_bytes() - probe.delta_bytes());
    }
    const double f_ms = ms_since(t0);
    std::vector<at::Tensor> roots, seeds;
    for (const auto& t : out.ts) {
      if (t.defined() && t.requires_grad() && t.grad_fn()) {
        roots.push_back(t);
        seeds.push_back(at::ones_like(t));
      }
    }
    out = Values();  // the roots hold the outputs until the backward lets go of them
    double b_ms = 0;
    int64_t above = 0;
    if (!roots.empty()) {
      // NOTE [redirected gradient edges], as for the stage itself.
      Redirected red = redirect_gradient_edges(roots, in.ts, seq0);
      torch::autograd::edge_list outputs;
      for (uint32_t k = 0; k < red.num_inputs(); ++k) outputs.push_back(red.edge(k));
      for (const auto& [leaf, nr] : red.other_leaves) red.hooks[nr]->discard = true;
      if (!outputs.empty()) {
        memory::Probe probe(dev);
        synchronize(dev);
        const auto t1 = Clock::now();
        auto grads = backward_releasing(std::move(roots), std::move(seeds), /*keep_graph=*/false, outputs);
        synchronize(dev);
        b_ms = ms_since(t1);
        int64_t grad_in = 0;
        for (size_t k = 0; k < in.size(); ++k) {
          const int64_t nr = red.target_input[k];
          if (nr >= 0 && grads[nr].defined()) grad_in += storage_bytes(grads[nr]);
        }
        above = probe.peak_bytes() - grad_in;
      }
    }
    if (r >= options.warmup()) {
      forward_ms.push_back(f_ms);
      backward_ms.push_back(b_ms);
    }
    // What it keeps: the new bytes, and what its output passes on from its input.
    opt.saved_bytes = std::max(stage.output_bytes, kept + stage.shared_input_bytes);
    opt.forward_tmp_bytes = tmp;
    opt.backward_tmp_bytes = std::max<int64_t>(0, above);
    opt.backward_freed_bytes =
        std::min(std::max<int64_t>(0, -above), opt.saved_bytes + stage.grad_bytes() - stage.shared_input_bytes);
  }
  // Worth a place on the menu: it keeps at least 1% (and 4 KiB) less.
  if (opt.saved_bytes > stage.saved_bytes - std::max<int64_t>(4096, stage.saved_bytes / 100)) return std::nullopt;
  opt.forward_ms = std::max(median(forward_ms), stage.forward_ms);
  opt.backward_ms = std::max(median(backward_ms), stage.backward_ms);
  return opt;
}

}  // namespace

plan::Chain profile_values(const torch::nn::Sequential& seq_in, const Values& x, const ProfileOptions& options,
                           Values* result, std::vector<char>* writes_input, Levers* levers) {
  torch::nn::Sequential seq = seq_in;
  if (seq->size() == 0) throw Error("[remat::profile] the Sequential is empty; add modules before profiling.");
  if (options.repeats() < 1 || options.warmup() < 0) {
    throw Error("[remat::profile] repeats must be >= 1 and warmup >= 0, got repeats=" +
                std::to_string(options.repeats()) + ", warmup=" + std::to_string(options.warmup()) + ".");
  }
  // A CUDA chain is measured in CUDA bytes (the caching allocator's).
  const c10::Device mem_device = memory_device(x.ts, seq->parameters());
  if (options.selective_levels() < 0) {
    throw Error("[remat::profile] selective_levels is " + std::to_string(options.selective_levels()) +
                "; it must be >= 0 (0: no selective levels on the stages' menus).");
  }
  for (size_t k = 0; k < options.offload().size(); ++k) {
    const OffloadOptions& off = options.offload()[k];
    check_menu_offload("[remat::profile] offload option " + std::to_string(k) + " (" + to_string(off.target()) +
                           ", codec " + to_string(off.codec()) + ")",
                       off, mem_device.is_cpu());
  }
  if (levers) *levers = Levers();
  // NOTE [RNG regions and threads]: the RNG state is put back at the end.
  RngRegionLock rng_lock(true);
  Restore restore(seq, mem_device);
  const std::vector<at::Tensor> buffers = seq->buffers();
  if (writes_input) writes_input->assign(seq->size(), 0);
  // Counting on for the whole profile, not only inside each measured
  // window: a tensor made between two windows (the backward's seed) and
  // freed inside one would otherwise look alive to its end (the seed of a
  // ResNet block's backward, freed by its first op: one activation added
  // to every later temporary).
  memory::Probe counting(mem_device);
  c10::AutoGradMode grad_on(true);
  // No autocast cache while profiling: a cast cached here would keep its
  // grad_fn edges redirected to this profile's sink (NOTE [redirected
  // gradient edges]), and the user's forward in the same autocast region
  // would reuse it: its parameters would get no gradient.
  struct NoAutocastCache {
    bool was = at::autocast::is_autocast_cache_enabled();
    NoAutocastCache() { at::autocast::set_autocast_cache_enabled(false); }
    ~NoAutocastCache() { at::autocast::set_autocast_cache_enabled(was); }
  } no_autocast_cache;

  plan::Chain chain;
  // Tensors of the chain input live through the whole step: counted once,
  // in input_bytes, and never again in a boundary that passes them on.
  chain.input_bytes = x.bytes();
  Values h = x.detached();
  for (size_t i = 0; i < seq->size(); ++i) {
    auto& module = *(seq->begin() + static_cast<std::ptrdiff_t>(i));
    plan::Stage stage;
    stage.name = std::to_string(i) + ":" + module.ptr()->name();
    const std::string who = "[remat::profile] stage " + stage.name;
    std::vector<double> forward_ms, backward_ms;
    Values out, next;
    bool writes = false;
    {
      // A plain forward (the runtime's kForward: no autograd, so each
      // intermediate is freed when it dies instead of being saved): its own
      // temporaries above the output, often more than a forward_save's above
      // its saved set (a CNN block's: 4 activations against 3). The input's
      // version counters tell whether the stage writes its input in place
      // (NOTE [stages that write their input]): then its values are put
      // back and the stage is measured on a copy, as the runtime runs it.
      at::NoGradGuard no_grad;
      const Values backup = h.cloned();
      std::vector<int64_t> versions;
      for (const auto& t : h.ts) versions.push_back(t.defined() && !t.is_inference() ? t._version() : -1);
      auto plain_forward = [&](const Values& in) {
        RunWrites run_writes(buffers);
        dispatch::Scope ops(run_writes.interceptor());
        memory::Probe probe(mem_device);
        next = run_module(module, in, who);
        stage.plain_forward_tmp_bytes = std::max<int64_t>(0, probe.peak_bytes() - probe.delta_bytes());
      };
      plain_forward(h.detached());
      for (size_t k = 0; k < h.size(); ++k) writes |= versions[k] >= 0 && h[k]._version() != versions[k];
      if (writes) {
        next = Values();
        for (size_t k = 0; k < h.size(); ++k) {
          if (h[k].defined()) h[k].variable_data().copy_(backup[k]);
        }
        plain_forward(h.cloned());
      }
    }
    if (writes_input) (*writes_input)[i] = writes;
    for (int r = 0; r < options.warmup() + options.repeats(); ++r) {
      RunWrites run_writes(buffers);  // undone after the backward, which checks the versions it saved
      Values in = h.detached();
      std::unordered_set<const c10::StorageImpl*> seen;
      for (auto& t : in.ts) {
        if (!t.defined()) continue;
        if (differentiable(t)) t.requires_grad_(true);
        seen.insert(t.storage().unsafeGetStorageImpl());
      }
      // Distinct storages saved for backward, minus parameters and the input.
      int64_t saved_bytes = 0;
      int64_t tmp_bytes = 0;
      uint64_t seq0 = 0;
      Clock::time_point t0;
      {
        SavedTensorsHooks count(
            [&](const at::Tensor& t) {
              if (!is_parameter_like(t) && seen.insert(t.storage().unsafeGetStorageImpl()).second) {
                saved_bytes += storage_bytes(t);
                if (levers) levers->largest_saved = std::max(levers->largest_saved, storage_bytes(t));
              }
              // Detached: an op's output kept as is would hold its own
              // grad_fn, a cycle that leaks the graph when the forward
              // throws and no backward ever releases it.
              return t.detach();
            },
            [](const at::Tensor& t) { return t; });
        memory::Probe probe(mem_device);
        seq0 = at::sequence_number::peek();
        dispatch::Scope ops(run_writes.interceptor());
        synchronize(mem_device);
        t0 = Clock::now();
        out = run_stage_module(module, in, writes, who);
        tmp_bytes = std::max<int64_t>(0, probe.peak_bytes() - probe.delta_bytes());
      }
      synchronize(mem_device);
      const double f_ms = ms_since(t0);
      // An output no op saved is freed at the start of the runtime's stage
      // backward (it keeps only what the graph saved); here it lives on as
      // the next stage's input. A tensor passed on unchanged from the
      // stage's input is freed by neither, but belongs to the output (and
      // so to the saved set, which includes it) unless it is the chain's
      // input, counted once in input_bytes.
      std::unordered_set<const c10::StorageImpl*> chain_input;
      for (const auto& t : x.ts) {
        if (t.defined()) chain_input.insert(t.storage().unsafeGetStorageImpl());
      }
      std::unordered_set<const c10::StorageImpl*> passed;
      int64_t out_unsaved = 0, out_passed = 0;
      std::vector<at::Tensor> unsaved;  // held through the backward, then subtracted
      for (const auto& t : out.ts) {
        if (!t.defined()) continue;
        const auto* st = t.storage().unsafeGetStorageImpl();
        const bool from_input = std::any_of(in.ts.begin(), in.ts.end(), [&](const at::Tensor& u) {
          return u.defined() && u.storage().unsafeGetStorageImpl() == st;
        });
        if (from_input) {
          if (!chain_input.count(st) && passed.insert(st).second) out_passed += storage_bytes(t);
        } else if (seen.insert(st).second) {
          out_unsaved += storage_bytes(t);
          unsaved.push_back(t);
        }
      }
      saved_bytes += out_unsaved + out_passed;
      // The planner counts those bytes once while a_i and a_{i+1} are both
      // live (Stage::shared_input_bytes): a residual head's (first(x), x).
      stage.shared_input_bytes = out_passed;
      double b_ms = 0;
      int64_t b_tmp = 0, b_freed = 0;
      std::vector<at::Tensor> roots, seeds;
      for (const auto& t : out.ts) {
        // A tensor with no history (an input passed on) has no backward.
        if (t.defined() && t.requires_grad() && t.grad_fn()) {
          roots.push_back(t);
          seeds.push_back(at::ones_like(t));
        }
      }
      // NOTE [redirected gradient edges]: the stage's backward computes its
      // parameters' gradients (their cost is the stage's) but never reaches
      // the real parameters: no .grad written, no user or DDP hook fired.
      Redirected red;
      torch::autograd::edge_list outputs;
      if (!roots.empty()) {
        red = redirect_gradient_edges(roots, in.ts, seq0);
        for (uint32_t k = 0; k < red.num_inputs(); ++k) outputs.push_back(red.edge(k));
        // Parameter gradients are dropped as soon as each is complete: the
        // runtime adds each to the existing .grad at that moment (NOTE
        // [early delivery]), so only one lives at a time, not the stage's all.
        for (const auto& [leaf, nr] : red.other_leaves) red.hooks[nr]->discard = true;
      }
      stage.output_bytes = out.bytes(&x);
      {
        // The gradient at the output: one dense tensor per output that
        // requires grad, a passed-on chain input included (its value is in
        // input_bytes, its gradient is the chain's to hold), a mask not.
        std::unordered_set<const c10::TensorImpl*> with_grad;
        int64_t grad_bytes = 0;
        for (const auto& t : out.ts) {
          if (t.defined() && t.requires_grad() && with_grad.insert(t.unsafeGetTensorImpl()).second)
            grad_bytes += static_cast<int64_t>(t.numel()) * static_cast<int64_t>(t.element_size());
        }
        stage.output_grad_bytes = grad_bytes == stage.output_bytes ? -1 : grad_bytes;
      }
      // As in the runtime, only the graph keeps a saved output (a ReLU's
      // result) during the backward: freed with that op's saved set, not
      // pinned to the end (one activation too many in every later
      // temporary of a ResNet block's backward). One no op saved, which
      // the runtime frees as the backward starts, is held and subtracted
      // (exact either way). The next stage's input comes from the plain
      // run below.
      out = Values(out.kind, std::vector<at::Tensor>(out.size()));
      if (!outputs.empty()) {             // else: it reaches no input and no leaf
        memory::Probe probe(mem_device);  // from the start of the backward: the saved set and g live
        synchronize(mem_device);
        auto t1 = Clock::now();
        // As the runtime runs it (g freed once used); the input's gradients
        // are held until the probe is read, as the next stage would hold them.
        auto grads = backward_releasing(std::move(roots), std::move(seeds), /*keep_graph=*/false, outputs);
        synchronize(mem_device);
        b_ms = ms_since(t1);
        int64_t grad_in = 0;
        for (size_t k = 0; k < in.size(); ++k) {
          const int64_t nr = red.target_input[k];
          if (nr >= 0 && grads[nr].defined()) grad_in += storage_bytes(grads[nr]);
        }
        // The planner's backward peak: bytes before + |grad_i| + tmp - freed.
        const int64_t above = probe.peak_bytes() - out_unsaved - grad_in;
        b_tmp = std::max<int64_t>(0, above);
        b_freed = std::max<int64_t>(0, -above);
      }
      if (r >= options.warmup()) {
        forward_ms.push_back(f_ms);
        backward_ms.push_back(b_ms);
      }
      stage.saved_bytes = saved_bytes;
      stage.forward_tmp_bytes = tmp_bytes;
      stage.backward_tmp_bytes = b_tmp;
      // What the input still holds (the shared bytes) is not the backward's to free.
      stage.backward_freed_bytes = std::min(b_freed, saved_bytes + stage.grad_bytes() - stage.shared_input_bytes);
    }
    if (options.recompute()) {
      stage.recompute_ms = cut_recompute_ms(module, h, who, options.repeats(), mem_device, writes, buffers);
    }
    stage.forward_ms = median(forward_ms);
    stage.backward_ms = median(backward_ms);
    if (levers) levers->stages.emplace_back();
    for (StageLever& lever : stage_menu(module, h, writes, who, buffers, options)) {
      std::optional<plan::StageOption> o =
          measure_lever(module, h, lever, stage, writes, who, mem_device, buffers, options);
      if (!o) continue;
      stage.options.push_back(std::move(*o));
      if (levers) levers->stages.back().push_back(std::move(lever));
    }
    chain.stages.push_back(stage);
    h = next.detached();
  }
  if (result) *result = Values(h.kind, std::vector<at::Tensor>(h.size()));
  chain.validate();
  return chain;
}

}  // namespace detail

plan::Chain profile(const torch::nn::Sequential& seq, const at::Tensor& x, const ProfileOptions& options) {
  return detail::profile_values(seq, detail::Values(x), options);
}

plan::Chain profile(const torch::nn::Sequential& seq, const std::vector<at::Tensor>& xs,
                    const ProfileOptions& options) {
  return detail::profile_values(seq, detail::Values(detail::Values::Kind::kVector, xs), options);
}

std::string chain_to_json(const plan::Chain& chain) { return plan::chain_to_json(chain); }

}  // namespace remat
