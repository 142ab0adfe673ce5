// The module switch (remat::Checkpointable, enable/disable/describe_
// checkpointing, selectors) on a user's module tree and on remat's GPT and
// ResNet: gradients bitwise against plain, memory measured, errors pinned.
#include "common.h"

#include <filesystem>

#include <remat/models/gpt.h>
#include <remat/models/resnet.h>

using namespace remat_test;
namespace pol = remat::policy;
namespace sel = remat::select;

namespace user {

/** A user's block: x + W2 gelu(W1 x), with a named hidden layer. */
struct UserBlockImpl : torch::nn::Module, remat::Checkpointable {
  explicit UserBlockImpl(int64_t d)
      : up(register_module("up", torch::nn::Linear(d, 4 * d))),
        down(register_module("down", torch::nn::Linear(4 * d, d))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return checkpointed(
        [this](const torch::Tensor& h) {
          auto hidden = remat::checkpoint_name(torch::gelu(up(h)), "hidden");
          return h + down(hidden);
        },
        x);
  }
  torch::nn::Linear up, down;
};
TORCH_MODULE(UserBlock);

/** Two stages of blocks in ModuleLists, and a head: nothing remat ships. */
struct UserNetImpl : torch::nn::Module {
  explicit UserNetImpl(int64_t d) {
    for (auto* s : {&s1, &s2}) {
      *s = torch::nn::ModuleList();
      for (int i = 0; i < 2; ++i) (*s)->push_back(UserBlock(d));
    }
    register_module("s1", s1);
    register_module("s2", s2);
    head = register_module("head", torch::nn::Linear(d, 1));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto* s : {&s1, &s2}) {
      for (auto& m : **s) x = m->as<UserBlockImpl>()->forward(x);
    }
    return head(x);
  }
  torch::nn::ModuleList s1{nullptr}, s2{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(UserNet);

/** Six blocks; blocks.1 registered again as "alias", blocks.4 shared with a
 *  second parent ("inner"). LibTorch's named_modules() lists both under
 *  each name: 8 entries, 6 module objects. */
struct SharedNetImpl : torch::nn::Module {
  explicit SharedNetImpl(int64_t d) {
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 6; ++i) blocks->push_back(UserBlock(d));
    register_module("alias", blocks->ptr(1));
    inner = register_module("inner", torch::nn::ModuleList());
    inner->push_back(blocks->ptr(4));
  }
  torch::nn::ModuleList blocks{nullptr}, inner{nullptr};
};
TORCH_MODULE(SharedNet);

/** A Checkpointable whose forward does not go through checkpointed(). */
struct BypassBlockImpl : torch::nn::Module, remat::Checkpointable {
  BypassBlockImpl() : lin(register_module("lin", torch::nn::Linear(8, 8))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + torch::tanh(lin(x)); }
  torch::nn::Linear lin;
};
TORCH_MODULE(BypassBlock);

struct MixedNetImpl : torch::nn::Module {
  MixedNetImpl()
      : a(register_module("a", UserBlock(8))),
        bypass(register_module("bypass", BypassBlock())),
        b(register_module("b", UserBlock(8))) {}
  torch::Tensor forward(const torch::Tensor& x) { return b(bypass(a(x))); }
  UserBlock a;
  BypassBlock bypass;
  UserBlock b;
};
TORCH_MODULE(MixedNet);

}  // namespace user

