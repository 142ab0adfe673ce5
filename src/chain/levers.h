// Internal: the per-stage menu of a planned chain (plan::StageOption k >= 1)
// and how a stage runs under one of its options: a checkpoint region with
// a selective policy (what it keeps; its backward recomputes the rest), or
// its saves sent to an offload store.
#pragma once

#include <optional>
#include <vector>

#include <remat/checkpoint.h>
#include <remat/offload.h>
#include <remat/plan/schedule.h>

#include "values.h"

namespace remat::detail {

/** One option of a stage's menu: exactly one of the two is set. */
struct StageLever {
  std::optional<CheckpointOptions> region;  // a selective level
  std::optional<OffloadOptions> offload;    // the saves go to this store
  /** An offload to disk: the store may hold max_inflight_bytes in flight. */
  bool disk() const { return offload && offload->target() == OffloadTarget::kDisk; }
};

/** Every stage's menu, aligned with each plan::Stage::options (disk offload
 *  options last, so that dropping them leaves the others' indices). */
struct Levers {
  std::vector<std::vector<StageLever>> stages;
  /** The largest storage a stage saves for backward (bytes, over all
   *  stages): a store lets one tensor larger than max_inflight_bytes go
   *  alone. */
  int64_t largest_saved = 0;
  /** Bytes the disk stores of the menus may hold in flight at once: over
   *  the distinct disk options, the sum of max_inflight_bytes or
   *  largest_saved, whichever is larger. */
  int64_t inflight_margin() const;
  /** chain without its disk offload options. */
  plan::Chain without_disk(const plan::Chain& chain) const;
  /** The schedule uses a disk offload option. */
  bool uses_disk(const plan::Schedule& schedule) const;
};

/** run_stage_module(m, in, writes_input, who) under `lever` (nullptr: as
 *  is). trial: an offload runs with one tensor in flight and waits for its
 *  writes (the profiler's runs: bytes that do not depend on the disk's
 *  pace). */
Values run_stage_under(torch::nn::AnyModule& m, const Values& in, bool writes_input, const std::string& who,
                       const StageLever* lever, bool trial = false);

}  // namespace remat::detail
