// Exception safety: a user exception thrown inside a
// checkpointed function, in the forward or in the recompute that backward
// triggers, reaches the caller unchanged and leaves the thread as it was:
//  - hook stack: remat::current_hooks() is what it was before the call (a
//    user's SavedTensorsHooks guard still on top, or nothing);
//  - grad mode, CPU autocast state (enabled, dtype, cache) and
//    remat::is_recomputing() as before the call;
//  - CPU RNG (the default generator's full state, compared bitwise):
//    remat neither consumes nor rewinds random numbers on the way out. A
//    forward that throws leaves the state a plain (uncheckpointed) call of
//    the same function would leave when throwing at the same point (fn's
//    own draws before the throw count); a backward that throws leaves the
//    state as it was right before loss.backward() (the recompute replays
//    the forward's state and must put the current one back, even though we
//    move the generator between forward and backward and fn draws before
//    it throws); a throw while CheckpointedSequential profiles its first
//    batch leaves the state as before (the profiler puts it back);
//  - memory: a remat::memory::Probe opened before the failed step reads
//    delta 0 once the failed step's tensors (outputs, loss, .grad) are
//    dropped (tracking on for the whole test, so nothing is uncounted);
//  - the next step works and its gradients are bitwise those of a plain run.
// Covered: remat::checkpoint, nested checkpoints (the inner one throws in
// its forward, inside the outer recompute, and in its own recompute), and
// CheckpointedSequential (a stage that throws on its Nth call: while
// profiling, in the forward part, in the backward part).
#include "common.h"

#include <ATen/autocast_mode.h>

#include <optional>

#include <remat/sequential.h>

using namespace remat_test;
namespace F = torch::nn::functional;

namespace {

struct UserError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/** The default CPU generator's whole state, as bytes: kept outside tensor
 *  storage, so holding it does not show in the memory probes. */
using RngBytes = std::vector<uint8_t>;

RngBytes cpu_rng_state() {
  auto gen = at::globalContext().defaultGenerator(c10::Device(c10::kCPU));
  std::lock_guard<std::mutex> lock(gen.mutex());
  at::Tensor t = gen.get_state();
  const auto* p = t.data_ptr<uint8_t>();
  return RngBytes(p, p + t.numel());
}

void set_cpu_rng_state(const RngBytes& s) {
  at::Tensor t =
      torch::from_blob(const_cast<uint8_t*>(s.data()), {static_cast<int64_t>(s.size())}, torch::kUInt8).clone();
  auto gen = at::globalContext().defaultGenerator(c10::Device(c10::kCPU));
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(t);
}

/** The thread state a failed call must leave alone. */
struct Ambient {
  remat::HookFactory* hooks = nullptr;
  RngBytes rng;
  bool grad = true, recomputing = false;
  bool autocast_cpu = false, autocast_cache = true;
  at::ScalarType autocast_dtype = at::kBFloat16;

