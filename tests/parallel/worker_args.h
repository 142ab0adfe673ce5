// The command line of the test workers (ddp_worker, fsdp_worker): --name value
// and --flag, nothing else.
#pragma once

#include <string>

namespace worker {

/** The value after --name, or fallback. */
inline std::string arg(int argc, char** argv, const std::string& name, const std::string& fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (argv[i] == "--" + name) return argv[i + 1];
  }
  return fallback;
}

/** Whether --name is given. */
inline bool flag(int argc, char** argv, const std::string& name) {
  for (int i = 1; i < argc; ++i) {
    if (argv[i] == "--" + name) return true;
  }
  return false;
}

}  // namespace worker
