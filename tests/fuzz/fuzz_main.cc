// libFuzzer entry for one fuzz target; VRDMA_FUZZ_ENTRY names its function (fuzz_command.cc,
// fuzz_ring.cc). The same functions run in the replay test (replay_test.cc) without libFuzzer.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

namespace vrdma::fuzz {
int VRDMA_FUZZ_ENTRY(const uint8_t* data, size_t size);
}

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  ::setenv("VRDMA_LOG", "error", 0);  // a log line per session would drown the fuzzer's output
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return vrdma::fuzz::VRDMA_FUZZ_ENTRY(data, size);
}
