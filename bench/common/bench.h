// bench/common/bench.h: what every benchmark program of bench/ shares.
// Command-line arguments (--key value, --flag; numbers parsed with an error
// that names the flag), JSON output (quoting, numbers, lists), timing
// (milliseconds since, medians), process counters (/proc/self/status,
// minor page faults), the LD_PRELOAD byte counter of bench/preload, and the
// run-metadata record every result carries (machine, UTC date, git commit,
// LibTorch version, the program's arguments; bench/py/common.py writes the
// same record for the Python workers).
// Leaves out: anything a single program alone needs.
#pragma once

#include <dlfcn.h>
#include <spawn.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <remat/memory.h>

extern char** environ;  // the process's environment, for spawn()

namespace bench {

// --- arguments ---------------------------------------------------------------
/** The value after `key` ("--steps 3"), or `dflt` when absent. */
inline std::string arg(int argc, char** argv, const std::string& key, const std::string& dflt) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (argv[i] == key) return argv[i + 1];
  }
  return dflt;
}

/** Whether `key` stands alone anywhere on the command line ("--quick"). */
inline bool flag(int argc, char** argv, const std::string& key) {
  for (int i = 1; i < argc; ++i) {
    if (argv[i] == key) return true;
  }
  return false;
}

/** `s` cut at `sep`, empty items dropped. */
inline std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, sep);) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

/** `text` as a whole number; exits 2 with a message naming `what` (the flag) otherwise. */
inline int64_t to_int(const std::string& what, const std::string& text) {
  size_t used = 0;
  try {
    const long long v = std::stoll(text, &used);
    if (used == text.size()) return v;
  } catch (const std::exception&) {
  }
  std::fprintf(stderr, "%s: expected a whole number, got \"%s\"\n", what.c_str(), text.c_str());
  std::exit(2);
}

/** `text` as a number; exits 2 with a message naming `what` (the flag) otherwise. */
inline double to_double(const std::string& what, const std::string& text) {
  size_t used = 0;
  try {
    const double v = std::stod(text, &used);
    if (used == text.size()) return v;
  } catch (const std::exception&) {
  }
  std::fprintf(stderr, "%s: expected a number, got \"%s\"\n", what.c_str(), text.c_str());
  std::exit(2);
}

inline int64_t int_arg(int argc, char** argv, const std::string& key, const std::string& dflt) {
  return to_int(key, arg(argc, argv, key, dflt));
}
inline double double_arg(int argc, char** argv, const std::string& key, const std::string& dflt) {
  return to_double(key, arg(argc, argv, key, dflt));
}

// --- JSON --------------------------------------------------------------------
/** `s` as a JSON string (quotes and backslashes escaped, newlines and tabs as spaces). */
inline std::string quoted(const std::string& s) {
  std::string o = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    o += (c == '\n' || c == '\t' || c == '\r') ? ' ' : c;
  }
  return o + "\"";
}

/** `v` with `digits` decimals. */
inline std::string num(double v, int digits = 4) {
  char b[64];
  std::snprintf(b, sizeof b, "%.*f", digits, v);
  return b;
}

inline std::string json_list(const std::vector<double>& v, int digits = 4) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + num(v[i], digits);
  return s + "]";
}
inline std::string json_list(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}
inline std::string json_list(const std::vector<std::string>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + bench::quoted(v[i]);
  return s + "]";
}

// --- timing ------------------------------------------------------------------
using Clock = std::chrono::steady_clock;
/** Starts exe with args (argv[0] included) and this process's environment;
 *  returns its pid, or -1 (with perror naming `who`). */
inline pid_t spawn(const char* exe, std::vector<std::string> args, const char* who) {
  std::vector<char*> cargv;
  for (auto& s : args) cargv.push_back(s.data());
  cargv.push_back(nullptr);
  pid_t pid = -1;
  if (posix_spawn(&pid, exe, nullptr, nullptr, cargv.data(), environ) != 0) {
    std::perror((std::string(who) + ": posix_spawn").c_str());
    return -1;
  }
  return pid;
}

inline double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}
inline double secs_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

/** The median (mean of the middle two for an even count); 0 for none. */
inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// --- process counters --------------------------------------------------------
/** Minor page faults of this process so far (fresh pages the kernel maps in). */
inline int64_t minor_faults() {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_minflt;
}

/** A field of /proc/self/status in KiB ("VmRSS", "VmHWM"), -1 if absent. */
inline int64_t status_kib(const std::string& key) {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);) {
    if (line.rfind(key + ":", 0) == 0) return std::atoll(line.c_str() + key.size() + 1);
  }
  return -1;
}

// --- the preload counter (bench/preload/remat_preload.cpp) -------------------
/** c10's CPU allocator bytes as the LD_PRELOAD library counts them, the
 *  meter both the C++ and the Python workers read. Not loaded: with
 *  `required` the program exits 2 saying how to run it; otherwise it falls
 *  back on remat::memory (name "remat::memory"). */
