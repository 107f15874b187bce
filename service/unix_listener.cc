#include "service/unix_listener.h"

#include <fcntl.h>
#include <grpcpp/server.h>
#include <grpcpp/server_posix.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

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
  std::unique_ptr<UnixListener> l(new UnixListener(path, fd, server));
  if (pipe2(l->wake_, O_CLOEXEC) != 0)
    return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
  l->thread_ = std::thread([p = l.get()] { p->Run(); });
  return l;
}

UnixListener::UnixListener(std::string path, int fd, grpc::Server* server)
    : path_(std::move(path)), fd_(fd), server_(server) {}

UnixListener::~UnixListener() {
  if (thread_.joinable()) {
    const char c = 0;
    if (write(wake_[1], &c, 1) != 1) shutdown(fd_, SHUT_RDWR);
    thread_.join();
  }
  for (int p : wake_)
    if (p >= 0) close(p);
  close(fd_);
  unlink(path_.c_str());
}

void UnixListener::Run() {
  for (;;) {
    pollfd fds[2] = {{fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    const int conn = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (conn < 0) {  // EAGAIN, ECONNABORTED, EMFILE: keep serving the others
      if (errno == EMFILE || errno == ENFILE) usleep(10000);  // no busy loop while out of fds
      continue;
    }
    // gRPC takes the descriptor (non-blocking, as its event engine expects) and closes it.
    fcntl(conn, F_SETFL, fcntl(conn, F_GETFL) | O_NONBLOCK);
    grpc::AddInsecureChannelFromFd(server_, conn);
  }
}

}  // namespace attnd
