// remat::parallel::FullyShard as programs outside remat use it, on one rank
// (in process, over a FileStore): frozen parameters beside trainable ones in a
// unit (LoRA), evaluation forwards between backward and the optimizer step,
// loading shards after an evaluation, a unit's module called from outside the
// unit, and bad values. One rank's reduce-scatter is a copy and AdamW is
// elementwise, so each run is compared bitwise with the same model unsharded.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>
#include <torch/utils.h>

#include <remat/checkpointable.h>
#include <remat/error.h>
#include <remat/models/gpt.h>
#include <remat/parallel/fully_shard.h>

#include "../common.h"
#include "fsdp_model.h"

namespace {

using remat::parallel::FullyShard;
using remat::parallel::FullyShardOptions;
using remat::parallel::InitOptions;
using remat_test::error_of;

remat::parallel::ProcessGroup one_rank(const std::string& name) {
  return remat::parallel::init_process_group(
      InitOptions(0, 1).file_store(remat_test::fresh_dir(name) + "/store").timeout(std::chrono::milliseconds(10000)));
}

/** A LoRA unit: a frozen Linear plus a trainable low-rank branch. */
struct LoraImpl : torch::nn::Module, remat::Checkpointable {
  LoraImpl(int64_t d, int64_t r)
      : base(register_module("base", torch::nn::Linear(d, d))),
        a(register_module("a", torch::nn::Linear(torch::nn::LinearOptions(d, r).bias(false)))),
        b(register_module("b", torch::nn::Linear(torch::nn::LinearOptions(r, d).bias(false)))) {
    for (auto& p : base->parameters()) p.set_requires_grad(false);
  }
  at::Tensor forward(const at::Tensor& x) {
    return checkpointed([this](const at::Tensor& h) { return torch::tanh(base(h) + b(a(h))); }, x);
  }
  torch::nn::Linear base, a, b;
};
TORCH_MODULE(Lora);

/** A trainable layer, two LoRA units, a trainable head: the units' inputs
 *  need their gradient, which their frozen weights give. */
struct LoraNetImpl : torch::nn::Module {
  LoraNetImpl()
      : first(register_module("first", torch::nn::Linear(16, 32))),
        l1(register_module("l1", Lora(32, 4))),
        l2(register_module("l2", Lora(32, 4))),
        head(register_module("head", torch::nn::Linear(32, 8))) {}
  at::Tensor forward(const at::Tensor& x) { return head(l2(l1(first(x)))); }
  torch::nn::Linear first;
  Lora l1, l2;
  torch::nn::Linear head;
};
TORCH_MODULE(LoraNet);

LoraNet lora_net() {
  torch::manual_seed(5);
  return LoraNet();
}

std::vector<at::Tensor> values_of(const std::vector<at::Tensor>& ps) {
  std::vector<at::Tensor> out;
  for (const auto& p : ps) out.push_back(p.detach().clone());
  return out;
}

/** Three AdamW steps (weight decay on) of a LoRA net, sharded and plain:
 *  bitwise equal, the frozen weights unchanged. */
void expect_lora_trains_as_plain(bool checkpointed) {
  auto group = one_rank(checkpointed ? "lora_ckpt" : "lora");
  auto plain = lora_net(), sharded = lora_net();
  if (checkpointed) {
    remat::enable_checkpointing(plain, remat::select::all());
    remat::enable_checkpointing(sharded, remat::select::all());
  }
  const auto initial = values_of(plain->parameters());
  FullyShard fsdp(sharded.ptr(), group);
  ASSERT_EQ(fsdp.units().size(), 3u);  // root (first, head), l1, l2
  // Per LoRA unit a trainable shard and a frozen one.
  ASSERT_EQ(fsdp.parameters().size(), 5u);
  int frozen_shards = 0;
  for (const auto& s : fsdp.parameters()) frozen_shards += !s.requires_grad();
  EXPECT_EQ(frozen_shards, 2);
  const auto o = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  torch::optim::AdamW opt_plain(plain->parameters(), o), opt_sharded(fsdp.parameters(), o);
  for (int step = 0; step < 3; ++step) {
    auto x = torch::randn({4, 16});
    opt_plain.zero_grad();
    opt_sharded.zero_grad();
    plain->forward(x).square().mean().backward();
    fsdp.forward([&] { return sharded->forward(x).square().mean(); }).backward();
    EXPECT_EQ(fsdp.memory().gathered_bytes, 0) << "every unit freed after backward";
    opt_plain.step();
    opt_sharded.step();
  }
  const std::string path = remat_test::fresh_dir(checkpointed ? "lora_ckpt_full" : "lora_full") + "/full.pt";
  fsdp.save_full(path);
  auto back = lora_net();
  torch::load(back, path);
  const auto pp = plain->named_parameters(), bp = back->named_parameters();
  ASSERT_EQ(pp.size(), bp.size());
  for (size_t i = 0; i < pp.size(); ++i) {
    EXPECT_TRUE(torch::equal(pp[i].value(), bp[i].value())) << pp[i].key();
    if (pp[i].key().find("base") != std::string::npos) {
      EXPECT_TRUE(torch::equal(bp[i].value(), initial[i])) << pp[i].key() << " is frozen and moved";
    } else {
      EXPECT_FALSE(torch::equal(bp[i].value(), initial[i])) << pp[i].key() << " trains";
    }
  }
}

TEST(FullyShardUse, FrozenParametersInAUnitNeverMoveAndTheRestTrainsAsPlain) { expect_lora_trains_as_plain(false); }
TEST(FullyShardUse, FrozenParametersInACheckpointedUnitNeverMoveAndTheRestTrainsAsPlain) {
  expect_lora_trains_as_plain(true);
}

/** A root with a frozen embedding and a frozen layer after the units, a
 *  trainable head; the units train. */
struct FrozenRootNetImpl : torch::nn::Module {
  FrozenRootNetImpl()
      : emb(register_module("emb", torch::nn::Embedding(16, 32))),
        l1(register_module("l1", Lora(32, 4))),
        l2(register_module("l2", Lora(32, 4))),
        mid(register_module("mid", torch::nn::Linear(32, 32))),
        head(register_module("head", torch::nn::Linear(32, 8))) {
    for (auto& p : emb->parameters()) p.set_requires_grad(false);
    for (auto& p : mid->parameters()) p.set_requires_grad(false);
  }
  at::Tensor forward(const at::Tensor& ids) { return head(torch::tanh(mid(l2(l1(emb(ids)))))); }
  torch::nn::Embedding emb;
  Lora l1, l2;
  torch::nn::Linear mid, head;
};
TORCH_MODULE(FrozenRootNet);

// The root was freed once the head's gradient reduced its trainable part,
// while the frozen layer after the units still had its backward to run
// (c10's "out of bounds for storage of size 0" in backward). It stays to
// the backward's end; three AdamW steps are bitwise plain's.
TEST(FullyShardUse, AFrozenRootLayerAfterTheUnitsIsKeptForItsBackward) {
  auto group = one_rank("frozen_root");
  torch::manual_seed(9);
  FrozenRootNet plain;
  torch::manual_seed(9);
  FrozenRootNet sharded;
  FullyShard fsdp(sharded.ptr(), group);
  const auto o = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  torch::optim::AdamW opt_plain(plain->parameters(), o), opt_sharded(fsdp.parameters(), o);
  for (int step = 0; step < 3; ++step) {
    const auto ids = torch::randint(16, {4, 5}, torch::kLong);
    opt_plain.zero_grad();
    opt_sharded.zero_grad();
    plain->forward(ids).square().mean().backward();
    fsdp.forward([&] { return sharded->forward(ids).square().mean(); }).backward();
    opt_plain.step();
    opt_sharded.step();
  }
  torch::NoGradGuard no_grad;
  const auto ids = torch::randint(16, {4, 5}, torch::kLong);
  EXPECT_TRUE(torch::equal(plain->forward(ids), fsdp.forward([&] { return sharded->forward(ids); })));
}

// NOTE [writes into gathered parameters]: Embedding's max_norm renormalises
// the rows it reads in place; under FullyShard the write went to the
// gathered copy and was lost (the embedding 3.05 off plain after one SGD
// step). Refused after the forward that wrote, before its backward; the
// next forward starts clean.
TEST(FullyShardUse, AWriteIntoAGatheredParameterInForwardIsRefused) {
  auto group = one_rank("max_norm");
  torch::manual_seed(3);
  auto emb = torch::nn::Embedding(torch::nn::EmbeddingOptions(16, 32).max_norm(0.5));
  auto net = torch::nn::Sequential(emb, Lora(32, 4), torch::nn::Linear(32, 8));
  FullyShard fsdp(net.ptr(), group);
  const auto ids = torch::randint(16, {4, 5}, torch::kLong);
  const std::string e = error_of([&] { fsdp.forward([&] { return net->forward(ids).square().mean(); }); });
  EXPECT_NE(e.find("[remat::parallel] FullyShard: parameter '0.weight' of unit '"), std::string::npos) << e;
  EXPECT_NE(e.find("' was written in place while gathered (a module that changes its own weights in forward, as "
                   "Embedding's max_norm does, or a write between steps); the write went to the gathered copy, "
                   "which FullyShard frees, not to the shard the optimizer holds, so it would be lost. Drop the "
                   "in-place write (e.g. Embedding without max_norm), or write into the shards of "
                   "FullyShard::parameters()."),
            std::string::npos)
      << e;
  emb->options.max_norm(std::nullopt);
  const auto loss = fsdp.forward([&] { return net->forward(ids).square().mean(); });
  loss.backward();
  EXPECT_TRUE(std::isfinite(loss.item<double>())) << "the next forward runs as usual";
}

/** Throws in its backward (a NaN check of the user's own). */
struct ThrowInBackward : torch::autograd::Function<ThrowInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list) {
    throw std::runtime_error("a NaN in the gradient");
  }
};

