// The translation unit the test programs' shared precompiled header is built
// with (tests/CMakeLists.txt, KVCACHE_TEST_PCH): it has no code of its own.
