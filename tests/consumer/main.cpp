// Consumer check: checkpoint an MLP layer and a planned chain through the
// installed headers and libraries; exit 0 when gradients match a plain run.
#include <remat/remat.h>
#include <remat/sequential.h>
#include <torch/torch.h>

#include <cstdio>

int main() {
  torch::manual_seed(0);
  torch::nn::Sequential seq(torch::nn::Linear(8, 8), torch::nn::Tanh(), torch::nn::Linear(8, 8), torch::nn::Tanh());
  auto x = torch::randn({4, 8}, torch::requires_grad());
  seq->forward(x).square().sum().backward();
  auto plain = x.grad().clone();
  x.mutable_grad() = torch::Tensor();
  remat::checkpoint_sequential(seq, 2, x).square().sum().backward();
  auto ckpt = x.grad().clone();
  x.mutable_grad() = torch::Tensor();
  remat::CheckpointedSequential net(seq, remat::SequentialOptions().algorithm("revolve:2"));
  net->forward(x).square().sum().backward();
  const bool ok = torch::equal(plain, ckpt) && torch::equal(plain, x.grad());
  std::printf("consumer: gradients %s\n", ok ? "match" : "DIFFER");
  return ok ? 0 : 1;
}