  static Ambient now() {
    Ambient a;
    a.hooks = remat::current_hooks();
    a.rng = cpu_rng_state();
    a.grad = at::GradMode::is_enabled();
    a.recomputing = remat::is_recomputing();
    a.autocast_cpu = at::autocast::is_autocast_enabled(at::kCPU);
    a.autocast_cache = at::autocast::is_autocast_cache_enabled();
    a.autocast_dtype = at::autocast::get_autocast_dtype(at::kCPU);
    return a;
  }
};

/** Everything but the RNG, which each case defines (see the file comment). */
void expect_same_thread_state(const Ambient& before, const Ambient& after) {
  EXPECT_EQ(after.hooks, before.hooks) << "hook stack changed";
  EXPECT_EQ(after.grad, before.grad) << "grad mode changed";
  EXPECT_EQ(after.recomputing, before.recomputing) << "is_recomputing() changed";
  EXPECT_EQ(after.autocast_cpu, before.autocast_cpu) << "autocast enabled changed";
  EXPECT_EQ(after.autocast_cache, before.autocast_cache) << "autocast cache changed";
  EXPECT_EQ(after.autocast_dtype, before.autocast_dtype) << "autocast dtype changed";
}

/** Linear, tanh, dropout (draws RNG), then throws on call `throw_on`
 *  (1-based; counts every call, recomputes included), then more saved ops,
 *  so the throw is never cut off by early stop. Records where it threw. */
struct FlakyImpl : torch::nn::Module {
  explicit FlakyImpl(int64_t w, double p = 0.25)
      : a(register_module("a", torch::nn::Linear(w, w))), b(register_module("b", torch::nn::Linear(w, w))), p_(p) {}
  torch::Tensor forward(torch::Tensor x) {
    ++calls;
    auto h = F::dropout(a(x).tanh(), F::DropoutFuncOptions().p(p_).training(is_training()));
    if (calls == throw_on) {
      threw_recomputing = remat::is_recomputing();
      threw_hooks = remat::current_hooks();
      throw UserError("user: flaky stage failed on call " + std::to_string(calls));
    }
    return b(h).sigmoid();
  }
  torch::nn::Linear a, b;
  double p_;
  int calls = 0;
  int throw_on = -1;
  bool threw_recomputing = false;
  remat::HookFactory* threw_hooks = nullptr;
};
TORCH_MODULE(Flaky);

std::string expected_message(int call) { return "user: flaky stage failed on call " + std::to_string(call); }

class ExceptionSafety : public ::testing::Test {
 protected:
  void SetUp() override { remat::memory::enable_tracking(); }
};

/** Runs f, which must throw UserError with `message`; returns the thread
 *  state right after. The exception must come out unchanged (type and
 *  text), also from inside autograd's engine. */
template <class F>
Ambient expect_user_error(F&& f, const std::string& message) {
  try {
    f();
    ADD_FAILURE() << "no exception; expected: " << message;
  } catch (const UserError& e) {
    EXPECT_EQ(std::string(e.what()), message);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "the user's exception was replaced by " << typeid(e).name() << ": " << e.what();
  }
  return Ambient::now();
}

/** loss.backward(), with f set to throw during the recompute: the user's
 *  error comes out unchanged, the throw came from the recompute, and the
 *  thread state and the RNG are as right before backward. Drops loss. */
void expect_recompute_throw_is_clean(torch::Tensor& loss, Flaky& f, const std::string& message) {
  const Ambient before = Ambient::now();
  const Ambient after = expect_user_error([&] { loss.backward(); }, message);
  EXPECT_TRUE(f->threw_recomputing) << "the throw must come from the recompute";
  expect_same_thread_state(before, after);
  EXPECT_TRUE(after.rng == before.rng) << "the recompute did not put the RNG state back";
  loss = torch::Tensor();
}

// ---- remat::checkpoint ----

TEST_F(ExceptionSafety, CheckpointForwardThrow) {
  torch::manual_seed(1);
  Flaky f(16);
  auto x = torch::randn({8, 16}, torch::requires_grad());
  auto fn = [f](torch::Tensor in) mutable { return f(in); };
  auto ckpt_step = [&] { return step_grads(*f, x, [&](torch::Tensor h) { return remat::checkpoint(fn, h); }); };
  ckpt_step();  // warm-up: lazy allocations (RNG copies, caches) settle

  // What a plain failing call leaves in the generator.
  const RngBytes start = cpu_rng_state();
  f->throw_on = f->calls + 1;
  expect_user_error([&] { fn(x); }, expected_message(f->throw_on));
  const RngBytes plain_after = cpu_rng_state();
  ASSERT_FALSE(plain_after == start) << "fn must draw before it throws, or the RNG check is empty";

  for (bool user_hooks : {false, true}) {
    SCOPED_TRACE(user_hooks ? "under a user's SavedTensorsHooks" : "no outer hooks");
    std::optional<remat::SavedTensorsHooks> outer;
    if (user_hooks) outer.emplace([](const at::Tensor& t) { return t; }, [](const at::Tensor& t) { return t; });
    set_cpu_rng_state(start);
    const Ambient before = Ambient::now();
    ASSERT_EQ(before.hooks != nullptr, user_hooks);
    remat::memory::Probe probe;
    f->throw_on = f->calls + 1;
    const Ambient after = expect_user_error([&] { remat::checkpoint(fn, x); }, expected_message(f->throw_on));
    EXPECT_FALSE(f->threw_recomputing);
    EXPECT_NE(f->threw_hooks, before.hooks) << "fn must have run under the checkpoint's hooks";
    expect_same_thread_state(before, after);
    EXPECT_TRUE(after.rng == plain_after) << "RNG differs from a plain failing call";
    EXPECT_EQ(probe.delta_bytes(), 0) << "the failed forward left tensors behind";
  }
  f->throw_on = -1;
  torch::manual_seed(5);
  auto plain = step_grads(*f, x, fn);
  torch::manual_seed(5);
  expect_bitwise_equal(plain, ckpt_step());
}

TEST_F(ExceptionSafety, CheckpointRecomputeThrowInBackward) {
  torch::manual_seed(2);
  Flaky f(16);
  torch::nn::Linear head(16, 16);
  auto x = torch::randn({8, 16}, torch::requires_grad());
  torch::nn::Sequential all(f, head);
  auto fn = [f](torch::Tensor in) mutable { return f(in); };
  auto ckpt_run = [&](torch::Tensor h) { return head(remat::checkpoint(fn, h)).tanh(); };
  auto plain_run = [&](torch::Tensor h) { return head(fn(h)).tanh(); };
  step_grads(*all, x, ckpt_run);  // warm-up

  for (bool grad_mode : {true, false}) {
    SCOPED_TRACE(grad_mode ? "backward with grad mode on" : "backward under NoGradGuard");
    remat::reset_checkpoint_stats();
    zero_grads(*all, x);
    remat::memory::Probe probe;
    auto loss = ckpt_run(x).square().mean();
    f->throw_on = f->calls + 1;  // the recompute
    torch::rand({100});          // move the generator away from the captured state
    {
      c10::AutoGradMode mode(grad_mode);
      expect_recompute_throw_is_clean(loss, f, expected_message(f->throw_on));
    }
    EXPECT_EQ(remat::checkpoint_stats().recomputations, 0) << "a failed recompute is not counted as one";
    zero_grads(*all, x);
    EXPECT_EQ(probe.delta_bytes(), 0) << "the failed step left tensors behind";
  }
  f->throw_on = -1;
  torch::manual_seed(6);
  auto plain = step_grads(*all, x, plain_run);
  torch::manual_seed(6);
  expect_bitwise_equal(plain, step_grads(*all, x, ckpt_run));
}

TEST_F(ExceptionSafety, CheckpointRecomputeThrowUnderAutocast) {
  torch::manual_seed(3);
  Flaky f(16);
  auto x = torch::randn({4, 16}, torch::requires_grad());
  auto fn = [f](torch::Tensor in) mutable { return f(in); };
  auto run = [&](bool ckpt) {
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    auto y = ckpt ? remat::checkpoint(fn, x) : fn(x);
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
    EXPECT_EQ(y.scalar_type(), at::kBFloat16);
    return y.to(torch::kFloat).square().sum();
  };
  zero_grads(*f, x);
  run(true).backward();  // warm-up
  // Forward throw inside autocast: still enabled, bf16, afterwards.
  {
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    const Ambient before = Ambient::now();
    f->throw_on = f->calls + 1;
    const Ambient after = expect_user_error([&] { remat::checkpoint(fn, x); }, expected_message(f->throw_on));
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
    expect_same_thread_state(before, after);
    EXPECT_TRUE(after.autocast_cpu);
  }
  // Recompute throw (it replays autocast on): off again afterwards.
  zero_grads(*f, x);
  remat::memory::Probe probe;
  auto loss = run(true);
  f->throw_on = f->calls + 1;
  ASSERT_FALSE(Ambient::now().autocast_cpu);
  expect_recompute_throw_is_clean(loss, f, expected_message(f->throw_on));
  zero_grads(*f, x);
  EXPECT_EQ(probe.delta_bytes(), 0);
  f->throw_on = -1;
  zero_grads(*f, x);
  torch::manual_seed(7);
  run(false).backward();
  auto plain = grads_of(*f, x);
  zero_grads(*f, x);
  torch::manual_seed(7);
  run(true).backward();
  expect_bitwise_equal(plain, grads_of(*f, x));
}

// ---- nested checkpoints: the inner region throws ----

TEST_F(ExceptionSafety, NestedInnerThrowsAtEachCall) {
  torch::manual_seed(4);
  Flaky f(16);
  torch::nn::Linear l0(16, 16), l3(16, 16);
  torch::nn::Sequential all(l0, f, l3);
  auto x = torch::randn({6, 16}, torch::requires_grad());
  auto inner = [f](torch::Tensor h) mutable { return f(h); };
  int outer_runs = 0;
  auto outer_fn = [&outer_runs, l0, l3, inner](torch::Tensor h) mutable {
    ++outer_runs;
    h = l0(h).tanh();
    h = remat::checkpoint(inner, h);
    return l3(h).tanh();
  };
  auto plain_run = [&](torch::Tensor h) { return l3(f(l0(h).tanh())).tanh(); };
  auto ckpt_run = [&](torch::Tensor h) { return remat::checkpoint(outer_fn, h); };
  step_grads(*all, x, ckpt_run);  // warm-up; inner runs 3 times per step
  ASSERT_EQ(f->calls, 3);

  // Call 1: the inner forward; 2: inside the outer recompute; 3: the inner's own recompute.
  for (int n : {1, 2, 3}) {
    SCOPED_TRACE("inner throws on its call " + std::to_string(n) + " of the step");
    zero_grads(*all, x);
    remat::memory::Probe probe;
    const int base = f->calls;
    f->throw_on = base + n;
    const RngBytes start = cpu_rng_state();
    if (n == 1) {
      const Ambient before = Ambient::now();
      const Ambient after = expect_user_error([&] { ckpt_run(x); }, expected_message(base + 1));
      EXPECT_FALSE(f->threw_recomputing);
      expect_same_thread_state(before, after);
      // As a plain failing call: fn's draws up to the throw, nothing else.
      set_cpu_rng_state(start);
      f->throw_on = f->calls + 1;
      expect_user_error([&] { plain_run(x); }, expected_message(f->throw_on));
      EXPECT_TRUE(after.rng == cpu_rng_state()) << "RNG differs from a plain failing call";
    } else {
      auto loss = ckpt_run(x).square().mean();
      torch::rand({100});
      expect_recompute_throw_is_clean(loss, f, expected_message(base + n));
      EXPECT_EQ(f->calls, base + n);
    }
    zero_grads(*all, x);
    EXPECT_EQ(probe.delta_bytes(), 0) << "the failed step left tensors behind";
  }
  f->throw_on = -1;
  torch::manual_seed(8);
  auto plain = step_grads(*all, x, plain_run);
  torch::manual_seed(8);
  outer_runs = 0;
  const int before_calls = f->calls;
  expect_bitwise_equal(plain, step_grads(*all, x, ckpt_run));
  EXPECT_EQ(outer_runs, 2);
  EXPECT_EQ(f->calls - before_calls, 3);
}

// ---- CheckpointedSequential: a stage that throws on its Nth call ----

torch::nn::Sequential flaky_chain(Flaky& f) {
  torch::manual_seed(9);
  f = Flaky(32);
  torch::nn::Sequential seq;
  seq->push_back(torch::nn::Linear(32, 32));
  seq->push_back(torch::nn::Tanh());
  seq->push_back(f);  // stage 2
  seq->push_back(torch::nn::Linear(32, 32));
  seq->push_back(torch::nn::Tanh());
  seq->push_back(torch::nn::Linear(32, 32));
  return seq;
}

TEST_F(ExceptionSafety, CheckpointedSequentialStageThrows) {
  Flaky f(1);
  auto seq = flaky_chain(f);
  // uniform:2: stages 0-2 are a checkpointed segment, so stage 2 runs in
  // the forward part and again in the backward part.
  remat::CheckpointedSequential net(seq, remat::SequentialOptions().segments(2));
  auto x = torch::randn({8, 32}, torch::requires_grad());
  auto ckpt_run = [&](torch::Tensor h) { return net->forward(h); };
  auto plain_run = [&](torch::Tensor h) { return seq->forward(h); };

  // Throw while the first batch is profiled: the profiler's own state
  // (buffers, RNG) is put back, nothing is cached, the next forward profiles.
  for (int rep = 0; rep < 3; ++rep) {
    remat::memory::Probe probe;
    f->throw_on = f->calls + 1;
    const Ambient before = Ambient::now();
    const Ambient after = expect_user_error([&] { net->forward(x); }, expected_message(f->throw_on));
    expect_same_thread_state(before, after);
    EXPECT_TRUE(after.rng == before.rng) << "the profiler did not put the RNG state back";
    EXPECT_EQ(net->profiles(), 0);
    EXPECT_THROW(net->plan(), remat::Error) << "no plan may be cached from a failed profile";
    EXPECT_EQ(probe.delta_bytes(), 0) << "rep " << rep;
  }
  f->throw_on = -1;
  step_grads(*seq, x, ckpt_run);  // warm-up: profiles, plans, one full step
  ASSERT_EQ(net->profiles(), 1);
  ASSERT_EQ(net->last_step().forwards_per_stage[2], 2) << "stage 2 must be recomputed for this test";

  for (int n : {1, 2}) {
    SCOPED_TRACE(n == 1 ? "forward part throws" : "backward part throws");
    zero_grads(*seq, x);
    remat::memory::Probe probe;
    const int base = f->calls;
    f->throw_on = base + n;
    const RngBytes start = cpu_rng_state();
    if (n == 1) {
      const Ambient before = Ambient::now();
      const Ambient after = expect_user_error([&] { net->forward(x); }, expected_message(base + 1));
      EXPECT_FALSE(f->threw_recomputing);
      expect_same_thread_state(before, after);
      set_cpu_rng_state(start);
      f->throw_on = f->calls + 1;
      expect_user_error([&] { seq->forward(x); }, expected_message(f->throw_on));
      EXPECT_TRUE(after.rng == cpu_rng_state()) << "RNG differs from a plain failing forward";
    } else {
      auto loss = net->forward(x).square().mean();
      torch::rand({100});
      expect_recompute_throw_is_clean(loss, f, expected_message(base + 2));
    }
    zero_grads(*seq, x);
    EXPECT_EQ(probe.delta_bytes(), 0) << "the failed step left tensors behind";
  }
  f->throw_on = -1;
  torch::manual_seed(10);
  auto plain = step_grads(*seq, x, plain_run);
  torch::manual_seed(10);
  const int before_calls = f->calls;
  expect_bitwise_equal(plain, step_grads(*seq, x, ckpt_run));
  EXPECT_EQ(f->calls - before_calls, 2);
  EXPECT_EQ(net->profiles(), 1) << "a failed step must not invalidate the cached plan";
  EXPECT_EQ(net->last_step().forwards_per_stage, net->plan().prediction.forwards_per_stage);
}

// remat's own errors thrown from a recompute inside backward also come out
// of loss.backward() as they were thrown (type and text), and leave the
// thread clean: here the input-modified-in-place error.
TEST_F(ExceptionSafety, RematErrorFromRecomputeReachesTheCaller) {
  auto w = torch::randn({3}, torch::requires_grad());
  auto x = torch::randn({3});
  // Each thread keeps a copy of the last RNG state it captured (~5 KiB, see
  // replay.cpp): take it before the probe, as any earlier step would.
  remat::checkpoint([](torch::Tensor a) { return a.exp(); }, x);
  remat::memory::Probe probe;
  auto y = remat::checkpoint([w](torch::Tensor a) { return (a * w).exp(); }, x).sum();
  x.add_(1);
  const Ambient before = Ambient::now();
  try {
    y.backward();
    FAIL() << "no error";
  } catch (const remat::Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "[remat::checkpoint] input 0 of a checkpointed function was modified in place after the forward "
              "(version 0 -> 1); recomputing from it would give wrong gradients. Modify a clone instead, or keep "
              "the input unchanged until backward has run.");
  }
  const Ambient after = Ambient::now();
  expect_same_thread_state(before, after);
  EXPECT_TRUE(after.rng == before.rng);
  y = torch::Tensor();
  w.mutable_grad() = torch::Tensor();
  EXPECT_EQ(probe.delta_bytes(), 0);
}

