// Small helpers the parallel layer's files share: the clock their timings
// use and how a backend's exception becomes one line of a remat::Error.
#pragma once

#include <chrono>
#include <exception>
#include <string>

#include <c10/util/Exception.h>

namespace remat::parallel::util {

using Clock = std::chrono::steady_clock;

/** b - a in ms. */
inline double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

/** The first line of s (c10 and Gloo messages go on with context lines). */
inline std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

/** e's message, first line only, without a c10::Error's backtrace. */
inline std::string message_of(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return first_line(c->what_without_backtrace());
  return first_line(e.what());
}

}  // namespace remat::parallel::util
