#include "service/unix_listener.h"

#include <fcntl.h>
#include <grpcpp/server.h>
#include <grpcpp/server_posix.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/accept_loop.h"

namespace attnd {

absl::StatusOr<std::unique_ptr<UnixListener>> UnixListener::Start(const std::string& path,
                                                                  unsigned mode,
                                                                  grpc::Server* server) {
  sockaddr_un addr{};
  if (path.empty() || path.size() >= sizeof(addr.sun_path))
    return absl::InvalidArgumentError(
        absl::StrCat("--shm-socket: path must be 1 to ", sizeof(addr.sun_path) - 1, " bytes"));
  struct stat st {};
  if (lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode))
      return absl::FailedPreconditionError(
          absl::StrCat("--shm-socket: ", path, " exists and is not a socket"));
    unlink(path.c_str());  // left by an earlier run
  }
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      chmod(path.c_str(), mode) != 0 || listen(fd, 128) != 0) {
    const std::string why = std::strerror(errno);
    close(fd);
    return absl::UnavailableError(absl::StrCat("--shm-socket: cannot listen on ", path, ": ", why));
  }
  std::unique_ptr<UnixListener> l(new UnixListener(path, fd));
  auto loop = AcceptLoop::Start(fd, [server](int conn) {
    // gRPC takes the descriptor (non-blocking, as its event engine expects) and closes it.
    fcntl(conn, F_SETFL, fcntl(conn, F_GETFL) | O_NONBLOCK);
    grpc::AddInsecureChannelFromFd(server, conn);
  });
  if (!loop.ok()) return loop.status();
  l->loop_ = std::move(loop).value();
  return l;
}

UnixListener::UnixListener(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}

UnixListener::~UnixListener() {
  loop_.reset();  // no more connections handed over
  close(fd_);
  unlink(path_.c_str());
}

}  // namespace attnd
