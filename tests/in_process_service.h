// What the service-level tests (tests/service/) drive without a transport: the tiny model's
// CPU engine and an AttentionService over it, in this process.
#pragma once

#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <string>

#include "engine/engine.h"
#include "metrics/metrics.h"
#include "service/attention_service.h"
#include "service/executor.h"
#include "service/service_metrics.h"

namespace attnd::testing {

// The tiny model on one CPU device of `pages` pages, `threads` compute threads (`cpu_isa`: ""
// for the machine's widest).
inline std::unique_ptr<Engine> TinyEngine(int32_t pages, int threads,
                                          const std::string& cpu_isa = "") {
  EngineOptions o;
  o.spec = PresetModelSpec("tiny").value();
  o.pages_per_device = pages;
  o.threads = threads;
  if (!cpu_isa.empty()) o.device.cpu_isa = cpu_isa;
  return Engine::Create(o).value();
}

// An engine, an executor of `executor_threads` and the service over them (messages up to
// 64 MiB unless `options` says), destroyed in the order a server stops them (the service first,
// the engine last).
struct InProcessService {
  InProcessService(std::unique_ptr<Engine> e, int executor_threads, ServiceOptions options = {})
      : engine(std::move(e)),
        executor(executor_threads),
        metrics(std::make_unique<ServiceMetrics>(&registry, engine.get())) {
    if (options.max_message_bytes == 0) options.max_message_bytes = 64 << 20;
    service = std::make_unique<AttentionService>(engine.get(), &executor, metrics.get(), options);
  }
  std::unique_ptr<Engine> engine;
  Executor executor;
  metrics::Registry registry;
  std::unique_ptr<ServiceMetrics> metrics;
  std::unique_ptr<AttentionService> service;
};

// A caller as over the Unix-socket listener, where shared memory is allowed: the anonymous
// tenant, whose peer credentials, read from one end of a socket pair, are this process's.
class LocalCaller {
 public:
  LocalCaller() {
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sockets_) == 0) {
      caller_.local = true;
      caller_.socket_fd = sockets_[0];
    }
  }
  ~LocalCaller() {
    for (int fd : sockets_)
      if (fd >= 0) close(fd);
  }
  LocalCaller(const LocalCaller&) = delete;
  LocalCaller& operator=(const LocalCaller&) = delete;
  bool ok() const { return caller_.local; }
  operator const Caller&() const { return caller_; }  // NOLINT: stands for the caller

 private:
  int sockets_[2] = {-1, -1};
  Caller caller_;
};

}  // namespace attnd::testing
