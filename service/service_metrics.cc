#include "service/service_metrics.h"

#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "attnd/v1/attention.grpc.pb.h"
#include "cluster/replication_hook.h"
#include "common/build_version.h"
#include "google/protobuf/descriptor.h"
#include "service/executor.h"
#include "service/kv_events.h"
#include "transport/ucx_log.h"
#include "transport/ucx_plane.h"

namespace attnd {
namespace {

// Counters mirror engine totals: add the difference (they only go up).
void CatchUp(metrics::Counter* c, double total) {
  if (total > c->Value()) c->Increment(total - c->Value());
}

const char* CodeName(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kCancelled:
      return "CANCELLED";
    case absl::StatusCode::kUnknown:
      return "UNKNOWN";
    case absl::StatusCode::kInvalidArgument:
      return "INVALID_ARGUMENT";
    case absl::StatusCode::kDeadlineExceeded:
      return "DEADLINE_EXCEEDED";
    case absl::StatusCode::kNotFound:
      return "NOT_FOUND";
    case absl::StatusCode::kAlreadyExists:
      return "ALREADY_EXISTS";
    case absl::StatusCode::kPermissionDenied:
      return "PERMISSION_DENIED";
    case absl::StatusCode::kResourceExhausted:
      return "RESOURCE_EXHAUSTED";
    case absl::StatusCode::kFailedPrecondition:
      return "FAILED_PRECONDITION";
    case absl::StatusCode::kAborted:
      return "ABORTED";
    case absl::StatusCode::kOutOfRange:
      return "OUT_OF_RANGE";
    case absl::StatusCode::kUnimplemented:
      return "UNIMPLEMENTED";
    case absl::StatusCode::kInternal:
      return "INTERNAL";
    case absl::StatusCode::kUnavailable:
      return "UNAVAILABLE";
    case absl::StatusCode::kDataLoss:
      return "DATA_LOSS";
    case absl::StatusCode::kUnauthenticated:
      return "UNAUTHENTICATED";
    default:
      return "OK";
  }
}

// Why a new sequence or step was refused, or null when the error is not a rejection.
const char* RejectionReason(const absl::Status& s) {
  if (s.code() == absl::StatusCode::kResourceExhausted) {
    if (absl::StrContains(s.message(), "KV cache full")) return "cache_full";
    if (absl::StrContains(s.message(), "tenant quota")) return "quota";
    return "limit";
  }
  if (s.code() == absl::StatusCode::kOutOfRange && absl::StrContains(s.message(), "max_context"))
    return "max_context";
  if (s.code() == absl::StatusCode::kUnavailable) return "draining";
  return nullptr;
}

double TicksPerSecond() {
  static const double t = static_cast<double>(sysconf(_SC_CLK_TCK));
  return t;
}

}  // namespace

