// What attnctl's commands share (client/attnctl.cc, client/attnctl_bench.cc): the parsed
// arguments, closing what a command opened, failures, and whether a workload fits the server.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "client/attnd_client.h"
#include "common/model_spec.h"

namespace attnd::client::ctl {

using Clock = std::chrono::steady_clock;
inline double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

struct Args {
  std::string command;
  std::map<std::string, std::string> flags;
  std::string Get(const std::string& k, const std::string& d) const {
    auto it = flags.find(k);
    return it == flags.end() ? d : it->second;
  }
  int64_t Int(const std::string& k, int64_t d) const {
    int64_t v = d;
    if (flags.count(k) && !absl::SimpleAtoi(flags.at(k), &v)) {
      std::fprintf(stderr, "attnctl: --%s wants an integer\n", k.c_str());
      std::exit(2);
    }
    return v;
  }
};

// Closes the sequences a command opened on every way out of it: a demo or bench that fails
// half-way leaves nothing behind on the server. Declared before the command's stream, so the
// stream (and its open step) is gone first.
class Opened {
 public:
  explicit Opened(Client& c) : c_(c) {}
  ~Opened() {
    for (const std::string& id : ids_) (void)c_.CloseSequence(id);
  }
  void Add(const std::string& id) { ids_.push_back(id); }

 private:
  Client& c_;
  std::vector<std::string> ids_;
};

// Ctrl-C (SIGINT) or SIGTERM: the first asks the running command to stop before its next step,
// so it closes what it opened (Opened) and exits 128 + the signal; the second ends the process.
void StopOnInterrupt();
// CANCELLED "interrupted" once a first Ctrl-C came, else OK (checked before each step).
absl::Status Interrupted();

// Prints "attnctl: WHAT: STATUS" to stderr; returns 1 (the command's exit code).
int Fail(const absl::Status& s, const char* what);

// Whether sequences growing to `lengths` tokens fit the server: each within the model's
// max_context, their pages within the free pages of its devices. Checked before any tensor is
// built (a demo past max_context built gigabytes of inputs for a step the server then refused).
absl::Status CheckFits(const v1::ServerInfoResponse& info, const ModelSpec& spec,
                       const std::vector<int64_t>& lengths, const char* lower);

// The server's ServerInfo (into *info) and the model it serves: what every bench starts from.
absl::StatusOr<ModelSpec> ServedSpec(Client& c, v1::ServerInfoResponse* info);

// attnctl bench: wire bytes and per-layer round trips of the same decode layers, each way a
// worker may send them, over each transport, beside an echo of the same bytes (JSON with json).
int Bench(Client& c, const Args& a, const ConnectOptions& options, bool json);

// attnctl transport (docs/data-plane.md): per-layer transport over gRPC bytes, the UCX data plane
// and shared memory, a bare UCX round trip of the same bytes, and two micro-batches in flight.
int TransportBench(const std::string& target, const Args& a, const ConnectOptions& options,
                   bool json);

}  // namespace attnd::client::ctl
