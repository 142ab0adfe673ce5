# REMAT_CUDA=AUTO|ON|OFF: build remat's CUDA paths. AUTO: on when the
# LibTorch found is a CUDA build. Included after find_package(Torch).
set(REMAT_CUDA AUTO CACHE STRING "Build remat's CUDA paths: AUTO, ON or OFF")
set_property(CACHE REMAT_CUDA PROPERTY STRINGS AUTO ON OFF)
