// Chunking along a dimension; see include/remat/chunked.h.
#include <remat/chunked.h>

#include <algorithm>
#include <limits>
#include <string>
#include <utility>

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <remat/error.h>

namespace remat {
namespace {

thread_local detail::ChunkObserver* tls_chunk_observer = nullptr;
thread_local int tls_chunk_depth = 0;  // chunked calls running on this thread (a call inside another is not seen)

/** The observer to tell of a chunked call starting now, or nullptr: none
 *  while a checkpoint recomputes or inside another chunked call, whose
 *  count decides how many times this one runs (NOTE [chunked calls as
 *  units], src/auto/chunks.cpp). */
detail::ChunkObserver* observer_now() {
  return tls_chunk_depth == 0 && !is_recomputing() ? tls_chunk_observer : nullptr;
}

/** RAII: a chunked call runs. Counted outside recomputes only: the
 *  observer is never asked inside one. */
struct Running {
  Running() : counted_(!is_recomputing()) {
    if (counted_) ++tls_chunk_depth;
  }
  ~Running() {
    if (counted_) --tls_chunk_depth;
  }
  Running(const Running&) = delete;
  Running& operator=(const Running&) = delete;

 private:
  bool counted_;
};

/** A chunked call's work with `chunks` slices (-1: its own count) on `in`. */
using RunWith = std::function<at::Tensor(int64_t chunks, const std::vector<at::Tensor>& in)>;

/** Runs a chunked call of `kind` with its own count `own`: told to the
 *  observer first (which may measure it again and choose another count),
 *  then run and, when observed, finished with its output. */
at::Tensor observed(const char* kind, int64_t limit, const std::vector<at::Tensor>& inputs, int64_t own,
                    const RunWith& run) {
  int64_t chunks = own;
  std::unique_ptr<detail::UnitObserver::Call> call;
  if (detail::ChunkObserver* obs = observer_now()) {
    const detail::ChunkRun again = [&](int64_t c, const std::vector<at::Tensor>& in) -> std::vector<at::Tensor> {
      Running running;
      return {run(c < 0 ? own : c, in)};
    };
    call = obs->begin(kind, limit, inputs, again, &chunks);
  }
  Running running;
  at::Tensor out = run(chunks, inputs);
  if (call) call->finish({out});
  return out;
}

std::string str(int64_t v) { return std::to_string(v); }

std::string shape(const at::Tensor& t) {
  std::string s = "(";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + str(t.size(i));
  return s + ")";
}

/** Lengths of k slices of n positions, the first n % k one longer. */
std::vector<int64_t> slice_lengths(int64_t n, int64_t k) {
  std::vector<int64_t> out(static_cast<size_t>(k), n / k);
  for (int64_t i = 0; i < n % k; ++i) ++out[static_cast<size_t>(i)];
  return out;
}

void check_chunks(const char* what, int64_t chunks, int64_t least, const char* least_runs) {
  if (chunks < least) {
    throw Error(std::string("[remat::") + what + "] chunks must be >= " + str(least) + ", got " + str(chunks) +
                ". Pass the number of slices, e.g. 8 (" + str(least) + " runs " + least_runs + ").");
  }
}

/** chunked()'s work after its checks: fn over `chunks` slices (at least 1,
 *  at most length) of inputs along dims (one per input, non-negative). */
at::Tensor run_chunked(const std::function<at::Tensor(const std::vector<at::Tensor>&)>& fn,
                       const std::vector<at::Tensor>& inputs, const std::vector<int64_t>& dims, int64_t length,
                       const ChunkOptions& options, int64_t chunks) {
  const int64_t k = std::max<int64_t>(1, std::min(chunks, length));
  const auto lengths = slice_lengths(length, k);
  // One split per input: a single backward node gathers the slices'
  // gradients (k narrow()s would each build a full-size zero gradient).
  std::vector<std::vector<at::Tensor>> pieces;
  for (size_t i = 0; i < inputs.size(); ++i) pieces.push_back(inputs[i].split_with_sizes(lengths, dims[i]));

  std::vector<at::Tensor> outs;
  outs.reserve(static_cast<size_t>(k));
  at::Tensor acc;
  for (int64_t c = 0; c < k; ++c) {
    std::vector<at::Tensor> args;
    for (auto& p : pieces) args.push_back(p[static_cast<size_t>(c)]);
    at::Tensor y = options.checkpoint() ? remat::checkpoint(
                                              options.checkpoint_options(),
                                              [fn](const std::vector<at::Tensor>& a) { return fn(a); }, args)
                                        : fn(args);
    args.clear();
    if (options.reduce() == ChunkReduce::kConcat) {
      outs.push_back(std::move(y));
      continue;
    }
    if (options.reduce() == ChunkReduce::kMean) {
      y = y * (static_cast<double>(lengths[static_cast<size_t>(c)]) / static_cast<double>(length));
    }
    acc = acc.defined() ? acc + y : y;  // out of place: y may be an input's view or needed by autograd
  }
  for (auto& p : pieces) p.clear();
  if (options.reduce() != ChunkReduce::kConcat) return acc;
  const auto& y0 = outs.front();
  const int64_t d = options.dim() < 0 ? options.dim() + y0.dim() : options.dim();
  if (d < 0 || d >= y0.dim()) {
    throw Error("[remat::chunked] fn returned a tensor of shape " + shape(y0) + " without dim " + str(options.dim()) +
                " to concatenate along. Return per-position outputs, or use ChunkReduce::kSum or kMean.");
  }
  return k == 1 ? outs.front() : at::cat(outs, d);
}

}  // namespace

namespace detail {
ChunkObserver* chunk_observer() { return tls_chunk_observer; }
ChunkObserver* set_chunk_observer(ChunkObserver* o) { return std::exchange(tls_chunk_observer, o); }
}  // namespace detail

at::Tensor chunked(const std::function<at::Tensor(const std::vector<at::Tensor>&)>& fn,
                   const std::vector<at::Tensor>& inputs, const ChunkOptions& options) {
  check_chunks("chunked", options.chunks(), 1, "unchunked");
  if (inputs.empty()) {
    throw Error("[remat::chunked] no inputs to slice. Pass the tensors to slice (e.g. {x}); capture the others in fn.");
  }
  int64_t length = -1;
  std::vector<int64_t> dims;  // per input, dim made non-negative
  for (size_t i = 0; i < inputs.size(); ++i) {
    const auto& t = inputs[i];
    if (!t.defined()) {
      throw Error("[remat::chunked] input " + str(static_cast<int64_t>(i)) +
                  " is an undefined tensor. Pass defined tensors only; capture optional ones in fn.");
    }
    const int64_t d = options.dim() < 0 ? options.dim() + t.dim() : options.dim();
    if (d < 0 || d >= t.dim()) {
      throw Error("[remat::chunked] dim " + str(options.dim()) + " does not exist in input " +
                  str(static_cast<int64_t>(i)) + " of shape " + shape(t) + " (" + str(t.dim()) +
                  " dimensions). Pass a dim in [-" + str(t.dim()) + ", " + str(t.dim() - 1) + "].");
    }
    if (length >= 0 && t.size(d) != length) {
      throw Error("[remat::chunked] input " + str(static_cast<int64_t>(i)) + " has length " + str(t.size(d)) +
                  " along dim " + str(options.dim()) + ", input 0 has " + str(length) +
                  ". Every input is sliced along dim: pass tensors of one length there, and capture the "
                  "others in fn.");
    }
    length = t.size(d);
    dims.push_back(d);
  }
  return observed("chunked", length, inputs, options.chunks(), [&](int64_t chunks, const std::vector<at::Tensor>& in) {
    return run_chunked(fn, in, dims, length, options, chunks);
  });
}

// --- chunked cross-entropy ----------------------------------------------------

namespace {

/** The logits' and the loss's dtype: float32, or float64 for float64
 *  inputs (never computed in less than the inputs' precision). */
at::ScalarType loss_dtype(const at::Tensor& hidden) { return at::promote_types(hidden.scalar_type(), at::kFloat); }

/** Per slice of rows: logits, loss sum and (when wanted) the gradients.
 *  scale multiplies the gradients (1 / counted targets for the mean). */
struct CeWork {
  const ChunkedCrossEntropyOptions& o;
  at::Tensor h2, weight, bias, t1;  // (N, C), (V, C), (V) or undefined, (N)
  int64_t k;
};

/** Sum over rows of the loss, and the gradients scaled by scale when the
 *  grad_* tensors are defined (grad_h (N, C) written, grad_w/grad_b added to). */
at::Tensor ce_slices(const CeWork& w, double scale, at::Tensor* grad_h, at::Tensor* grad_w, at::Tensor* grad_b) {
  const int64_t N = w.h2.size(0), V = w.weight.size(0);
  const double eps = w.o.label_smoothing();
  const auto lengths = slice_lengths(N, w.k);
  const at::ScalarType acc = loss_dtype(w.h2);
  at::Tensor total = at::zeros({}, w.h2.options().dtype(acc));
  int64_t s = 0;
  for (int64_t len : lengths) {
    auto hc = w.h2.narrow(0, s, len);                                 // (n, C)
    auto tc = w.t1.narrow(0, s, len);                                 // (n)
    auto logits = at::linear(hc, w.weight, w.bias).to(acc);           // (n, V)
    auto valid = tc.ne(w.o.ignore_index());                           // (n)
    auto safe = tc.masked_fill(valid.logical_not(), 0).unsqueeze(1);  // (n, 1)
    auto lse = at::logsumexp(logits, {1}, /*keepdim=*/true);          // (n, 1)
    auto row = (lse - logits.gather(1, safe)).squeeze(1);             // (n): -log p[target]
    if (eps > 0) {  // smoothing term: -sum_v log p[v] = V lse - sum_v logits
      row = row * (1.0 - eps) + (lse.squeeze(1) * static_cast<double>(V) - logits.sum(1)) * (eps / V);
    }
    total = total + row.masked_fill(valid.logical_not(), 0).sum();
    if (grad_h || grad_w || grad_b) {
      // d loss_row / d logits = softmax - (1 - eps) onehot - eps / V, in place on logits.
      auto g = logits.sub_(lse).exp_();
      if (eps > 0) g.sub_(eps / V);
      g.scatter_add_(1, safe, at::full({len, 1}, -(1.0 - eps), g.options()));
      g.mul_(valid.unsqueeze(1).to(acc) * scale);
      logits = at::Tensor();
      if (grad_h) grad_h->narrow(0, s, len).copy_(at::mm(g.to(w.h2.scalar_type()), w.weight.to(w.h2.scalar_type())));
      if (grad_w) grad_w->add_(at::mm(g.t().to(w.h2.scalar_type()), hc));
      if (grad_b) grad_b->add_(g.sum(0));
    }
    s += len;
  }
  return total;
}

struct ChunkedCe : torch::autograd::Function<ChunkedCe> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                            const at::Tensor& bias, const at::Tensor& targets, const CeWork* work, double scale,
                            double loss_scale) {
    const bool gh = hidden.requires_grad(), gw = weight.requires_grad(),
               gb = work->bias.defined() && bias.requires_grad();
    // Gradient accumulators in float32 (float64 for float64 inputs; summed
    // over slices), cast on return.
    const at::ScalarType acc = loss_dtype(work->h2);
    at::Tensor grad_h = gh ? at::empty(work->h2.sizes(), hidden.options()) : at::Tensor();
    at::Tensor grad_w = gw ? at::zeros(weight.sizes(), weight.options().dtype(acc)) : at::Tensor();
    at::Tensor grad_b = gb ? at::zeros(bias.sizes(), bias.options().dtype(acc)) : at::Tensor();
    auto total = ce_slices(*work, scale, gh ? &grad_h : nullptr, gw ? &grad_w : nullptr, gb ? &grad_b : nullptr);
    if (gh) grad_h = grad_h.view(hidden.sizes());
    if (gw && weight.scalar_type() != acc) grad_w = grad_w.to(weight.scalar_type());
    if (gb && bias.scalar_type() != acc) grad_b = grad_b.to(bias.scalar_type());
    ctx->save_for_backward({grad_h, grad_w, grad_b});
    (void)targets;
    return total * loss_scale;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    if (at::GradMode::is_enabled()) {  // backward(create_graph=true): the result would miss its own graph
      throw Error(
          "[remat::chunked_cross_entropy] its gradient is computed in forward and is not differentiable again "
          "(a backward with create_graph, e.g. a gradient penalty through the loss). Use the unchunked loss "
          "(torch::nn::functional::cross_entropy on the logits) where a second derivative is needed.");
    }
    auto saved = ctx->get_saved_variables();
    const auto& g = grad_out[0];  // () float32 (float64 for float64 inputs)
    // loss.backward() passes exactly 1: hand the gradients over unscaled,
    // without a second (vocab, C) weight gradient (on a GPU the check costs
    // one synchronization per backward, as Liger's fused loss pays too).
    const bool one = g.item<double>() == 1.0;
    auto scaled = [&](const at::Tensor& t) {
      if (!t.defined()) return at::Tensor();
      return one ? t : t * g.to(t.scalar_type());
    };
    return {scaled(saved[0]), scaled(saved[1]), scaled(saved[2]), at::Tensor(),
            at::Tensor(),     at::Tensor(),     at::Tensor()};
  }
};

