// The service's Prometheus metrics (docs/lifecycle.md), Prometheus naming conventions throughout:
// build info; errors by RPC method and status code; steps by outcome and aborted steps by reason;
// rejections by reason; tokens once per committed step by phase; layer and step latency by phase
// (and layer kind); payload bytes; the executor's queue; compute seconds and cache use per device;
// the tiers below the devices (pages and sequences per tier, bytes moved, spills and restores by
// reason with their latency, data loss); and the standard process_* metrics. Engine-owned values
// are read by a collect hook at scrape time, so the hot path records only what it alone knows
// (timings, bytes, errors).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "engine/engine.h"
#include "metrics/metrics.h"

namespace attnd {

namespace transport {
class UcxPlane;
}

enum class Transport { kStream, kUnary };

class Executor;
class KvEventPublisher;

class ReplicationHook;

class ServiceMetrics {
 public:
  // Registers every family in `registry`; registry, engine and executor (may be null) outlive
  // this object. Thread safe.
  ServiceMetrics(metrics::Registry* registry, const Engine* engine, Executor* executor = nullptr);

  // One layer call finished successfully: its wall time inside the server, the step's phase,
  // the layer's kind, and the payload bytes of the request and the reply.
  void LayerDone(Transport transport, StepPhase phase, LayerKind kind, double seconds,
                 size_t bytes_received, size_t bytes_sent);
  // A step committed `seconds` after it began.
  void StepDone(StepPhase phase, double seconds);
  // An RPC finished with `status` (counted by code; errors also apart); a refused OpenSequence or
  // BeginStep also counts as a rejection by reason (cache full, quota, max_context, draining).
  // `seconds`: from the call's start to its status (a stream: its lifetime).
  void RpcDone(const char* method, const absl::Status& status, double seconds);
  // A tier move or a data loss (EngineOptions::on_tier_event): its latency by kind.
  void TierMoved(const TierEvent& event);
  // The KV-event publisher whose counts to export (set once, before serving).
  void SetKvEvents(const KvEventPublisher* events) { kv_events_ = events; }
  // The standby replicas' replicator whose state to export (set once, before serving).
  void SetReplicator(const ReplicationHook* replicator) { replicator_ = replicator; }
  // The UCX data plane whose state to export (set once, before serving).
  void SetDataPlane(const transport::UcxPlane* plane) { data_plane_ = plane; }
  // A layer call began (+1) or ended (-1) its wait for its data plane transfers to land.
  void CallsWaiting(int delta) {
    delta > 0 ? calls_waiting_->Increment() : calls_waiting_->Decrement();
  }
  // A standby copy here was promoted (failover).
  void Promoted() { promotions_->Increment(); }

 private:
  void Refresh();
  const Engine* engine_;
  Executor* executor_;
  // Every label set of the hot path made at construction: the hot path indexes, never inserts.
  metrics::Histogram* layer_seconds_[2][3][3];  // [transport][phase][kind]
  metrics::Histogram* step_seconds_[3];         // [phase]
  metrics::Family<metrics::Counter>* requests_;
  metrics::HistogramFamily* rpc_seconds_;
  // Per method of the service, fixed after construction: one lookup per finished call.
  struct MethodSeries {
    metrics::Counter* ok;         // requests_{method, code="OK"}
    metrics::Histogram* seconds;  // rpc_seconds_{method}
  };
  absl::flat_hash_map<std::string, MethodSeries> methods_;
  metrics::Family<metrics::Counter>* errors_;
  metrics::Family<metrics::Counter>* rejections_;
  metrics::Counter* bytes_received_;
  metrics::Counter* bytes_sent_;
  metrics::Counter* steps_committed_;
  metrics::Counter* steps_aborted_;
  metrics::Counter* sequences_expired_;
  metrics::Family<metrics::Counter>* aborted_by_reason_;
  metrics::Family<metrics::Counter>* tokens_;
  metrics::Family<metrics::Counter>* compute_seconds_;
  metrics::Gauge* sequences_;
  metrics::Gauge* open_steps_;
  metrics::Gauge* queue_depth_;
  metrics::Family<metrics::Gauge>* pages_;
  metrics::Family<metrics::Gauge>* utilization_;
  // Tiers: pages and sequences by tier, bytes moved, moves by kind and reason, their latency,
  // sequences lost.
  metrics::Family<metrics::Gauge>* tier_pages_;
  metrics::Family<metrics::Gauge>* tier_sequences_;
  metrics::Family<metrics::Counter>* tier_bytes_;
  metrics::Family<metrics::Counter>* tier_moves_;
  metrics::Histogram* move_seconds_[2];  // [spill, restore]
  metrics::Counter* data_loss_;
  // The prefix cache and its KV events.
  metrics::Gauge* prefix_blocks_;
  metrics::Gauge* prefix_retained_;
  metrics::Counter* prefix_lookups_;
  metrics::Counter* prefix_hit_;
  metrics::Counter* prefix_miss_;
  metrics::Counter* prefix_tokens_;
  // vLLM's prompt_tokens_by_source: local_compute, local_cache_hit, external_kv_transfer.
  metrics::Counter* prompt_by_source_[3];
  // Cached prompt tokens by where they were: device, host, disk (prefix cache), standby.
  metrics::Counter* cached_by_source_[4];
  metrics::Counter* prefix_stored_;
  metrics::Counter* prefix_removed_;
  metrics::Counter* events_published_;
  metrics::Counter* events_dropped_;
  std::atomic<const KvEventPublisher*> kv_events_{nullptr};
  // Standby replicas (docs/replication.md).
  std::atomic<const ReplicationHook*> replicator_{nullptr};
  metrics::Gauge* repl_lag_steps_;
  metrics::Gauge* repl_lag_bytes_;
  metrics::Counter* repl_bytes_;
  metrics::Counter* repl_steps_;
  metrics::Family<metrics::Gauge>* repl_sequences_;
  metrics::Family<metrics::Counter>* repl_commits_;
  metrics::Gauge* standby_sequences_;
  metrics::Gauge* standby_pages_;
  metrics::Counter* promotions_;
  metrics::Counter* fenced_;
  metrics::Counter* repl_errors_;
  metrics::Counter* repl_degraded_;
  // The UCX data plane (docs/data-plane.md).
  std::atomic<const transport::UcxPlane*> data_plane_{nullptr};
  metrics::Gauge* planes_;
  metrics::Counter* plane_bytes_[2];  // in, out
  metrics::Counter* plane_refused_;
  metrics::Counter* planes_closed_[5];  // closed, idle, silent, stalled, lost
  metrics::Counter* ucx_log_held_;      // transport::UcxLogLinesSuppressed
  metrics::Gauge* calls_waiting_;
  // process_*
  metrics::Gauge* rss_;
  metrics::Gauge* vsize_;
  metrics::Counter* cpu_seconds_;
  metrics::Gauge* open_fds_;
  metrics::Gauge* max_fds_;
  metrics::Gauge* threads_;
  metrics::Gauge* start_time_;
};

}  // namespace attnd