namespace {
using user::BypassBlock;
using user::MixedNet;
using user::SharedNet;
using user::UserBlockImpl;
using user::UserNet;

std::vector<std::string> on_names(torch::nn::Module& m) {
  std::vector<std::string> out;
  for (const auto& item : m.named_modules()) {
    auto* c = dynamic_cast<remat::Checkpointable*>(item.value().get());
    if (c != nullptr && c->checkpointing()) out.push_back(item.key());
  }
  return out;
}

TEST(ModuleSwitch, SelectorsChooseTheRightBlocks) {
  UserNet net(16);
  using V = std::vector<std::string>;
  EXPECT_EQ(remat::enable_checkpointing(net, sel::type<UserBlockImpl>()), 4);
  EXPECT_EQ(on_names(*net), (V{"s1.0", "s1.1", "s2.0", "s2.1"}));
  EXPECT_EQ(remat::disable_checkpointing(net), 4);
  EXPECT_TRUE(on_names(*net).empty());
  remat::enable_checkpointing(net, sel::every_n(2, sel::type<UserBlockImpl>()));
  EXPECT_EQ(on_names(*net), (V{"s1.0", "s2.0"}));
  remat::disable_checkpointing(net);
  remat::enable_checkpointing(net, sel::name("s2.*"));
  EXPECT_EQ(on_names(*net), (V{"s2.0", "s2.1"}));
  remat::disable_checkpointing(net);
  remat::enable_checkpointing(net, sel::first_n(3));
  EXPECT_EQ(on_names(*net), (V{"s1.0", "s1.1", "s2.0"}));
  remat::enable_checkpointing(net, sel::name("s2.1"), remat::CheckpointOptions().policy(pol::save_names({"hidden"})));
  EXPECT_EQ(remat::describe_checkpointing(net),
            "user::UserNetImpl: 4 of 4 checkpointable modules on\n"
            "  s1.0  user::UserBlockImpl  on, full recompute\n"
            "  s1.1  user::UserBlockImpl  on, full recompute\n"
            "  s2.0  user::UserBlockImpl  on, full recompute\n"
            "  s2.1  user::UserBlockImpl  on, policy save_names(hidden)\n");
}

// Each module object once, at its first name, as Python's named_modules():
// every_n(2) over the 6 objects switches 3 on, and describe says 3.
// (Over the 8 names it switched 4 objects and describe listed 6 of 8 on.)
TEST(ModuleSwitch, AModuleReachedByTwoNamesCountsOnce) {
  SharedNet net(8);
  int64_t listed = 0;
  remat::enable_checkpointing(net, sel::predicate("count", [&](const torch::nn::Module&) {
                                ++listed;
                                return true;
                              }));
  EXPECT_EQ(listed, 6) << "each object once";
  EXPECT_EQ(remat::disable_checkpointing(net), 6);
  EXPECT_EQ(remat::enable_checkpointing(net, sel::every_n(2)), 3);
  EXPECT_EQ(remat::describe_checkpointing(net),
            "user::SharedNetImpl: 3 of 6 checkpointable modules on\n"
            "  blocks.0  user::UserBlockImpl  on, full recompute\n"
            "  blocks.1  user::UserBlockImpl  off (also as alias)\n"
            "  blocks.2  user::UserBlockImpl  on, full recompute\n"
            "  blocks.3  user::UserBlockImpl  off\n"
            "  blocks.4  user::UserBlockImpl  on, full recompute (also as inner.0)\n"
            "  blocks.5  user::UserBlockImpl  off\n");
  // A name selector sees the first name only.
  remat::disable_checkpointing(net);
  EXPECT_EQ(remat::enable_checkpointing(net, sel::name("blocks.*")), 6);
  const std::string none =
      "[remat::enable_checkpointing] the selector 'name alias' chose no module of user::SharedNetImpl.";
  EXPECT_EQ(error_of([&] { remat::enable_checkpointing(net, sel::name("alias")); }).substr(0, none.size()), none);
  EXPECT_EQ(remat::disable_checkpointing(net), 6);
  remat::enable_checkpointing(net, sel::first_n(2));
  EXPECT_EQ(on_names(*net), (std::vector<std::string>{"blocks.0", "blocks.1", "alias"}))
      << "LibTorch's own listing: the object is on under both names";
}

// Switched on, a block whose forward skips checkpointed() runs plain. The
// switch cannot tell before a forward; after one, the blocks that route
// through checkpointed() have counted calls and this one has not.
TEST(ModuleSwitch, DescribeMarksABlockWhoseForwardSkipsCheckpointed) {
  MixedNet net;
  EXPECT_EQ(remat::enable_checkpointing(net, sel::all()), 3);
  const std::string before =
      "user::MixedNetImpl: 3 of 3 checkpointable modules on\n"
      "  a  user::UserBlockImpl  on, full recompute\n"
      "  bypass  user::BypassBlockImpl  on, full recompute\n"
      "  b  user::UserBlockImpl  on, full recompute\n";
  EXPECT_EQ(remat::describe_checkpointing(net), before) << "no forward yet: nothing to tell";
  remat::reset_checkpoint_stats();
  net->forward(torch::randn({4, 8})).sum().backward();
  EXPECT_EQ(remat::checkpoint_stats().recomputations, 2) << "a and b; bypass ran plain";
  EXPECT_EQ(net->a->checkpointed_calls(), 1) << "the recompute calls the body, not checkpointed()";
  EXPECT_EQ(net->b->checkpointed_calls(), 1);
  EXPECT_EQ(net->bypass->checkpointed_calls(), 0);
  EXPECT_EQ(remat::describe_checkpointing(net),
            "user::MixedNetImpl: 3 of 3 checkpointable modules on, 1 of them not running through checkpointed()\n"
            "  a  user::UserBlockImpl  on, full recompute\n"
            "  bypass  user::BypassBlockImpl  on, full recompute, but no user::BypassBlockImpl has run through "
            "checkpointed() while other modules have: its forward must call checkpointed(), or the switch does "
            "nothing\n"
            "  b  user::UserBlockImpl  on, full recompute\n");
  // Off, it is not marked; calls are counted on or off.
  remat::disable_checkpointing(net);
  net->forward(torch::randn({4, 8}));
  EXPECT_EQ(net->a->checkpointed_calls(), 2);
  EXPECT_EQ(remat::describe_checkpointing(net),
            "user::MixedNetImpl: 0 of 3 checkpointable modules on\n"
            "  a  user::UserBlockImpl  off\n"
            "  bypass  user::BypassBlockImpl  off\n"
            "  b  user::UserBlockImpl  off\n");
  // By type: a block not called in a forward (only `a` runs here) is not
  // marked while another of its type was; the bypassing type is.
  MixedNet fresh;
  remat::enable_checkpointing(fresh, sel::all());
  fresh->a(torch::randn({4, 8}));
  EXPECT_EQ(fresh->b->checkpointed_calls(), 0);
  const std::string marked = remat::describe_checkpointing(fresh);
  EXPECT_NE(marked.find("1 of them not running through checkpointed()\n"), std::string::npos) << marked;
  EXPECT_NE(marked.find("\n  b  user::UserBlockImpl  on, full recompute\n"), std::string::npos) << marked;
  // A tree whose only checkpointable block skips checkpointed(): no module
  // has called it, so a forward cannot be told from none (documented).
  BypassBlock alone;
  remat::enable_checkpointing(alone, sel::all());
  alone->forward(torch::randn({4, 8}));
  EXPECT_EQ(remat::describe_checkpointing(alone),
            "user::BypassBlockImpl: 1 of 1 checkpointable modules on\n"
            "  (root)  user::BypassBlockImpl  on, full recompute\n");
}

TEST(ModuleSwitch, Errors) {
  UserNet net(8);
  EXPECT_EQ(error_of([&] { remat::enable_checkpointing(net, sel::name("blocks.*")); }),
            "[remat::enable_checkpointing] the selector 'name blocks.*' chose no module of user::UserNetImpl. "
            "Its checkpointable modules are:\n  s1.0  user::UserBlockImpl\n  s1.1  user::UserBlockImpl\n"
            "  s2.0  user::UserBlockImpl\n  s2.1  user::UserBlockImpl");
  torch::nn::Linear plain(4, 4);
  EXPECT_EQ(error_of([&] { remat::enable_checkpointing(plain, sel::all()); }),
            "[remat::enable_checkpointing] the selector 'all' chose no module of torch::nn::LinearImpl. The tree "
            "has no checkpointable module: derive the blocks from remat::Checkpointable and forward through "
            "checkpointed().");
  EXPECT_EQ(error_of([] { sel::every_n(0); }), "[remat::select::every_n] n must be at least 1, got 0.");
  EXPECT_EQ(error_of([] { sel::first_n(-1); }), "[remat::select::first_n] n must be at least 0, got -1.");
}

TEST(ModuleSwitch, UserTreeBitwiseUnderEverySelectionAndPolicy) {
  torch::manual_seed(1);
  UserNet net(32);
  auto x = torch::randn({16, 32}, torch::requires_grad());
  auto fwd = [&](torch::Tensor h) { return net->forward(h); };
  auto plain = step_grads(*net, x, fwd);
  const std::vector<std::pair<remat::Selector, remat::CheckpointOptions>> cases = {
      {sel::all(), remat::CheckpointOptions()},
      {sel::every_n(2), remat::CheckpointOptions().policy(pol::save_matmuls())},
      {sel::all(), remat::CheckpointOptions().policy(pol::save_names({"hidden"}))},
      {sel::name("s1.*"), remat::CheckpointOptions().policy(pol::save_nothing()).early_stop(false)},
  };
  for (const auto& [s, o] : cases) {
    remat::disable_checkpointing(net);
    remat::enable_checkpointing(net, s, o);
    remat::reset_checkpoint_stats();
    auto got = step_grads(*net, x, fwd);
    SCOPED_TRACE(s.description());
    expect_bitwise_equal(plain, got);
    EXPECT_GT(remat::checkpoint_stats().recomputations, 0);
  }
}

TEST(ModuleSwitch, ToggledBetweenStepsChangesMemoryNotGradients) {
  torch::manual_seed(2);
  UserNet net(64);
  auto x = torch::randn({256, 64}, torch::requires_grad());
  remat::memory::enable_tracking();
  auto step = [&](int64_t* held) {
    zero_grads(*net, x);
    const int64_t before = remat::memory::current_bytes();
    auto loss = net->forward(x).square().mean();
    *held = remat::memory::current_bytes() - before;
    loss.backward();
    return grads_of(*net, x);
  };
  int64_t plain = 0, full = 0, names = 0, off_again = 0;
  step(&plain);  // first-use allocations
  auto g_plain = step(&plain);
  // No RNG state to keep (no dropout): the figures are the activations alone.
  const auto o = remat::CheckpointOptions().preserve_rng_state(false);
  remat::enable_checkpointing(net, sel::type<UserBlockImpl>(), o);
  auto g_full = step(&full);
  remat::enable_checkpointing(net, sel::type<UserBlockImpl>(),
                              remat::CheckpointOptions(o).policy(pol::save_names({"hidden"})));
  auto g_names = step(&names);
  remat::disable_checkpointing(net);
  auto g_off = step(&off_again);
  expect_bitwise_equal(g_plain, g_full);
  expect_bitwise_equal(g_plain, g_names);
  expect_bitwise_equal(g_plain, g_off);
  EXPECT_EQ(off_again, plain);
  EXPECT_LT(full, names);
  EXPECT_LT(names, plain);
  // Per block, plain keeps up's output (GELU's input) and GELU's output
  // (down's input), 4 x 256 x 64 floats each; full recompute keeps neither
  // and save_names(hidden) keeps the GELU output only.
  const int64_t per = 4 * 256 * 64 * 4;
  EXPECT_EQ(plain - full, 4 * 2 * per) << "plain " << plain << " full " << full;
  EXPECT_EQ(names - full, 4 * per) << "names " << names;
}

TEST(ModuleSwitch, OffloadingSendsWhatABlockSavesToTheStoreBitwise) {
  torch::manual_seed(3);
  UserNet net(64);
  auto x = torch::randn({256, 64}, torch::requires_grad());
  remat::memory::enable_tracking();
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "switch_offload";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  size_t files_at_backward = 0;
  auto step = [&](int64_t* held) {
    zero_grads(*net, x);
    const int64_t before = remat::memory::current_bytes();
    auto loss = net->forward(x).square().mean();
    remat::wait_checkpoint_offloads();  // writes done: what stays is what the graph holds
    *held = remat::memory::current_bytes() - before;
    files_at_backward = static_cast<size_t>(std::distance(std::filesystem::directory_iterator(dir), {}));
    loss.backward();
    return grads_of(*net, x);
  };
  int64_t plain = 0, offloaded = 0, both = 0;
  step(&plain);  // first-use allocations
  auto g_plain = step(&plain);
  const auto disk = remat::OffloadOptions(remat::OffloadTarget::kDisk).directory(dir.string()).min_bytes(0);
  EXPECT_EQ(remat::enable_offloading(net, sel::name("s1.*"), disk), 2);
  EXPECT_NE(remat::describe_checkpointing(*net).find("s1.0  user::UserBlockImpl  off, saves offloaded (kDisk)"),
            std::string::npos)
      << remat::describe_checkpointing(*net);
  EXPECT_NE(remat::describe_checkpointing(*net).find("s2.0  user::UserBlockImpl  off\n"), std::string::npos);
  remat::reset_checkpoint_stats();
  auto g_off = step(&offloaded);
  EXPECT_EQ(remat::checkpoint_stats().recomputations, 0);
  EXPECT_GT(files_at_backward, 0u);
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir), {}), 0) << "files outlive the step";
  // s1's two blocks each kept up's output and GELU's output (256 x 256
  // floats each), and s1.1 its input, s1.0's output (256 x 64 floats), which
  // nothing else holds: all of it left memory.
  const int64_t per = 4 * 256 * 64 * 4;
  EXPECT_EQ(plain - offloaded, 2 * 2 * per + per / 4) << "plain " << plain << " offloaded " << offloaded;
  // A block switched on as well is checkpointed: the switch wins.
  remat::enable_checkpointing(net, sel::name("s1.0"), remat::CheckpointOptions().preserve_rng_state(false));
  remat::reset_checkpoint_stats();
  auto g_both = step(&both);
  EXPECT_EQ(remat::checkpoint_stats().recomputations, 1);
  EXPECT_EQ(remat::disable_checkpointing(net), 2);  // s1.0 (on) and s1.1 (offloading)
  EXPECT_EQ(remat::describe_checkpointing(*net).find("offloaded"), std::string::npos);
  int64_t off_again = 0;
  auto g_again = step(&off_again);
  EXPECT_EQ(off_again, plain);
  expect_bitwise_equal(g_plain, g_off);
  expect_bitwise_equal(g_plain, g_both);
  expect_bitwise_equal(g_plain, g_again);
  // A missing directory is refused before any module changes.
  const std::string missing = (dir / "missing").string();
  const std::string e = error_of([&] {
    remat::enable_offloading(net, sel::all(), remat::OffloadOptions(remat::OffloadTarget::kDisk).directory(missing));
  });
  EXPECT_NE(e.find(missing), std::string::npos) << e;
  EXPECT_EQ(remat::describe_checkpointing(*net).find("offloaded"), std::string::npos);
  EXPECT_EQ(error_of([&] { remat::enable_offloading(net, sel::name("blocks.*"), disk); }),
            "[remat::enable_offloading] the selector 'name blocks.*' chose no module of user::UserNetImpl. "
            "Its checkpointable modules are:\n  s1.0  user::UserBlockImpl\n  s1.1  user::UserBlockImpl\n"
            "  s2.0  user::UserBlockImpl\n  s2.1  user::UserBlockImpl");
}

