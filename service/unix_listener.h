// The local listener for co-located clients (docs/trust.md): a Unix-domain socket whose
// connections are handed to the gRPC server one by one, so a call's peer reads "fd:N" and the
// service can ask the kernel who is at the other end (SO_PEERCRED) before it opens a client's
// shared-memory object. gRPC's own `unix:` listener hides the connection's descriptor.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace grpc {
class Server;
}

namespace attnd {

class AcceptLoop;

class UnixListener {
 public:
  // Binds `path` (an existing socket file there is replaced; any other file is an error),
  // chmod `mode`, and hands every accepted connection to `server`, which must outlive this.
  static absl::StatusOr<std::unique_ptr<UnixListener>> Start(const std::string& path, unsigned mode,
                                                             grpc::Server* server);
  // Stops accepting (connections already handed over stay with the server) and removes the
  // socket file.
  ~UnixListener();
  UnixListener(const UnixListener&) = delete;
  UnixListener& operator=(const UnixListener&) = delete;
  const std::string& path() const { return path_; }

 private:
  UnixListener(std::string path, int fd);

  const std::string path_;
  const int fd_;
  std::unique_ptr<AcceptLoop> loop_;  // reset first in the destructor: it uses fd_
};

}  // namespace attnd
