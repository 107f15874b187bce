#include "tests/server_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <regex>

namespace attnd::testing {

std::string AttndBinary(const std::string& built) {
  const char* env = std::getenv("ATTND_BIN");
  return env && *env ? env : built;
}

std::string SocketPath(const std::string& tag) {
  return "/tmp/attnd-" + tag + "-" + std::to_string(getpid()) + ".sock";
}

std::vector<std::string> SharedServerArgs(const std::string& tag, int64_t step_idle_timeout_ms,
                                          int64_t max_message_bytes) {
  std::vector<std::string> args = {"--model=tiny",
                                   "--kv-pages=400",
                                   "--threads=2",
                                   "--metrics-port=0",
                                   "--step-idle-timeout-ms=" + std::to_string(step_idle_timeout_ms),
                                   "--max-message-bytes=" + std::to_string(max_message_bytes),
                                   "--shm",
                                   "--shm-socket=" + SocketPath(tag)};
  if (TestDataPlane()) args.push_back("--data-plane=ucx");
  return args;
}

bool TestDataPlane() {
  const char* v = getenv("ATTND_TEST_DATA_PLANE");
  return v != nullptr && std::string(v) == "ucx";
}

ServerProcess::ServerProcess(const std::string& built, const std::vector<std::string>& args) {
  const std::string binary = AttndBinary(built);
  int fds[2];
  if (pipe(fds) != 0) std::abort();
  pid_ = fork();
  if (pid_ == 0) {
    dup2(fds[1], STDOUT_FILENO);
    close(fds[0]);
    std::vector<std::string> all = {binary, "--grpc-port=0", "--grpc-address=127.0.0.1"};
    all.insert(all.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : all) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(binary.c_str(), argv.data());
    std::perror("execv attnd");
    _exit(127);
  }
  close(fds[1]);
  stdout_fd_ = fds[0];
  std::string out;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  const std::regex serving("serving attnd.v1 on [^ ]*:([0-9]+)");
  std::smatch m;
  while (!std::regex_search(out, m, serving)) {
    pollfd p{stdout_fd_, POLLIN, 0};
    const int left = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                          deadline - std::chrono::steady_clock::now())
                                          .count());
    char buf[512];
    ssize_t n = 0;
    if (left <= 0 || poll(&p, 1, left) <= 0 || (n = read(stdout_fd_, buf, sizeof(buf))) <= 0) {
      std::fprintf(stderr, "attnd did not start; its output:\n%s\n", out.c_str());
      std::abort();
    }
    out.append(buf, n);
  }
  port_ = std::stoi(m[1]);
}

int ServerProcess::Stop() {
  if (pid_ <= 0) return -1;
  kill(pid_, SIGTERM);
  int status = 0;
  waitpid(pid_, &status, 0);
  pid_ = -1;
  if (stdout_fd_ >= 0) close(stdout_fd_);
  stdout_fd_ = -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

ServerProcess::~ServerProcess() { Stop(); }

}  // namespace attnd::testing
