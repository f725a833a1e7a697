// Fuzz target: the guest->backend command decoder *and* handler. The input is a sequence of
// messages one session sends (each with flags that can repair its header, size its body for the
// opcode, or attach a sealed memfd), fed to Server::handle as if read from the socket, so every
// Device control method sees fuzzer-chosen fields in any order (commands before hello, handles
// of nothing, rings then modifies of QPs that do not exist ...). The responses and any fds
// they carry are read back and closed, as a guest would.
// What must hold: no crash, no sanitizer report, no descriptor or memory kept after the session
// ends (LeakSanitizer checks the latter).
#include <sys/socket.h>

#include <cstring>
#include <vector>

#include "backend/server.h"
#include "common/memfd.h"
#include "common/socket.h"

namespace vrdma::fuzz {

using namespace vrdma::proto;

class CommandFuzzer {
 public:
  static void run(const uint8_t* data, size_t size) {
    backend::Config cfg;
    // Small quotas, so sequences reach them (and their log lines) quickly.
    cfg.quotas = engine::Quotas{4, 4, 4, 2, 8, 1u << 20, 256};
    backend::Server srv(cfg);
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sv) < 0) return;
    UniqueFd peer(sv[1]);
    backend::Server::Conn c;
    c.sock = UniqueFd(sv[0]);
    for (int n = 0; size >= 3 && n < 64; ++n) {
      const uint8_t flags = data[0];
      size_t len = data[1] | size_t{data[2]} << 8;
      data += 3;
      size -= 3;
      if (len > size) len = size;
      std::vector<uint8_t> msg(data, data + len);
      data += len;
      size -= len;
      if (flags & 1) fix_header(msg, flags & 2);
      std::vector<UniqueFd> fds;
      if (flags & 4) {
        // A segment of the size the request names, when it is small enough, else a page.
        uint64_t want = 4096;
        if (msg.size() >= sizeof(MsgHeader) + sizeof(RegSegmentReq))
          std::memcpy(&want, msg.data() + sizeof(MsgHeader), sizeof(want));
        if (want == 0 || want > (1u << 20)) want = 4096;
        if (auto fd = make_sealed_memfd("fuzz-seg", want); fd.is_ok()) fds.push_back(std::move(*fd));
      }
      const Status st = srv.handle(c, msg, fds);
      drain(peer.get());
      if (!st.is_ok()) break;  // the server drops such a connection
    }
    if (c.session) srv.dev_.close_session(c.session);
  }

 private:
  /// Makes the header well-formed (magic, version, length), and the body the opcode's size.
  static void fix_header(std::vector<uint8_t>& msg, bool size_body) {
    if (msg.size() < sizeof(MsgHeader)) msg.resize(sizeof(MsgHeader));
    MsgHeader h;
    std::memcpy(&h, msg.data(), sizeof(h));
    h.magic = kMagic;
    h.version = kVersion;
    h.op = static_cast<uint16_t>(1 + h.op % (static_cast<uint16_t>(Op::kMax) - 1));
    if (size_body) msg.resize(sizeof(MsgHeader) + request_body_size(static_cast<Op>(h.op)));
    h.length = static_cast<uint32_t>(msg.size());
    std::memcpy(msg.data(), &h, sizeof(h));
  }
  static void drain(int sock) {
    std::vector<uint8_t> buf;
    std::vector<UniqueFd> fds;
    while (recv_msg(sock, buf, kMaxResponse, fds).is_ok()) fds.clear();
  }
};

int fuzz_command(const uint8_t* data, size_t size) {
  CommandFuzzer::run(data, size);
  return 0;
}

}  // namespace vrdma::fuzz
