# An installed package must not depend on whether the packaging machine had
# nvcc. Configures and installs the library three ways (the default search,
# CUDA absent, CUDA switched off) and requires three identical trees, file
# for file and byte for byte.
#   cmake -DSOURCE_DIR=... -DWORK_DIR=... -DGENERATOR=... -P cuda_absent.cmake
file(REMOVE_RECURSE "${WORK_DIR}")
set(common -G "${GENERATOR}" -DKVCACHE_BUILD_TESTS=OFF -DKVCACHE_BUILD_EXAMPLES=OFF -DKVCACHE_BUILD_BENCH=OFF)
# "absent": no CUDACXX, no nvcc on PATH, and CMAKE_CUDA_COMPILER as CMake
# leaves it when its search finds none (NOTFOUND), so the /usr/local/cuda
# probe is skipped too.
set(ways default absent off)
set(args_default "")
set(args_absent -DCMAKE_CUDA_COMPILER=NOTFOUND)
set(args_off -DKVCACHE_ENABLE_CUDA=OFF)
foreach(way IN LISTS ways)
  execute_process(
    COMMAND ${CMAKE_COMMAND} -E env --unset=CUDACXX --unset=CUDAToolkit_ROOT PATH=/usr/bin:/bin
            ${CMAKE_COMMAND} -S "${SOURCE_DIR}" -B "${WORK_DIR}/${way}" ${common} ${args_${way}}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "configure (${way}) failed:\n${out}")
  endif()
  string(REGEX MATCH "kvcache: CUDA kernels (ON|OFF)" cuda "${out}")
  message(STATUS "${way}: ${cuda}")
  if(NOT way STREQUAL "default" AND NOT cuda STREQUAL "kvcache: CUDA kernels OFF")
    message(FATAL_ERROR "configure (${way}) should have CUDA off, says '${cuda}'")
  endif()
  execute_process(COMMAND ${CMAKE_COMMAND} --install "${WORK_DIR}/${way}" --prefix "${WORK_DIR}/${way}-prefix"
                  RESULT_VARIABLE rc OUTPUT_QUIET ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "install (${way}) failed:\n${err}")
  endif()
  file(GLOB_RECURSE files_${way} RELATIVE "${WORK_DIR}/${way}-prefix" "${WORK_DIR}/${way}-prefix/*")
  list(SORT files_${way})
endforeach()
list(LENGTH files_default n)
if(n LESS 50)
  message(FATAL_ERROR "the default install has only ${n} files")
endif()
foreach(way absent off)
  if(NOT files_${way} STREQUAL files_default)
    message(FATAL_ERROR "install (${way}) has other files than the default one:\n${files_${way}}\nvs\n${files_default}")
  endif()
  foreach(f IN LISTS files_default)
    file(SHA256 "${WORK_DIR}/default-prefix/${f}" a)
    file(SHA256 "${WORK_DIR}/${way}-prefix/${f}" b)
    if(NOT a STREQUAL b)
      message(FATAL_ERROR "install (${way}): ${f} differs from the default install's")
    endif()
  endforeach()
endforeach()
message(STATUS "${n} installed files, identical with CUDA found, absent and off")
