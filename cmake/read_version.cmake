# kvcache_read_version(<header> <out>): "major.minor.patch" from the three
# KVCACHE_VERSION_* lines of version.hpp. The top-level CMakeLists.txt and
# tests/packaging/check_versions.cmake both read the version through it.
function(kvcache_read_version header out)
  file(STRINGS "${header}" lines REGEX "^#define KVCACHE_VERSION_(MAJOR|MINOR|PATCH) [0-9]+$")
  set(version "")
  foreach(part MAJOR MINOR PATCH)
    if(NOT lines MATCHES "KVCACHE_VERSION_${part} ([0-9]+)")
      message(FATAL_ERROR "kvcache: no KVCACHE_VERSION_${part} in ${header}")
    endif()
    list(APPEND version ${CMAKE_MATCH_1})
  endforeach()
  list(JOIN version "." version)
  set(${out} "${version}" PARENT_SCOPE)
endfunction()
