// Shared by the fuzz harnesses: what a harness does when an invariant breaks.
// A harness lets remat::Error (the documented refusal) pass and lets every
// other exception escape, which libFuzzer reports as a crash (std::terminate).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

namespace remat::fuzz {

/** Prints the broken invariant and aborts: libFuzzer saves the input as crash-*. */
[[noreturn]] inline void fail(const std::string& what) {
  std::fprintf(stderr, "remat fuzz invariant broken: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace remat::fuzz
