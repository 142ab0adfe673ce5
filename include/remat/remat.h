// remat: gradient (activation) checkpointing for LibTorch. Umbrella header:
// the whole public API of remat::remat (checkpoint, hooks, memory, profile,
// CheckpointedSequential, the planner). The models and trainer behind
// remat-train are a separate library (remat::models, <remat/models/*.h>), and
// so is distributed training on c10d (remat::parallel: <remat/parallel/data_parallel.h>,
// fully_shard.h, pipeline.h).
#pragma once

#include <remat/auto.h>
#include <remat/checkpoint.h>
#include <remat/checkpointable.h>
#include <remat/chunked.h>
#include <remat/error.h>
#include <remat/hooks.h>
#include <remat/memory.h>
#include <remat/offload.h>
#include <remat/optim.h>
#include <remat/plan/plan.h>
#include <remat/policy.h>
#include <remat/profile.h>
#include <remat/selective.h>
#include <remat/sequential.h>
