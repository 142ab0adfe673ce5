// remat::parallel::Pipeline: a stage per rank, micro-batches run in the
// order of GPipe or 1F1B, boundary tensors sent with c10d send/recv.
//
// Each message between neighbours is a fixed-size header (an int64 tensor of
// kHeaderLen) followed by its tensors: the header says what follows (kind,
// count, per tensor dtype, requires_grad, shape), so a receiver allocates
// without knowing the shapes ahead and can check a gradient against the
// activation it sent. An abort (NOTE [a failing stage] in pipeline.h) is a
// header of kind kAbort and the message's bytes. Sends are asynchronous and
// waited for at the step's end; receives block (with the group's timeout).
// Activations flow rank r -> r + 1 and gradients r + 1 -> r, each in
// micro-batch order on both sides, so one tag serves both directions.
#include <remat/parallel/pipeline.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>
#include <unordered_set>

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros_like.h>
#include <torch/autograd.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <remat/auto.h>
#include <remat/error.h>
#include <remat/memory.h>
#include <remat/optim.h>

#include "common.h"

namespace remat::parallel {

namespace {
/** Identity with its own autograd node: its output is no leaf (nor a view of
 *  one), so in-place ops on it are allowed; the gradient passes through. */
struct StageInput : torch::autograd::Function<StageInput> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) { return x.detach(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list g) {
    return g;
  }
};
}  // namespace

namespace {

using util::Clock;
using util::message_of;
using util::ms_between;

std::string str(int64_t v) { return std::to_string(v); }

std::string shape_of(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + str(t.size(d));
  return s + "] " + std::string(c10::toString(t.scalar_type()));
}

std::string shapes_of(const std::vector<at::Tensor>& ts) {
  std::string s;
  for (size_t i = 0; i < ts.size(); ++i) s += (i ? ", " : "") + (ts[i].defined() ? shape_of(ts[i]) : "undefined");
  return s.empty() ? "none" : s;
}

constexpr int64_t kHeaderLen = 64;
constexpr int64_t kData = 1;
constexpr int64_t kAbort = 2;
constexpr int kTag = 0;
constexpr int64_t kMaxAbortBytes = int64_t{1} << 20;

/** Gets a gradient back across a boundary: floating or complex, requiring grad. */
bool differentiable(const at::Tensor& t) {
  return t.defined() && t.requires_grad() && (t.is_floating_point() || t.is_complex());
}

/** An abort received from a neighbour: the failing stage's message. */
struct Aborted : std::runtime_error {
  Aborted(const std::string& m, int from) : std::runtime_error(m), from_rank(from) {}
  int from_rank;
};

/** A step's op: forward or backward of micro-batch m. */
struct Op {
  bool forward;
  int m;
};

std::vector<Op> schedule_ops(PipelineSchedule s, int rank, int P, int M) {
  std::vector<Op> ops;
  if (s == PipelineSchedule::kGPipe) {
    for (int m = 0; m < M; ++m) ops.push_back({true, m});
    for (int m = 0; m < M; ++m) ops.push_back({false, m});
    return ops;
  }
  const int warmup = std::min(P - rank - 1, M);
  for (int m = 0; m < warmup; ++m) ops.push_back({true, m});
  for (int i = 0; i < M - warmup; ++i) {
    ops.push_back({true, warmup + i});
    ops.push_back({false, i});
  }
  for (int m = M - warmup; m < M; ++m) ops.push_back({false, m});
  return ops;
}

bool same_impl(const at::Tensor& a, const at::Tensor& b) { return a.unsafeGetTensorImpl() == b.unsafeGetTensorImpl(); }

}  // namespace

const char* to_string(PipelineSchedule s) { return s == PipelineSchedule::kGPipe ? "gpipe" : "1f1b"; }

PipelineSchedule parse_pipeline_schedule(const std::string& name) {
  std::string n = name;
  for (auto& c : n) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (n == "gpipe") return PipelineSchedule::kGPipe;
  if (n == "1f1b") return PipelineSchedule::k1F1B;
  throw Error("[remat::parallel] pipeline schedule '" + name + "' is not one of gpipe, 1f1b.");
}

