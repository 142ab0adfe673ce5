// The non-reentrant checkpoint runtime: a Frame per checkpointed call, the
// hooks that save handles in forward and refill them by recomputation.
// NOTE [checkpoint frames]: each saved tensor gets a Slot, in save order.
// kRef slots (parameters and views of them) and kInput slots (the region's
// own inputs) hold no extra memory; kRecompute slots are empty after forward
// and are filled, all at once and in the same order, by re-running fn under a
// RecomputeHook. unpack moves the value out, so each recomputed tensor lives
// only until autograd has used it; a slot whose node is released is dropped.
#include <remat/checkpoint.h>

#include "../core/dispatch.h"
#include "../core/replay.h"
#include "../core/write_guard.h"
#include "../offload/offload_internal.h"
#include "region_depth.h"
#include "selective_state.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <atomic>
#include <iomanip>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>

namespace remat {
namespace {

std::atomic<bool> g_early_stop_default{true}, g_debug_default{false};

std::atomic<int64_t> g_regions{0}, g_recomputations{0}, g_early_stops{0}, g_writes_undone{0};

/** Thrown by the recompute hook once every needed tensor exists. A
 *  std::exception: when the region's function runs autograd::grad, the stop
 *  can come from inside that inner backward, and the engine carries only
 *  std::exceptions to the caller of grad (anything else would unwind
 *  through its worker loop); Frame::recompute catches it by type. */
struct StopRecompute final : std::exception {
  const char* what() const noexcept override {
    return "[remat::checkpoint] internal: recomputation stopped early (caught by remat; a function that catches "
           "std::exception inside a checkpointed region must rethrow it)";
  }
};

std::string shape_str(at::IntArrayRef sizes) {
  std::ostringstream os;
  os << sizes;
  return os.str();
}

struct SavedMeta {
  std::vector<int64_t> sizes;
  at::ScalarType dtype = at::ScalarType::Undefined;
  c10::Device device = c10::kCPU;
  uint64_t hash = 0;  // FNV-1a of the bytes, kValues only
};

uint64_t hash_values(const at::Tensor& t) {
  at::Tensor c = t.detach().contiguous();
  if (!c.device().is_cpu()) c = c.cpu();
  const auto* p = static_cast<const unsigned char*>(c.data_ptr());
  const size_t n = c.numel() * c.element_size();
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

SavedMeta saved_meta_of(const at::Tensor& t, bool with_hash) {
  return {t.sizes().vec(), t.scalar_type(), t.device(), with_hash ? hash_values(t) : 0};
}

}  // namespace

namespace detail {

enum class SlotKind { kRef, kInput, kRecompute };

struct Slot {
  SlotKind kind = SlotKind::kRecompute;
  size_t input_index = 0;  // kInput
  at::Tensor ref;          // kRef
  uint32_t ref_version = 0;
  SavedMeta meta;                     // kRecompute
  at::Tensor value;                   // kRecompute: filled by recompute, moved out by unpack
  std::optional<c10::Stream> stream;  // kRecompute: where the re-run produced value (NOTE [recompute streams])
  bool alive = true;                  // false once the node that saved it is released
  int unpacked_in = -2;               // graph task that last took its value (kRecompute)
};

struct SavedInput {
  bool defined = false;
  at::Tensor tensor;  // when no outer hooks were active; a copy when written
  uint32_t version = 0;
  std::optional<torch::autograd::SavedVariable> saved;  // through outer hooks
  // NOTE [inputs written by the region]: fn wrote into this input during its
  // forward (an in-place activation on the block's input). tensor is then a
  // copy taken right before the first write, and each recompute runs on a
  // fresh copy of it, so the copy keeps the values the forward started from.
  bool written = false;
  bool requires_grad = false;  // written: whether the input required grad
};

struct Frame : std::enable_shared_from_this<Frame> {
  CheckpointOptions options;
  RecomputeFn recompute_fn;
  std::vector<SavedInput> inputs;
  std::vector<const c10::TensorImpl*> input_impls;          // forward only, for kInput
  std::vector<at::Tensor> forward_inputs;                   // forward only: the inputs as given
  ReplayState replay;                                       // RNG, autocast, buffers of the first run
  std::vector<std::pair<at::Tensor, uint32_t>> parameters;  // module fn: tensor, version
  std::vector<Slot> slots;
  // NOTE [tensors the first run writes]: the values before the first run
  // wrote them, of tensors that existed before it (not its inputs).
  WriteGuard first_writes;
  std::vector<at::Tensor> pending_inputs;               // fetched for a recompute to come
  std::shared_ptr<SelectiveCache> selective;            // with a policy (NOTE [selective op cache])
  std::vector<std::string> forward_ops, recompute_ops;  // debug mode: op keys of each run