// A backward that throws leaves the ranks' collectives where each stopped:
// the next forward is refused with what to do (it advised sharding the
// same model again, whose parameters hold no data: a crash).
TEST(FullyShardUse, AForwardAfterABackwardThatThrewSaysHowToRecover) {
  auto group = one_rank("threw_in_backward");
  auto net = lora_net();
  FullyShard fsdp(net.ptr(), group);
  const auto x = torch::randn({4, 16});
  const std::string first = error_of([&] {  // thrown after unit l2's backward began
    fsdp.forward([&] { return net->head(net->l2(ThrowInBackward::apply(net->l1(net->first(x))))).square().mean(); })
        .backward();
  });
  EXPECT_NE(first.find("a NaN in the gradient"), std::string::npos) << first;
  EXPECT_EQ(error_of([&] { fsdp.forward([&] { return net->forward(x).sum(); }); }),
            "[remat::parallel] FullyShard::forward ran before the last backward through it ended (it is still "
            "running, or an error stopped it); finish the backward first. After an error in backward, rebuild the "
            "model, load the last save_sharded() or save_full() into it and shard that: this model's parameters "
            "hold no data.");
}

/** The GPT's loss on tokens tok, read under no gradient. */
at::Tensor eval_loss(remat::models::Gpt& gpt, const at::Tensor& tok) {
  auto x = tok.slice(1, 0, 32), y = tok.slice(1, 1, 33);
  return gpt->loss(gpt->blocks->forward(gpt->embed(x)), y);
}

