// remat: gradient (activation) checkpointing for LibTorch. Umbrella header.
#pragma once

#include <remat/checkpoint.h>
#include <remat/error.h>
#include <remat/hooks.h>
#include <remat/memory.h>
