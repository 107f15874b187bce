#include "service/flags.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/build_version.h"
#include "kernels/cuda/backend/kernel_choice.h"

namespace attnd {
namespace {

// One flag: its name, the form of its value in --help, the help text (lines after the first are
// indented under it), and how it sets ServerFlags. An entry without a name starts a group.
// A setter returns "" when it took the value, else what the value must be ("an integer in [1,
// 1024]"), which the error names.
using Setter = std::function<std::string(const std::string&)>;
struct Flag {
  std::string name;
  std::string value;
  std::string help;
  Setter set;
  bool is_switch = false;  // may stand alone (--shm means --shm=true)
};

// A non-negative integer that fits the destination's type: nothing is silently truncated.
template <typename T>
Setter Int(T* out) {
  return [out](const std::string& v) -> std::string {
    int64_t x;
    const auto max = static_cast<uint64_t>(std::numeric_limits<T>::max());
    if (!absl::SimpleAtoi(v, &x) || x < 0 || static_cast<uint64_t>(x) > max)
      return absl::StrCat("an integer in [0, ", max, "]");
    *out = static_cast<T>(x);
    return "";
  };
}
// Bytes: an integer with an optional unit K, M, G or T (powers of 1024; Ki, KiB and KB mean the
// same), at most 2^62.
absl::StatusOr<int64_t> ParseBytes(absl::string_view v) {
  size_t digits = 0;
  while (digits < v.size() && absl::ascii_isdigit(static_cast<unsigned char>(v[digits]))) ++digits;
  int64_t n;
  if (digits == 0 || digits > 19 || !absl::SimpleAtoi(v.substr(0, digits), &n))
    return absl::InvalidArgumentError("no number");
  // The unit: none or B (bytes), or K, M, G, T alone or followed by B, i or iB.
  const std::string unit = absl::AsciiStrToUpper(v.substr(digits));
  int shift = 0;
  if (!unit.empty() && unit != "B") {
    const size_t at = std::string("KMGT").find(unit[0]);
    const std::string rest = unit.substr(1);
    if (at == std::string::npos || (rest != "" && rest != "B" && rest != "I" && rest != "IB"))
      return absl::InvalidArgumentError("unit");
    shift = 10 * static_cast<int>(at + 1);
  }
  if (n > (int64_t{1} << 62) >> shift) return absl::InvalidArgumentError("too large");
  return n << shift;
}
Setter Bytes(int64_t* out, bool or_all = false) {
  return [out, or_all](const std::string& v) -> std::string {
    if (or_all && v == "all") {
      *out = -1;
      return "";
    }
    auto n = ParseBytes(v);
    if (!n.ok())
      return absl::StrCat("bytes: an integer with an optional unit K, M, G or T (powers of 1024)",
                          or_all ? ", or all" : "", ", at most 2^62");
    *out = *n;
    return "";
  };
}
// An integer in [lo, hi].
template <typename T>
Setter InRange(T* out, int64_t lo, int64_t hi) {
  return [out, lo, hi](const std::string& v) -> std::string {
    int64_t x;
    if (!absl::SimpleAtoi(v, &x) || x < lo || x > hi)
      return absl::StrCat("an integer in [", lo, ", ", hi, "]");
    *out = static_cast<T>(x);
    return "";
  };
}
// A positive integer (a limit of 0 would refuse everything).
Setter Limit(int64_t* out) { return InRange(out, 1, std::numeric_limits<int64_t>::max()); }
// A fraction in (0, 1].
Setter Fraction(double* out) {
  return [out](const std::string& v) -> std::string {
    double x;
    if (!absl::SimpleAtod(v, &x) || !(x > 0 && x <= 1)) return "a fraction in (0, 1]";
    *out = x;
    return "";
  };
}
Setter Bool(bool* out) {
  return [out](const std::string& v) -> std::string {
    if (v != "true" && v != "false") return "true or false";
    *out = v == "true";
    return "";
  };
}
Setter Str(std::string* out) {
  return [out](const std::string& v) -> std::string {
    *out = v;
    return "";
  };
}
std::set<std::string> ToSet(const std::vector<std::string>& v) { return {v.begin(), v.end()}; }

Setter OneOf(std::string* out, std::set<std::string> allowed) {
  return [out, allowed](const std::string& v) -> std::string {
    if (allowed.count(v) == 0) return absl::StrCat("one of ", absl::StrJoin(allowed, ", "));
    *out = v;
    return "";
  };
}
Setter List(std::vector<std::string>* out, bool nonempty) {
  return [out, nonempty](const std::string& v) -> std::string {
    *out = absl::StrSplit(v, ',', absl::SkipEmpty());
    return nonempty && out->empty() ? "a comma-separated list of at least one" : "";
  };
}

// Every flag, in --help order. `f` receives the values.
std::vector<Flag> Table(ServerFlags* f) {
  return {
      {"help", "", "this text (also -h)", nullptr, true},
      {"version", "", "the build's version and git revision", nullptr, true},
      {"grpc-address", "ADDR", "listen address: IPv4, IPv6 (:: or ::1) or a name (default 0.0.0.0)",
       Str(&f->grpc_address)},
      {"grpc-port", "N", "gRPC port (default 50051; 0 picks a free port and prints it)",
       Int(&f->grpc_port)},
      {"reuse-grpc-port", "true|false",
       "share --grpc-port with other processes (SO_REUSEPORT; default off:\na port in use is a "
       "startup error)",
       Bool(&f->reuse_grpc_port), true},
      {"metrics-port", "N",
       "Prometheus /metrics port (default 8002, Triton's; 0 picks a free port\nand prints it)",
       Int(&f->metrics_port)},
      {"metrics-address", "ADDR",
       "its address (IPv4 or IPv6) or host name (default: --grpc-address's)",
       Str(&f->metrics_address)},
      {"allow-metrics", "true|false", "serve /metrics at all (default true)",
       Bool(&f->allow_metrics)},
      {"model", "NAME", "preset: deepseek-v3.2, glm-5, glm-5.2, tiny, demo (default demo)",
       Str(&f->model)},
      {"model-file", "PATH", "JSON model spec (overrides --model)", Str(&f->model_file)},
      {"hf-config", "PATH",
       "a Hugging Face config.json (deepseek_v32, glm_moe_dsa): the spec as\ntransformers reads "
       "that model (overrides --model)",
       Str(&f->hf_config)},
      {"absorb-from", "DIR",
       "server-side absorption: read every layer's kv_b_proj weight from this\nHugging Face "
       "checkpoint (config.json + safetensors); calls may then\nsend q_nope and receive [T, H, "
       "V] (docs/numerics.md)",
       Str(&f->absorb_from)},
      {"kv-cache-bytes", "BYTES",
       "cache bytes per device (default 1G: 1073741824; units K, M, G, T)",
       Bytes(&f->kv_cache_bytes)},
      {"kv-cache-fraction", "F",
       "size the cache from memory instead (overrides bytes): F in (0, 1] of\neach GPU's free "
       "memory less its --gpu-scratch-bytes, or of the host's\navailable memory (within the "
       "cgroup limit) split over the CPU devices\n(on the CPU leave room for steps and messages: "
       "0.5-0.7)",
       Fraction(&f->kv_cache_fraction)},
      {"kv-pages", "N",
       "cache pages per device, incl. reserved page 0 (overrides bytes and\nfraction)",
       Int(&f->kv_pages)},
      {"gpu-scratch-bytes", "BYTES",
       "per GPU, beside its cache: a step's working memory (about 1.8 MiB per\nnew token at 128 "
       "heads, 0.35 MiB at 16); a step that needs more is\nrefused at BeginStep (default "
       "8589934592)",
       Bytes(&f->gpu_scratch_bytes)},
      {"cache-dtype", "bf16|fp8|fp32 (or BF16|FP8_E4M3|FP32)",
       "cache element type (default bf16); fp8: e4m3 keys with fp32\nscales per 128 values, "
       "0.57x the bytes of bf16",
       [f](const std::string& v) -> std::string {
         // The short names, or the API's datatype spellings (ServerInfo.cache_datatype).
         if (v == "bf16" || v == "BF16") {
           f->cache_dtype = DType::kBF16;
         } else if (v == "fp8" || v == "FP8_E4M3" || v == "fp8_e4m3") {
           f->cache_dtype = DType::kFP8E4M3;
         } else if (v == "fp32" || v == "FP32") {
           f->cache_dtype = DType::kF32;
         } else {
           return "bf16, fp8 or fp32 (or BF16, FP8_E4M3, FP32)";
         }
         return "";
       }},
      {"devices", "LIST",
       "cpu:N and/or cuda:N, comma separated; each sequence lives on one\ndevice. auto (default): "
       "every GPU when this build has CUDA and a GPU\nis visible, else cpu:0. --devices=cpu:0 "
       "forces the CPU",
       List(&f->devices, true)},
      {"threads", "N", "compute threads (default: all cores)", Int(&f->threads)},
      {"executor-threads", "N",
       "threads that run layer calls and other blocking RPC work off\ngRPC's threads, 1 to 1024 "
       "(default 8)",
       InRange(&f->executor_threads, 1, 1024)},
      {"cpu-isa", "auto|avx512|avx2|generic",
       "CPU inner loops (default auto: the widest the host has; avx512 and\navx2 give the same "
       "bits)",
       OneOf(&f->cpu_isa, {"auto", "avx512", "avx2", "generic"})},
      {"cuda-mla", "default|simt|mma|wgmma|wgmma-ws|flashinfer|gemm",
       "the sparse MLA's CUDA kernel for bf16 requests (default: the\npipelined tensor-core one); "
       "flashinfer and gemm where they apply,\nelse the default (ATTND_CUDA_MLA overrides)",
       OneOf(&f->cuda_mla, ToSet(cuda::CudaMlaNames()))},
      {"cuda-indexer", "default|simt",
       "the indexer's CUDA kernel for bf16 requests (default: tensor cores;\nATTND_CUDA_INDEXER "
       "overrides)",
       OneOf(&f->cuda_indexer, ToSet(cuda::CudaIndexerNames()))},
      {"cuda-topk", "attnd|flashinfer",
       "the indexer's top-k on the GPU (default attnd; flashinfer where it\napplies; "
       "ATTND_CUDA_TOPK overrides)",
       OneOf(&f->cuda_topk, ToSet(cuda::CudaTopKNames()))},
      {"max-message-bytes", "BYTES", "gRPC send/receive limit (default 1G)",
       Bytes(&f->max_message_bytes)},
      {"keepalive-time-ms", "N",
       "ping a connection idle this long; one that does not answer in\n--keepalive-timeout-ms is "
       "closed (default 60000; 0 = never)",
       Int(&f->keepalive_time_ms)},
      {"keepalive-timeout-ms", "N", "(default 20000)", Int(&f->keepalive_timeout_ms)},
      {"keepalive-min-client-interval-ms", "N",
       "clients' keepalive pings may come this often, calls or not\n(more often: GOAWAY "
       "too_many_pings; default 10000)",
       Int(&f->keepalive_min_client_interval_ms)},
      {"max-connection-age-ms", "N",
       "close connections this old, gracefully (clients reconnect and re-\nresolve; default 0 = "
       "never)",
       Int(&f->max_connection_age_ms)},
      {"max-connection-age-grace-ms", "N",
       "then give calls in flight (a Step stream) this long (default 0:\nas long as they take)",
       Int(&f->max_connection_age_grace_ms)},
      {"step-idle-timeout-ms", "N", "abort open steps idle this long (default 30000)",
       Int(&f->step_idle_timeout_ms)},
      {"sequence-idle-timeout-s", "N",
       "close sequences no step began or ended on for this long (their\nlease; every step "
       "renews it; default 0 = never)",
       Int(&f->sequence_idle_timeout_s)},
      {"host-cache-bytes", "BYTES",
       "a host-memory tier below the devices: when a device's pages run out,\nits least "
       "recently stepped sequences spill here and a step brings\nthem back (pinned for GPUs; "
       "default 0 = off)",
       Bytes(&f->host_cache_bytes)},
      {"disk-cache-dir", "DIR",
       "a local directory for the disk tier below the host tier (a page file,\nchecksummed; "
       "scratch: emptied at every start; default off)",
       Str(&f->disk_cache_dir)},
      {"disk-cache-bytes", "BYTES", "the disk tier's size (with --disk-cache-dir)",
       Bytes(&f->disk_cache_bytes)},
      {"spill-idle-ms", "N",
       "spill sequences no step touched for this long down a tier (default 0:\nonly when a "
       "device needs room)",
       Int(&f->spill_idle_ms)},
      {"prefix-cache-bytes", "BYTES|all",
       "blocks of closed sequences kept for later prompts that start the same\n(found by "
       "their token ids or block hashes; least recently used out\nfirst; default all: as much "
       "as the cache and tiers hold, given back\nto any request that needs the room; 0 = only "
       "while a sequence holds\nthem)",
       Bytes(&f->prefix_cache_bytes, true)},
      {"kv-events", "ENDPOINT",
       "publish every prefix-cache block stored and removed as vLLM KV events\n(msgpack over "
       "ZeroMQ PUB) on this bind endpoint, e.g. tcp://*:5557\n(default off; "
       "docs/prefix_cache.md)",
       Str(&f->kv_events)},
      {"kv-events-replay", "ENDPOINT",
       "answer vLLM's replay requests (ZeroMQ ROUTER) for recent KV events on\nthis bind "
       "endpoint, e.g. tcp://*:5558 (default off)",
       Str(&f->kv_events_replay)},
      {"kv-events-replay-bytes", "SIZE",
       "what the replay buffer keeps: at most this many payload bytes and\n10000 messages "
       "(default 64M)",
       Bytes(&f->kv_events_replay_bytes)},
      {"kv-events-format", "map|array",
       "events as vLLM's tagged maps (default) or the tagged arrays of vLLM\nbefore 0.24 "
       "(older routers)",
       OneOf(&f->kv_events_format, {"map", "array"})},
      {"shutdown-grace-ms", "N", "after the drain, let RPCs finish this long (default 10000)",
       Int(&f->shutdown_grace_ms)},
      {"log-level", "debug|info|warning|error",
       "leveled logs on stderr (default info): the effective configuration,\none line per refused "
       "or aborted step (rate-limited), drains, reloads;\ndebug adds verbose lines",
       OneOf(&f->log_level, {"debug", "info", "warning", "error"})},
      {"log-format", "text|json",
       "text (default) or one JSON object per line (ts, level, msg, file),\nthe lifecycle lines "
       "on stdout included",
       OneOf(&f->log_format, {"text", "json"})},
      {"", "", "Per-request limits (ServerInfo.limits reports them):", nullptr},
      {"max-step-tokens", "N", "new tokens in one step, all sequences (default 65536)",
       Limit(&f->max_step_tokens)},
      {"max-batch-entries", "N", "sequences in one step (default 4096)",
       Limit(&f->max_batch_entries)},
      {"max-sequences", "N", "open sequences (default 65536)", Limit(&f->max_sequences)},
      {"max-id-bytes", "N", "length of a sequence id (default 256)", Limit(&f->max_id_bytes)},
      {"max-echo-bytes", "BYTES",
       "Echo reply size (default 67108864; also capped by the message size)",
       Bytes(&f->max_echo_bytes)},
      {"max-shm-regions", "N", "registered shared-memory regions, all tenants (default 64)",
       Int(&f->max_shm_regions)},
      {"check-finite", "true|false", "refuse NaN/Inf in input tensors (default true)",
       Bool(&f->check_finite)},
      {"begin-wait-ms", "N",
       "a BeginStep whose sequence is in a step running a layer (which may be\naborting after a "
       "cancel) waits this long for it (default 10000)",
       Int(&f->begin_wait_ms)},
      {"", "", "Trust (see the README's deployment section):", nullptr},
      {"auth", "none|token|mtls",
       "who the caller is: one anonymous tenant (default, local use), a\nbearer token looked up "
       "in --auth-tokens, or the mTLS client\ncertificate's identity (first SAN, else CN)",
       OneOf(&f->auth, {"none", "token", "mtls"})},
      {"auth-tokens", "FILE",
       "lines of TOKEN TENANT [pages=N] [sequences=N] [steps=N]\n[shm-regions=N]; reread when it "
       "changes",
       Str(&f->auth_tokens)},
      {"admin-tenant", "NAME",
       "this tenant may list every tenant's sequences, act as one (metadata\nattnd-tenant: NAME) "
       "and drain the server",
       Str(&f->admin_tenant)},
      {"tls-cert", "PEM", "serve TLS with this certificate chain; reread when it changes",
       Str(&f->tls_cert)},
      {"tls-key", "PEM", "its private key", Str(&f->tls_key)},
      {"tls-client-ca", "PEM", "require client certificates signed by this CA (mTLS)",
       Str(&f->tls_client_ca)},
      {"metrics-tls", "true|false", "serve /metrics over HTTPS with the same certificate",
       Bool(&f->metrics_tls), true},
      {"reload-interval-s", "N", "how often certificate and token files are checked (default 10)",
       Limit(&f->reload_interval_s)},
      {"grpc-reflection", "true|false", "gRPC server reflection (default true)",
       Bool(&f->grpc_reflection)},
      {"shm", "true|false",
       "allow shared-memory tensors (default off), only over --shm-socket,\nonly for objects the "
       "calling user owns",
       Bool(&f->shm), true},
      {"shm-socket", "PATH", "the Unix-socket listener for co-located clients",
       Str(&f->shm_socket)},
      {"shm-socket-mode", "OCTAL", "its file mode (default 0660)",
       [f](const std::string& v) -> std::string {
         char* end = nullptr;
         const unsigned long m = std::strtoul(v.c_str(), &end, 8);
         if (v.empty() || *end != '\0' || m > 0777) return "an octal file mode up to 0777";
         f->shm_socket_mode = static_cast<uint32_t>(m);
         return "";
       }},
      {"shm-prefix", "PREFIX", "objects that may be opened (default /attnd-)", Str(&f->shm_prefix)},
      {"data-plane", "off|ucx",
       "tensors by UCX beside gRPC (default off): clients that connect a\nplane send and receive "
       "them through registered buffers; UCX picks\nshared memory, TCP or RDMA (UCX_TLS as "
       "usual); UCX trusts its\npeers: only on a network whose hosts are all trusted",
       OneOf(&f->data_plane, {"off", "ucx"})},
      {"data-plane-region-bytes", "BYTES",
       "the largest input or output region a client may ask for\n(default 268435456)",
       Bytes(&f->data_plane_region_bytes)},
      {"data-plane-max-planes", "N", "planes connected at once, all tenants (default 64)",
       Int(&f->data_plane_max_planes)},
      {"data-plane-timeout-ms", "N",
       "how long a layer call waits for its inputs to land and its\noutput to be delivered "
       "(default 2000)",
       Limit(&f->data_plane_timeout_ms)},
      {"data-plane-keepalive-ms", "N",
       "clients that offer keepalives send one this often, and a plane\nsilent three times as "
       "long (its client died) is closed within a\nsecond (default 5000; 0: none asked, "
       "planes close\nafter ten idle minutes)",
       Int(&f->data_plane_keepalive_ms)},
      {"data-plane-push", "true|false",
       "send each output to the client as soon as it is built, on an\nendpoint to the worker "
       "address the client gave (default false:\nclients pull outputs once the reply names "
       "them; pushes were slower\non a 2-core host, bench/results/transport.md)",
       Bool(&f->data_plane_push)},
      {"data-plane-without-tls", "true|false",
       "with --tls-cert: allow the data plane anyway (UCX does not encrypt;\nuse only on a "
       "network you trust)",
       Bool(&f->data_plane_without_tls), true},
      {"quota-pages", "N", "per tenant: cache pages held (default 0 = no limit)",
       Int(&f->quota_pages)},
      {"quota-sequences", "N", "per tenant: open sequences (default 0)", Int(&f->quota_sequences)},
      {"quota-steps", "N", "per tenant: open steps (default 0)", Int(&f->quota_steps)},
      {"quota-shm-regions", "N", "per tenant: shared-memory regions (default 0)",
       Int(&f->quota_shm_regions)},
      {"", "",
       "Drain (SIGTERM or the Drain RPC: readiness NOT_SERVING, new steps UNAVAILABLE, open\nsteps "
       "finish, every sequence handed to the peer the clients' rendezvous hash picks,\nthen exit):",
       nullptr},
      {"drain-peers", "LIST",
       "host:port,... or dns:NAME:PORT (a headless Service; this host's\naddresses are skipped); "
       "none: sequences are dropped at exit",
       List(&f->drain_peers, false)},
      {"replica-name", "NAME",
       "what clients and drains hash sequences over (default\nHOST:PORT: in a StatefulSet "
       "stable across restarts)",
       Str(&f->replica_name)},
      {"drain-timeout-ms", "N", "for open steps to end and the moves (default 60000)",
       Int(&f->drain_timeout_ms)},
      {"drain-parallel", "N",
       "sequences handed off at once, each on its own connection\n(1-64, default 4)",
       Limit(&f->drain_parallel)},
      {"drain-token-file", "FILE", "the admin identity's bearer token on the peers",
       Str(&f->drain_token_file)},
      {"admin-token-file", "FILE",
       "--auth=none: its bearer is the admin from any address (the peers'\ndrains and standby "
       "copies); without it admin calls (drain, export,\nhandoff, standby copies) are served "
       "only on loopback and the\nlocal socket",
       Str(&f->admin_token_file)},
      {"drain-tls-ca", "PEM", "TLS to the peers: their CA", Str(&f->drain_tls_ca)},
      {"drain-tls-cert", "PEM", "mTLS to the peers: this server's client certificate",
       Str(&f->drain_tls_cert)},
      {"drain-tls-key", "PEM", "its key", Str(&f->drain_tls_key)},
      {"", "",
       "Standby replicas (docs/replication.md: every sequence's commits copied to the replica\n"
       "its rendezvous hash ranks next; a client fails over there with PromoteSequence; the\n"
       "peers are reached with the drain's credentials):",
       nullptr},
      {"standby-peers", "LIST",
       "host:port,... or dns:NAME:PORT, this replica may be among them\n(default none: no "
       "standby copies)",
       List(&f->standby_peers, false)},
      {"replication", "async|sync",
       "async (default): a commit answers at once, the standby lags by at\nmost "
       "--replication-max-lag-steps commits; sync: a commit answers\nonce its standby has it",
       OneOf(&f->replication, {"async", "sync"})},
      {"replication-max-lag-steps", "N",
       "async: commits wait beyond this many unacknowledged per sequence\n(default 4)",
       Int(&f->replication_max_lag_steps)},
      {"replication-ack-timeout-ms", "N",
       "a standby silent this long no longer holds commits back: they\nanswer unprotected, "
       "the log and metrics say so (default 1000)",
       Int(&f->replication_ack_timeout_ms)},
      {"replication-lease-ms", "N",
       "a primary serves a sequence only while its standby's lease holds:\nrenewed by every "
       "answer, it stops committing 3/4 of this after\nthe last one; the standby is promoted "
       "once it ran out (default\n2000; 0: no leases, serve on when the standby is cut off)",
       Int(&f->replication_lease_ms)},
      {"standby-cache-bytes", "BYTES|all",
       "cache bytes standby copies may hold here (default all: as the\ncache has room; they "
       "spill down the tiers before primaries do)",
       Bytes(&f->standby_cache_bytes, true)},
  };
}

constexpr char kAbout[] = "attnd: the attention-offload server (--flag=value or --flag value)";

// The closest flag to a misspelt one (at most a third of its letters wrong), or "".
std::string Closest(const std::string& name, const std::vector<Flag>& table) {
  std::string best;
  size_t best_distance = name.size() / 3 + 1;
  for (const Flag& t : table) {
    if (t.name.empty()) continue;
    // Levenshtein distance, one row at a time.
    std::vector<size_t> row(t.name.size() + 1);
    for (size_t j = 0; j < row.size(); ++j) row[j] = j;
    for (size_t a = 1; a <= name.size(); ++a) {
      size_t diagonal = row[0];
      row[0] = a;
      for (size_t b = 1; b <= t.name.size(); ++b) {
        const size_t up = row[b];
        row[b] = std::min(
            {row[b] + 1, row[b - 1] + 1, diagonal + (name[a - 1] == t.name[b - 1] ? 0 : 1)});
        diagonal = up;
      }
    }
    if (row.back() < best_distance) {
      best_distance = row.back();
      best = t.name;
    }
  }
  return best;
}

// The table as a CLI11 app: every flag an option taking one value (the last one given wins),
// switches also standing alone, groups as CLI11's option groups; --help and --version as
// CLI11's. A setter's refusal is kept in *error (CLI11 only learns that the value failed).
// Switch values wait in *switches until the parse is done.
void AddFlags(CLI::App& app, const std::vector<Flag>& table, std::string* error,
              std::map<std::string, std::string>* switches) {
  app.set_help_flag("-h,--help", "this text");
  app.set_version_flag("--version",
                       absl::StrCat("attnd ", BuildVersion(), " (", BuildRevision(), ")"),
                       "the build's version and git revision");
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.allow_extras();  // unknown flags and stray arguments: named by ParseServerFlags
  app.get_formatter()->column_width(31);
  std::string group = "Flags", footer;
  for (const Flag& t : table) {
    if (t.name.empty()) {
      // "Name (what it is, maybe over lines):": the name heads the group (one line, CLI11 adds
      // the colon), what it is goes to the footer.
      const absl::string_view title = absl::StripSuffix(t.help, ":");
      const size_t paren = title.find(" (");
      group = std::string(title.substr(0, paren));
      if (paren != absl::string_view::npos)
        absl::StrAppend(&footer, footer.empty() ? "" : "\n", group, ": ",
                        absl::StripSuffix(title.substr(paren + 2), ")"));
      continue;
    }
    if (t.set == nullptr) continue;  // --help, --version: CLI11's own
    CLI::Option* o;
    if (t.is_switch) {
      o = app.add_flag("--" + t.name, (*switches)[t.name], t.help);  // bare: "true"
    } else {
      // Each value given is checked and set in turn (a later one wins; a bad earlier one is
      // refused, not hidden by the later).
      const std::string name = t.name;
      const Setter set = t.set;
      o = app.add_option("--" + name, t.help)
              ->check(CLI::Validator(
                  [name, set, error](std::string& v) {
                    const std::string want = set(v);
                    if (!want.empty())
                      *error = absl::StrCat("bad value '", v, "' for --", name, ": ", want);
                    return want;
                  },
                  "", name));
    }
    o->type_name(t.value)->group(group);
  }
  app.footer(footer + "\n");
}

}  // namespace

std::string ServerUsage() {
  ServerFlags unused;
  CLI::App app{kAbout, "attnd"};
  std::string error;
  std::map<std::string, std::string> switches;
  AddFlags(app, Table(&unused), &error, &switches);
  return app.help();
}

std::vector<std::string> ServerFlagNames() {
  ServerFlags unused;
  std::vector<std::string> names;
  for (const Flag& f : Table(&unused))
    if (!f.name.empty()) names.push_back(f.name);
  return names;
}

absl::StatusOr<ServerFlags> ParseServerFlags(int argc, char** argv) {
  ServerFlags f;
  auto bad = [](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(what, "\nsee attnd --help"));
  };
  const std::vector<Flag> table = Table(&f);
  CLI::App app{kAbout, "attnd"};
  std::string error;
  std::map<std::string, std::string> switches;
  AddFlags(app, table, &error, &switches);
  // --help or --version anywhere (before a "--") answers, whatever else the line holds.
  for (int i = 1; i < argc && std::string(argv[i]) != "--"; ++i) {
    const std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") return absl::CancelledError(app.help());
    if (arg == "--version")
      return absl::CancelledError(
          absl::StrCat("attnd ", BuildVersion(), " (", BuildRevision(), ")\n"));
  }
  // "--flag=" gives the flag an empty value (--drain-peers= clears the list), which CLI11 reads
  // as a missing one: it gets the empty value as the next argument instead. A switch's value
  // must be true or false.
  std::vector<std::string> args;
  for (int i = argc - 1; i >= 1; --i) {
    const std::string arg = argv[i];
    if (arg.size() > 3 && arg.rfind("--", 0) == 0 && arg.back() == '=' &&
        arg.find('=') == arg.size() - 1) {
      const std::string name = arg.substr(2, arg.size() - 3);
      for (const Flag& t : table)
        if (t.is_switch && t.name == name)
          return bad(absl::StrCat("bad value '' for --", name, ": true or false"));
      args.push_back("");
      args.push_back(arg.substr(0, arg.size() - 1));
    } else {
      args.push_back(arg);
    }
  }
  try {
    app.parse(std::move(args));  // reversed, as CLI11 takes a vector
  } catch (const CLI::CallForHelp&) {
    return absl::CancelledError(app.help());
  } catch (const CLI::CallForVersion& v) {
    return absl::CancelledError(absl::StrCat(v.what(), "\n"));
  } catch (const CLI::ParseError& e) {
    // A setter's refusal says the value and what it must be; CLI11's own errors (a flag
    // without its value) name the flag.
    return bad(error.empty() ? std::string(e.what()) : error);
  }
  for (const std::string& arg : app.remaining()) {
    if (arg.rfind("--", 0) != 0) return bad(absl::StrCat("unexpected argument '", arg, "'"));
    const std::string name =
        arg.substr(2, arg.find('=') == std::string::npos ? std::string::npos : arg.find('=') - 2);
    const std::string near = Closest(name, table);
    return bad(absl::StrCat("unknown flag --", name,
                            near.empty() ? "" : absl::StrCat(" (did you mean --", near, "?)")));
  }
  for (const Flag& t : table)
    if (t.is_switch && !switches[t.name].empty())
      if (const std::string want = t.set(switches[t.name]); !want.empty())
        return bad(absl::StrCat("bad value '", switches[t.name], "' for --", t.name, ": ", want));
  if (f.grpc_port > 65535 || f.metrics_port > 65535) return bad("port out of range");
  if (f.max_message_bytes > INT32_MAX) return bad("--max-message-bytes must fit in 2^31-1");
  // Trust flags that only make sense together.
  if (f.tls_cert.empty() != f.tls_key.empty()) return bad("--tls-cert and --tls-key go together");
  if (!f.tls_client_ca.empty() && f.tls_cert.empty())
    return bad("--tls-client-ca needs --tls-cert and --tls-key");
  if (f.auth == "mtls" && f.tls_client_ca.empty())
    return bad("--auth=mtls needs --tls-client-ca (and --tls-cert, --tls-key)");
  if (f.auth == "token" && f.auth_tokens.empty()) return bad("--auth=token needs --auth-tokens");
  if (f.auth == "none" && !f.auth_tokens.empty())
    return bad("--auth-tokens needs --auth=token (or --auth=mtls for local callers)");
  if (f.metrics_tls && f.tls_cert.empty()) return bad("--metrics-tls needs --tls-cert/--tls-key");
  if (f.shm && f.shm_socket.empty()) return bad("--shm needs --shm-socket=PATH");
  if (!f.model_file.empty() && !f.hf_config.empty())
    return bad("--model-file and --hf-config: give one");
  if (f.drain_parallel > 64) return bad("--drain-parallel: at most 64");
  if (f.replication_ack_timeout_ms < 1) return bad("--replication-ack-timeout-ms: at least 1");
  if (f.replication_lease_ms != 0 &&
      (f.replication_lease_ms < f.replication_ack_timeout_ms || f.replication_lease_ms > 600000))
    return bad("--replication-lease-ms: 0, or from --replication-ack-timeout-ms to 600000");
  if (f.replica_name.size() > 253 ||  // empty: HOST:PORT, once the port is bound
      !std::all_of(f.replica_name.begin(), f.replica_name.end(), [](char c) {
        return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.' ||
               c == '_' || c == ':';
      }))
    return bad("--replica-name: at most 253 letters, digits, '-', '.', '_' or ':'");
  if (f.sequence_idle_timeout_s > int64_t{10} * 365 * 86400)
    return bad("--sequence-idle-timeout-s: at most ten years (0 = never)");
  if (!f.shm && !f.shm_socket.empty()) return bad("--shm-socket is only used with --shm");
  if (f.data_plane == "ucx" && !f.tls_cert.empty() && !f.data_plane_without_tls)
    return bad(
        "--data-plane=ucx with TLS: UCX does not encrypt; add --data-plane-without-tls "
        "to allow it on a network you trust");
  if (f.data_plane_region_bytes < 4096 || f.data_plane_region_bytes > (int64_t{1} << 34))
    return bad("--data-plane-region-bytes: from 4096 to 17179869184");
  if (f.data_plane_max_planes < 1 || f.data_plane_max_planes > 4096)
    return bad("--data-plane-max-planes: from 1 to 4096");
  if (f.data_plane_keepalive_ms != 0 &&
      (f.data_plane_keepalive_ms < 100 || f.data_plane_keepalive_ms > 3600000))
    return bad("--data-plane-keepalive-ms: 0, or from 100 to 3600000");
  if (f.kv_events.empty() && !f.kv_events_replay.empty())
    return bad("--kv-events-replay needs --kv-events");
  if (f.disk_cache_dir.empty() != (f.disk_cache_bytes == 0))
    return bad("--disk-cache-dir and --disk-cache-bytes go together");
  if (f.spill_idle_ms > 0 && f.host_cache_bytes == 0 && f.disk_cache_dir.empty())
    return bad("--spill-idle-ms needs a tier to spill to (--host-cache-bytes, --disk-cache-dir)");
  if (!f.admin_token_file.empty() && f.auth != "none")
    return bad("--admin-token-file is for --auth=none (under token or mtls auth: --admin-tenant)");
  if (!f.admin_tenant.empty() && f.auth == "none")
    return bad("--admin-tenant needs --auth=token or --auth=mtls");
  return f;
}

}  // namespace attnd
