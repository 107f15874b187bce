// attnd's command-line flags, kebab-case in Triton's style: --grpc-port=50051 or --grpc-port 50051.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"

namespace attnd {

struct ServerFlags {
  std::string grpc_address = "0.0.0.0";
  int grpc_port = 50051;
  bool reuse_grpc_port = false;  // SO_REUSEPORT: share the port with another process on purpose
  int metrics_port = 8002;       // Triton's; 0 = an ephemeral port (printed)
  bool allow_metrics = true;     // false: no metrics endpoint
  std::string metrics_address;   // default: --grpc-address's host
  std::string model = "demo";    // a preset name
  std::string model_file;        // a JSON model spec; wins over --model
  std::string hf_config;         // a Hugging Face config.json: the spec from it
  std::string absorb_from;  // a checkpoint directory: server-side absorption's kv_b_proj weights
  int64_t kv_cache_bytes = int64_t{1} << 30;  // per device
  double kv_cache_fraction = 0;  // > 0: the cache from device memory, over kv_cache_bytes
  int32_t kv_pages = 0;          // per device, incl. the reserved page 0; wins over bytes
  int64_t gpu_scratch_bytes = int64_t{8} << 30;  // per GPU, beside its cache
  DType cache_dtype = DType::kBF16;
  std::vector<std::string> devices = {"auto"};  // cpu:N and/or cuda:N, or auto
  int threads = 0;                              // compute threads; 0 = all cores
  int executor_threads = 8;                     // the service's executor (blocking RPC work)
  std::string cpu_isa = "auto";                 // auto, avx512, avx2, generic
  // CUDA kernel forms (kernels/cuda/backend/kernel_choice.h).
  std::string cuda_mla = "default", cuda_indexer = "default", cuda_topk = "attnd";
  int64_t max_message_bytes = int64_t{1} << 30;
  // Connections: keepalive pings both ways, and an optional maximum age (0 = off).
  int keepalive_time_ms = 60000;
  int keepalive_timeout_ms = 20000;
  int keepalive_min_client_interval_ms = 10000;
  int max_connection_age_ms = 0;
  int max_connection_age_grace_ms = 0;  // 0: calls in flight finish however long they take
  int64_t step_idle_timeout_ms = 30000;
  int64_t sequence_idle_timeout_s = 0;  // a sequence's lease; 0 = never expires
  // Tiers below the devices (docs/architecture.md#tiers); 0 / "" = off.
  int64_t host_cache_bytes = 0;
  std::string disk_cache_dir;
  int64_t disk_cache_bytes = 0;
  int64_t spill_idle_ms = 0;  // spill sequences idle this long; 0: only when room is needed
  // The prefix cache (docs/prefix_cache.md): bytes of closed sequences' blocks kept (-1: "all",
  // as much as the tiers hold); the KV-event endpoint ("" = off).
  int64_t prefix_cache_bytes = -1;
  std::string kv_events;
  std::string kv_events_replay;
  std::string kv_events_format = "map";
  int64_t kv_events_replay_bytes = int64_t{64} << 20;
  int64_t shutdown_grace_ms = 10000;
  // Per-request bounds (docs/trust.md); defaults a production server can ship with.
  int64_t max_step_tokens = 65536;
  int64_t max_batch_entries = 4096;
  int64_t max_sequences = 65536;
  int64_t max_id_bytes = 256;
  int64_t max_echo_bytes = int64_t{64} << 20;
  int32_t max_shm_regions = 64;
  bool check_finite = true;  // refuse NaN/Inf inputs; off only for trusted, measured deployments
  int64_t begin_wait_ms = 10000;  // BeginStep waits this long for a conflicting running layer
  // Trust (docs/trust.md). Defaults suit local use: no TLS, one anonymous tenant, no shared memory.
  std::string auth = "none";       // none, token, mtls
  std::string auth_tokens;         // token file (token -> tenant, quota overrides)
  std::string admin_tenant;        // may list every tenant's sequences and act as one
  std::string tls_cert, tls_key;   // PEM files: serve TLS
  std::string tls_client_ca;       // PEM file: require and verify client certificates (mTLS)
  bool metrics_tls = false;        // serve /metrics over HTTPS with the same certificate
  int64_t reload_interval_s = 10;  // how often certificate and token files are checked
  bool grpc_reflection = true;
  bool shm = false;        // shared memory, over the Unix-socket listener only
  std::string shm_socket;  // that listener's path
  std::string shm_prefix = "/attnd-";
  uint32_t shm_socket_mode = 0660;
  // The UCX data plane (docs/data-plane.md): off, or ucx.
  std::string data_plane = "off";
  int64_t data_plane_region_bytes = int64_t{256} << 20;  // each region of a plane, at most
  int32_t data_plane_max_planes = 64;
  int64_t data_plane_timeout_ms = 2000;    // an input's landing, an output's delivery
  bool data_plane_without_tls = false;     // with TLS on: allow the (unencrypted) plane anyway
  int64_t data_plane_keepalive_ms = 5000;  // clients that offer keepalives send one this often
  bool data_plane_push = false;  // outputs sent as built to clients that gave their address
  // Per-tenant quotas (0 = none); the token file may override them per tenant.
  int64_t quota_pages = 0;
  int64_t quota_sequences = 0;
  int64_t quota_steps = 0;
  int64_t quota_shm_regions = 0;
  // Drain (docs/lifecycle.md): on SIGTERM (or the Drain RPC) hand every sequence to these replicas.
  std::vector<std::string> drain_peers;  // host:port, or dns:NAME:PORT
  // The name routing hashes over (ServerInfo.replica_name); default: this host's name.
  std::string replica_name;
  int64_t drain_timeout_ms = 60000;
  int64_t drain_parallel = 4;
  std::string drain_token_file;  // the admin identity's token on the peers
  std::string admin_token_file;  // --auth=none: the token that makes its bearer the admin
  std::string drain_tls_ca, drain_tls_cert, drain_tls_key;
  // Standby replicas (docs/replication.md): every sequence's commits copied to the peer its
  // rendezvous hash ranks next (peer credentials: the drain's).
  std::vector<std::string> standby_peers;  // host:port, or dns:NAME:PORT
  std::string replication = "async";       // async, sync
  int64_t replication_max_lag_steps = 4;
  int64_t replication_ack_timeout_ms = 1000;
  int64_t replication_lease_ms = 2000;  // 0: no leases
  int64_t standby_cache_bytes = -1;     // -1: all
  std::string log_level = "info";       // debug, info, warning, error (glog, on stderr)
  std::string log_format = "text";      // text, json (service/logging.h)
  bool operator==(const ServerFlags&) const = default;
};

// Parses argv. INVALID_ARGUMENT (with the usage text) for unknown flags or bad values;
// `--help` (and `--version`) return a CANCELLED status whose message is the usage text (the
// version line), for main to print on stdout with exit code 0.
absl::StatusOr<ServerFlags> ParseServerFlags(int argc, char** argv);
std::string ServerUsage();  // generated from the one flag table ParseServerFlags uses
std::vector<std::string> ServerFlagNames();

}  // namespace attnd