torch::nn::Sequential pipeline_part(const torch::nn::Sequential& model, const std::vector<int64_t>& cuts, int rank) {
  const int64_t n = static_cast<int64_t>(model->size());
  const int P = static_cast<int>(cuts.size()) + 1;
  int64_t prev = 0;
  for (size_t i = 0; i < cuts.size(); ++i) {
    if (cuts[i] <= prev || cuts[i] >= n) {
      throw Error("[remat::parallel] pipeline cut " + str(cuts[i]) + " (cuts[" + str(static_cast<int64_t>(i)) +
                  "]) must be greater than " + str(prev) + " and less than the model's " + str(n) +
                  " modules: give P - 1 increasing indices, each stage at least one module.");
    }
    prev = cuts[i];
  }
  if (rank < 0 || rank >= P) {
    throw Error("[remat::parallel] rank " + str(rank) + " has no stage: " + str(static_cast<int64_t>(cuts.size())) +
                " cuts make " + str(P) + " stages (give world_size - 1 cuts).");
  }
  const int64_t lo = rank == 0 ? 0 : cuts[rank - 1];
  const int64_t hi = rank == P - 1 ? n : cuts[rank];
  torch::nn::Sequential part;
  torch::nn::Sequential whole = model;  // shares the modules
  const auto names = whole->named_children();
  for (int64_t i = lo; i < hi; ++i) part->push_back(names[i].key(), *(whole->begin() + i));
  return part;
}

StageFn sequential_stage(torch::nn::Sequential part) {
  return [part](const std::vector<at::Tensor>& in) mutable -> std::vector<at::Tensor> {
    if (in.size() != 1) {
      throw Error("[remat::parallel] a Sequential stage takes one tensor, got " + str(static_cast<int64_t>(in.size())) +
                  " (" + shapes_of(in) + "); give a StageFn of your own for several.");
    }
    return {part->forward(in[0])};
  };
}

struct Pipeline::Impl {
  ProcessGroup group;
  /** Tied parameters are summed across stages after the last micro-batch:
   *  a StepInBackward leaves them to the optimizer's step(). */
  std::unique_ptr<remat::detail::DeferredGradients> deferred_tied;
  StageFn fn;
  PipelineOptions options;
  int rank = 0, P = 1, M = 1;
  PipelineStats stats;

  struct Pending {
    c10::intrusive_ptr<c10d::Work> work;
    at::Tensor keep;  // the buffer, alive until the send is done
  };
  std::vector<Pending> pending;

  struct Micro {
    std::vector<at::Tensor> inputs;   // received (leaves) or rank 0's slice
    std::vector<at::Tensor> outputs;  // what forward returned (sent on, or the loss's input)
    at::Tensor loss;                  // last stage: loss / M
  };

  std::string where() const { return "pipeline stage " + str(rank) + " of " + str(P); }

  [[noreturn]] void comm_failed(const std::string& what, const std::exception& e) const {
    throw Error("[remat::parallel] " + where() + ": " + what + " failed: " + message_of(e) +
                ". A peer process probably exited or stopped answering (timeout " +
                str(group.timeout().count() / 1000) + " s).");
  }

  void isend(const at::Tensor& t, int dst) {
    std::vector<at::Tensor> ts{t};
    pending.push_back({group.c10d()->send(ts, dst, kTag), t});
  }

  void send_message(int dst, const std::vector<at::Tensor>& ts, const std::string& what) {
    auto header = at::zeros({kHeaderLen}, at::kLong);
    auto* h = header.data_ptr<int64_t>();
    int64_t k = 0;
    h[k++] = kData;
    h[k++] = static_cast<int64_t>(ts.size());
    for (const auto& t : ts) {
      if (!t.defined() || t.device().type() != c10::kCPU) {
        throw Error("[remat::parallel] " + where() + ": " + what + " has " + (t.defined() ? shape_of(t) : "undefined") +
                    " on " + (t.defined() ? t.device().str() : std::string("no device")) +
                    "; a stage sends defined CPU tensors (this group is Gloo).");
      }
      if (k + 3 + t.dim() > kHeaderLen) {
        throw Error("[remat::parallel] " + where() + ": " + what + " (" + shapes_of(ts) +
                    ") does not fit a message header of " + str(kHeaderLen) +
                    " values; pass fewer tensors (concatenate them) at a stage boundary.");
      }
      h[k++] = static_cast<int64_t>(t.scalar_type());
      h[k++] = differentiable(t) ? 1 : 0;
      h[k++] = t.dim();
      for (int64_t d = 0; d < t.dim(); ++d) h[k++] = t.size(d);
    }
    // Every buffer ready before anything is queued: a failure here leaves
    // the stream between messages, where an abort can follow.
    std::vector<at::Tensor> bufs;
    for (const auto& t : ts) {
      if (t.numel() > 0) bufs.push_back(t.detach().contiguous());
    }
    try {
      isend(header, dst);
      for (const auto& c : bufs) {
        stats.sent_bytes += static_cast<int64_t>(c.nbytes());
        isend(c, dst);
      }
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      comm_failed("sending " + what + " to stage " + str(dst), e);
    }
  }

