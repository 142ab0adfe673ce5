// remat::SavedTensorsHooks and the hook stack: pack/unpack counts, nesting
// (innermost applies), DisableHooks, threads, and hooks transforming values.
#include "common.h"

#include <thread>

namespace {

TEST(Hooks, PackUnpackCalledPerSavedTensor) {
  int packs = 0, unpacks = 0;
  std::vector<torch::Tensor> packed;
  auto x = torch::randn({5}, torch::requires_grad());
  torch::Tensor y;
  {
    // The packed value is a copy: backward must use what unpack returns.
    remat::SavedTensorsHooks g(
        [&](const at::Tensor& t) {
          ++packs;
          packed.push_back(t.detach());
          return t.detach().clone();
        },
        [&](const at::Tensor& t) {
          ++unpacks;
          return t;
        });
    y = x.exp().sin().sum();  // exp saves its result, sin its input: the same tensor
  }
  EXPECT_EQ(packs, 2);
  ASSERT_EQ(packed.size(), 2u);
  EXPECT_TRUE(torch::equal(packed[0], x.detach().exp()));
  EXPECT_TRUE(torch::equal(packed[1], x.detach().exp()));
  EXPECT_EQ(unpacks, 0);
  y.backward();
  EXPECT_EQ(unpacks, 2);
  auto e = x.detach().exp();
  EXPECT_TRUE(torch::allclose(x.grad(), e.cos() * e));
}

TEST(Hooks, InnermostAppliesAndDisable) {
  std::vector<std::string> log;
  auto x = torch::randn({3}, torch::requires_grad());
  auto make = [&](std::string name) {
    return std::make_unique<remat::SavedTensorsHooks>(
        [&log, name](const at::Tensor& t) {
          log.push_back("pack " + name);
          return t;
        },
        [&log, name](const at::Tensor& t) {
          log.push_back("unpack " + name);
          return t;
        });
  };
  torch::Tensor y;
  {
    auto outer = make("outer");
    auto a = x.exp();
    {
      auto inner = make("inner");
      a = a.exp();
      {
        remat::DisableHooks off;
        EXPECT_EQ(remat::current_hooks(), nullptr);
        a = a.exp();
      }
      EXPECT_NE(remat::current_hooks(), nullptr);
    }
    y = a.sum();
  }
  EXPECT_EQ(remat::current_hooks(), nullptr);
  EXPECT_EQ(log, (std::vector<std::string>{"pack outer", "pack inner"}));
  y.backward();
  // Each saved tensor is unpacked by the hooks that packed it, innermost
  // first (backward runs the later exp first); the disabled one by none.
  EXPECT_EQ(log, (std::vector<std::string>{"pack outer", "pack inner", "unpack inner", "unpack outer"}));
  auto e3 = x.detach().exp().exp().exp();
  EXPECT_TRUE(torch::allclose(x.grad(), e3 * x.detach().exp().exp() * x.detach().exp()));
}

TEST(Hooks, PackedValueMayBeAnyType) {
  // Store saved tensors as bf16 and restore them in float: gradients then
  // differ from the exact ones by bf16 rounding only.
  auto x = torch::randn({64}, torch::requires_grad());
  torch::Tensor y;
  {
    remat::SavedTensorsHooks g([](const at::Tensor& t) { return std::make_pair(t.to(at::kBFloat16), t.scalar_type()); },
                               [](const std::pair<at::Tensor, at::ScalarType>& p) { return p.first.to(p.second); });
    y = x.exp().sum();
  }
  y.backward();
  auto exact = x.detach().exp();
  EXPECT_FALSE(torch::equal(x.grad(), exact));
  EXPECT_TRUE(torch::allclose(x.grad(), exact, 1e-2, 1e-2));
}

TEST(Hooks, StackIsPerThread) {
  int packs = 0;
  remat::SavedTensorsHooks g(
      [&](const at::Tensor& t) {
        ++packs;
        return t;
      },
      [](const at::Tensor& t) { return t; });
  std::thread other([] {
    EXPECT_EQ(remat::current_hooks(), nullptr);
    auto x = torch::randn({3}, torch::requires_grad());
    x.exp().sum().backward();
  });
  other.join();
  EXPECT_EQ(packs, 0);
}

}  // namespace