/** chunked_cross_entropy()'s work after its checks, over `chunks` slices
 *  (0: the plain form through autograd). */
at::Tensor run_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                             const ChunkedCrossEntropyOptions& options, const at::Tensor& bias, int64_t chunks) {
  const int64_t N = targets.numel(), V = weight.size(0);
  auto t1 = targets.reshape({N}).to(at::kLong);
  if (chunks > 0) {  // the unchunked form leaves the check to LibTorch's cross_entropy (no synchronization added)
    auto valid = t1.ne(options.ignore_index());
    if (valid.any().item<bool>()) {
      auto ids = t1.masked_select(valid);
      const int64_t lo = ids.min().item<int64_t>(), hi = ids.max().item<int64_t>();
      if (lo < 0 || hi >= V) {
        throw Error("[remat::chunked_cross_entropy] target " + str(lo < 0 ? lo : hi) + " is out of range for " +
                    str(V) + " classes (ignore_index " + str(options.ignore_index()) +
                    "). Pass ids in [0, vocab) or the ignore_index.");
      }
    }
  }
  if (chunks == 0) {
    // As a model computes it: the logits at hidden's shape, then flattened in float32 (float64 stays).
    auto logits = at::linear(hidden, weight, bias);
    return at::cross_entropy_loss(
        logits.reshape({-1, logits.size(-1)}).to(loss_dtype(hidden)), t1, {},
        options.reduction() == LossReduction::kMean ? at::Reduction::Mean : at::Reduction::Sum, options.ignore_index(),
        options.label_smoothing());
  }
  const int64_t counted =
      options.reduction() == LossReduction::kMean ? t1.ne(options.ignore_index()).sum().item<int64_t>() : 1;
  const double scale = counted == 0 ? 0.0 : 1.0 / static_cast<double>(counted);
  // Mean over no counted target: 0 / 0, NaN, as LibTorch (gradients 0).
  const double loss_scale = counted == 0 ? std::numeric_limits<double>::quiet_NaN() : scale;
  CeWork work{options, hidden.reshape({N, hidden.size(-1)}),     weight, bias,
              t1,      std::max<int64_t>(1, std::min(chunks, N))};
  const bool grad = at::GradMode::is_enabled() &&
                    (hidden.requires_grad() || weight.requires_grad() || (bias.defined() && bias.requires_grad()));
  if (!grad) return ce_slices(work, scale, nullptr, nullptr, nullptr) * loss_scale;
  // apply() wants defined tensors: an empty stand-in for no bias (work.bias stays undefined).
  return ChunkedCe::apply(hidden, weight, bias.defined() ? bias : at::empty({0}, weight.options()), targets, &work,
                          scale, loss_scale);
}

}  // namespace

