// Backend construction, one translation unit each (NOTE [c10d from C++] in
// docs/parallel.md): gloo.cpp is the only file that includes <gloo/...>.
#pragma once

#include <chrono>
#include <string>

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace remat::parallel::detail {

/** ProcessGroupGloo on `store`. Binds the loopback interface when every
 *  rank is local (master_addr is a loopback address) and GLOO_SOCKET_IFNAME
 *  is unset; otherwise (another address, or "" for a FileStore, whose ranks
 *  may be on several hosts) c10d's default device: GLOO_SOCKET_IFNAME, else
 *  the host name's address, as torch.distributed does. */
c10::intrusive_ptr<c10d::Backend> make_gloo(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                            std::chrono::milliseconds timeout, const std::string& master_addr);

/** ProcessGroupNCCL (a remat built with REMAT_CUDA and c10d's NCCL);
 *  otherwise throws remat::Error naming the remedy. */
c10::intrusive_ptr<c10d::Backend> make_nccl(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                            std::chrono::milliseconds timeout);

/** True for 127.0.0.0/8, ::1 and "localhost". */
bool is_loopback(const std::string& addr);

}  // namespace remat::parallel::detail