  void wait_recv(std::vector<at::Tensor>& ts, int src, const std::string& what) {
    const auto t0 = Clock::now();
    try {
      if (!group.c10d()->recv(ts, src, kTag)->wait(group.timeout())) {
        throw std::runtime_error("the receive was aborted");
      }
    } catch (const std::exception& e) {
      comm_failed("receiving " + what + " from stage " + str(src), e);
    }
    stats.recv_ms += ms_between(t0, Clock::now());
  }

  /** The next message from src: its tensors and their requires_grad flags.
   *  Throws Aborted for an abort. */
  std::vector<at::Tensor> recv_message(int src, const std::string& what, std::vector<bool>* flags) {
    std::vector<at::Tensor> header{at::empty({kHeaderLen}, at::kLong)};
    wait_recv(header, src, what);
    const auto* h = header[0].data_ptr<int64_t>();
    auto malformed = [&]() {
      return Error("[remat::parallel] " + where() + ": " + what + " from stage " + str(src) +
                   " began with a malformed header; every rank must run the same remat version and schedule.");
    };
    if (h[0] == kAbort) {
      if (h[1] < 0 || h[1] > kMaxAbortBytes) throw malformed();
      std::vector<at::Tensor> text{at::empty({std::max<int64_t>(h[1], 1)}, at::kByte)};
      wait_recv(text, src, "the message of a failed stage");
      std::string msg(reinterpret_cast<const char*>(text[0].data_ptr<uint8_t>()), static_cast<size_t>(h[1]));
      throw Aborted(msg, src);
    }
    if (h[0] != kData || h[1] < 0 || 2 + 3 * h[1] > kHeaderLen) throw malformed();
    std::vector<at::Tensor> out;
    int64_t k = 2;
    for (int64_t i = 0; i < h[1]; ++i) {
      if (k + 3 > kHeaderLen) throw malformed();
      const int64_t code = h[k++];
      const bool rg = h[k++] != 0;
      const int64_t ndim = h[k++];
      if (code < 0 || code >= static_cast<int64_t>(c10::ScalarType::NumOptions) || ndim < 0 || k + ndim > kHeaderLen) {
        throw malformed();
      }
      const auto dtype = static_cast<c10::ScalarType>(code);
      std::vector<int64_t> sizes(h + k, h + k + ndim);
      k += ndim;
      if (std::any_of(sizes.begin(), sizes.end(), [](int64_t s) { return s < 0; })) throw malformed();
      out.push_back(at::empty(sizes, at::TensorOptions().dtype(dtype)));
      if (flags) flags->push_back(rg);
    }
    for (auto& t : out) {
      if (t.numel() == 0) continue;
      std::vector<at::Tensor> one{t};
      wait_recv(one, src, what);
      stats.received_bytes += static_cast<int64_t>(t.nbytes());
    }
    return out;
  }

  /** Best effort: tells the neighbours in dsts that this step failed with
   *  msg. Both are sent before either is waited for, so the failing rank
   *  throws within one timeout. */
  void send_abort(const std::vector<int>& dsts, const std::string& msg) {
    auto header = at::zeros({kHeaderLen}, at::kLong);
    header.data_ptr<int64_t>()[0] = kAbort;
    header.data_ptr<int64_t>()[1] = static_cast<int64_t>(msg.size());
    auto text = at::empty({std::max<int64_t>(static_cast<int64_t>(msg.size()), 1)}, at::kByte);
    std::memcpy(text.data_ptr<uint8_t>(), msg.data(), msg.size());
    for (int dst : dsts) {
      try {
        std::vector<at::Tensor> a{header}, b{text};
        orphaned.push_back({group.c10d()->send(a, dst, kTag), header});
        orphaned.push_back({group.c10d()->send(b, dst, kTag), text});
      } catch (const std::exception&) {
        // That neighbour is gone; it fails on its own.
      }
    }
    // Not waited for: a neighbour blocked on a receive from us reads it
    // there; one that has finished its schedule learns of the failure from
    // the step's status all-reduce (NOTE [a failing stage]).
  }

  /** Sends a failed step left queued: a live neighbour may still receive
   *  them (in order, before an abort queued behind them), so their buffers
   *  stay alive; Gloo would spin on a queued write whose buffer is gone. */
  std::vector<Pending> orphaned;

  void keep_pending_after_failure() {
    for (auto& p : pending) {
      if (!p.work->isCompleted()) orphaned.push_back(std::move(p));
    }
    pending.clear();
  }