TEST(ModuleSwitch, GptModelBitwiseWithTheMegatronPolicyAndDropout) {
  remat::models::GptConfig c;
  c.vocab = 50;
  c.seq_len = 32;
  c.d_model = 32;
  c.heads = 4;
  c.layers = 3;
  c.dropout = 0.1;
  torch::manual_seed(3);
  remat::models::Gpt gpt(c);
  auto idx = torch::randint(50, {2, 32}, torch::kLong);
  auto grads = [&] {
    for (auto& p : gpt->parameters()) p.mutable_grad() = torch::Tensor();
    torch::manual_seed(4);
    gpt->forward(idx).square().mean().backward();
    std::vector<torch::Tensor> g;
    for (auto& p : gpt->parameters()) g.push_back(p.grad().clone());
    return g;
  };
  auto plain = grads();
  for (const auto& p : {remat::models::megatron_policy(), pol::save_matmuls()}) {
    remat::enable_checkpointing(gpt, sel::type<remat::models::GptBlockImpl>(), remat::CheckpointOptions().policy(p));
    remat::reset_checkpoint_stats();
    auto got = grads();
    SCOPED_TRACE(p.description());
    expect_bitwise_equal(plain, got);
    EXPECT_EQ(remat::checkpoint_stats().recomputations, 3);
    EXPECT_GT(remat::checkpoint_stats().ops_replayed, 0);
  }
  // Megatron: the named linear layers are handed back, the attention core is recomputed.
  remat::enable_checkpointing(gpt, sel::type<remat::models::GptBlockImpl>(),
                              remat::CheckpointOptions().policy(remat::models::megatron_policy()));
  remat::reset_checkpoint_stats();
  grads();
  const auto s = remat::op_stats();
  EXPECT_EQ(s.at("aten::addmm").saved, 3 * 3);
  EXPECT_EQ(s.at("aten::addmm").replayed, 3 * 3);
  // The MLP's output projection runs again: its dropout saves a mask after it.
  EXPECT_EQ(s.at("aten::addmm").recomputed, 3);
  EXPECT_EQ(s.at("aten::bmm").recomputed, 3 * 2);
  EXPECT_EQ(s.at("aten::_softmax").recomputed, 3);
  // The old attention-only strategy, through the switch.
  remat::disable_checkpointing(gpt);
  remat::enable_checkpointing(gpt, sel::type<remat::models::CausalSelfAttentionImpl>());
  expect_bitwise_equal(plain, grads());
}

