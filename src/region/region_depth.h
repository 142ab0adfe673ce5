// Internal: whether this thread is inside the first run (the forward) of a
// checkpointed region: a chunked call there must run with its own count,
// since the region's recompute runs it again with that count (NOTE [chunked
// calls as units], src/auto/chunks.cpp).
#pragma once

namespace remat::detail {

/** True while a remat::checkpoint region's forward runs on this thread
 *  (not its recompute in backward: is_recomputing()). */
bool in_region_forward();

}  // namespace remat::detail
