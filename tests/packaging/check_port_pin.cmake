# The vcpkg port pins the release tarball of its version: the SHA512 in
# ports/kvcache/portfile.cmake is the hash of scripts/source-tarball's output
# for the tag vX.Y.Z. Without that tag (a tarball checkout, or a clone
# without tags) there is nothing to compare: the test is skipped (it prints
# "SKIPPED:", its SKIP_REGULAR_EXPRESSION; cmake -P has no exit code 77 before
# CMake 3.29).
#   cmake -DSOURCE_DIR=... -DVERSION=... -DWORK_DIR=... -P check_port_pin.cmake
find_program(GIT git)
if(NOT GIT OR NOT EXISTS "${SOURCE_DIR}/.git")
  message("SKIPPED: not a git checkout")
  return()
endif()
execute_process(COMMAND "${GIT}" -C "${SOURCE_DIR}" rev-parse -q --verify "refs/tags/v${VERSION}^{commit}"
                RESULT_VARIABLE rc OUTPUT_QUIET ERROR_QUIET)
if(NOT rc EQUAL 0)
  message("SKIPPED: no tag v${VERSION} in this clone")
  return()
endif()
execute_process(COMMAND bash "${SOURCE_DIR}/scripts/source-tarball" "v${VERSION}" "${WORK_DIR}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "scripts/source-tarball v${VERSION} failed:\n${err}")
endif()
string(REGEX MATCH "SHA512 ([0-9a-f]+)" _ "${out}")
set(sha "${CMAKE_MATCH_1}")
file(READ "${SOURCE_DIR}/ports/kvcache/portfile.cmake" portfile)
if(NOT portfile MATCHES "SHA512 ${sha}")
  message(FATAL_ERROR "ports/kvcache/portfile.cmake does not pin the tarball of v${VERSION} (SHA512 ${sha})")
endif()
message(STATUS "ports/kvcache pins v${VERSION}: SHA512 ${sha}")