  /** Drops the sends that completed: the boundary tensors they held go. */
  void prune_pending() {
    pending.erase(
        std::remove_if(pending.begin(), pending.end(), [](const Pending& p) { return p.work->isCompleted(); }),
        pending.end());
  }

  void wait_pending() {
    const auto t0 = Clock::now();
    for (auto& p : pending) {
      try {
        p.work->wait(group.timeout());
      } catch (const std::exception& e) {
        comm_failed("a send to a neighbour", e);
      }
    }
    pending.clear();
    stats.send_ms += ms_between(t0, Clock::now());
  }

  std::vector<std::vector<at::Tensor>> split(const std::vector<at::Tensor>& ts, const char* what) const {
    std::vector<std::vector<at::Tensor>> out(M);
    for (size_t i = 0; i < ts.size(); ++i) {
      const auto& t = ts[i];
      if (!t.defined() || t.dim() == 0 || t.size(0) % M != 0) {
        throw Error("[remat::parallel] " + where() + ": " + what + "[" + str(static_cast<int64_t>(i)) + "] (" +
                    (t.defined() ? shape_of(t) : "undefined") + ") does not split into " + str(M) +
                    " micro-batches along dim 0; give a batch that is a multiple of PipelineOptions::microbatches.");
      }
      auto parts = t.chunk(M, 0);
      for (int m = 0; m < M; ++m) out[m].push_back(parts[m]);
    }
    return out;
  }

  /** What the stage function gets: each received leaf that needs a
   *  gradient behind an identity node, so that the stage may modify it in
   *  place (an in-place ReLU first) as it may the output of the stage before
   *  in one process. The leaf keeps the gradient sent back. */
  static std::vector<at::Tensor> stage_inputs(const std::vector<at::Tensor>& received) {
    std::vector<at::Tensor> out;
    for (const auto& t : received) out.push_back(t.defined() && t.requires_grad() ? StageInput::apply(t) : t);
    return out;
  }

  void forward(int m, Micro& mb, const std::vector<std::vector<at::Tensor>>& in,
               const std::vector<std::vector<at::Tensor>>& tg, const LossFn& loss) {
    if (rank == 0) {
      mb.inputs = in[m];
    } else {
      std::vector<bool> rg;
      mb.inputs = recv_message(rank - 1, "the activations of micro-batch " + str(m), &rg);
      for (size_t i = 0; i < mb.inputs.size(); ++i) {
        if (rg[i]) mb.inputs[i].requires_grad_(true);
      }
    }
    const auto t0 = Clock::now();
    try {
      mb.outputs = fn(rank == 0 ? mb.inputs : stage_inputs(mb.inputs));
      if (rank == P - 1) {
        if (!loss) throw Error("[remat::parallel] the last stage needs a LossFn; pass one to step() on every rank.");
        auto l = loss(mb.outputs, tg.empty() ? std::vector<at::Tensor>{} : tg[m]);
        if (!l.defined() || l.numel() != 1) {
          throw Error("[remat::parallel] the loss of micro-batch " + str(m) + " is " +
                      (l.defined() ? shape_of(l) : "undefined") + "; return a scalar (the micro-batch's mean).");
        }
        mb.loss = l.reshape({}) / static_cast<double>(M);
      }
    } catch (const Error& e) {
      throw Error("[remat::parallel] " + where() + ": the forward of micro-batch " + str(m) + " on inputs (" +
                  shapes_of(mb.inputs) + ") failed: " + message_of(e));
    } catch (const std::exception& e) {
      throw Error("[remat::parallel] " + where() + ": the forward of micro-batch " + str(m) + " on inputs (" +
                  shapes_of(mb.inputs) + ") failed: " + message_of(e));
    }
    stats.forward_ms += ms_between(t0, Clock::now());
    if (rank < P - 1) send_message(rank + 1, mb.outputs, "the activations of micro-batch " + str(m));
  }