  /** Debug mode: the two op sequences side by side around the first
   *  difference (or the end of the recompute); "" otherwise. */
  std::string debug_report() const {
    if (!options.debug()) return "";
    size_t first = 0;
    while (first < forward_ops.size() && first < recompute_ops.size() && forward_ops[first] == recompute_ops[first]) {
      ++first;
    }
    const bool same = first == recompute_ops.size() && first <= forward_ops.size();
    std::ostringstream os;
    os << "\n[debug] ops of the forward (" << forward_ops.size() << ") and of the recomputation ("
       << recompute_ops.size() << ", up to the failure), ";
    if (same) {
      os << "identical up to the failure, which came at or after recompute op " << first << ":";
    } else {
      os << "first difference at op " << first << ":";
    }
    os << "\n     #  " << std::left << std::setw(32) << "forward"
       << "recompute";
    const size_t from = first > 5 ? first - 5 : 0;
    const size_t to = std::max(std::min(first + 4, std::max(forward_ops.size(), recompute_ops.size())), first + 1);
    for (size_t i = from; i < to; ++i) {
      auto at = [](const std::vector<std::string>& v, size_t k) { return k < v.size() ? v[k] : std::string("-"); };
      os << "\n  " << (i == first && !same ? ">" : " ") << std::right << std::setw(3) << i << "  " << std::left
         << std::setw(32) << at(forward_ops, i) << at(recompute_ops, i);
    }
    return os.str();
  }
  // During a recompute: next slot to fill, and how many are still needed.
  size_t cursor = 0;
  size_t needed = 0;
  // False while the first run of fn is still going: fn itself may call
  // autograd::grad/backward, whose unpacks re-run fn up to that point.
  bool forward_done = false;
  // NOTE [RNG lock lent to awaited threads]: regions on other threads that
  // drew under this region's lock during its forward.
  int64_t borrow_epoch = 0;
  int64_t borrows_in_forward = 0;
  bool gated_before = false;  // the lock's gate before this region's forward
  std::recursive_mutex mu;

  at::Tensor input(size_t k) {
    SavedInput& in = inputs[k];
    if (!in.defined) return {};
    if (in.saved) return in.saved->unpack();
    if (in.tensor._version() != in.version) {
      throw Error("[remat::checkpoint] input " + std::to_string(k) +
                  " of a checkpointed function was modified in place after the forward "
                  "(version " +
                  std::to_string(in.version) + " -> " + std::to_string(in.tensor._version()) +
                  "); recomputing from it would give wrong gradients. Modify a clone "
                  "instead, or keep the input unchanged until backward has run.");
    }
    return in.tensor;
  }

  /** First run, before op writes through `written`: a region input that
   *  shares its storage is copied once (NOTE [inputs written by the region]). */
  void before_write(const at::Tensor& written) {
    if (!written.defined() || !written.has_storage()) return;
    const c10::StorageImpl* st = written.storage().unsafeGetStorageImpl();
    std::lock_guard<std::recursive_mutex> lock(mu);
    for (size_t k = 0; k < forward_inputs.size() && k < inputs.size(); ++k) {
      const at::Tensor& x = forward_inputs[k];
      SavedInput& in = inputs[k];
      if (in.written || !x.defined() || !x.has_storage() || x.storage().unsafeGetStorageImpl() != st) continue;
      c10::InferenceMode normal(false);  // a copy autograd may use, even when the write runs in inference mode
      at::NoGradGuard no_grad;
      in.tensor = x.detach().clone();
      in.requires_grad = x.requires_grad();
      in.version = in.tensor._version();
      in.saved.reset();
      in.written = true;
    }
  }

