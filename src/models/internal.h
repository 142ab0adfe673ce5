// Helpers shared by the trainer (trainer.cpp) and the what-fits search
// (fit.cpp): progress lines to a log, and a heartbeat for long calls.
// Leaves out: anything about models or memory (those stay in their files).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <ostream>
#include <string>
#include <thread>
#include <utility>

namespace remat::models::detail {

using Clock = std::chrono::steady_clock;

inline std::string str(int64_t v) { return std::to_string(v); }

/** One line to log at once, flushed (nothing without a log). */
inline void note(std::ostream* log, const std::string& line) {
  if (log == nullptr) return;
  *log << line + "\n" << std::flush;
}

/** "12.3 s". */
inline std::string seconds(double s) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f s", s);
  return b;
}

inline double since_s(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

/** While alive, writes "<what>: N s so far" to log every every_s seconds
 *  (from a thread: for a long call that reports nothing itself). */
class Heartbeat {
 public:
  Heartbeat(std::ostream* log, std::string what, double every_s = 5.0)
      : log_(log), what_(std::move(what)), t0_(Clock::now()) {
    if (log_ == nullptr) return;
    thread_ = std::thread([this, every_s] {
      std::unique_lock<std::mutex> lock(mu_);
      while (!cv_.wait_for(lock, std::chrono::duration<double>(every_s), [this] { return done_; })) {
        note(log_, what_ + ": " + seconds(since_s(t0_)) + " so far");
      }
    });
  }
  ~Heartbeat() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;
  double elapsed_s() const { return since_s(t0_); }

 private:
  std::ostream* log_;
  std::string what_;
  Clock::time_point t0_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace remat::models::detail
