#include "service/service_metrics.h"

namespace attnd {

ServiceMetrics::ServiceMetrics(metrics::Registry* registry, const Engine* engine)
    : engine_(engine) {
  auto& seconds = registry->AddHistogram(
      "attnd_layer_seconds", "Wall time of one layer call inside the server, by transport.",
      metrics::DefaultLatencyBuckets());
  auto& tokens = registry->AddCounter("attnd_layer_tokens_total",
                                      "Query tokens processed, summed over layers, by transport.");
  const char* names[2] = {"stream", "unary"};
  for (int i = 0; i < 2; ++i) {
    layer_seconds_[i] = &seconds.Add({{"transport", names[i]}});
    layer_tokens_[i] = &tokens.Add({{"transport", names[i]}});
  }
  auto& steps = registry->AddCounter("attnd_steps_total", "Steps finished, by outcome.");
  steps_committed_ = &steps.Add({{"outcome", "committed"}});
  steps_aborted_ = &steps.Add({{"outcome", "aborted"}});
  sequences_ = &registry->AddGauge("attnd_sequences", "Open sequences.").Add({});
  open_steps_ = &registry->AddGauge("attnd_open_steps", "Steps open right now.").Add({});
  pages_ = &registry->AddGauge("attnd_cache_pages",
                               "KV cache pages per device by state (used, free); page 0 excluded.");
  registry->AddCollectHook([this] { Refresh(); });
}

void ServiceMetrics::LayerDone(Transport transport, int64_t tokens, double seconds) {
  const int i = transport == Transport::kStream ? 0 : 1;
  layer_seconds_[i]->Observe(seconds);
  layer_tokens_[i]->Increment(static_cast<double>(tokens));
}

void ServiceMetrics::Refresh() {
  // Counters only go up; the engine's totals are the truth, so add the difference.
  steps_committed_->Increment(static_cast<double>(engine_->steps_committed()) -
                              steps_committed_->Value());
  steps_aborted_->Increment(static_cast<double>(engine_->steps_aborted()) -
                            steps_aborted_->Value());
  sequences_->Set(static_cast<double>(engine_->num_sequences()));
  open_steps_->Set(static_cast<double>(engine_->num_open_steps()));
  for (const DeviceCapacity& d : engine_->Capacity()) {
    pages_->Add({{"device", d.name}, {"state", "used"}}).Set(d.pages_total - d.pages_free);
    pages_->Add({{"device", d.name}, {"state", "free"}}).Set(d.pages_free);
  }
}

}  // namespace attnd