// ---- the autocast cache after a recompute ----

// A recompute under the forward's autocast state fills autocast's cache with
// casts of the parameters; that cache maps a tensor to its cast without
// checking versions. If the recompute leaves them there, the next step's
// forward under autocast uses the casts of the previous step's weights
// (found by CheckpointRecomputeThrowUnderAutocast's leak check; fixed in
// ReplayGuard, which now ends its autocast region as torch.autocast does).
TEST(AutocastCache, RecomputeLeavesNoStaleCastsForTheNextStep) {
  remat::memory::enable_tracking();
  for (int mode = 0; mode < 2; ++mode) {
    SCOPED_TRACE(mode == 0 ? "remat::checkpoint per block" : "CheckpointedSequential");
    std::vector<std::vector<torch::Tensor>> finals;
    for (bool ckpt : {false, true}) {
      auto seq = make_mlp(4, 16, /*seed=*/3);
      remat::CheckpointedSequential net(seq, remat::SequentialOptions().segments(2));
      torch::optim::SGD opt(seq->parameters(), 0.5);
      auto gen = torch::make_generator<torch::CPUGeneratorImpl>(4);
      for (int step = 0; step < 4; ++step) {
        auto x = torch::randn({8, 16}, gen);
        opt.zero_grad();
        const int64_t before = remat::memory::current_bytes();
        at::autocast::set_autocast_enabled(at::kCPU, true);
        at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
        torch::Tensor y;
        if (!ckpt) {
          y = seq->forward(x);
        } else if (mode == 0) {
          y = x;
          for (size_t i = 0; i < seq->size(); i += 2) {
            auto pair = torch::nn::Sequential(*(seq->begin() + i), *(seq->begin() + i + 1));
            y = remat::checkpoint(pair, y);
          }
        } else {
          y = net->forward(x);
        }
        at::autocast::set_autocast_enabled(at::kCPU, false);
        at::autocast::clear_cache();  // the user's end of the autocast region
        y.to(torch::kFloat).square().mean().backward();
        ASSERT_FALSE(at::autocast::is_autocast_enabled(at::kCPU));
        y = torch::Tensor();
        opt.step();
        opt.zero_grad();
        if (step > 0) {  // step 0 profiles and fills first-use caches
          EXPECT_EQ(remat::memory::current_bytes() - before, 0) << "casts left in the autocast cache, step " << step;
        }
      }
      std::vector<torch::Tensor> w;
      for (auto& p : seq->parameters()) w.push_back(p.detach().clone());
      finals.push_back(std::move(w));
    }
    expect_bitwise_equal(finals[0], finals[1]);
  }
}

}  // namespace
