// Replays the fuzzers' corpora (seeds and every input that once crashed, tests/fuzz/corpus/*)
// through the fuzz targets in an ordinary build: each preset (ASan+UBSan, TSan included) checks
// that no input that was ever interesting crashes the backend again.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

namespace vrdma::fuzz {
int fuzz_command(const uint8_t* data, size_t size);
int fuzz_ring(const uint8_t* data, size_t size);
int fuzz_wire(const uint8_t* data, size_t size);
int fuzz_direct_wire(const uint8_t* data, size_t size);

namespace {

void replay(const char* name, int (*target)(const uint8_t*, size_t)) {
  const std::filesystem::path dir = std::filesystem::path(VRDMA_FUZZ_CORPUS) / name;
  size_t n = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    std::ifstream f(e.path(), std::ios::binary);
    std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), {});
    SCOPED_TRACE(e.path().string());
    EXPECT_EQ(target(bytes.data(), bytes.size()), 0);
    ++n;
  }
  EXPECT_GT(n, 0u) << "no corpus in " << dir;
}

TEST(FuzzReplay, CommandCorpus) { replay("command", fuzz_command); }
TEST(FuzzReplay, RingCorpus) { replay("ring", fuzz_ring); }
TEST(FuzzReplay, WireCorpus) { replay("wire", fuzz_wire); }
TEST(FuzzReplay, DirectWireCorpus) { replay("direct_wire", fuzz_direct_wire); }

}  // namespace
}  // namespace vrdma::fuzz
