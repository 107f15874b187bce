// ServerInfo: what this server serves (model, limits, capacity, features).
#include <sys/socket.h>

#include <chrono>
#include <cstring>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cluster/replication_hook.h"
#include "common/build_version.h"
#include "common/client_text.h"
#include "common/status_macros.h"
#include "engine/layer_check.h"
#include "kv_store/cache_layout.h"
#include "proto/convert/model_spec_proto.h"
#include "service/attention_service.h"
#include "service/layer_codec.h"
#include "service/service_internal.h"
#include "service/status_map.h"
#include "service/tensor_codec.h"
#include "transport/ucx_plane.h"

namespace attnd {

grpc::ServerUnaryReactor* AttentionService::ServerInfo(grpc::CallbackServerContext* ctx,
                                                       const v1::ServerInfoRequest*,
                                                       v1::ServerInfoResponse* resp) {
  return Unary(ctx, "ServerInfo", [&](const Caller& c) { return DoServerInfo(c, resp); });
}

void AttentionService::SetReplicaName(std::string name) {
  std::lock_guard<std::mutex> lock(name_mu_);
  replica_name_ = std::move(name);
}

absl::Status AttentionService::DoServerInfo(const Caller& caller,
                                            v1::ServerInfoResponse* resp) const {
  const ModelSpec& s = engine_->spec();
  resp->set_version(absl::StrCat("attnd ", BuildVersion(), " (", BuildRevision(), ")"));
  resp->set_tenant(caller.tenant);
  resp->set_admin(caller.admin);
  resp->set_auth(options_.auth ? AuthModeName(options_.auth->options().mode) : "none");
  resp->set_shm(options_.shm_enabled);
  v1::DataPlaneInfo* planes = resp->mutable_data_plane();
  planes->add_planes("grpc");
  if (options_.shm_enabled) planes->add_planes("shm");
  if (options_.data_plane != nullptr) {
    planes->add_planes("ucx");
    planes->set_ucx_version(transport::UcxVersion());
    planes->set_ucx_transports(transport::UcxTransports());
    planes->set_max_region_bytes(options_.data_plane->options().max_region_bytes);
    planes->set_pushes_outputs(options_.data_plane->options().push);
  }
  resp->set_context_parallel(engine_->ServesContextParallel());
  {
    std::lock_guard<std::mutex> lock(name_mu_);
    resp->set_replica_name(replica_name_);
  }
  if (const std::shared_ptr<const Absorption> a = engine_->absorption()) {
    v1::AbsorptionInfo* ai = resp->mutable_absorption();
    ai->set_qk_nope_head_dim(a->qk_nope_head_dim());
    ai->set_v_head_dim(a->v_head_dim());
    ai->set_source(a->source());
    ai->set_bytes(static_cast<int64_t>(a->bytes()));
  }
  v1::ModelSpec* m = resp->mutable_model();
  ModelSpecToProto(s, m);
  resp->set_backend(engine_->backend());
  resp->set_cpu_isa(engine_->cpu_isa());
  resp->set_cache_datatype(std::string(DTypeName(engine_->options().cache_dtype)));
  for (const DeviceCapacity& d : engine_->Capacity()) {
    v1::DeviceInfo* out = resp->add_devices();
    out->set_name(d.name);
    out->set_pages_total(d.pages_total);
    out->set_pages_free(d.pages_free);
    out->set_pages_cached(d.pages_cached);
    out->set_bytes_per_page(static_cast<int64_t>(d.bytes_per_page));
    out->set_sequences(d.sequences);
  }
  for (const TierCapacity& t : engine_->Tiers()) {
    v1::TierInfo* out = resp->add_tiers();
    out->set_name(TierName(t.tier));
    out->set_pages_total(t.pages_total);
    out->set_pages_used(t.pages_used);
    out->set_bytes_per_page(static_cast<int64_t>(t.bytes_per_page));
    out->set_sequences(t.sequences);
  }
  const PrefixStats prefix = engine_->PrefixCacheStats();
  v1::PrefixCacheInfo* pc = resp->mutable_prefix_cache();
  pc->set_max_cached_bytes(engine_->options().prefix_cache_bytes);
  pc->set_blocks(prefix.blocks);
  pc->set_cached_only_pages(prefix.cached_only);
  if (const KvEventPublisher* ev = kv_events_.load()) {
    pc->set_kv_events(ev->endpoint());
    pc->set_kv_events_replay(ev->replay_endpoint());
    pc->set_kv_events_format(ev->array_form() ? "array" : "map");
  }
  v1::LoadInfo* load = resp->mutable_load();
  load->set_open_steps(engine_->num_open_steps());
  load->set_queue_depth(executor_ != nullptr ? static_cast<int64_t>(executor_->queue_depth()) : 0);
  load->set_sequences(engine_->num_sequences());
  v1::ReplicationInfo* ri = resp->mutable_replication();
  const StandbyUsage standby = engine_->Standby();
  ri->set_standby_sequences(standby.sequences);
  ri->set_standby_pages(standby.pages);
  ri->set_standby_budget_pages(standby.budget_pages);
  ri->set_mode("off");
  if (replicator_ != nullptr) {
    const ReplicationOptions& ro = replicator_->options();
    ri->set_mode(ro.mode == ReplicationOptions::Mode::kSync ? "sync" : "async");
    ri->set_max_lag_steps(ro.max_lag_steps);
    for (std::string& p : replicator_->Stats().peers) ri->add_peers(std::move(p));
  }
  for (const char* t : {"BF16", "FP16", "FP32"}) resp->add_datatypes(t);
  resp->add_datatypes("FP8_E4M3");  // queries with scales anywhere; keys into an fp8 cache
  resp->set_max_message_bytes(options_.max_message_bytes);
  resp->set_step_idle_timeout_ms(options_.step_idle_timeout_ms);
  const EngineLimits& lim = engine_->options().limits;
  v1::ServerLimits* l = resp->mutable_limits();
  l->set_max_echo_bytes(max_echo_bytes());
  l->set_max_export_chunk_tokens(max_export_chunk_tokens());
  l->set_max_attended_positions(max_attended_positions());
  l->set_max_step_tokens(lim.max_step_tokens);
  l->set_max_batch_entries(lim.max_batch_entries);
  l->set_max_sequences(lim.max_sequences);
  l->set_max_id_bytes(static_cast<int64_t>(lim.max_id_bytes));
  l->set_max_shm_regions(options_.max_shm_regions);
  l->set_check_finite(lim.check_finite);
  return absl::OkStatus();
}

}  // namespace attnd
