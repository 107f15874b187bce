#include "common/accept_loop.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace attnd {

absl::StatusOr<std::unique_ptr<AcceptLoop>> AcceptLoop::Start(
    int listen_fd, std::function<void(int)> on_connection) {
  std::unique_ptr<AcceptLoop> loop(new AcceptLoop(listen_fd, std::move(on_connection)));
  if (pipe2(loop->wake_, O_CLOEXEC) != 0)
    return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
  loop->thread_ = std::thread([p = loop.get()] { p->Run(); });
  return loop;
}

AcceptLoop::~AcceptLoop() {
  if (thread_.joinable()) {
    const char c = 0;
    if (write(wake_[1], &c, 1) != 1) shutdown(listen_fd_, SHUT_RDWR);
    thread_.join();
  }
  for (int p : wake_)
    if (p >= 0) close(p);
}

void AcceptLoop::Run() {
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {  // EAGAIN, ECONNABORTED, EMFILE: keep serving the others
      if (errno == EMFILE || errno == ENFILE) usleep(10000);  // no busy loop while out of fds
      continue;
    }
    on_connection_(fd);
  }
}

}  // namespace attnd
