// remat::plan errors and byte formatting/parsing. Torch-free. The planner
// throws the same remat::Error as the runtime (remat/error.h is torch-free),
// so a user catches one type whichever layer refused.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

#include "remat/error.h"

namespace remat::plan {

/** Thrown for invalid chains, invalid schedules and infeasible budgets.
 *  Messages start with "[remat::plan]", name the values involved and the remedy. */
using Error = remat::Error;

/** "512 B", "1.50 KiB", "3.25 MiB", "1.93 GiB" (binary units, two decimals). */
std::string format_bytes(int64_t bytes);

/** Parses "536870912", "512MiB", "2GiB", "1.5GB", "64k", "1.5 GiB".
 *  Binary units (KiB, MiB, GiB, TiB, and K/M/G/T) are powers of 1024; decimal
 *  units (kB, MB, GB, TB) powers of 1000. Fractions round down to whole bytes.
 *  Throws Error naming the text when it is not a non-negative size. */
int64_t parse_bytes(std::string_view text);

}  // namespace remat::plan
