// The version macros, the run-time version functions and the inline
// namespace agree with each other and with CMake's project version.
#include <catch2/catch.hpp>
#include <kvcache/kvcache.hpp>

#include <string>
#include <type_traits>

TEST_CASE("the version macros and functions agree with CMake's project version") {
  CHECK(std::string(KVCACHE_VERSION_STRING) == KVCACHE_PROJECT_VERSION);
  CHECK(std::string(kvcache::version_string()) == KVCACHE_PROJECT_VERSION);
  CHECK(KVCACHE_VERSION == KVCACHE_VERSION_MAJOR * 10000 + KVCACHE_VERSION_MINOR * 100 + KVCACHE_VERSION_PATCH);
  CHECK(kvcache::version() == KVCACHE_VERSION);
  const std::string expected = std::to_string(KVCACHE_VERSION_MAJOR) + "." + std::to_string(KVCACHE_VERSION_MINOR) +
                               "." + std::to_string(KVCACHE_VERSION_PATCH);
  CHECK(expected == KVCACHE_PROJECT_VERSION);
}

TEST_CASE("every symbol sits in the inline namespace named for the major version") {
  CHECK(std::string(KVCACHE_STRINGIFY(KVCACHE_INLINE_NAMESPACE)) == "v" + std::to_string(KVCACHE_VERSION_MAJOR));
  STATIC_REQUIRE(std::is_same_v<kvcache::Geometry, kvcache::KVCACHE_INLINE_NAMESPACE::Geometry>);
  STATIC_REQUIRE(std::is_same_v<kvcache::Cache<>, kvcache::KVCACHE_INLINE_NAMESPACE::Cache<>>);
}
