// The service's Prometheus metrics (DESIGN §8): layer latency and throughput by transport, steps
// by outcome, cache pages per device, sequences and open steps. Engine-owned values are read by a
// collect hook at scrape time, so the hot path only records layer timings.
#pragma once

#include <cstdint>

#include "engine/engine.h"
#include "service/metrics.h"

namespace attnd {

enum class Transport { kStream, kUnary };

class ServiceMetrics {
 public:
  // Registers every family in `registry`; both outlive this object. Thread safe.
  ServiceMetrics(metrics::Registry* registry, const Engine* engine);

  // One layer call finished successfully: its wall time and the step's token count.
  void LayerDone(Transport transport, int64_t tokens, double seconds);

 private:
  void Refresh();
  const Engine* engine_;
  metrics::Histogram* layer_seconds_[2];
  metrics::Counter* layer_tokens_[2];
  metrics::Counter* steps_committed_;
  metrics::Counter* steps_aborted_;
  metrics::Gauge* sequences_;
  metrics::Gauge* open_steps_;
  metrics::Family<metrics::Gauge>* pages_;
};

}  // namespace attnd
