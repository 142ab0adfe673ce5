// The GPT fsdp_worker trains and test_parallel loads its saves into: 4 blocks
// of d_model 64, 4 heads, T 32, vocabulary 64, initialised from seed 1.
#pragma once

#include <torch/utils.h>

#include <remat/models/gpt.h>

namespace worker {

inline remat::models::Gpt fsdp_gpt() {
  torch::manual_seed(1);
  remat::models::GptConfig cfg;
  cfg.vocab = 64;
  cfg.seq_len = 32;
  cfg.d_model = 64;
  cfg.heads = 4;
  cfg.layers = 4;
  return remat::models::Gpt(cfg);
}

}  // namespace worker