  void backward(int m, Micro& mb) {
    std::vector<at::Tensor> roots, grads;
    if (rank == P - 1) {
      roots.push_back(mb.loss);
    } else {
      std::vector<bool> rg;
      const std::string what = "the gradients of micro-batch " + str(m);
      auto got = recv_message(rank + 1, what, &rg);
      std::vector<at::Tensor> expect;
      for (const auto& o : mb.outputs) {
        if (differentiable(o)) expect.push_back(o);
      }
      bool ok = got.size() == expect.size();
      for (size_t i = 0; ok && i < got.size(); ++i) {
        ok = got[i].sizes() == expect[i].sizes() && got[i].scalar_type() == expect[i].scalar_type();
      }
      if (!ok) {
        throw Error("[remat::parallel] " + where() + ": " + what + " from stage " + str(rank + 1) + " are (" +
                    shapes_of(got) + "), but the activations sent that need them are (" + shapes_of(expect) +
                    "); every stage must return a gradient for each floating input that requires grad.");
      }
      roots = std::move(expect);
      grads = std::move(got);
    }
    const auto t0 = Clock::now();
    try {
      if (!roots.empty()) torch::autograd::backward(roots, grads);
    } catch (const std::exception& e) {
      throw Error("[remat::parallel] " + where() + ": the backward of micro-batch " + str(m) +
                  " failed: " + message_of(e));
    }
    stats.backward_ms += ms_between(t0, Clock::now());
    if (rank > 0) {
      std::vector<at::Tensor> gin;
      for (const auto& x : mb.inputs) {
        if (!differentiable(x)) continue;
        gin.push_back(x.grad().defined() ? x.grad() : at::zeros_like(x));
      }
      send_message(rank - 1, gin, "the gradients of micro-batch " + str(m));
    }
    mb = Micro{};  // its activations and boundary tensors go
  }

  /** Tied parameters' gradients from before the step, set aside so that
   *  the all-reduce sums only this step's: a rank whose optimizer does not
   *  hold a tied parameter never zeroes its copy's gradient. */
  std::vector<at::Tensor> tied_before;

  void set_tied_aside() {
    tied_before.clear();
    if (P == 1) return;
    for (const auto& p : options.tied()) {
      tied_before.push_back(p.grad());
      p.mutable_grad() = at::Tensor();
    }
  }

  /** After a failed step: the tied gradients as they were before it. */
  void put_tied_back() {
    for (size_t i = 0; i < tied_before.size(); ++i) options.tied()[i].mutable_grad() = tied_before[i];
    tied_before.clear();
  }

  void sum_tied() {
    const auto& tied = options.tied();
    if (tied.empty() || P == 1) return;
    const auto t0 = Clock::now();
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < tied.size(); ++i) {
      const auto& p = tied[i];
      // One all-reduce per parameter: each keeps its own dtype.
      auto sum = p.grad().defined() ? p.grad().contiguous() : at::zeros_like(p);
      std::vector<at::Tensor> ts{sum};
      try {
        group.c10d()->allreduce(ts)->wait(group.timeout());
      } catch (const std::exception& e) {
        comm_failed("the all-reduce of the tied parameters' gradients", e);
      }
      if (tied_before[i].defined()) {
        p.mutable_grad() = tied_before[i].add_(sum);  // accumulates over steps, as autograd would
      } else {
        p.mutable_grad() = sum;
      }
    }
    tied_before.clear();
    stats.send_ms += ms_between(t0, Clock::now());
  }
};