TEST(ModuleSwitch, ResNetWithBatchNormBitwiseAndStatsOnce) {
  remat::models::ResNetConfig c;
  c.depth = 10;
  c.width = 8;
  torch::manual_seed(5);
  remat::models::ResNet net(c);
  auto x = torch::randn({4, 3, 16, 16});
  std::vector<torch::Tensor> start;
  for (auto& b : net->buffers()) start.push_back(b.clone());
  auto run = [&] {
    {
      torch::NoGradGuard g;
      auto bufs = net->buffers();
      for (size_t i = 0; i < bufs.size(); ++i) bufs[i].copy_(start[i]);
    }
    for (auto& p : net->parameters()) p.mutable_grad() = torch::Tensor();
    net->forward(x).square().mean().backward();
    std::vector<torch::Tensor> g;
    for (auto& p : net->parameters()) g.push_back(p.grad().clone());
    for (auto& b : net->buffers()) g.push_back(b.clone());
    return g;
  };
  auto plain = run();
  remat::enable_checkpointing(net, sel::type<remat::models::ResBlockImpl>(),
                              remat::CheckpointOptions().policy(pol::save_matmuls()));
  expect_bitwise_equal(plain, run());
  remat::disable_checkpointing(net);
  remat::enable_checkpointing(net, sel::name("blocks.*.first"));
  expect_bitwise_equal(plain, run());
}