enum class Opt { kAdamW, kSgd, kSgdMomentum };

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Opt o, const std::vector<at::Tensor>& params) {
  if (o == Opt::kAdamW) return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-2));
  // SGD writes through p.data(), whose version counter is not the parameter's.
  return std::make_unique<torch::optim::SGD>(
      params, torch::optim::SGDOptions(0.1).momentum(o == Opt::kSgdMomentum ? 0.9 : 0.0));
}

/** Steps where an evaluation forward runs between backward and the
 *  optimizer's step (without gradient, or with it and dropped), as plain:
 *  the evaluations read the current shards, and training matches bitwise. */
void expect_evaluations_read_current_shards(const FullyShardOptions& options, bool eval_with_grad,
                                            const std::string& tag, Opt kind = Opt::kAdamW) {
  auto group = one_rank(tag);
  auto plain = worker::fsdp_gpt(), sharded = worker::fsdp_gpt();
  FullyShard fsdp(sharded.ptr(), group, options);
  auto opt_plain_ptr = make_optimizer(kind, plain->parameters());
  auto opt_sharded_ptr = make_optimizer(kind, fsdp.parameters());
  torch::optim::Optimizer &opt_plain = *opt_plain_ptr, &opt_sharded = *opt_sharded_ptr;
  const auto eval_tok = torch::randint(64, {2, 33}, torch::kLong);
  for (int step = 0; step < 3; ++step) {
    auto tok = torch::randint(64, {2, 33}, torch::kLong);
    opt_plain.zero_grad();
    opt_sharded.zero_grad();
    eval_loss(plain, tok).backward();
    fsdp.forward([&] { return eval_loss(sharded, tok); }).backward();
    {
      std::optional<torch::NoGradGuard> no_grad;
      if (!eval_with_grad) no_grad.emplace();
      const auto a = eval_loss(plain, eval_tok);
      const auto b = fsdp.forward([&] { return eval_loss(sharded, eval_tok); });
      EXPECT_TRUE(torch::equal(a, b)) << tag << ", step " << step << ": " << a.item<double>() << " vs "
                                      << b.item<double>();
    }
    if (!eval_with_grad) {
      EXPECT_EQ(fsdp.memory().gathered_bytes, 0) << "an evaluation leaves nothing gathered";
    }
    opt_plain.step();
    opt_sharded.step();
  }
  torch::NoGradGuard no_grad;
  const auto a = eval_loss(plain, eval_tok);
  const auto b = fsdp.forward([&] { return eval_loss(sharded, eval_tok); });
  EXPECT_TRUE(torch::equal(a, b)) << a.item<double>() << " vs " << b.item<double>();
}

