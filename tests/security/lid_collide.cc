// What an attacker who wants a given LID runs: prints a guest name whose LID, as vrdma derives it
// from the name (src/common/identity.h), is LID. Usage: lid_collide LID
#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/identity.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s LID\n", argv[0]);
    return 2;
  }
  const unsigned long lid = std::strtoul(argv[1], nullptr, 0);
  if (lid < 1 || lid > 0xbfff) return 2;
  for (unsigned i = 0;; ++i) {
    const std::string n = "m" + std::to_string(i);
    if (vrdma::lid_of_name(n) == lid) {
      std::printf("%s\n", n.c_str());
      return 0;
    }
  }
}