at::Tensor chunked_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                 const ChunkedCrossEntropyOptions& options, const at::Tensor& bias) {
  check_chunks("chunked_cross_entropy", options.chunks(), 0, "unchunked, through the whole logits");
  const double eps = options.label_smoothing();
  if (!(eps >= 0.0 && eps <= 1.0)) {
    throw Error("[remat::chunked_cross_entropy] label_smoothing must be in [0, 1], got " + std::to_string(eps) +
                ". Pass e.g. 0.1, or 0 for none.");
  }
  // targets' shape is hidden's less its last dimension: the same count in
  // another shape ((8, 4) for (4, 8, 16)) would pair rows with other rows' ids.
  const char* fix = ". Pass hidden (..., C), weight (vocab, C), targets (...) of int64 ids and bias (vocab).";
  if (!hidden.defined() || !weight.defined() || !targets.defined() || hidden.dim() < 1 || weight.dim() != 2 ||
      hidden.size(-1) != weight.size(1) || targets.sizes() != hidden.sizes().slice(0, hidden.dim() - 1) ||
      (bias.defined() && (bias.dim() != 1 || bias.size(0) != weight.size(0)))) {
    auto sh = [](const at::Tensor& t) { return t.defined() ? shape(t) : std::string("undefined"); };
    throw Error("[remat::chunked_cross_entropy] shapes do not match: hidden " + sh(hidden) + ", weight " + sh(weight) +
                ", targets " + sh(targets) + (bias.defined() ? ", bias " + sh(bias) : "") + fix);
  }
  if (at::isFloatingType(targets.scalar_type()) || targets.scalar_type() == at::kBool) {
    throw Error("[remat::chunked_cross_entropy] targets are " + std::string(c10::toString(targets.scalar_type())) +
                "; class probabilities are not supported. Pass class ids (int64, e.g. targets.to(torch::kLong)).");
  }
  const int64_t N = targets.numel();
  std::vector<at::Tensor> in{hidden, weight, targets};
  if (bias.defined()) in.push_back(bias);
  return observed("chunked_cross_entropy", N, in, options.chunks(),
                  [&](int64_t chunks, const std::vector<at::Tensor>& t) {
                    return run_cross_entropy(t[0], t[1], t[2], options, t.size() > 3 ? t[3] : at::Tensor(), chunks);
                  });
}

}  // namespace remat
