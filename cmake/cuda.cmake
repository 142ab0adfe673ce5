# REMAT_CUDA=AUTO|ON|OFF: build remat's CUDA paths. AUTO: on when the
# LibTorch found is a CUDA build. Included after find_package(Torch).
# Sets REMAT_WITH_CUDA (ON/OFF); src/CMakeLists.txt then defines
# REMAT_WITH_CUDA=1 on remat (PUBLIC) and links c10_cuda. What the CUDA
# build adds is docs/gpu.md; the CPU build is unchanged by this file.
set(REMAT_CUDA AUTO CACHE STRING "Build remat's CUDA paths: AUTO, ON or OFF")
set_property(CACHE REMAT_CUDA PROPERTY STRINGS AUTO ON OFF)
string(TOUPPER "${REMAT_CUDA}" _remat_cuda)
if(NOT _remat_cuda MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "[remat] REMAT_CUDA is '${REMAT_CUDA}'; expected AUTO, ON or OFF.")
endif()
# A CUDA LibTorch defines the imported targets torch_cuda and c10_cuda
# (Caffe2Targets.cmake); a CPU one defines neither.
set(_remat_torch_has_cuda OFF)
if(TARGET torch_cuda AND TARGET c10_cuda)
  set(_remat_torch_has_cuda ON)
endif()
if(_remat_cuda STREQUAL "ON" AND NOT _remat_torch_has_cuda)
  message(FATAL_ERROR
    "[remat] REMAT_CUDA=ON, but the LibTorch found (Torch_DIR=${Torch_DIR}) is a "
    "CPU-only build (no torch_cuda/c10_cuda targets). Point CMAKE_PREFIX_PATH at a "
    "CUDA LibTorch (a CUDA torch wheel's torch.utils.cmake_prefix_path, or the "
    "pytorch.org CUDA zip), or configure with -DREMAT_CUDA=AUTO or OFF.")
endif()
if(_remat_cuda STREQUAL "OFF")
  set(REMAT_WITH_CUDA OFF)
else()
  set(REMAT_WITH_CUDA ${_remat_torch_has_cuda})
endif()
message(STATUS "remat: CUDA paths ${REMAT_WITH_CUDA} (REMAT_CUDA=${REMAT_CUDA}, LibTorch with CUDA: ${_remat_torch_has_cuda})")