TEST(FullyShardUse, NoGradEvaluationBetweenBackwardAndStepReadsTheCurrentShards) {
  expect_evaluations_read_current_shards(FullyShardOptions(), false, "eval_no_grad");
}
TEST(FullyShardUse, EvaluationWithGradientReadsTheCurrentShardsOfUnitsKeptGathered) {
  expect_evaluations_read_current_shards(FullyShardOptions().reshard_after_forward(false), true, "eval_grad");
}
// NOTE [stale gathered values]: LibTorch's SGD steps through p.data(), which
// left the shard's version as it was: the units (and the root) an evaluation
// with gradient left gathered served the values before the step (4.1726 for
// 4.1365 here). Two ranks: FullyShardProcesses.TwoRanksWithSgd...
TEST(FullyShardUse, EvaluationWithGradientThenAnSgdStepReadsTheCurrentShards) {
  expect_evaluations_read_current_shards(FullyShardOptions().reshard_after_forward(false), true, "eval_grad_sgd",
                                         Opt::kSgdMomentum);
  expect_evaluations_read_current_shards(FullyShardOptions(), true, "eval_grad_sgd0", Opt::kSgd);
  expect_evaluations_read_current_shards(FullyShardOptions(), false, "eval_no_grad_sgd", Opt::kSgd);
}

