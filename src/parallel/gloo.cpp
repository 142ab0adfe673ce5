// The one translation unit that includes ProcessGroupGloo.hpp, whose
// <gloo/...> includes come from Debian's libgloo-dev (the wheel ships none):
// a 2022 snapshot, older than the gloo inside libtorch_cpu. Only what is
// exported from libtorch_cpu is called here (the constructor, the Options
// constructor, createDeviceForHostname, create_default), no gloo type is
// touched inline, and the file is compiled with hidden visibility so that
// none of its inline copies can interpose on libtorch_cpu's. What is left
// is the object sizes this file allocates (ProcessGroupGloo, its Options):
// tests/parallel/gloo_abi.sh compares them with the sizes libtorch_cpu
// itself allocates, and the multi-process tests compare parameters.
#include "backends.h"

#include <cstdlib>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

namespace remat::parallel::detail {

c10::intrusive_ptr<c10d::Backend> make_gloo(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                            std::chrono::milliseconds timeout, const std::string& master_addr) {
  c10::intrusive_ptr<c10d::ProcessGroupGloo::Options> options;
  if (is_loopback(master_addr) && std::getenv("GLOO_SOCKET_IFNAME") == nullptr) {
    options = c10d::ProcessGroupGloo::Options::create(timeout);
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  } else {
    options = c10d::ProcessGroupGloo::Options::create_default(timeout);
  }
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
}

}  // namespace remat::parallel::detail