TEST(ModuleSwitch, NameAfterAnInPlaceWriteIsRefused) {
  // The C++ nn::Linear on a 3-d input adds its bias in place into the mm.
  torch::nn::Linear lin(8, 8);
  auto x = torch::randn({2, 3, 8}, torch::requires_grad());
  EXPECT_EQ(error_of([&] {
              remat::checkpoint(
                  remat::CheckpointOptions().policy(pol::save_names({"out"})),
                  [&](const torch::Tensor& h) { return remat::checkpoint_name(lin(h), "out").tanh(); }, x);
            }),
            "[remat::checkpoint_name] the policy 'save_names(out)' saves 'out', but aten::add_.Tensor wrote in place "
            "into the output of aten::mm before it was named, so no op's result holds those values (C++ "
            "torch::nn::Linear adds its bias in place on 3-d inputs). Name a tensor no in-place op has written "
            "(e.g. call torch::linear(x, weight, bias)), or save aten::mm by operator (policy::save_ops), which "
            "copies it before the write.");
  // torch::linear runs addmm: the name saves it.
  remat::reset_checkpoint_stats();
  auto y = remat::checkpoint(
      remat::CheckpointOptions().policy(pol::save_names({"out"})),
      [&](const torch::Tensor& h) {
        return remat::checkpoint_name(torch::linear(h, lin->weight, lin->bias), "out").tanh();
      },
      x);
  y.sum().backward();
  EXPECT_EQ(remat::op_stats().at("aten::addmm").saved, 1);
}

}  // namespace

