// What the service-level tests (tests/service/) drive without a transport: the tiny model's
// CPU engine and an AttentionService over it, in this process.
#pragma once

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

// The service over `engine`, posting layers to `executor`, its metrics in `registry`.
inline std::unique_ptr<AttentionService> ServiceOver(Engine* engine, Executor* executor,
                                                     metrics::Registry* registry,
                                                     std::unique_ptr<ServiceMetrics>* metrics,
                                                     ServiceOptions options) {
  if (options.max_message_bytes == 0) options.max_message_bytes = 64 << 20;
  *metrics = std::make_unique<ServiceMetrics>(registry, engine);
  return std::make_unique<AttentionService>(engine, executor, metrics->get(), options);
}

}  // namespace attnd::testing