ServiceMetrics::ServiceMetrics(metrics::Registry* registry, const Engine* engine,
                               Executor* executor)
    : engine_(engine), executor_(executor) {
  registry->AddGauge("attnd_build_info", "attnd's version and git revision; always 1.")
      .Add({{"version", BuildVersion()}, {"revision", BuildRevision()}})
      .Set(1);
  auto& layer = registry->AddHistogram(
      "attnd_layer_seconds",
      "Wall time of one layer call inside the server, by transport, step phase and layer kind.",
      metrics::DefaultLatencyBuckets());
  auto& step = registry->AddHistogram(
      "attnd_step_seconds", "Time from BeginStep to the commit of its last layer, by phase.",
      metrics::DefaultLatencyBuckets());
  const StepPhase phases[3] = {StepPhase::kPrefill, StepPhase::kDecode, StepPhase::kImport};
  const LayerKind kinds[3] = {LayerKind::kFull, LayerKind::kShared, LayerKind::kDense};
  for (int p = 0; p < 3; ++p) {
    step_seconds_[p] = &step.Add({{"phase", StepPhaseName(phases[p])}});
    for (int t = 0; t < 2; ++t)
      for (int k = 0; k < 3; ++k)
        layer_seconds_[t][p][k] = &layer.Add({{"transport", t == 0 ? "stream" : "unary"},
                                              {"phase", StepPhaseName(phases[p])},
                                              {"kind", std::string(LayerKindName(kinds[k]))}});
  }
  requests_ = &registry->AddCounter(
      "attnd_rpc_requests_total",
      "RPCs finished, by method and gRPC status code (OK included): the error ratio's "
      "denominator.");
  errors_ = &registry->AddCounter("attnd_rpc_errors_total",
                                  "RPCs that ended in an error, by method and gRPC status code.");
  rejections_ = &registry->AddCounter(
      "attnd_rejections_total",
      "New sequences or steps refused, by reason (cache_full, quota, max_context, draining, "
      "limit).");
  rpc_seconds_ = &registry->AddHistogram(
      "attnd_rpc_seconds",
      "Time from an RPC's start to its status inside the server, by method (a Step or "
      "ExportSequence stream: its lifetime; attnd_layer_seconds times each layer).",
      metrics::DefaultLatencyBuckets());
  // Series exist before their first event, so rates and ratios do too.
  if (const google::protobuf::ServiceDescriptor* service =
          google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
              v1::Attention::service_full_name()))
    for (int m = 0; m < service->method_count(); ++m) {
      const std::string& name = service->method(m)->name();
      methods_[name] = {&requests_->Add({{"method", name}, {"code", "OK"}}),
                        &rpc_seconds_->Add({{"method", name}})};
    }
  for (const char* reason : {"cache_full", "quota", "max_context", "draining", "limit"})
    rejections_->Add({{"reason", reason}});
  auto& bytes = registry->AddCounter("attnd_payload_bytes_total",
                                     "Layer-message bytes received and replies sent.");
  bytes_received_ = &bytes.Add({{"direction", "received"}});
  bytes_sent_ = &bytes.Add({{"direction", "sent"}});
  auto& steps = registry->AddCounter("attnd_steps_total", "Steps finished, by outcome.");
  steps_committed_ = &steps.Add({{"outcome", "committed"}});
  steps_aborted_ = &steps.Add({{"outcome", "aborted"}});
  aborted_by_reason_ = &registry->AddCounter(
      "attnd_steps_aborted_total",
      "Steps aborted, by reason (error, abort, cancel, expiry, drain); each leaves its sequences "
      "as before it.");
  for (int r = 0; r < kNumAbortReasons; ++r)
    aborted_by_reason_->Add({{"reason", AbortReasonName(static_cast<AbortReason>(r))}});
  sequences_expired_ = &registry
                            ->AddCounter("attnd_sequences_expired_total",
                                         "Sequences closed because no step renewed their lease "
                                         "(--sequence-idle-timeout-s).")
                            .Add({});
  tokens_ = &registry->AddCounter(
      "attnd_tokens_total",
      "New tokens of committed steps, once per step (not per layer), by phase (prefill, decode, "
      "import).");
  compute_seconds_ = &registry->AddCounter("attnd_device_compute_seconds_total",
                                           "Seconds each device spent computing layers.");
  sequences_ = &registry->AddGauge("attnd_sequences", "Open sequences.").Add({});
  open_steps_ = &registry->AddGauge("attnd_open_steps", "Steps open right now.").Add({});
  queue_depth_ = &registry
                      ->AddGauge("attnd_executor_queue_depth",
                                 "Layer and step tasks waiting for an executor thread.")
                      .Add({});
  pages_ = &registry->AddGauge(
      "attnd_cache_pages",
      "KV cache pages per device by state (used by sequences and steps; cached: held only by the "
      "prefix cache, given back on demand; free); page 0 excluded.");
  utilization_ = &registry->AddGauge(
      "attnd_cache_utilization",
      "Fraction of each device's cache pages used by sequences and steps (0 to 1; the prefix "
      "cache's own pages are not counted).");
  tier_pages_ = &registry->AddGauge(
      "attnd_tier_pages",
      "Pages of the tiers below the devices (host, disk) by state (used, free); every device's "
      "sequences share them.");
  tier_sequences_ = &registry->AddGauge(
      "attnd_tier_sequences", "Sequences by the tier their pages are at (device, host, disk).");
  tier_bytes_ = &registry->AddCounter("attnd_tier_bytes_total",
                                      "Cache bytes moved between tiers, by direction (from, to).");
  tier_moves_ = &registry->AddCounter(
      "attnd_tier_moves_total",
      "Sequences spilled down a tier, and restored to their device by reason (step, prefetch, "
      "other: a fork, migration or export).");
  auto& move_seconds = registry->AddHistogram(
      "attnd_tier_move_seconds", "Time to copy one move's pages between tiers, by kind.",
      metrics::DefaultLatencyBuckets());
  move_seconds_[0] = &move_seconds.Add({{"kind", "spill"}});
  move_seconds_[1] = &move_seconds.Add({{"kind", "restore"}});
  data_loss_ = &registry
                    ->AddCounter("attnd_data_loss_total",
                                 "Sequences lost because a page could not be read back from the "
                                 "disk tier (a read error or a checksum mismatch).")
                    .Add({});
  prefix_blocks_ = &registry
                        ->AddGauge("attnd_prefix_cache_blocks",
                                   "Blocks in the prefix cache's index, every tenant.")
                        .Add({});
  prefix_retained_ = &registry
                          ->AddGauge("attnd_prefix_cache_retained_pages",
                                     "Pages only the prefix cache holds (closed sequences' "
                                     "blocks), every tier: given back to any request needing "
                                     "room.")
                          .Add({});
  prefix_lookups_ = &registry
                         ->AddCounter("attnd_prefix_cache_lookups_total",
                                      "Sequences opened with a prompt (token ids or block hashes).")
                         .Add({});
  auto& looked = registry->AddCounter(
      "attnd_prefix_cache_lookup_blocks_total",
      "Blocks those opens asked for, by result: hit (mapped from the cache) or miss.");
  prefix_hit_ = &looked.Add({{"result", "hit"}});
  prefix_miss_ = &looked.Add({{"result", "miss"}});
  prefix_tokens_ = &registry
                        ->AddCounter("attnd_prefix_cache_tokens_total",
                                     "Tokens served from the prefix cache (not prefilled again).")
                        .Add({});
  // Under vLLM's names and source labels (vllm:prompt_tokens_by_source_total), so a dashboard's
  // queries carry over with the prefix: prefilled here, mapped from this replica's prefix cache,
  // or kept by a failover (a standby copy promoted here held them).
  auto& by_source = registry->AddCounter(
      "attnd_prompt_tokens_by_source_total",
      "Prompt tokens by where their keys came from: local_compute (prefill steps), "
      "local_cache_hit (prefix cache), external_kv_transfer (standby copies promoted here).");
  prompt_by_source_[0] = &by_source.Add({{"source", "local_compute"}});
  prompt_by_source_[1] = &by_source.Add({{"source", "local_cache_hit"}});
  prompt_by_source_[2] = &by_source.Add({{"source", "external_kv_transfer"}});
  auto& cached = registry->AddCounter(
      "attnd_prompt_tokens_cached_by_source_total",
      "Prompt tokens not prefilled again, by where they were: the prefix cache's device, host or "
      "disk tier, or a standby copy promoted here.");
  for (int t = 0; t < kNumTiers; ++t)
    cached_by_source_[t] = &cached.Add({{"source", TierName(static_cast<Tier>(t))}});
  cached_by_source_[kNumTiers] = &cached.Add({{"source", "standby"}});
  prefix_stored_ = &registry
                        ->AddCounter("attnd_prefix_cache_stored_blocks_total",
                                     "Blocks indexed when the steps completing them committed.")
                        .Add({});
  prefix_removed_ = &registry
                         ->AddCounter("attnd_prefix_cache_removed_blocks_total",
                                      "Blocks that left the index: evicted (room, "
                                      "--prefix-cache-bytes) or lost.")
                         .Add({});
  auto& events = registry->AddCounter(
      "attnd_kv_events_total",
      "Blocks announced as KV events (--kv-events), by result: published, or dropped (the "
      "queue was full; subscribers see a gap in the sequence numbers).");
  events_published_ = &events.Add({{"result", "published"}});
  events_dropped_ = &events.Add({{"result", "dropped"}});
  auto gauge = [&](const char* name, const char* help) {
    return &registry->AddGauge(name, help).Add({});
  };
  auto counter = [&](const char* name, const char* help) {
    return &registry->AddCounter(name, help).Add({});
  };
  repl_lag_steps_ = gauge("attnd_replication_lag_steps",
                          "The most commits one sequence's standby copy has not acknowledged.");
  repl_lag_bytes_ = gauge("attnd_replication_lag_bytes",
                          "Cache bytes committed here that no standby has acknowledged yet.");
  repl_bytes_ = counter("attnd_replication_bytes_total",
                        "Key bytes shipped to standby replicas (as cached).");
  repl_steps_ = counter("attnd_replication_steps_total",
                        "Write-only steps standby replicas committed for this replica.");
  repl_sequences_ = &registry->AddGauge(
      "attnd_replication_sequences",
      "Primaries here by state: protected (a standby copy on a peer that answers) or "
      "unprotected (no peer up, or the copy not made yet).");
  repl_sequences_->Add({{"state", "protected"}});
  repl_sequences_->Add({{"state", "unprotected"}});
  standby_sequences_ =
      gauge("attnd_standby_sequences", "Standby copies held here for other replicas' sequences.");
  standby_pages_ = gauge("attnd_standby_pages", "Pages standby copies hold here, every tier.");
  promotions_ =
      counter("attnd_promotions_total", "Standby copies here promoted to primaries (failovers).");
  fenced_ = counter("attnd_fenced_total",
                    "Copies here dropped because the sequence was promoted on another replica.");
  repl_errors_ =
      counter("attnd_replication_errors_total", "Failed rounds of calls to standby peers.");
  repl_degraded_ = counter("attnd_replication_degraded_total",
                           "Commits answered without their standby's acknowledgement (it did not "
                           "answer within --replication-ack-timeout-ms).");
  repl_commits_ = &registry->AddCounter(
      "attnd_replication_commits_total",
      "Batch entries of committing replies by where their rows stood (LayerOutput.protection): "
      "replicated, shipping (async) or unprotected.");
  for (const char* p : {"replicated", "shipping", "unprotected"})
    repl_commits_->Add({{"protection", p}});
  for (const char* t : {"host", "disk"})
    for (const char* state : {"used", "free"}) tier_pages_->Add({{"tier", t}, {"state", state}});
  for (int t = 0; t < kNumTiers; ++t)
    tier_sequences_->Add({{"tier", TierName(static_cast<Tier>(t))}});
  tier_moves_->Add({{"kind", "spill"}, {"reason", "room_or_idle_or_offload"}});
  for (const char* reason : {"step", "prefetch", "other"})
    tier_moves_->Add({{"kind", "restore"}, {"reason", reason}});
  planes_ =
      &registry->AddGauge("attnd_data_plane_planes", "UCX data planes connected now.").Add({});
  auto& plane_bytes = registry->AddCounter(
      "attnd_data_plane_bytes_total",
      "Tensor bytes moved by the UCX data plane: in (landed in input regions), out (outputs "
      "sent).");
  plane_bytes_[0] = &plane_bytes.Add({{"direction", "in"}});
  plane_bytes_[1] = &plane_bytes.Add({{"direction", "out"}});
  auto& planes_closed = registry->AddCounter(
      "attnd_data_plane_planes_closed_total",
      "UCX data planes closed, by reason: closed (by their client), idle (unused ten minutes), "
      "silent (their client's keepalives stopped: it died), stalled (a message its client "
      "began never ended), lost (the endpoint to their client failed).");
  int r = 0;
  for (const char* reason : {"closed", "idle", "silent", "stalled", "lost"})  // ClosedCounts' order
    planes_closed_[r++] = &planes_closed.Add({{"reason", reason}});
  plane_refused_ = &registry
                        ->AddCounter("attnd_data_plane_refused_messages_total",
                                     "UCX messages dropped: unknown plane, wrong secret, "
                                     "malformed.")
                        .Add({});
  ucx_log_held_ = &registry
                       ->AddCounter("attnd_data_plane_ucx_log_lines_held_total",
                                    "UCX's own log lines held back by the bound on how many a "
                                    "second reach the log (a peer can make UCX warn per "
                                    "message).")
                       .Add({});
  calls_waiting_ = &registry
                        ->AddGauge("attnd_data_plane_calls_waiting",
                                   "Layer calls waiting for their data plane transfers to land "
                                   "(holding no executor thread).")
                        .Add({});
  rss_ = &registry->AddGauge("process_resident_memory_bytes", "Resident memory size in bytes.")
              .Add({});
  vsize_ =
      &registry->AddGauge("process_virtual_memory_bytes", "Virtual memory size in bytes.").Add({});
  cpu_seconds_ =
      &registry->AddCounter("process_cpu_seconds_total", "User and system CPU time in seconds.")
           .Add({});
  open_fds_ = &registry->AddGauge("process_open_fds", "Open file descriptors.").Add({});
  max_fds_ = &registry->AddGauge("process_max_fds", "The limit on open file descriptors.").Add({});
  threads_ = &registry->AddGauge("process_threads", "Threads in the process.").Add({});
  start_time_ = &registry
                     ->AddGauge("process_start_time_seconds",
                                "Start time of the process since the Unix epoch, in seconds.")
                     .Add({});
  registry->AddCollectHook([this] { Refresh(); });
}

