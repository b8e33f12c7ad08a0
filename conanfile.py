# Conan 2 recipe: header-only, no requirements. `conan create . -s compiler.cppstd=20`
# packages the headers and kernels with the CMake config files, and builds and
# runs test_package against the result.
import os
import re

from conan import ConanFile
from conan.tools.build import check_min_cppstd
from conan.tools.cmake import CMake, cmake_layout
from conan.tools.files import load


class KvcacheConan(ConanFile):
    name = "kvcache"
    license = "Apache-2.0"
    description = "Header-only C++20 KV-cache manager for transformer inference engines (host + CUDA kernels)"
    topics = ("llm", "inference", "kv-cache", "cuda", "header-only")
    package_type = "header-library"
    settings = "os", "arch", "compiler", "build_type"
    generators = "CMakeToolchain"
    exports_sources = "CMakeLists.txt", "LICENSE", "cmake/*", "include/*"
    no_copy_source = True

    def set_version(self):
        header = load(self, os.path.join(self.recipe_folder, "include", "kvcache", "version.hpp"))
        parts = [re.search(rf"#define KVCACHE_VERSION_{p} (\d+)", header).group(1) for p in ("MAJOR", "MINOR", "PATCH")]
        self.version = ".".join(parts)

    def validate(self):
        check_min_cppstd(self, 20)

    def layout(self):
        cmake_layout(self)

    def package(self):
        cmake = CMake(self)
        cmake.configure(variables={"KVCACHE_BUILD_TESTS": "OFF", "KVCACHE_BUILD_EXAMPLES": "OFF",
                                   "KVCACHE_BUILD_BENCH": "OFF", "KVCACHE_ENABLE_CUDA": "OFF"})
        cmake.install()

    def package_info(self):
        self.cpp_info.bindirs = []
        self.cpp_info.libdirs = []
        self.cpp_info.set_property("cmake_file_name", "kvcache")
        self.cpp_info.set_property("cmake_target_name", "kvcache::kvcache")

    def package_id(self):
        self.info.clear()
