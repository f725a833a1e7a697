// vrdmad: the vrdma backend, the process that plays the RDMA device for the guests of a host.
#include <signal.h>

#include <CLI/CLI.hpp>

#include "backend/server.h"
#include "common/log.h"
#include "common/paths.h"

namespace {
vrdma::backend::Server* g_server = nullptr;
void on_signal(int) {
  if (g_server) g_server->stop();
}
}  // namespace

int main(int argc, char** argv) {
  vrdma::backend::Options opt;
  opt.socket_path = vrdma::socket_path();
  CLI::App app{"vrdmad: the vrdma backend (the software RDMA device)"};
  app.add_option("--socket", opt.socket_path, "unix socket guests connect to");
  app.add_option("--idle-exit", opt.idle_exit_s, "exit after this many seconds without guests (0: never)");
  app.add_option("--spin-us", opt.spin_us, "microseconds to poll idle rings before sleeping");
  CLI11_PARSE(app, argc, argv);

  ::signal(SIGPIPE, SIG_IGN);
  struct sigaction sa{};
  sa.sa_handler = on_signal;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);

  vrdma::backend::Server server(opt);
  g_server = &server;
  vrdma::Status st = server.run();
  if (!st.is_ok()) {
    VLOG_ERROR("{}", st.message());
    return 1;
  }
  return 0;
}