void ServiceMetrics::LayerDone(Transport transport, StepPhase phase, LayerKind kind, double seconds,
                               size_t bytes_received, size_t bytes_sent) {
  layer_seconds_[transport == Transport::kStream ? 0 : 1][static_cast<int>(phase)]
                [static_cast<int>(kind)]
                    ->Observe(seconds);
  bytes_received_->Increment(static_cast<double>(bytes_received));
  bytes_sent_->Increment(static_cast<double>(bytes_sent));
}

void ServiceMetrics::StepDone(StepPhase phase, double seconds) {
  step_seconds_[static_cast<int>(phase)]->Observe(seconds);
}

void ServiceMetrics::RpcDone(const char* method, const absl::Status& status, double seconds) {
  // Every unary layer call ends here: its series were made at construction.
  const auto known = methods_.find(method);
  const bool listed = known != methods_.end();
  (listed ? *known->second.seconds : rpc_seconds_->Add({{"method", method}})).Observe(seconds);
  if (status.ok()) {
    (listed ? *known->second.ok : requests_->Add({{"method", method}, {"code", "OK"}})).Increment();
    return;
  }
  requests_->Add({{"method", method}, {"code", CodeName(status.code())}}).Increment();
  errors_->Add({{"method", method}, {"code", CodeName(status.code())}}).Increment();
  const std::string m = method;
  if (m == "OpenSequence" || m == "BeginStep" || m == "Step")
    if (const char* reason = RejectionReason(status))
      rejections_->Add({{"reason", reason}}).Increment();
}

