// A thread that accepts connections on a listening socket and hands each to a callback until it
// is destroyed (a pipe wakes its poll). Out of descriptors (EMFILE/ENFILE) it pauses 10 ms
// instead of spinning; other accept errors skip that connection. Used by the Unix-socket listener
// and the HTTPS metrics listener.
#pragma once

#include <functional>
#include <memory>
#include <thread>

#include "absl/status/statusor.h"

namespace attnd {

class AcceptLoop {
 public:
  // `listen_fd` stays the caller's (not closed here) and must outlive this object.
  static absl::StatusOr<std::unique_ptr<AcceptLoop>> Start(int listen_fd,
                                                           std::function<void(int)> on_connection);
  // Stops accepting and joins (a connection being handed over finishes first).
  ~AcceptLoop();
  AcceptLoop(const AcceptLoop&) = delete;
  AcceptLoop& operator=(const AcceptLoop&) = delete;

 private:
  AcceptLoop(int listen_fd, std::function<void(int)> on_connection)
      : listen_fd_(listen_fd), on_connection_(std::move(on_connection)) {}
  void Run();

  const int listen_fd_;
  const std::function<void(int)> on_connection_;
  int wake_[2] = {-1, -1};
  std::thread thread_;
};

}  // namespace attnd
