// Starts a real attnd binary for integration tests and stops it with SIGTERM.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace attnd::testing {

// The attnd binary to test: $ATTND_BIN when set (e.g. an older build, to show a test fails
// there), else `built` (the one this build made).
std::string AttndBinary(const std::string& built);

// A fresh Unix-socket path for a server's --shm-socket (unique per test process and tag).
std::string SocketPath(const std::string& tag);
// Whether this run drives the layer calls over the UCX data plane (ATTND_TEST_DATA_PLANE=ucx:
// ctest runs the layer-call suites a second time so, prefixed "ucx.").
bool TestDataPlane();
// The flags of a suite's shared tiny-model server: 400 pages, 2 threads, no metrics port, the
// step idle timeout and message limit given, shared memory on the Unix socket SocketPath(tag),
// and --data-plane=ucx when TestDataPlane().
std::vector<std::string> SharedServerArgs(const std::string& tag, int64_t step_idle_timeout_ms,
                                          int64_t max_message_bytes);

class ServerProcess {
 public:
  // Runs `binary --grpc-port=0 <args>` and waits for its "serving" line; port() is the port it
  // bound. Aborts the test binary if the server does not come up in 30 s.
  ServerProcess(const std::string& binary, const std::vector<std::string>& args);
  // Stops the server if still running.
  ~ServerProcess();

  int port() const { return port_; }
  std::string target() const { return "127.0.0.1:" + std::to_string(port_); }
  pid_t pid() const { return pid_; }
  // SIGTERM, then waits; returns the exit status (or 128 + signal).
  int Stop();

 private:
  pid_t pid_ = -1;
  int port_ = 0;
  int stdout_fd_ = -1;
};

}  // namespace attnd::testing
