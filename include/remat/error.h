// remat::Error, the one exception type the runtime throws, and the helpers
// that format sizes and shapes for its messages. Messages name the operation
// in brackets, the values involved and the remedy; a broken invariant of
// remat's own says "internal" and asks for a bug report.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

/** Activation checkpointing for LibTorch: the runtime (<remat/remat.h>),
 *  the planner (remat::plan), models (remat::models) and data parallel
 *  (remat::parallel). */
namespace remat {

/** Thrown by every remat runtime entry point; what() is the full message. */
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/** "1.50 GiB", "312.0 KiB", "17 B": binary units, for messages and tables. */
std::string format_bytes(int64_t bytes);

}  // namespace remat