void ServiceMetrics::TierMoved(const TierEvent& e) {
  if (e.kind == TierEvent::Kind::kSpill) move_seconds_[0]->Observe(e.seconds);
  if (e.kind == TierEvent::Kind::kRestore) move_seconds_[1]->Observe(e.seconds);
}

void ServiceMetrics::Refresh() {
  const EngineCounters c = engine_->Counters();
  for (int a = 0; a < kNumTiers; ++a)
    for (int b = 0; b < kNumTiers; ++b)
      if (c.tier_bytes[a][b] > 0)
        CatchUp(&tier_bytes_->Add({{"from", TierName(static_cast<Tier>(a))},
                                   {"to", TierName(static_cast<Tier>(b))}}),
                static_cast<double>(c.tier_bytes[a][b]));
  CatchUp(&tier_moves_->Add({{"kind", "spill"}, {"reason", "room_or_idle_or_offload"}}),
          static_cast<double>(c.spills));
  CatchUp(&tier_moves_->Add({{"kind", "restore"}, {"reason", "step"}}),
          static_cast<double>(c.restores_step));
  CatchUp(&tier_moves_->Add({{"kind", "restore"}, {"reason", "prefetch"}}),
          static_cast<double>(c.restores_prefetch));
  CatchUp(&tier_moves_->Add({{"kind", "restore"}, {"reason", "other"}}),
          static_cast<double>(c.restores_other));
  CatchUp(data_loss_, static_cast<double>(c.data_loss));
  const PrefixStats p = engine_->PrefixCacheStats();
  prefix_blocks_->Set(static_cast<double>(p.blocks));
  prefix_retained_->Set(static_cast<double>(p.cached_only));
  CatchUp(prefix_lookups_, static_cast<double>(p.lookups));
  CatchUp(prefix_hit_, static_cast<double>(p.hit_blocks));
  CatchUp(prefix_miss_, static_cast<double>(p.miss_blocks));
  CatchUp(prefix_tokens_, static_cast<double>(p.hit_blocks * engine_->spec().page_size));
  CatchUp(prefix_stored_, static_cast<double>(p.stored_blocks));
  const double page = static_cast<double>(engine_->spec().page_size);
  CatchUp(prompt_by_source_[0], static_cast<double>(c.tokens_prefill));
  CatchUp(prompt_by_source_[1], static_cast<double>(p.hit_blocks) * page);
  CatchUp(prompt_by_source_[2], static_cast<double>(p.promoted_tokens));
  for (int t = 0; t < kNumTiers; ++t)
    CatchUp(cached_by_source_[t], static_cast<double>(p.hit_blocks_at[t]) * page);
  CatchUp(cached_by_source_[kNumTiers], static_cast<double>(p.promoted_tokens));
  CatchUp(prefix_removed_, static_cast<double>(p.removed_blocks));
  if (const transport::UcxPlane* dp = data_plane_.load()) {
    planes_->Set(static_cast<double>(dp->num_planes()));
    CatchUp(plane_bytes_[0], static_cast<double>(dp->bytes_in()));
    CatchUp(plane_bytes_[1], static_cast<double>(dp->bytes_out()));
    CatchUp(plane_refused_, static_cast<double>(dp->refused_messages()));
    const transport::UcxPlane::ClosedCounts c = dp->closed_counts();
    const int64_t closed[] = {c.closed, c.idle, c.silent, c.stalled, c.lost};
    for (int r = 0; r < 5; ++r) CatchUp(planes_closed_[r], static_cast<double>(closed[r]));
    CatchUp(ucx_log_held_, static_cast<double>(transport::UcxLogLinesSuppressed()));
  }
  if (const KvEventPublisher* ev = kv_events_.load()) {
    CatchUp(events_published_, static_cast<double>(ev->events_published()));
    CatchUp(events_dropped_, static_cast<double>(ev->events_dropped()));
  }
  const StandbyUsage standby = engine_->Standby();
  standby_sequences_->Set(static_cast<double>(standby.sequences));
  standby_pages_->Set(static_cast<double>(standby.pages));
  if (const ReplicationHook* r = replicator_.load()) {
    const ReplicationStats st = r->Stats();
    repl_lag_steps_->Set(static_cast<double>(st.lag_steps));
    repl_lag_bytes_->Set(static_cast<double>(st.lag_bytes));
    CatchUp(repl_bytes_, static_cast<double>(st.bytes_shipped));
    CatchUp(repl_steps_, static_cast<double>(st.steps_shipped));
    repl_sequences_->Add({{"state", "protected"}}).Set(static_cast<double>(st.sequences));
    repl_sequences_->Add({{"state", "unprotected"}}).Set(static_cast<double>(st.unprotected));
    CatchUp(fenced_, static_cast<double>(st.fenced));
    CatchUp(repl_errors_, static_cast<double>(st.errors));
    CatchUp(repl_degraded_, static_cast<double>(st.degraded));
    CatchUp(&repl_commits_->Add({{"protection", "replicated"}}),
            static_cast<double>(st.replicated));
    CatchUp(&repl_commits_->Add({{"protection", "shipping"}}), static_cast<double>(st.shipping));
    CatchUp(&repl_commits_->Add({{"protection", "unprotected"}}),
            static_cast<double>(st.unprotected_commits));
  }
  int64_t below = 0;
  for (const TierCapacity& t : engine_->Tiers()) {
    const char* name = TierName(t.tier);
    tier_pages_->Add({{"tier", name}, {"state", "used"}}).Set(static_cast<double>(t.pages_used));
    tier_pages_->Add({{"tier", name}, {"state", "free"}})
        .Set(static_cast<double>(t.pages_total - t.pages_used));
    tier_sequences_->Add({{"tier", name}}).Set(static_cast<double>(t.sequences));
    below += t.sequences;
  }
  tier_sequences_->Add({{"tier", "device"}})
      .Set(static_cast<double>(engine_->num_sequences() - below));
  CatchUp(steps_committed_, static_cast<double>(c.steps_committed));
  int64_t aborted = 0;
  for (int r = 0; r < kNumAbortReasons; ++r) {
    aborted += c.steps_aborted[r];
    CatchUp(&aborted_by_reason_->Add({{"reason", AbortReasonName(static_cast<AbortReason>(r))}}),
            static_cast<double>(c.steps_aborted[r]));
  }
  CatchUp(steps_aborted_, static_cast<double>(aborted));
  CatchUp(sequences_expired_, static_cast<double>(c.sequences_expired));
  CatchUp(&tokens_->Add({{"phase", "prefill"}}), static_cast<double>(c.tokens_prefill));
  CatchUp(&tokens_->Add({{"phase", "decode"}}), static_cast<double>(c.tokens_decode));
  CatchUp(&tokens_->Add({{"phase", "import"}}), static_cast<double>(c.tokens_import));
  sequences_->Set(static_cast<double>(engine_->num_sequences()));
  open_steps_->Set(static_cast<double>(engine_->num_open_steps()));
  if (executor_ != nullptr) queue_depth_->Set(static_cast<double>(executor_->queue_depth()));
  const auto caps = engine_->Capacity();
  for (size_t d = 0; d < caps.size(); ++d) {
    const DeviceCapacity& cap = caps[d];
    // Pages only the prefix cache holds are given back to any request that needs them: they
    // count as "cached", not "used", so a full prefix cache does not read as a full cache.
    const int32_t used = cap.pages_total - cap.pages_free - cap.pages_cached;
    pages_->Add({{"device", cap.name}, {"state", "used"}}).Set(used);
    pages_->Add({{"device", cap.name}, {"state", "cached"}}).Set(cap.pages_cached);
    pages_->Add({{"device", cap.name}, {"state", "free"}}).Set(cap.pages_free);
    utilization_->Add({{"device", cap.name}})
        .Set(cap.pages_total > 0 ? static_cast<double>(used) / cap.pages_total : 0.0);
    if (d < c.device_compute_seconds.size())
      CatchUp(&compute_seconds_->Add({{"device", cap.name}}), c.device_compute_seconds[d]);
  }
  // process_*, from /proc/self (Linux).
  std::ifstream stat("/proc/self/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t close = text.rfind(')');  // the command name may hold spaces
  if (close != std::string::npos) {
    std::istringstream rest(text.substr(close + 2));
    std::string f[50];
    for (int i = 0; i < 50 && rest >> f[i]; ++i) {
    }
    // Fields after the name, from field 3 (state) = f[0]: utime 14, stime 15, threads 20,
    // starttime 22, vsize 23, rss 24.
    const double tick = TicksPerSecond();
    CatchUp(cpu_seconds_, (std::stod("0" + f[11]) + std::stod("0" + f[12])) / tick);
    threads_->Set(std::stod("0" + f[17]));
    vsize_->Set(std::stod("0" + f[20]));
    rss_->Set(std::stod("0" + f[21]) * static_cast<double>(sysconf(_SC_PAGESIZE)));
    std::ifstream up("/proc/stat");
    std::string key;
    double btime = 0;
    while (up >> key)
      if (key == "btime") {
        up >> btime;
        break;
      }
    start_time_->Set(btime + std::stod("0" + f[19]) / tick);
  }
  int fds = 0;
  if (DIR* dir = opendir("/proc/self/fd")) {
    while (readdir(dir) != nullptr) ++fds;
    closedir(dir);
    fds -= 3;  // ".", ".." and the directory's own descriptor
  }
  open_fds_->Set(fds);
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) == 0) max_fds_->Set(static_cast<double>(lim.rlim_cur));
}

}  // namespace attnd
