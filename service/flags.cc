#include "service/flags.h"

#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "service/service_metrics.h"

namespace attnd {

std::string ServerUsage() {
  return R"(usage: attnd [flags]
  --help, --version            this text; the build's version and git revision
  --log-level=info|warning|error  leveled logs on stderr (default info): the effective
                               configuration at start, one line per refused or aborted step
                               (rate-limited), drains, reloads
  --grpc-address=ADDR          listen address (default 0.0.0.0)
  --grpc-port=N                gRPC port (default 50051; 0 picks a free port and prints it)
  --metrics-port=N             Prometheus /metrics port (default 9090; 0 disables)
  --model=NAME                 preset: deepseek-v3.2, glm-5, glm-5.2, tiny, demo (default demo)
  --model-file=PATH            JSON model spec (overrides --model)
  --kv-cache-bytes=N           cache bytes per device (default 1073741824)
  --kv-pages=N                 cache pages per device, incl. reserved page 0 (overrides bytes)
  --gpu-scratch-bytes=N        per GPU, beside its cache: a step's working memory (about
                               1.1 MiB per new token at 128 heads, 0.2 MiB at 16); a step
                               that needs more is refused at BeginStep (default 8589934592)
  --cache-dtype=bf16|fp32      cache element type (default bf16)
  --devices=LIST               cpu:N and/or cuda:N, comma separated; each sequence lives on
                               one device. auto (default): every GPU when this build has CUDA
                               and a GPU is visible, else cpu:0. --devices=cpu:0 forces the CPU
  --threads=N                  compute threads (default: all cores)
  --cpu-isa=auto|avx2|generic  CPU inner loops (default auto: the widest the host has)
  --max-message-bytes=N        gRPC send/receive limit (default 1073741824)
  --step-idle-timeout-ms=N     abort open steps idle this long (default 30000)
  --shutdown-grace-ms=N        on SIGTERM, let RPCs finish this long (default 10000)
Per-request limits (ServerInfo.limits reports them):
  --max-step-tokens=N          new tokens in one step, all sequences (default 65536)
  --max-batch-entries=N        sequences in one step (default 4096)
  --max-sequences=N            open sequences (default 65536)
  --max-id-bytes=N             length of a sequence id (default 256)
  --max-echo-bytes=N           Echo reply size (default 67108864; also capped by the message size)
  --max-shm-regions=N          registered shared-memory regions (default 64)
  --check-finite=true|false    refuse NaN/Inf in input tensors (default true)
  --begin-wait-ms=N            a BeginStep whose sequence is in a step running a layer (which may
                               be aborting after a cancel) waits this long for it (default 10000)
Trust (see the README's deployment section):
  --auth=none|token|mtls       who the caller is: one anonymous tenant (default, local use), a
                               bearer token looked up in --auth-tokens, or the mTLS client
                               certificate's identity (first SAN, else CN)
  --auth-tokens=FILE           lines of TOKEN TENANT [pages=N] [sequences=N] [steps=N]
                               [shm-regions=N]; reread when it changes
  --admin-tenant=NAME          this tenant may list every tenant's sequences and act as one
                               (metadata attnd-tenant: NAME)
  --tls-cert=PEM --tls-key=PEM serve TLS; the files are reread when they change (rotation)
  --tls-client-ca=PEM          require client certificates signed by this CA (mTLS)
  --metrics-tls[=true|false]   serve /metrics over HTTPS with the same certificate
  --reload-interval-s=N        how often certificate and token files are checked (default 10)
  --grpc-reflection=true|false gRPC server reflection (default true)
  --shm[=true|false]           allow shared-memory tensors (default off), only over
                               --shm-socket, only for objects the calling user owns
  --shm-socket=PATH            the Unix-socket listener for co-located clients
  --shm-socket-mode=OCTAL      its file mode (default 0660)
  --shm-prefix=PREFIX          objects that may be opened (default /attnd-)
  --quota-pages=N              per tenant: cache pages held (default 0 = no limit)
  --quota-sequences=N          per tenant: open sequences (default 0)
  --quota-steps=N              per tenant: open steps (default 0)
  --quota-shm-regions=N        per tenant: shared-memory regions (default 0)
Drain (SIGTERM or the Drain RPC: readiness NOT_SERVING, new steps UNAVAILABLE, open steps finish,
every sequence handed to the peer the clients' rendezvous hash picks, then exit):
  --drain-peers=LIST           host:port,... or dns:NAME:PORT (a headless Service; this host's
                               addresses are skipped); none: sequences are lost at exit
  --drain-timeout-ms=N         for open steps to end and the moves (default 60000)
  --drain-token-file=FILE      the admin identity's bearer token on the peers
  --drain-tls-ca=PEM --drain-tls-cert=PEM --drain-tls-key=PEM   TLS/mTLS to the peers
)";
}

absl::StatusOr<ServerFlags> ParseServerFlags(int argc, char** argv) {
  ServerFlags f;
  auto bad = [](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(what, "\n", ServerUsage()));
  };
  // A non-negative integer that fits the destination's type: nothing is silently truncated.
  auto int_flag = [](auto* out) {
    return [out](const std::string& v) {
      using T = std::remove_pointer_t<decltype(out)>;
      int64_t x;
      if (!absl::SimpleAtoi(v, &x) || x < 0 ||
          static_cast<uint64_t>(x) > static_cast<uint64_t>(std::numeric_limits<T>::max()))
        return false;
      *out = static_cast<T>(x);
      return true;
    };
  };
  // A positive integer (a limit of 0 would refuse everything).
  auto limit_flag = [](int64_t* out) {
    return [out](const std::string& v) {
      int64_t x;
      if (!absl::SimpleAtoi(v, &x) || x < 1) return false;
      *out = x;
      return true;
    };
  };
  auto bool_flag = [](bool* out) {
    return [out](const std::string& v) {
      if (v != "true" && v != "false") return false;
      *out = v == "true";
      return true;
    };
  };
  auto str_flag = [](std::string* out) {
    return [out](const std::string& v) {
      *out = v;
      return true;
    };
  };
  const std::map<std::string, std::function<bool(const std::string&)>> flags = {
      {"grpc-address", str_flag(&f.grpc_address)},
      {"grpc-port", int_flag(&f.grpc_port)},
      {"metrics-port", int_flag(&f.metrics_port)},
      {"model", str_flag(&f.model)},
      {"model-file", str_flag(&f.model_file)},
      {"kv-cache-bytes", int_flag(&f.kv_cache_bytes)},
      {"kv-pages", int_flag(&f.kv_pages)},
      {"gpu-scratch-bytes", int_flag(&f.gpu_scratch_bytes)},
      {"cache-dtype",
       [&f](const std::string& v) {
         if (v == "bf16") {
           f.cache_dtype = DType::kBF16;
         } else if (v == "fp32") {
           f.cache_dtype = DType::kF32;
         } else {
           return false;
         }
         return true;
       }},
      {"devices",
       [&f](const std::string& v) {
         f.devices = absl::StrSplit(v, ',', absl::SkipEmpty());
         return !f.devices.empty();
       }},
      {"threads", int_flag(&f.threads)},
      {"cpu-isa",
       [&f](const std::string& v) {
         f.cpu_isa = v;
         return v == "auto" || v == "avx2" || v == "generic";
       }},
      {"max-message-bytes", int_flag(&f.max_message_bytes)},
      {"step-idle-timeout-ms", int_flag(&f.step_idle_timeout_ms)},
      {"shutdown-grace-ms", int_flag(&f.shutdown_grace_ms)},
      {"max-step-tokens", limit_flag(&f.max_step_tokens)},
      {"max-batch-entries", limit_flag(&f.max_batch_entries)},
      {"max-sequences", limit_flag(&f.max_sequences)},
      {"max-id-bytes", limit_flag(&f.max_id_bytes)},
      {"max-echo-bytes", int_flag(&f.max_echo_bytes)},
      {"max-shm-regions", int_flag(&f.max_shm_regions)},
      {"begin-wait-ms", int_flag(&f.begin_wait_ms)},
      {"check-finite", bool_flag(&f.check_finite)},
      {"auth",
       [&f](const std::string& v) {
         f.auth = v;
         return v == "none" || v == "token" || v == "mtls";
       }},
      {"auth-tokens", str_flag(&f.auth_tokens)},
      {"admin-tenant", str_flag(&f.admin_tenant)},
      {"tls-cert", str_flag(&f.tls_cert)},
      {"tls-key", str_flag(&f.tls_key)},
      {"tls-client-ca", str_flag(&f.tls_client_ca)},
      {"metrics-tls", bool_flag(&f.metrics_tls)},
      {"reload-interval-s", limit_flag(&f.reload_interval_s)},
      {"grpc-reflection", bool_flag(&f.grpc_reflection)},
      {"shm", bool_flag(&f.shm)},
      {"shm-socket", str_flag(&f.shm_socket)},
      {"shm-prefix", str_flag(&f.shm_prefix)},
      {"shm-socket-mode",
       [&f](const std::string& v) {
         char* end = nullptr;
         const unsigned long m = std::strtoul(v.c_str(), &end, 8);
         if (v.empty() || *end != '\0' || m > 0777) return false;
         f.shm_socket_mode = static_cast<uint32_t>(m);
         return true;
       }},
      {"quota-pages", int_flag(&f.quota_pages)},
      {"quota-sequences", int_flag(&f.quota_sequences)},
      {"quota-steps", int_flag(&f.quota_steps)},
      {"quota-shm-regions", int_flag(&f.quota_shm_regions)},
      {"drain-peers",
       [&f](const std::string& v) {
         f.drain_peers = absl::StrSplit(v, ',', absl::SkipEmpty());
         return true;
       }},
      {"drain-timeout-ms", int_flag(&f.drain_timeout_ms)},
      {"log-level",
       [&f](const std::string& v) {
         f.log_level = v;
         return v == "info" || v == "warning" || v == "error";
       }},
      {"drain-token-file", str_flag(&f.drain_token_file)},
      {"drain-tls-ca", str_flag(&f.drain_tls_ca)},
      {"drain-tls-cert", str_flag(&f.drain_tls_cert)},
      {"drain-tls-key", str_flag(&f.drain_tls_key)},
  };
  // Switches that may stand alone (--shm means --shm=true).
  const std::set<std::string> switches = {"shm", "metrics-tls"};
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") return absl::CancelledError(ServerUsage());
    if (arg == "--version")
      return absl::CancelledError(
          absl::StrCat("attnd ", BuildVersion(), " (", BuildRevision(), ")\n"));
    if (arg.rfind("--", 0) != 0) return bad(absl::StrCat("unexpected argument '", arg, "'"));
    std::string name = arg.substr(2), value;
    const size_t eq = name.find('=');
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    } else if (switches.count(name)) {
      value = "true";
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      return bad(absl::StrCat("flag --", name, " needs a value"));
    }
    auto it = flags.find(name);
    if (it == flags.end()) return bad(absl::StrCat("unknown flag --", name));
    if (!it->second(value)) return bad(absl::StrCat("bad value '", value, "' for --", name));
  }
  if (f.grpc_port > 65535 || f.metrics_port > 65535) return bad("port out of range");
  if (f.max_message_bytes > INT32_MAX) return bad("--max-message-bytes must fit in 2^31-1");
  // Trust flags that only make sense together.
  if (f.tls_cert.empty() != f.tls_key.empty()) return bad("--tls-cert and --tls-key go together");
  if (!f.tls_client_ca.empty() && f.tls_cert.empty())
    return bad("--tls-client-ca needs --tls-cert and --tls-key");
  if (f.auth == "mtls" && f.tls_client_ca.empty())
    return bad("--auth=mtls needs --tls-client-ca (and --tls-cert, --tls-key)");
  if (f.auth == "token" && f.auth_tokens.empty()) return bad("--auth=token needs --auth-tokens");
  if (f.metrics_tls && f.tls_cert.empty()) return bad("--metrics-tls needs --tls-cert/--tls-key");
  if (f.shm && f.shm_socket.empty()) return bad("--shm needs --shm-socket=PATH");
  if (!f.shm && !f.shm_socket.empty()) return bad("--shm-socket is only used with --shm");
  if (!f.admin_tenant.empty() && f.auth == "none")
    return bad("--admin-tenant needs --auth=token or --auth=mtls");
  return f;
}

}  // namespace attnd
