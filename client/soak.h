// `attnctl soak`: mixed valid traffic with random aborts, cancels, disconnects and bad requests
// against one attnd on loopback, for a bounded time; reports steps, errors by status, the
// server's RSS and open descriptors over time, and ends with a state audit (every sequence's
// length equals its committed steps, every page is back in the pool once they are closed).
#pragma once

#include <cstdint>
#include <string>

namespace attnd::client {

struct SoakOptions {
  std::string target = "127.0.0.1:50051";  // loopback only
  double minutes = 1;
  int clients = 4;  // concurrent workers, each with its own sequences
  int sequences_per_client = 4;
  int64_t max_length = 1500;  // a sequence longer than this is closed and opened again
  int report_seconds = 30;
  int server_pid = 0;  // read RSS and fds from /proc/PID (0: not reported)
  uint64_t seed = 1;
};

// Returns 0 when no unexpected error happened and the audit passed.
int RunSoak(const SoakOptions& options);

// A size field of /proc/PID/status in bytes ("VmRSS", "VmHWM": the resident set now, its peak),
// or -1 where there is none.
int64_t ProcStatusBytes(int pid, const char* field);

}  // namespace attnd::client