TEST(FullyShardUse, LoadShardedAfterAnEvaluationReadsTheLoadedShards) {
  auto group = one_rank("load_after_eval");
  const std::string prefix = remat_test::fresh_dir("load_after_eval_files") + "/ckpt";
  auto gpt = worker::fsdp_gpt();
  FullyShard fsdp(gpt.ptr(), group, FullyShardOptions().reshard_after_forward(false));
  torch::optim::AdamW opt(fsdp.parameters(), torch::optim::AdamWOptions(1e-2));
  const auto tok = torch::randint(64, {2, 33}, torch::kLong);
  auto train = [&] {
    opt.zero_grad();
    fsdp.forward([&] { return eval_loss(gpt, tok); }).backward();
    opt.step();
  };
  train();
  fsdp.save_sharded(prefix);
  torch::NoGradGuard no_grad;
  const auto saved = fsdp.forward([&] { return eval_loss(gpt, tok); });
  {
    torch::AutoGradMode grad(true);
    train();
    // An evaluation with gradient, dropped: the units stay gathered.
    const auto moved = fsdp.forward([&] { return eval_loss(gpt, tok); });
    EXPECT_FALSE(torch::equal(saved, moved.detach()));
  }
  fsdp.load_sharded(prefix);
  const auto back = fsdp.forward([&] { return eval_loss(gpt, tok); });
  EXPECT_TRUE(torch::equal(saved, back)) << saved.item<double>() << " vs " << back.item<double>();
}

/** A GPT whose own code calls a block's MLP outside the block. */
TEST(FullyShardUse, AUnitsModuleCalledOutsideTheUnitIsRefusedByName) {
  auto group = one_rank("outside");
  auto gpt = worker::fsdp_gpt();
  FullyShard fsdp(gpt.ptr(), group, FullyShardOptions().units(remat::select::type<remat::models::GptBlockImpl>()));
  const auto tok = torch::randint(64, {2, 33}, torch::kLong);
  auto x = tok.slice(1, 0, 32), y = tok.slice(1, 1, 33);
  auto mlp = gpt->blocks[0]->as<remat::models::GptBlockImpl>()->mlp;
  EXPECT_EQ(error_of([&] { fsdp.forward([&] { return gpt->loss(mlp->forward(gpt->embed(x)), y); }); }),
            "[remat::parallel] FullyShard: the forward read a parameter of a unit while the unit was sharded "
            "(sharded then: 'blocks.0', 'blocks.1', 'blocks.2', 'blocks.3'). A unit's parameters hold data only "
            "while its own forward runs: a module of a unit was called from outside the unit (by the model's own "
            "code, or by another unit). Call it only from inside the unit's forward, or choose units "
            "(FullyShardOptions::units) that hold every module the model calls directly.");
  // Nothing was lost: the model trains through its units.
  auto plain = worker::fsdp_gpt();
  const auto a = plain->loss(plain->blocks->forward(plain->embed(x)), y);
  const auto b = fsdp.forward([&] { return eval_loss(gpt, tok); });
  b.backward();
  EXPECT_TRUE(torch::equal(a, b.detach()));
  EXPECT_EQ(fsdp.memory().gathered_bytes, 0);
}

/** A unit whose forward throws while `fail` is set. */
struct BreakableImpl : torch::nn::Module, remat::Checkpointable {
  BreakableImpl() : fc(register_module("fc", torch::nn::Linear(16, 16))) {}
  at::Tensor forward(const at::Tensor& x) {
    return checkpointed(
        [this](const at::Tensor& h) {
          if (fail) throw std::runtime_error("a forward that throws");
          return torch::tanh(fc(h));
        },
        x);
  }
  torch::nn::Linear fc;
  bool fail = false;
};
TORCH_MODULE(Breakable);

struct FourUnitsImpl : torch::nn::Module {
  FourUnitsImpl() {
    torch::manual_seed(9);
    for (int i = 0; i < 4; ++i) units.push_back(register_module("u" + std::to_string(i), Breakable()));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& u : units) x = u(x);
    return x;
  }
  std::vector<Breakable> units;
};
TORCH_MODULE(FourUnits);