  /** Adds the slot for a tensor the forward saves; returns its index. */
  size_t pack(const at::Tensor& t) {
    Slot s;
    if (is_parameter_like(t)) {
      s.kind = SlotKind::kRef;
      s.ref = t;
      s.ref_version = t._version();
    } else {
      s.kind = SlotKind::kRecompute;
      for (size_t k = 0; k < input_impls.size(); ++k) {
        // A written input saved after the write holds the written values:
        // those are recomputed (from the copy), not the input.
        if (input_impls[k] == t.unsafeGetTensorImpl() && !inputs[k].written) {
          s.kind = SlotKind::kInput;
          s.input_index = k;
          break;
        }
      }
      if (s.kind == SlotKind::kRecompute) {
        s.meta = saved_meta_of(t, options.determinism_check() == DeterminismCheck::kValues);
      }
    }
    slots.push_back(std::move(s));
    return slots.size() - 1;
  }

  at::Tensor unpack(size_t i) {
    // NOTE [RNG regions and threads]: a recompute (of this frame, or of an
    // outer one for a kInput slot) takes the RNG lock; take it before mu, in
    // the forward's order (a Region holds it while its packs lock mu), so
    // the two locks are never taken in both orders (TSan lock-order report).
    // slots is not resized after the forward: kind is safe to read here.
    RngRegionLock rng_lock(options.preserve_rng_state() && slots[i].kind != SlotKind::kRef);
    std::lock_guard<std::recursive_mutex> lock(mu);
    Slot& s = slots[i];
    switch (s.kind) {
      case SlotKind::kRef:
        if (s.ref._version() != s.ref_version) {
          throw Error(
              "[remat::checkpoint] a parameter saved for backward inside a checkpoint "
              "was modified in place before backward (version " +
              std::to_string(s.ref_version) + " -> " + std::to_string(s.ref._version()) +
              "); run optimizer.step() after backward, not between forward and backward.");
        }
        return s.ref;
      case SlotKind::kInput: {
        if (!inputs[s.input_index].saved) return input(s.input_index);
        // Nested: unpacking from the outer frame consumes its copy, so fetch
        // all inputs once and hand them out slot by slot.
        if (!s.value.defined()) {
          std::vector<at::Tensor> in = materialize_inputs();
          if (recompute_pending()) pending_inputs = std::move(in);
        }
        at::Tensor t = std::move(s.value);
        s.value = at::Tensor();
        return t;
      }
      case SlotKind::kRecompute: {
        const int task = torch::autograd::get_current_graph_task_id();
        if (!s.value.defined() && task != -1 && s.unpacked_in == task) {
          throw Error(
              "[remat::checkpoint] a tensor saved inside a checkpointed region was unpacked a second time in "
              "the same backward: it was already handed out and freed (PyTorch: \"Trying to backward through "
              "the graph a second time (or directly access saved tensors after they have already been "
              "freed)\"). If a custom autograd function calls ctx->get_saved_variables() in backward, call it "
              "once and keep the result.");
        }
        if (!s.value.defined()) recompute();
        slots[i].unpacked_in = task;
        at::Tensor t = std::move(s.value);
        s.value = at::Tensor();
        use_on_current_stream(t, s.stream);  // NOTE [recompute streams]
        s.stream.reset();
        return t;
      }
    }
    return {};
  }

  /** Every input, unpacked once; also fills the empty kInput slots of
   *  inputs that came through outer hooks (see unpack). Unpacking through
   *  an outer frame consumes its copy, so the inputs are fetched once per
   *  recompute: if a recompute of this frame is still to come, they are kept
   *  for it (pending_inputs) instead of being fetched again, which would
   *  re-run the outer region once more. */
  std::vector<at::Tensor> materialize_inputs() {
    std::vector<at::Tensor> in;
    if (!pending_inputs.empty()) {
      in = std::move(pending_inputs);
      pending_inputs.clear();
    } else {
      in.reserve(inputs.size());
      for (size_t k = 0; k < inputs.size(); ++k) in.push_back(input(k));
    }
    for (auto& s : slots) {
      if (s.kind == SlotKind::kInput && s.alive && !s.value.defined() && inputs[s.input_index].saved) {
        s.value = in[s.input_index];
      }
    }
    return in;
  }