Pipeline::Pipeline(ProcessGroup group, StageFn stage, PipelineOptions options) : impl_(std::make_unique<Impl>()) {
  auto& m = *impl_;
  if (!group.defined()) {
    throw Error("[remat::parallel] Pipeline needs a joined process group; call init_process_group() first.");
  }
  if (!stage) throw Error("[remat::parallel] Pipeline needs a stage function (an empty StageFn was given).");
  if (options.microbatches() < 1) {
    throw Error("[remat::parallel] PipelineOptions::microbatches " + str(options.microbatches()) +
                " must be at least 1.");
  }
  if (group.device() != c10::kCPU) {
    throw Error(
        "[remat::parallel] Pipeline runs on Gloo (CPU) groups; this group is CUDA (NCCL). Create the group with "
        "InitOptions::device(kCPU).");
  }
  m.group = std::move(group);
  m.fn = std::move(stage);
  m.options = std::move(options);
  m.rank = m.group.rank();
  m.P = m.group.world_size();
  m.M = m.options.microbatches();
  for (size_t i = 0; i < m.options.tied().size(); ++i) {
    const auto& p = m.options.tied()[i];
    if (!p.defined() || !p.is_floating_point()) {
      throw Error("[remat::parallel] PipelineOptions::tied[" + str(static_cast<int64_t>(i)) +
                  "] is not a floating parameter; tie parameters only.");
    }
    for (size_t j = 0; j < i; ++j) {
      if (same_impl(p, m.options.tied()[j])) {
        throw Error("[remat::parallel] PipelineOptions::tied lists one parameter twice (at " +
                    str(static_cast<int64_t>(j)) + " and " + str(static_cast<int64_t>(i)) + ").");
      }
    }
  }
  if (!m.options.tied().empty()) {
    m.deferred_tied = std::make_unique<remat::detail::DeferredGradients>(
        m.options.tied(), "tied across pipeline stages, their gradients are summed after the last micro-batch");
  }
  if (m.P > 1) {
    // Every rank must run the same schedule on the same number of
    // micro-batches and tie as many elements, or the messages would not
    // match (a hang until the timeout): compare them once, here.
    int64_t tied_numel = 0;
    for (const auto& p : m.options.tied()) tied_numel += p.numel();
    const std::vector<int64_t> mine{m.M, static_cast<int64_t>(m.options.schedule()),
                                    static_cast<int64_t>(m.options.tied().size()), tied_numel};
    auto v = at::empty({8}, at::kLong);
    for (int i = 0; i < 4; ++i) {
      v.data_ptr<int64_t>()[i] = mine[i];
      v.data_ptr<int64_t>()[4 + i] = -mine[i];
    }
    std::vector<at::Tensor> ts{v};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::MAX;
    try {
      m.group.c10d()->allreduce(ts, o)->wait(m.group.timeout());
    } catch (const std::exception& e) {
      m.comm_failed("the comparison of every rank's PipelineOptions", e);
    }
    const auto* x = v.data_ptr<int64_t>();
    const char* names[] = {"microbatches", "schedule (0 gpipe, 1 1f1b)", "tied parameters", "tied elements"};
    for (int i = 0; i < 4; ++i) {
      if (x[i] != -x[4 + i]) {
        throw Error("[remat::parallel] " + m.where() + ": the ranks' PipelineOptions differ: " + names[i] +
                    " ranges over " + str(-x[4 + i]) + ".." + str(x[i]) + " (this rank " + str(mine[i]) +
                    "); give every rank the same microbatches, schedule and tied list.");
      }
    }
  }
  if (!m.options.tied().empty() && m.P > 1) {
    // Every rank starts from rank 0's values.
    at::NoGradGuard no_grad;
    for (const auto& p : m.options.tied()) {
      auto buf = p.detach().contiguous();
      std::vector<at::Tensor> ts{buf};
      try {
        m.group.c10d()->broadcast(ts)->wait(m.group.timeout());
      } catch (const std::exception& e) {
        m.comm_failed("the broadcast of rank 0's tied parameters", e);
      }
      if (buf.data_ptr() != p.data_ptr()) p.detach().copy_(buf);
    }
  }
}

Pipeline::~Pipeline() {
  if (!impl_) return;
  // A send still queued in Gloo must keep its buffer (NOTE [a failing
  // stage]): leak what has not completed rather than free it under Gloo.
  for (auto* list : {&impl_->pending, &impl_->orphaned}) {
    for (auto& p : *list) {
      if (!p.work->isCompleted()) {
        (void)p.work.release();
        (void)new at::Tensor(p.keep);
      }
    }
  }
}