namespace {

/** fc -> (training-only noise | BatchNorm | Dropout) -> tanh, through the switch. */
struct FlagBlockImpl : torch::nn::Module, remat::Checkpointable {
  explicit FlagBlockImpl(std::string layer)
      : layer(std::move(layer)),
        fc(register_module("fc", torch::nn::Linear(32, 32))),
        bn(register_module("bn", torch::nn::BatchNorm1d(32))),
        drop(register_module("drop", torch::nn::Dropout(0.3))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return checkpointed(
        [this](const torch::Tensor& h) {
          auto z = fc(h);
          if (layer == "noise") {
            if (is_training()) z = z + 0.5 * torch::randn_like(z);  // a module's own training-only branch
          } else {
            z = layer == "bn" ? bn(z) : drop(z);
          }
          return torch::tanh(z);
        },
        x);
  }
  std::string layer;
  torch::nn::Linear fc;
  torch::nn::BatchNorm1d bn;
  torch::nn::Dropout drop;
};
TORCH_MODULE(FlagBlock);

}  // namespace

// An evaluation pass between forward and backward (eval(), a no-grad
// forward, train() only after backward): the recompute runs with the
// train/eval flags the forward ran with, so the gradients are the plain
// step's. It ran in eval mode: a training-only branch silently gave other
// gradients (a new user's fc.weight.grad sum 1.738 against 1.073), and
// BatchNorm failed the determinism check, or with kNone crashed in its
// backward. A module kept in eval while the block trains (frozen
// statistics) keeps its own flag, and after backward every flag is the
// one the user set.
TEST(ModuleSwitch, ARecomputeAfterAnEvalPassRunsInTheForwardsMode) {
  for (const std::string layer : {"noise", "bn", "dropout"}) {
    for (const bool frozen_bn : {false, true}) {
      std::vector<torch::Tensor> grads[3];
      for (int variant = 0; variant < 3; ++variant) {
        SCOPED_TRACE(layer + (frozen_bn ? ", BatchNorm frozen" : "") + ", variant " + std::to_string(variant));
        torch::manual_seed(0);
        FlagBlock b(layer);
        if (variant == 1) b->set_checkpointing(remat::CheckpointOptions());
        if (variant == 2) {
          b->set_checkpointing(remat::CheckpointOptions().determinism_check(remat::DeterminismCheck::kNone));
        }
        if (frozen_bn) b->bn->eval();
        const auto x = torch::randn({16, 32});
        torch::manual_seed(1);
        auto loss = b->forward(x).square().mean();
        b->eval();
        {
          torch::NoGradGuard no_grad;
          (void)b->forward(torch::randn({4, 32}));
        }
        loss.backward();
        EXPECT_FALSE(b->is_training());
        EXPECT_FALSE(b->bn->is_training());
        EXPECT_FALSE(b->fc->is_training());
        b->train();
        if (frozen_bn) b->bn->eval();
        for (auto& p : b->parameters())
          grads[variant].push_back(p.grad().defined() ? p.grad().clone() : torch::zeros({0}));
        for (auto& t : b->buffers()) grads[variant].push_back(t.clone());
      }
      expect_bitwise_equal(grads[0], grads[1]);
      expect_bitwise_equal(grads[0], grads[2]);
    }
  }
}

