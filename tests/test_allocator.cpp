// remat::memory's counting allocator against other allocators: one of
// higher priority installed first (remat must wrap it and count), one
// installed after remat's (counting must refuse loudly, not read 0), and a
// pointer raw_allocate()d before remat wrapped the allocator (freed, not
// leaked). Each scenario runs in a fresh process (threadsafe death-test
// style re-executes the binary), since the CPU allocator is process-wide.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include <c10/core/CPUAllocator.h>

#include <remat/error.h>
#include <remat/memory.h>

namespace {

#define CHILD_CHECK(cond)                                                     \
  do {                                                                        \
    if (!(cond)) {                                                            \
      std::fprintf(stderr, "check failed at line %d: %s\n", __LINE__, #cond); \
      std::exit(1);                                                           \
    }                                                                         \
  } while (0)

/** A user's counting allocator: forwards to the one it replaced. */
struct UserCounter final : c10::Allocator {
  explicit UserCounter(c10::Allocator* inner) : inner_(inner) {}
  c10::DataPtr allocate(size_t n) override {
    allocated.fetch_add(static_cast<int64_t>(n));
    return inner_->allocate(n);
  }
  c10::DeleterFnPtr raw_deleter() const override { return inner_->raw_deleter(); }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
  std::atomic<int64_t> allocated{0};
  c10::Allocator* inner_;
};

int64_t rss_bytes() {
  std::ifstream in("/proc/self/statm");
  int64_t size = 0, resident = 0;
  in >> size >> resident;
  return resident * 4096;
}

class Allocator : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

TEST_F(Allocator, WrapsAHigherPriorityAllocatorInstalledFirst) {
  EXPECT_EXIT(
      {
        static UserCounter user(c10::GetCPUAllocator());
        c10::SetCPUAllocator(&user, /*priority=*/200);
        CHILD_CHECK(c10::GetCPUAllocator() == &user);
        remat::memory::enable_tracking();
        CHILD_CHECK(remat::memory::tracking_enabled());
        const int64_t base = remat::memory::current_bytes();
        const int64_t user_base = user.allocated.load();
        {
          auto t = torch::empty({1 << 20}, torch::kFloat);  // 4 MiB
          CHILD_CHECK(remat::memory::current_bytes() - base == int64_t{4} << 20);
        }
        CHILD_CHECK(remat::memory::current_bytes() == base);
        CHILD_CHECK(user.allocated.load() - user_base == int64_t{4} << 20);  // the user's still counts
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST_F(Allocator, ReplacedAfterRematIsRefusedLoudly) {
  EXPECT_EXIT(
      {
        remat::memory::enable_tracking();
        static UserCounter user(c10::GetCPUAllocator());
        c10::SetCPUAllocator(&user, /*priority=*/255);
        CHILD_CHECK(!remat::memory::tracking_enabled());
        try {
          remat::memory::Probe probe;
          std::exit(2);
        } catch (const remat::Error& e) {
          const std::string want =
              "[remat::memory] remat's counting allocator is not the CPU allocator: another allocator was "
              "installed with SetCPUAllocator(..., 255) after remat's, so remat would count nothing. Install your "
              "allocator before the first use of remat::memory (remat then wraps it and both count).";
          CHILD_CHECK(std::string(e.what()) == want);
        }
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST_F(Allocator, PointerAllocatedBeforeTrackingIsFreedNotLeaked) {
  EXPECT_EXIT(
      {
        const size_t n = size_t{256} << 20;
        const int64_t rss0 = rss_bytes();
        void* p = c10::GetCPUAllocator()->raw_allocate(n);
        std::memset(p, 1, n);  // make it resident
        CHILD_CHECK(rss_bytes() - rss0 > int64_t{200} << 20);
        remat::memory::enable_tracking();
        const int64_t base = remat::memory::current_bytes();
        c10::GetCPUAllocator()->raw_deallocate(p);            // remat's raw deleter now
        CHILD_CHECK(remat::memory::current_bytes() == base);  // never counted, not subtracted
        CHILD_CHECK(rss_bytes() - rss0 < int64_t{32} << 20);  // but freed
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST_F(Allocator, CountsOnlyWhileAskedAndAnyNumberOfProbes) {
  EXPECT_EXIT(
      {
        {
          remat::memory::Probe p;  // installs; counts while alive
          CHILD_CHECK(remat::memory::counting_now());
        }
        CHILD_CHECK(!remat::memory::counting_now());
        const int64_t count0 = remat::memory::allocation_count();
        { auto t = torch::empty({1000}); }
        CHILD_CHECK(remat::memory::allocation_count() == count0);  // not counted: nobody asked
        // 1,000 probes alive at once (there was a limit of 64), nested peaks exact.
        std::vector<std::unique_ptr<remat::memory::Probe>> probes;
        std::vector<torch::Tensor> keep;
        for (int i = 0; i < 1000; ++i) {
          probes.push_back(std::make_unique<remat::memory::Probe>());
          keep.push_back(torch::empty({256}, torch::kFloat));  // 1 KiB each
        }
        for (int i = 0; i < 1000; ++i) CHILD_CHECK(probes[i]->peak_bytes() == (1000 - i) * 1024);
        keep.clear();
        { auto spike = torch::empty({1 << 20}, torch::kFloat); }  // 4 MiB, seen by every probe
        for (int i = 0; i < 1000; ++i) CHILD_CHECK(probes[i]->peak_bytes() == (4096 - i) * 1024);
        // Destroyed out of order, the others stay exact.
        for (int i = 0; i < 1000; i += 2) probes[i].reset();
        { auto spike = torch::empty({(1 << 20) + (1 << 18)}, torch::kFloat); }  // 5 MiB
        for (int i = 1; i < 1000; i += 2) CHILD_CHECK(probes[i]->peak_bytes() == (5120 - i) * 1024);
        probes.clear();
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

}  // namespace