at::Tensor Pipeline::step(const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& targets,
                          const LossFn& loss) {
  auto& m = *impl_;
  m.stats = PipelineStats{};
  const auto t0 = Clock::now();
  std::optional<memory::Probe> probe;
  if (memory::tracking_enabled()) probe.emplace();
  std::vector<std::vector<at::Tensor>> in, tg;
  std::vector<Impl::Micro> mbs(m.M);
  double total = 0.0;
  m.set_tied_aside();
  std::string failure;  // this rank's error, if its part of the step failed
  bool failed_here = false;
  try {
    if (m.rank == 0) {
      if (inputs.empty()) {
        throw Error("[remat::parallel] " + m.where() + ": step() got no inputs; the first stage splits them into " +
                    str(m.M) + " micro-batches.");
      }
      in = m.split(inputs, "inputs");
    }
    if (m.rank == m.P - 1 && !targets.empty()) tg = m.split(targets, "targets");
    int in_flight = 0;
    const auto ops = schedule_ops(m.options.schedule(), m.rank, m.P, m.M);
    // A StepInBackward updates in this stage's last backward only: the
    // micro-batches before it accumulate, as one step's gradient.
    size_t last_backward = ops.size();
    for (size_t k = 0; k < ops.size(); ++k) {
      if (!ops[k].forward) last_backward = k;
    }
    for (size_t k = 0; k < ops.size(); ++k) {
      const auto& op = ops[k];
      if (op.forward) {
        m.forward(op.m, mbs[op.m], in, tg, loss);
        m.stats.max_in_flight = std::max(m.stats.max_in_flight, ++in_flight);
        if (m.rank == m.P - 1) total += mbs[op.m].loss.detach().item<double>();
      } else {
        std::optional<remat::detail::AccumulateEverywhere> keep;
        if (k != last_backward) keep.emplace();
        m.backward(op.m, mbs[op.m]);
        --in_flight;
      }
      m.prune_pending();
    }
  } catch (const Aborted& a) {
    // Another stage failed: pass it on, away from where it came from.
    std::vector<int> to;
    for (int n : {m.rank - 1, m.rank + 1}) {
      if (n >= 0 && n < m.P && n != a.from_rank) to.push_back(n);
    }
    m.send_abort(to, a.what());
    std::string origin = a.what();
    const std::string prefix = "[remat::parallel] ";
    if (origin.rfind(prefix, 0) == 0) origin = origin.substr(prefix.size());
    failure = "[remat::parallel] " + m.where() + ": stopped because another stage failed: " + origin;
  } catch (const std::exception& e) {
    failure = dynamic_cast<const Error*>(&e) ? std::string(e.what())
                                             : "[remat::parallel] " + m.where() + ": " + message_of(e);
    failed_here = true;
    std::vector<int> to;
    for (int n : {m.rank - 1, m.rank + 1}) {
      if (n >= 0 && n < m.P) to.push_back(n);
    }
    m.send_abort(to, failure);
  }
  // NOTE [a failing stage]: every rank ends its schedule in one status
  // all-reduce (entry r: 1 if stage r failed, 2 if it stopped for another's
  // failure), so a stage that had nothing more to receive from the failed
  // one learns of it here instead of waiting in a later collective.
  std::vector<int64_t> status(m.P, 0);
  if (m.P > 1) {
    auto st = at::zeros({m.P}, at::kLong);
    if (!failure.empty()) st.data_ptr<int64_t>()[m.rank] = failed_here ? 1 : 2;
    std::vector<at::Tensor> ts{st};
    try {
      if (!m.group.c10d()->allreduce(ts)->wait(m.group.timeout())) throw std::runtime_error("aborted");
    } catch (const std::exception& e) {
      if (failure.empty()) {
        try {
          m.comm_failed("the status all-reduce at the step's end", e);
        } catch (const Error& err) {
          failure = err.what();
        }
      }
      status[m.rank] = 1;
    }
    if (status[m.rank] == 0) std::copy(st.data_ptr<int64_t>(), st.data_ptr<int64_t>() + m.P, status.begin());
  } else if (!failure.empty()) {
    status[0] = 1;
  }
  const auto origin = std::find(status.begin(), status.end(), 1);
  if (!failure.empty() || origin != status.end()) {
    mbs.clear();
    m.keep_pending_after_failure();
    m.put_tied_back();
    if (!failure.empty()) throw Error(failure);
    throw Error("[remat::parallel] " + m.where() + ": stopped because stage " +
                str(static_cast<int64_t>(origin - status.begin())) + " failed (its error is reported on that rank).");
  }
  try {
    m.wait_pending();
    m.sum_tied();
  } catch (const std::exception&) {
    m.keep_pending_after_failure();
    m.put_tied_back();
    throw;
  }
  // The loss, from the last stage to every rank.
  auto l = at::full({1}, total, at::kDouble);
  if (m.P > 1) {
    std::vector<at::Tensor> ts{l};
    c10d::BroadcastOptions o;
    o.rootRank = m.P - 1;
    try {
      m.group.c10d()->broadcast(ts, o)->wait(m.group.timeout());
    } catch (const std::exception& e) {
      m.comm_failed("the broadcast of the step's loss", e);
    }
  }
  m.stats.step_ms = ms_between(t0, Clock::now());
  if (m.stats.step_ms > 0) {
    m.stats.bubble = std::max(0.0, 1.0 - (m.stats.forward_ms + m.stats.backward_ms) / m.stats.step_ms);
  }
  if (probe) m.stats.peak_bytes = probe->peak_bytes();
  return l.reshape({});
}