// The same for CheckpointedSequential's stages, checkpoint_sequential over
// modules and remat::checkpoint of a module holder: each re-runs with the
// flags of its forward.
TEST(ModuleSwitch, ChainStagesRecomputeAfterAnEvalPassInTheForwardsMode) {
  auto make = [] {
    torch::manual_seed(3);
    return torch::nn::Sequential(torch::nn::Linear(32, 32), torch::nn::BatchNorm1d(32), torch::nn::Tanh(),
                                 torch::nn::Dropout(0.3), torch::nn::Linear(32, 32), torch::nn::BatchNorm1d(32),
                                 torch::nn::Tanh(), torch::nn::Dropout(0.3), torch::nn::Linear(32, 8));
  };
  const auto x = torch::randn({16, 32});
  auto run = [&](int how) {
    auto seq = make();
    std::optional<remat::CheckpointedSequential> chain;
    if (how == 1) chain.emplace(seq, remat::SequentialOptions().algorithm("sqrt"));
    torch::manual_seed(1);
    torch::Tensor y;
    if (how == 0) y = seq->forward(x);
    if (how == 1) y = (*chain)->forward(x);
    if (how == 2) y = remat::checkpoint_sequential(seq, 3, x);
    if (how == 3) y = remat::checkpoint(seq, x);  // a module holder as fn
    auto loss = y.square().mean();
    seq->eval();
    {
      torch::NoGradGuard no_grad;
      (void)seq->forward(torch::randn({4, 32}));
    }
    loss.backward();
    EXPECT_FALSE(seq->is_training());
    std::vector<torch::Tensor> out;
    for (auto& p : seq->parameters()) out.push_back(p.grad().clone());
    for (auto& t : seq->buffers()) out.push_back(t.clone());
    return out;
  };
  const auto plain = run(0);
  expect_bitwise_equal(plain, run(1));
  expect_bitwise_equal(plain, run(2));
  expect_bitwise_equal(plain, run(3));
}
