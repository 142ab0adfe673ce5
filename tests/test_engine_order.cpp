// A plain backward before the first checkpoint, in a process of its own:
// the stock autograd engine then starts the device threads (under a
// process-wide once flag) before remat's engine replaces it, and remat's
// engine must start its own (NOTE [device threads of remat's engine],
// src/core/hooks.cpp). On a GPU this order failed an INTERNAL ASSERT in
// Engine::ready_queue; on CPU it checks that nothing else changes.
// Its own binary: any earlier test in the process would install remat's
// engine first.
#include "common.h"

TEST(EngineOrder, PlainBackwardOnTheDeviceBeforeTheFirstCheckpoint) {
  const torch::Device dev = torch::cuda::is_available() ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
  torch::manual_seed(0);
  auto w = torch::randn({64, 64}, torch::TensorOptions().device(dev)).requires_grad_();
  auto x = torch::randn({32, 64}, torch::TensorOptions().device(dev));
  auto f = [&](const torch::Tensor& h) { return torch::gelu(torch::mm(h, w)); };
  f(x).sum().backward();  // the stock engine, device threads started
  auto plain = w.grad().clone();
  w.mutable_grad() = torch::Tensor();
  remat::checkpoint(f, x).sum().backward();  // remat's engine from here on
  EXPECT_TRUE(torch::equal(w.grad(), plain));
  w.mutable_grad() = torch::Tensor();
  remat::checkpoint(f, x).sum().backward();  // and again
  EXPECT_TRUE(torch::equal(w.grad(), plain)) << "on " << dev;
}