  /** True while a kRecompute slot is alive and unfilled. */
  bool recompute_pending() const {
    for (const auto& s : slots) {
      if (s.kind == SlotKind::kRecompute && s.alive && !s.value.defined()) return true;
    }
    return false;
  }

  void check_parameters() const {
    for (size_t k = 0; k < parameters.size(); ++k) {
      const auto now = parameters[k].first._version();
      if (now != parameters[k].second) {
        throw Error("[remat::checkpoint] parameter " + std::to_string(k) +
                    " of the checkpointed module was modified in place after the forward began (version " +
                    std::to_string(parameters[k].second) + " -> " + std::to_string(now) +
                    "): by an optimizer step between forward and backward, or by the forward itself (a clamp "
                    "of its own weight); recomputing with it would give wrong gradients. Run optimizer.step() "
                    "after backward, and write parameters outside the checkpointed forward.");
      }
    }
  }

  void release(size_t i) {
    std::lock_guard<std::recursive_mutex> lock(mu);
    if (i >= slots.size()) return;
    slots[i].alive = false;
    slots[i].value = at::Tensor();
    slots[i].ref = at::Tensor();
    if (!pending_inputs.empty() && !recompute_pending()) pending_inputs.clear();
  }

  /** Called by the recompute hook for each tensor the re-run saves. */
  void refill(const at::Tensor& t) {
    const size_t k = cursor++;
    // A re-run inside the forward (fn's own grad unpacked a slot) runs past
    // the tensors saved so far: those are the forward's future, not a mismatch.
    if (k >= slots.size() && !forward_done) return;
    if (k >= slots.size()) {
      throw Error("[remat::checkpoint] the recomputation saved more tensors than the forward (" +
                  std::to_string(slots.size()) +
                  "); the checkpointed function must run the same ops each time (no "
                  "data-dependent control flow or state that changes between calls)." +
                  debug_report());
    }
    Slot& s = slots[k];
    if (s.kind != SlotKind::kRecompute || !s.alive || s.value.defined()) return;
    check(k, s.meta, t);
    s.value = t.detach();
    s.stream = stream_of(t);
    if (--needed == 0 && options.early_stop()) throw StopRecompute{};
  }

  void check(size_t k, const SavedMeta& m, const at::Tensor& t) const {
    const auto mode = options.determinism_check();
    if (mode == DeterminismCheck::kNone) return;
    std::string what;
    if (t.sizes() != at::IntArrayRef(m.sizes)) {
      what = "shape " + shape_str(m.sizes) + " in forward vs " + shape_str(t.sizes()) + " in recompute";
    } else if (t.scalar_type() != m.dtype) {
      what = std::string("dtype ") + c10::toString(m.dtype) + " in forward vs " + c10::toString(t.scalar_type()) +
             " in recompute";
    } else if (t.device() != m.device) {
      what = "device " + m.device.str() + " in forward vs " + t.device().str() + " in recompute";
    } else if (mode == DeterminismCheck::kValues && hash_values(t) != m.hash) {
      what = "values differ bitwise (shape " + shape_str(m.sizes) + ")";
    }
    if (what.empty()) return;
    throw Error("[remat::checkpoint] saved tensor #" + std::to_string(k) +
                " differs between the forward and the recomputation: " + what +
                ". The checkpointed function must run as in its forward (keep "
                "preserve_rng_state(true) for dropout; a lambda's recompute sees its modules' train/eval flags "
                "as they are at backward: keep the mode until backward, or checkpoint the module itself); set "
                "determinism_check(kNone) to skip this check only where the difference is intended." +
                debug_report());
  }

