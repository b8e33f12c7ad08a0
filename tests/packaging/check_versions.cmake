# The version is written once (include/kvcache/version.hpp); everything that
# states it must agree: CMake's project() (it reads the header), the vcpkg
# port's manifest, the CHANGELOG's newest release, and the Conan recipe (it
# reads the header; its literal version would be a second source).
#   cmake -DSOURCE_DIR=... -DPROJECT_VERSION=... -P check_versions.cmake
include("${SOURCE_DIR}/cmake/read_version.cmake")
kvcache_read_version("${SOURCE_DIR}/include/kvcache/version.hpp" header)
set(failures "")
macro(expect what value)
  if(NOT "${value}" STREQUAL "${header}")
    list(APPEND failures "${what} says '${value}', version.hpp says '${header}'")
  else()
    message(STATUS "${what}: ${value}")
  endif()
endmacro()

expect("CMake project()" "${PROJECT_VERSION}")

file(READ "${SOURCE_DIR}/ports/kvcache/vcpkg.json" manifest)
string(JSON port_version ERROR_VARIABLE err GET "${manifest}" version)
expect("ports/kvcache/vcpkg.json" "${port_version}")

file(STRINGS "${SOURCE_DIR}/CHANGELOG.md" releases REGEX "^## [0-9]")
list(GET releases 0 newest)
string(REGEX MATCH "^## ([0-9]+\\.[0-9]+\\.[0-9]+) \\([0-9]+-[0-9]+-[0-9]+\\)" _ "${newest}")
expect("CHANGELOG.md's newest release (## X.Y.Z (YYYY-MM-DD))" "${CMAKE_MATCH_1}")

# A file that takes its version from version.hpp (matches `reads`) and states none (no match of `states`).
function(expect_reads_header file reads states how)
  file(READ "${SOURCE_DIR}/${file}" text)
  if(NOT text MATCHES "${reads}" OR text MATCHES "${states}")
    list(APPEND failures "${file} must take its version from version.hpp (${how}), not state one")
    set(failures "${failures}" PARENT_SCOPE)
  else()
    message(STATUS "${file}: reads version.hpp")
  endif()
endfunction()
expect_reads_header(pyproject.toml "input = \"include/kvcache/version.hpp\"" "\nversion = " "the regex provider")
expect_reads_header(conanfile.py "\"version\\.hpp\"" "\n    version = " "set_version")

if(failures)
  list(JOIN failures "\n  " msg)
  message(FATAL_ERROR "versions disagree:\n  ${msg}")
endif()
message(STATUS "every version is ${header}")
