// Formatting helpers for remat::Error messages; sizes are formatted as the
// planner does, so runtime and planner messages read alike.
#include <remat/error.h>

#include <remat/plan/error.h>

namespace remat {

std::string format_bytes(int64_t bytes) { return plan::format_bytes(bytes); }

}  // namespace remat