  void recompute();
};

namespace {

// NOTE [hooks on autograd's device threads]: a backward through CUDA tensors
// runs each CUDA node on autograd's worker thread for that GPU, not on the
// thread that called backward(); remat's hook stack is thread-local and that
// thread's stack is empty. What keeps checkpoints right there:
// - the unpack needs no thread-local: a ForwardHook carries its Frame (a
//   shared_ptr), and the Frame carries everything a re-run needs (inputs,
//   fn, RNG and autocast state, options);
// - the re-run happens on the unpacking thread (the device thread), and
//   everything it sets up is set up there: the recompute hooks pushed on
//   that thread's stack (so its saves refill the frame), grad mode,
//   autocast and is_recomputing() (thread-locals of that thread, put back
//   when it ends), RNG states (process-wide generators, under the RNG lock);
// - the re-run runs on the stream the engine made current for the node
//   (NOTE [recompute streams] in core/replay.h).
// Not covered: tensors saved on a device thread by an inner backward with
// create_graph inside a region (autograd::grad inside fn on CUDA) see the
// device thread's empty stack and are kept as autograd keeps them (correct,
// not checkpointed); and when such an inner backward unpacks a slot of a
// region that preserves RNG state (its own re-run inside the forward, or a
// nested region's) on the device thread, it waits for the RNG lock that the
// calling thread holds until its region's forward ends, while that thread
// waits for the backward: a deadlock. Higher-order autograd through CUDA
// regions needs preserve_rng_state(false) on them (docs/gpu.md); on CPU the
// backward runs on the calling thread, which re-enters the lock.

/** Saves handles during the first forward. */
class ForwardHook final : public SavedHook {
 public:
  explicit ForwardHook(std::shared_ptr<Frame> f) : frame_(std::move(f)) {}
  ~ForwardHook() override {
    if (packed_) frame_->release(index_);
  }
  void call_pack_hook(const at::Tensor& t) override {
    dispatch::Suspend suspend;  // hashing for kValues is remat's work, not the region's
    std::lock_guard<std::recursive_mutex> lock(frame_->mu);
    index_ = frame_->pack(t);
    packed_ = true;
  }
  at::Tensor call_unpack_hook() override { return frame_->unpack(index_); }

 private:
  std::shared_ptr<Frame> frame_;
  size_t index_ = 0;
  bool packed_ = false;
};

class ForwardFactory final : public HookFactory {
 public:
  explicit ForwardFactory(std::shared_ptr<Frame> f) : frame_(std::move(f)) {}
  std::unique_ptr<SavedHook> make_hook() override { return std::make_unique<ForwardHook>(frame_); }

 private:
  std::shared_ptr<Frame> frame_;
};

/** Sits on the re-run's graph; hands each saved tensor to the frame, and
 *  keeps a reference for the re-run's own backward: fn may call
 *  autograd::grad or backward inside the region (a gradient penalty), and
 *  that inner backward unpacks what the re-run saved. The reference shares
 *  the slot's storage and dies with the re-run's graph when fn returns, so
 *  it costs no memory beyond the refilled slots. The frame outlives the
 *  hook: packs happen only inside recompute(). */
class RecomputeHook final : public SavedHook {
 public:
  explicit RecomputeHook(Frame* f) : frame_(f) {}
  void call_pack_hook(const at::Tensor& t) override {
    dispatch::Suspend suspend;
    kept_ = t.detach();  // detached: an output saved with its grad_fn would be a cycle
    frame_->refill(t);
  }
  at::Tensor call_unpack_hook() override { return kept_; }

 private:
  Frame* frame_;
  at::Tensor kept_;
};

class RecomputeFactory final : public HookFactory {
 public:
  explicit RecomputeFactory(Frame* f) : frame_(f) {}
  std::unique_ptr<SavedHook> make_hook() override { return std::make_unique<RecomputeHook>(frame_); }

