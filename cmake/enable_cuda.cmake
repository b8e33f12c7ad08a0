# Enables CUDA the way kvcache's builds do (the library's tests and
# benchmarks, the Python module): CMake finds nvcc through CUDACXX or PATH,
# and the toolkit's usual folder too; a CMAKE_CUDA_COMPILER already set
# (NOTFOUND included) is left alone. Architectures default to sm_80 and
# sm_90. Sets <out> ON when CUDA is enabled. A macro: enable_language must
# run at file scope.
macro(kvcache_enable_cuda out)
  set(${out} OFF)
  if(NOT DEFINED CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 80 90)  # CUDA 13 starts at sm_75; `native` needs a GPU
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(${out} ON)
  endif()
endmacro()
