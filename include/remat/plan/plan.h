// Umbrella header of remat::plan, the torch-free checkpoint planner.
#pragma once

#include "remat/plan/chain.h"
#include "remat/plan/error.h"
#include "remat/plan/json.h"
#include "remat/plan/schedule.h"
#include "remat/plan/solve.h"
#include "remat/plan/step.h"
#include "remat/plan/transfer.h"