 private:
  Frame* frame_;
};

}  // namespace

namespace {
/** The interceptor of a region's first run: copies an input before fn
 *  first writes into it (NOTE [inputs written by the region]), then hands
 *  the op to the selective policy's first run, if any, or on below. */
class FirstRunGuard final : public dispatch::Interceptor {
 public:
  FirstRunGuard(Frame* f, std::unique_ptr<dispatch::Interceptor> selective)
      : frame_(f), selective_(std::move(selective)) {}
  void on_op(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) override {
    const auto& schema = op.schema();
    if (op.hasTag(at::Tag::nondeterministic_seeded)) wait_rng_unlent();  // NOTE [RNG lock lent to awaited threads]
    const size_t n = schema.arguments().size();
    if (schema.is_mutable()) {
      const auto& formals = schema.arguments();
      for (size_t a = 0; a < n; ++a) {
        const auto* alias = formals[a].alias_info();
        if (alias == nullptr || !alias->isWrite()) continue;
        for_each_tensor((*stack)[stack->size() - n + a], [&](const at::Tensor& t) { frame_->before_write(t); });
      }
    }
    // NOTE [tensors the first run writes]
    frame_->first_writes.before(op, c10::ArrayRef<c10::IValue>(stack->data() + stack->size() - n, n));
    if (selective_) {
      selective_->on_op(op, ks, stack);
    } else {
      dispatch::run_below(op, ks, stack);
    }
    const size_t nout = schema.returns().size();
    frame_->first_writes.made(op, c10::ArrayRef<c10::IValue>(stack->data() + stack->size() - nout, nout));
  }
  void on_tag(const at::Tensor& t, const std::string& name) override {
    if (selective_) selective_->on_tag(t, name);
  }

