# Header-only: one configuration, no binaries.
set(VCPKG_BUILD_TYPE release)

# The release's source tarball. ports/ is export-ignored (.gitattributes), so
# the tarball, and this hash, do not depend on this file;
# scripts/source-tarball writes the same tarball from a checkout.
vcpkg_from_github(
    OUT_SOURCE_PATH SOURCE_PATH
    REPO kvcache/kvcache
    REF "v${VERSION}"
    SHA512 7aed21d12b603432d588ae78d14d23641c667a9fbc6e5236240edef928154e7a1a38eb7180038009e547f47d6565d8852f381357769357553c3138ced84e207c
    HEAD_REF main
)

# Every optional part off: the package is the headers (the .cuh kernels
# included) and the CMake files, the same whether or not nvcc is present.
vcpkg_cmake_configure(
    SOURCE_PATH "${SOURCE_PATH}"
    OPTIONS
        -DKVCACHE_ENABLE_CUDA=OFF
        -DKVCACHE_BUILD_TESTS=OFF
        -DKVCACHE_BUILD_EXAMPLES=OFF
        -DKVCACHE_BUILD_BENCH=OFF
        -DKVCACHE_BUILD_FUZZ=OFF
)
vcpkg_cmake_install()
vcpkg_cmake_config_fixup(CONFIG_PATH share/cmake/kvcache)

# The license goes to share/kvcache/copyright; the project's own copy is dropped.
# No usage file: vcpkg writes the find_package / target_link_libraries text
# for a CMake config package itself, and an extension-less file would send
# its ELF fix-up pass (patchelf, a download) over it.
file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/share/doc")
vcpkg_install_copyright(FILE_LIST "${SOURCE_PATH}/LICENSE")