struct Meter {
  int64_t (*current)() = nullptr;
  int64_t (*peak)() = nullptr;
  void (*reset)() = nullptr;
  std::string name = "preload";

  Meter(const char* program, bool required) {
    current = reinterpret_cast<int64_t (*)()>(dlsym(RTLD_DEFAULT, "remat_preload_current_bytes"));
    peak = reinterpret_cast<int64_t (*)()>(dlsym(RTLD_DEFAULT, "remat_preload_peak_bytes"));
    reset = reinterpret_cast<void (*)()>(dlsym(RTLD_DEFAULT, "remat_preload_reset_peak"));
    auto installed = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "remat_preload_installed"));
    const bool loaded = current && peak && reset && (!required || (installed && installed() == 1));
    if (!loaded && required) {
      std::fprintf(stderr, "%s: run with LD_PRELOAD=<build>/bench/libremat_preload.so\n", program);
      std::exit(2);
    }
    if (!loaded) {
      current = &remat::memory::current_bytes;
      peak = &remat::memory::peak_bytes;
      reset = &remat::memory::reset_peak;
      name = "remat::memory";
      return;
    }
    if (!required) return;
    const int64_t before = current();  // it must see torch's allocations: 4 MiB in, 4 MiB out
    int64_t seen = 0;
    {
      auto t = torch::empty({1 << 20}, torch::kFloat32);
      seen = current() - before;
    }
    if (seen != (4 << 20) || current() != before) {
      std::fprintf(stderr, "%s: the preload counter does not see torch (saw %lld bytes)\n", program, (long long)seen);
      std::exit(2);
    }
  }
};

// --- run metadata ------------------------------------------------------------
/** The first line `cmd` prints, "" when it fails. */
inline std::string first_output_line(const std::string& cmd) {
  std::FILE* p = popen(cmd.c_str(), "r");
  if (!p) return "";
  char buf[512] = {0};
  std::string s = std::fgets(buf, sizeof buf, p) ? buf : "";
  if (pclose(p) != 0) return "";
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
  return s;
}

/** A benchmark's offload directory: --offload-dir when given (kept), else
 *  a new directory /tmp/PROGRAM.XXXXXX, removed with its files when this
 *  object goes. Exits with status 1 when it cannot be made. */
class ScratchDir {
 public:
  ScratchDir(int argc, char** argv, const std::string& program) : path_(arg(argc, argv, "--offload-dir", "")) {
    if (!path_.empty()) return;
    std::string tmpl = "/tmp/" + program + ".XXXXXX";
    if (mkdtemp(tmpl.data()) == nullptr) {
      std::perror((program + ": mkdtemp").c_str());
      std::exit(1);
    }
    path_ = tmpl;
    own_ = true;
  }
  ~ScratchDir() {
    std::error_code ec;
    if (own_) std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  bool own_ = false;
};

/** The run-metadata record, one JSON object: program, UTC date, git commit
 *  of the source tree ("" when git or the tree is absent; git runs without
 *  the preload counter), nproc, CPU model,
 *  total memory, LibTorch version, intra-op threads and the program's
 *  arguments. bench/py/common.py:metadata() writes the same keys. */
inline std::string metadata(int argc, char** argv) {
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  std::string cpu = "?";
  int64_t mem_kib = -1;
  {
    std::ifstream f("/proc/cpuinfo");
    for (std::string line; std::getline(f, line);) {
      if (line.rfind("model name", 0) == 0) {
        cpu = line.substr(line.find(':') + 2);
        break;
      }
    }
    std::ifstream m("/proc/meminfo");
    for (std::string line; std::getline(m, line);) {
      if (line.rfind("MemTotal:", 0) == 0) mem_kib = std::atoll(line.c_str() + 9);
    }
  }
#ifdef REMAT_SOURCE_DIR
  const std::string commit =
      first_output_line("env -u LD_PRELOAD git -C '" REMAT_SOURCE_DIR "' rev-parse HEAD 2>/dev/null");
#else
  const std::string commit = first_output_line("env -u LD_PRELOAD git rev-parse HEAD 2>/dev/null");
#endif
  std::vector<std::string> args(argv, argv + argc);
  std::string program = args.empty() ? "?" : args[0].substr(args[0].rfind('/') + 1);
  if (!args.empty()) args.erase(args.begin());
  return "{\"program\": " + bench::quoted(program) + ", \"date_utc\": " + bench::quoted(date) +
         ", \"git_commit\": " + bench::quoted(commit) +
         ", \"nproc\": " + std::to_string(sysconf(_SC_NPROCESSORS_ONLN)) + ", \"cpu\": " + bench::quoted(cpu) +
         ", \"mem_total_kib\": " + std::to_string(mem_kib) + ", \"torch\": " + bench::quoted(TORCH_VERSION) +
         ", \"threads\": " + std::to_string(torch::get_num_threads()) + ", \"args\": " + json_list(args) + "}";
}

}  // namespace bench
