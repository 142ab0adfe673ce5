// ProcessGroupNCCL for CUDA groups (a remat built with REMAT_CUDA and
// nccl.h found: src/parallel/CMakeLists.txt). Only exported libtorch_cuda
// functions are called; the NCCL headers are the ones the CUDA wheel ships
// (nvidia-nccl), as libtorch_cuda was built against.
#include "backends.h"

#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

namespace remat::parallel::detail {

c10::intrusive_ptr<c10d::Backend> make_nccl(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                            std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
}

}  // namespace remat::parallel::detail
