// Prints the sizes of the objects src/parallel/gloo.cpp allocates, as this
// build (Debian's gloo headers) lays them out; gloo_abi.sh compares them with
// the sizes libtorch_cpu itself allocates.
#include <cstdio>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

int main() {
  std::printf("ProcessGroupGloo %zu\n", sizeof(c10d::ProcessGroupGloo));
  std::printf("ProcessGroupGloo::Options %zu\n", sizeof(c10d::ProcessGroupGloo::Options));
  return 0;
}