// A unit's forward throws (the caller catches it) while the next unit is
// being prefetched: the failed step leaves nothing gathered, and the next
// step gathers every unit once, as usual, training as plain.
TEST(FullyShardUse, AFailedForwardFreesWhatItPrefetched) {
  auto group = one_rank("failed_prefetch");
  FourUnits plain, sharded;
  FullyShard fsdp(sharded.ptr(), group);  // prefetch on (64 MiB)
  torch::optim::SGD opt_plain(plain->parameters(), 0.1), opt_sharded(fsdp.parameters(), 0.1);
  auto step = [&](const at::Tensor& x) {
    opt_plain.zero_grad();
    opt_sharded.zero_grad();
    plain->forward(x).square().mean().backward();
    fsdp.forward([&] { return sharded->forward(x).square().mean(); }).backward();
    opt_plain.step();
    opt_sharded.step();
  };
  step(torch::randn({8, 16}));  // the units' order is known from here on: prefetch
  fsdp.reset_stats();
  step(torch::randn({8, 16}));
  const auto usual = fsdp.stats();
  ASSERT_EQ(usual.forward_allgathers, 4);
  sharded->units[1]->fail = true;
  EXPECT_EQ(error_of([&] { fsdp.forward([&] {
                             return sharded->forward(torch::randn({8, 16})).sum();
                           }); }),
            "a forward that throws");
  EXPECT_EQ(fsdp.memory().gathered_bytes, 0) << "the prefetched unit is freed";
  sharded->units[1]->fail = false;
  fsdp.reset_stats();
  step(torch::randn({8, 16}));
  EXPECT_EQ(fsdp.stats().forward_allgathers, 4);
  EXPECT_EQ(fsdp.stats().backward_allgathers, 4);
  EXPECT_EQ(fsdp.stats().max_gathered_bytes, usual.max_gathered_bytes) << "no more gathered at once than usual";
  EXPECT_EQ(fsdp.memory().gathered_bytes, 0);
  const auto a = plain->parameters();
  FourUnits back;
  const std::string path = remat_test::fresh_dir("failed_prefetch_full") + "/full.pt";
  fsdp.save_full(path);
  torch::load(back, path);
  const auto c = back->parameters();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], c[i])) << i;
}

TEST(FullyShardUse, BadValuesAreRefusedBeforeAnythingChanges) {
  auto group = one_rank("bad_values");
  auto gpt = worker::fsdp_gpt();
  FullyShard fsdp(gpt.ptr(), group);
  const auto tok = torch::randint(64, {2, 33}, torch::kLong);
  fsdp.forward([&] { return eval_loss(gpt, tok); }).backward();
  std::vector<at::Tensor> grads;
  for (const auto& s : fsdp.parameters()) grads.push_back(s.grad().clone());
  for (double bad : {-1.0, 0.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    EXPECT_EQ(error_of([&] { fsdp.clip_grad_norm(bad); }), "[remat::parallel] FullyShard::clip_grad_norm: max_norm " +
                                                               std::to_string(bad) +
                                                               " must be a positive finite number.");
  }
  for (size_t i = 0; i < grads.size(); ++i) EXPECT_TRUE(torch::equal(grads[i], fsdp.parameters()[i].grad()));
  // Unfreezing (or freezing) after sharding: the shards were cut by requires_grad.
  gpt->wte->weight.set_requires_grad(false);
  EXPECT_EQ(error_of([&] { fsdp.forward([&] { return eval_loss(gpt, tok); }); }),
            "[remat::parallel] FullyShard: parameter 'wte.weight' of unit '(root)' is frozen now but required grad "
            "when the model was sharded; set requires_grad before constructing FullyShard (it cuts each unit's "
            "buffers and the optimizer's shards by it), or shard the model again.");
  gpt->wte->weight.set_requires_grad(true);
  fsdp.forward([&] { return eval_loss(gpt, tok); }).backward();
  EXPECT_EQ(fsdp.memory().gathered_bytes, 0);
}

}  // namespace