double Pipeline::clip_grad_norm(const std::vector<at::Tensor>& parameters, double max_norm) {
  auto& m = *impl_;
  if (!(max_norm > 0.0) || !std::isfinite(max_norm)) {
    throw Error("[remat::parallel] clip_grad_norm: max_norm " + std::to_string(max_norm) +
                " must be a positive finite number.");
  }
  for (size_t i = 0; i < parameters.size(); ++i) {
    if (StepInBackward::steps_in_backward(parameters[i])) {
      throw Error("[remat::parallel] clip_grad_norm: parameter #" + str(static_cast<int64_t>(i)) +
                  " is updated inside backward (remat::StepInBackward), so no gradient is left to clip: the global "
                  "norm needs every gradient before any update. Destroy the StepInBackward to clip, or train "
                  "without clipping.");
    }
  }
  // A tied parameter's gradient is the same sum on every rank that steps
  // it; it is counted once, by the lowest rank whose `parameters` list it
  // (a rank that does not step it may hold an older sum).
  const auto& tied = m.options.tied();
  std::vector<int> owner(tied.size(), m.rank);
  if (!tied.empty() && m.P > 1) {
    auto lowest = at::full({static_cast<int64_t>(tied.size())}, m.P, at::kLong);
    for (size_t i = 0; i < tied.size(); ++i) {
      if (std::any_of(parameters.begin(), parameters.end(), [&](const at::Tensor& p) { return same_impl(p, tied[i]); }))
        lowest.data_ptr<int64_t>()[i] = m.rank;
    }
    std::vector<at::Tensor> ts{lowest};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::MIN;
    try {
      m.group.c10d()->allreduce(ts, o)->wait(m.group.timeout());
    } catch (const std::exception& e) {
      m.comm_failed("the all-reduce of the tied parameters' owners", e);
    }
    for (size_t i = 0; i < tied.size(); ++i) owner[i] = static_cast<int>(lowest.data_ptr<int64_t>()[i]);
  }
  auto sq = at::zeros({1}, at::kDouble);
  for (const auto& p : parameters) {
    if (!p.grad().defined()) continue;
    bool counted = true;
    for (size_t i = 0; i < tied.size(); ++i) {
      if (same_impl(p, tied[i])) counted = owner[i] == m.rank;
    }
    if (counted) sq += p.grad().detach().to(at::kDouble).pow(2).sum();
  }
  if (m.P > 1) {
    std::vector<at::Tensor> ts{sq};
    try {
      m.group.c10d()->allreduce(ts)->wait(m.group.timeout());
    } catch (const std::exception& e) {
      m.comm_failed("the all-reduce of the gradient norm", e);
    }
  }
  const double norm = std::sqrt(sq.item<double>());
  const double coef = std::min(1.0, max_norm / (norm + 1e-6));
  at::NoGradGuard no_grad;
  for (const auto& p : parameters) {
    if (p.grad().defined()) p.grad().mul_(coef);
  }
  return norm;
}

int Pipeline::stage() const { return impl_->rank; }
int Pipeline::stages() const { return impl_->P; }
const PipelineOptions& Pipeline::options() const { return impl_->options; }

int Pipeline::planned_in_flight() const {
  const auto& m = *impl_;
  return m.options.schedule() == PipelineSchedule::kGPipe ? m.M : std::min(m.P - m.rank, m.M);
}

PipelineStats Pipeline::stats() const { return impl_->stats; }

std::string Pipeline::explain(const AutoCheckpoint* planner) const {
  const auto& m = *impl_;
  const auto& s = m.stats;
  char line[2048];
  std::snprintf(line, sizeof line,
                "stage %d of %d (%s, %d micro-batches): holds at most %d at once (last step %d); step %.1f ms: "
                "forward %.1f, backward %.1f, waiting for neighbours %.1f, sends and tied %.1f; bubble %.0f%%; "
                "peak %s above the step's start\n",
                m.rank, m.P, to_string(m.options.schedule()), m.M, planned_in_flight(), s.max_in_flight, s.step_ms,
                s.forward_ms, s.backward_ms, s.recv_ms, s.send_ms, 100.0 * s.bubble,
                format_bytes(s.peak_bytes).c_str());
  std::string out = line;
  if (planner != nullptr) {
    if (!planner->planned()) {
      out += "  planner: not planned yet (it profiles a step first)\n";
    } else {
      std::snprintf(line, sizeof line, "  planner: budget %s, predicted peak %s, measured %s (last planned step)\n",
                    format_bytes(planner->budget_bytes()).c_str(),
                    format_bytes(planner->plan().prediction.peak_bytes).c_str(),
                    format_bytes(planner->measured_peak_bytes()).c_str());
      out += line;
      for (const auto& u : planner->units()) {
        if (u.calls == 0) continue;
        std::snprintf(line, sizeof line, "    %-20s %2lld calls  %-40s kept %s  %+.1f ms\n", u.name.c_str(),
                      static_cast<long long>(u.calls),
                      u.runs_in.empty() ? u.options[u.choice].c_str() : ("part of " + u.runs_in).c_str(),
                      format_bytes(u.kept_bytes).c_str(), u.time_added_ms);
        out += line;
      }
    }
  }
  return out;
}

}  // namespace remat::parallel