 private:
  Frame* frame_;
  std::unique_ptr<dispatch::Interceptor> selective_;
};
/** A re-run's outermost interceptor: its random ops wait while a thread it
 *  awaits borrows the RNG lock (NOTE [RNG lock lent to awaited threads]). */
class SeededGate final : public dispatch::Interceptor {
 public:
  void on_op(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) override {
    if (op.hasTag(at::Tag::nondeterministic_seeded)) wait_rng_unlent();
    dispatch::run_below(op, ks, stack);
  }
  void on_tag(const at::Tensor&, const std::string&) override {}
};
}  // namespace

void Frame::recompute() {
  check_parameters();
  std::vector<at::Tensor> in = materialize_inputs();
  for (size_t k = 0; k < in.size() && k < inputs.size(); ++k) {
    if (!inputs[k].written || !in[k].defined()) continue;
    // fn writes it again (NOTE [inputs written by the region]): a fresh
    // copy, not a leaf when the input required grad (as in the forward, so
    // autograd saves the same tensors and allows the write).
    at::AutoGradMode grad(inputs[k].requires_grad);
    in[k] = inputs[k].requires_grad ? in[k].detach().requires_grad_().clone() : in[k].clone();
  }
  needed = 0;
  for (const auto& s : slots) needed += s.kind == SlotKind::kRecompute && s.alive && !s.value.defined();
  cursor = 0;
  bool stopped = false;
  // A re-run inside the forward leaves the cache to the backward's re-runs.
  const bool keep_cache = selective && (!forward_done || torch::autograd::get_current_graph_task_keep_graph());
  WriteGuard writes;  // NOTE [recompute side effects]
  {
    ReplayGuard guard(replay, /*enable_grad=*/true);
    KeepLeafGrads leaf_grads;  // a backward() inside fn accumulated once, in the forward
    ScopedHooks hooks(std::make_shared<RecomputeFactory>(this));
    // Every op of the re-run is seen: a policy's saved ops are handed back,
    // and writes into tensors that outlive the re-run are undone after it.
    std::unique_ptr<dispatch::Interceptor> interceptor =
        selective ? selective->recompute(keep_cache, &writes) : make_write_guard_interceptor(&writes);
    struct Undo {
      WriteGuard& w;
      ~Undo() { g_writes_undone.fetch_add(w.restore(), std::memory_order_relaxed); }
    } undo{writes};
    recompute_ops.clear();
    for (size_t k = 0; k < in.size() && k < inputs.size(); ++k) {
      if (inputs[k].written) writes.adopt(in[k]);  // the re-run's own copy: its writes stay
    }
    const bool rng = options.preserve_rng_state();
    SeededGate gate;
    std::optional<dispatch::Scope> gated;  // only a re-run that replays RNG holds the lock it gates
    if (rng) gated.emplace(&gate);
    struct Gate {
      bool on, before;
      explicit Gate(bool o) : on(o), before(o && gate_rng_hold(true)) {}
      ~Gate() {
        if (on) gate_rng_hold(before);
      }
    } hold(rng);
    const int64_t epoch = rng ? rng_borrow_epoch() : 0;
    dispatch::Scope ops(interceptor.get(), options.debug() ? &recompute_ops : nullptr);
    try {
      recompute_fn(in);
    } catch (const StopRecompute&) {
      stopped = true;
    }
    const int64_t borrows = rng ? rng_borrow_epoch() - epoch : 0;
    if (forward_done && borrows != borrows_in_forward && (!stopped || borrows > borrows_in_forward)) {
      throw Error("[remat::checkpoint] while this region's forward ran, " + std::to_string(borrows_in_forward) +
                  " checkpointed region(s) on other threads drew random numbers under its RNG lock (it was "
                  "waiting, e.g. for a branch it ran with std::async), but " +
                  std::to_string(borrows) +
                  " did during its recomputation: the random numbers it replays would differ. Run such branches "
                  "from the checkpointed function each time it runs (the recomputation then runs them again), or "
                  "give the other threads' regions preserve_rng_state(false) if they draw no random numbers.");
    }
  }
  if (selective && !keep_cache) selective->clear();
  g_recomputations.fetch_add(1, std::memory_order_relaxed);
  if (stopped) {
    g_early_stops.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  if (!forward_done) return;  // ran to fn's end, past the slots saved so far
  if (cursor != slots.size() || needed != 0) {
    throw Error("[remat::checkpoint] the recomputation saved " + std::to_string(cursor) +
                " tensors but the forward saved " + std::to_string(slots.size()) +
                "; the checkpointed function must run the same ops each time (no "
                "data-dependent control flow or state that changes between calls)." +
                debug_report());
  }
}

bool should_checkpoint() { return at::GradMode::is_enabled() && !c10::InferenceMode::is_enabled(); }

namespace {
thread_local int t_region_forwards = 0;  // regions whose forward runs on this thread now
}  // namespace

bool in_region_forward() { return t_region_forwards > 0; }

Region::Region(const CheckpointOptions& options, const std::vector<at::Tensor>& inputs, RecomputeFn recompute,
               ModuleState state)
    : rng_locked_(options.preserve_rng_state()), frame_(std::make_shared<Frame>()) {
  ensure_engine_installed();
  // NOTE [RNG regions and threads]: from the capture below to the end of the
  // forward (~Region), no other remat region draws random numbers.
  if (rng_locked_) {
    lock_rng_regions();
    frame_->gated_before = gate_rng_hold(true);  // its random ops go through FirstRunGuard
    frame_->borrow_epoch = rng_borrow_epoch();
  }
  try {
    init(options, inputs, std::move(recompute), std::move(state));
  } catch (...) {
    if (rng_locked_) unlock_rng_regions();
    throw;
  }
  ++t_region_forwards;
}

void Region::init(const CheckpointOptions& options, const std::vector<at::Tensor>& inputs, RecomputeFn recompute,
                  ModuleState state) {
  Frame& f = *frame_;
  f.options = options;
  f.recompute_fn = std::move(recompute);
  for (auto& p : state.parameters) f.parameters.emplace_back(p, p._version());
  // Inputs go through the hooks active now (an outer checkpoint's, say), so
  // that a nested region does not pin its inputs in memory; with
  // offload(...) and no outer hooks, through an offload store.
  std::optional<ScopedHooks> offload_inputs;
  if (options.offload() && current_hooks() == nullptr) {
    offload_inputs.emplace(detail::make_offload_hooks(detail::OffloadStore::shared(*options.offload())));
  }
  const bool outer = current_hooks() != nullptr;
  f.inputs.resize(inputs.size());
  for (size_t k = 0; k < inputs.size(); ++k) {
    const at::Tensor& t = inputs[k];
    SavedInput& in = f.inputs[k];
    in.defined = t.defined();
    if (!in.defined) continue;
    if (outer) {
      in.saved.emplace(t, /*is_output=*/false);
    } else {
      in.tensor = t;
      in.version = t._version();
    }
  }
  offload_inputs.reset();
  // Aligned with input indices, undefined inputs included.
  for (const auto& t : inputs) f.input_impls.push_back(t.defined() ? t.unsafeGetTensorImpl() : nullptr);
  std::vector<c10::Device> devices;
  for (const auto& t : inputs) {
    if (t.defined()) devices.push_back(t.device());
  }
  f.replay =
      ReplayState::capture(options.preserve_rng_state(), devices, std::move(state.buffers), std::move(state.modules));
  g_regions.fetch_add(1, std::memory_order_relaxed);
  scope_ = std::make_unique<ScopedHooks>(std::make_shared<ForwardFactory>(frame_));
  std::unique_ptr<dispatch::Interceptor> selective_run;
  if (options.policy()) {
    f.selective = std::make_shared<SelectiveCache>(*options.policy());
    if (options.offload()) f.selective->set_offload(detail::OffloadStore::shared(*options.offload()));
    selective_run = f.selective->first_run();
  }
  for (const auto& t : inputs) {
    f.forward_inputs.push_back(t);
    f.first_writes.adopt(t);  // NOTE [inputs written by the region] covers them
  }
  // The module's buffers are replayed already, its parameters checked.
  for (const auto& b : f.replay.buffers) f.first_writes.adopt(b);
  for (const auto& [p, version] : f.parameters) f.first_writes.adopt(p);
  interceptor_ = std::make_unique<FirstRunGuard>(frame_.get(), std::move(selective_run));
  dispatch_scope_ = std::make_unique<dispatch::Scope>(interceptor_.get(), options.debug() ? &f.forward_ops : nullptr);
}

Region::~Region() {
  --t_region_forwards;
  dispatch_scope_.reset();
  if (frame_->selective) frame_->selective->end_first_run();
  interceptor_.reset();
  scope_.reset();
  {
    std::lock_guard<std::recursive_mutex> lock(frame_->mu);
    Frame& f = *frame_;
    f.input_impls.clear();
    f.forward_inputs.clear();
    f.forward_done = true;
    // NOTE [tensors the first run writes]: a tensor that existed before the
    // region and that its forward wrote in place (an average kept on
    // another module, updated in each block, then read) is replayed as a
    // module buffer is: a re-run starts from its value before the forward,
    // not from what later code left in it, and its current value is put
    // back after. Parameters stay with the parameter check (a write into
    // one is refused at backward); the module's own buffers are captured.
    for (auto& [t, before] : f.first_writes.take_copies()) {
      if (is_parameter_like(t)) continue;
      bool known = false;
      for (const auto& b : f.replay.buffers) known = known || b.unsafeGetTensorImpl() == t.unsafeGetTensorImpl();
      if (known) continue;
      f.replay.buffers.push_back(t);
      f.replay.buffer_values.push_back(std::move(before));
    }
    // What re-runs inside the forward refilled (for fn's own grad) and that
    // grad did not consume is recomputed again in backward, not kept.
    for (auto& s : f.slots) {
      if (s.kind != SlotKind::kRef) s.value = at::Tensor();
    }
    f.pending_inputs.clear();
    if (rng_locked_) {
      f.borrows_in_forward = rng_borrow_epoch() - f.borrow_epoch;
      gate_rng_hold(f.gated_before);
    }
  }
  if (rng_locked_) unlock_rng_regions();
}

}  // namespace detail

void set_checkpoint_early_stop(bool enabled) { g_early_stop_default = enabled; }
bool checkpoint_early_stop() { return g_early_stop_default.load(); }
void wait_checkpoint_offloads() { detail::OffloadStore::wait_shared(); }

void set_checkpoint_debug(bool enabled) { g_debug_default = enabled; }
bool checkpoint_debug() { return g_debug_default.load(); }

bool is_recomputing() { return detail::recomputing(); }

CheckpointStats checkpoint_stats() {
  return {g_regions.load(),           g_recomputations.load(),       g_early_stops.load(),
          detail::g_ops_saved.load(), detail::g_ops_replayed.load(), detail::g_ops_recomputed.load(),
          g_writes_undone.load()};
}

void reset_checkpoint_stats() {
  detail::reset_op_stats();
  g_regions = 0;
  g_recomputations = 0;
  g_early_stops = 0;
  g_writes_undone = 0;
}

}  // namespace remat
