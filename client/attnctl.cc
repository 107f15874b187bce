// attnctl: talks to a running attnd.
//   attnctl info  [--target=HOST:PORT]
//   attnctl demo  [--target=...] [--sequences=4] [--prompt=2200] [--chunk=512] [--decode=24]
//                 [--check-every=4] [--seed=1]
//   attnctl bench [--target=...] [--batch=8] [--context=4096] [--steps=20]
//   attnctl handoff --sequence=ID --to=HOST:PORT [--target=...] [--chunk=4096] [--close-source]
//   attnctl list  [--target=...] [--all-tenants]
//   attnctl drain [--target=...] [--to=HOST:PORT,...]
//   attnctl soak  [--target=127.0.0.1:PORT] [--minutes=1] [--clients=4] [--server-pid=PID]
//   attnctl health [--service=attnd.v1.Attention]
// Every command: --help; --target defaults to $ATTND_TARGET; --output=json for info and list.
// Unknown flags or arguments exit 2.
// Connection flags (every command but soak): --tls-ca=PEM [--tls-cert=PEM --tls-key=PEM]
// [--tls-server-name=NAME] for TLS/mTLS; --token-file=FILE (or $ATTND_TOKEN) for a bearer token;
// --as-tenant=NAME (the admin only).
#include <google/protobuf/util/json_util.h>
#include <grpcpp/generic/generic_stub.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <future>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/attnctl_common.h"
#include "client/attnd_client.h"
#include "client/soak.h"
#include "client/workload.h"
#include "common/build_version.h"
#include "common/status_macros.h"
#include "grpc/health/v1/health.pb.h"

namespace attnd::client {
namespace {

// The commands' shared pieces (attnctl_common.h).
using ctl::Args;
using ctl::Bench;
using ctl::CheckFits;
using ctl::Clock;
using ctl::Fail;
using ctl::Interrupted;
using ctl::Opened;
using ctl::Since;
using ctl::StopOnInterrupt;

// A message as one line of JSON (--output=json).
int PrintJson(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions o;
  o.preserve_proto_field_names = true;
  if (!google::protobuf::util::MessageToJsonString(m, &out, o).ok()) return 1;
  std::printf("%s\n", out.c_str());
  return 0;
}

// grpc.health.v1.Health/Check through a generic stub with the health proto's messages (its
// service stubs are not built here); exit 0 when SERVING.
int Health(Client& c, const std::string& service) {
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::GenericStub stub(c.channel());
  const std::string req = request.SerializeAsString();
  grpc::Slice slice(req);
  grpc::ByteBuffer in(&slice, 1), out;
  grpc::ClientContext ctx;
  c.PrepareUnary(&ctx);
  std::promise<grpc::Status> done;
  stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &in, &out,
                 [&done](grpc::Status s) { done.set_value(s); });
  const grpc::Status s = done.get_future().get();
  if (!s.ok()) return Fail(FromGrpcNotCancelled(s), "health");
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (out.Dump(&slices).ok())
    for (const auto& sl : slices)
      bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  grpc::health::v1::HealthCheckResponse reply;
  if (!reply.ParseFromString(bytes))
    return Fail(absl::InternalError("unreadable health reply"), "health");
  std::printf("%s: %s\n", service.empty() ? "(server)" : service.c_str(),
              grpc::health::v1::HealthCheckResponse::ServingStatus_Name(reply.status()).c_str());
  return reply.status() == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
}

int Info(Client& c, bool json) {
  auto info = c.Info();
  if (!info.ok()) return Fail(info.status(), "info");
  if (json) return PrintJson(*info);
  const auto& m = info->model();
  std::printf("%s, backend %s (cpu isa %s), cache %s\n", info->version().c_str(),
              info->backend().c_str(), info->cpu_isa().c_str(), info->cache_datatype().c_str());
  std::string kinds;
  for (const auto& k : m.layers()) kinds += static_cast<char>(std::toupper(k[0]));
  std::printf(
      "model %s: %d layers [%s], L=%d R=%d H=%d, indexer %dx%d, K=%d, page %d, "
      "sm_scale %.6g, max_context %lld, selection %s, prefill %s\n",
      m.name().c_str(), m.layers_size(), kinds.c_str(), m.kv_lora_rank(), m.qk_rope_head_dim(),
      m.num_heads(), m.index_n_heads(), m.index_head_dim(), m.index_topk(), m.page_size(),
      m.sm_scale(), static_cast<long long>(m.max_context()), m.selection().c_str(),
      m.prefill().c_str());
  std::printf("caller: tenant %s%s (auth %s), shared memory %s\n",
              info->tenant().empty() ? "(anonymous)" : info->tenant().c_str(),
              info->admin() ? ", admin" : "", info->auth().c_str(), info->shm() ? "on" : "off");
  for (const auto& d : info->devices())
    std::printf("device %s: %d/%d pages free (%lld bytes each), %lld sequences\n", d.name().c_str(),
                d.pages_free(), d.pages_total(), static_cast<long long>(d.bytes_per_page()),
                static_cast<long long>(d.sequences()));
  for (const auto& t : info->tiers())
    if (t.pages_total() > 0)
      std::printf(
          "tier %s: %lld/%lld pages used (%lld bytes each), %lld sequences\n", t.name().c_str(),
          static_cast<long long>(t.pages_used()), static_cast<long long>(t.pages_total()),
          static_cast<long long>(t.bytes_per_page()), static_cast<long long>(t.sequences()));
  return 0;
}

int Drain(Client& c, const Args& a) {
  v1::DrainRequest req;
  for (absl::string_view p : absl::StrSplit(a.Get("to", ""), ',', absl::SkipEmpty()))
    req.add_peers(std::string(p));
  grpc::ClientContext ctx;
  c.PrepareUnary(&ctx);
  v1::DrainResponse resp;
  if (auto s = FromGrpcNotCancelled(c.stub()->Drain(&ctx, req, &resp)); !s.ok())
    return Fail(s, "drain");
  std::printf("drain started: the server hands its sequences to %s and exits\n",
              req.peers_size() > 0 ? a.Get("to", "").c_str() : "its --drain-peers");
  return 0;
}

// Where a sequence's pages are: its device, or the tier it spilled to ("host", "disk"), and
// whether it is moving or lost.
std::string Where(const v1::SequenceInfo& s) {
  std::string w = s.tier().empty() || s.tier() == "device" ? s.device() : s.tier();
  if (s.moving()) w += " (moving)";
  if (s.lost()) w += " (lost)";
  return w;
}

// Standby replicas (docs/replication.md): a standby copy, or a primary's generation after a
// failover and where its standby is.
std::string Role(const v1::SequenceInfo& s) {
  if (s.standby()) return absl::StrCat("\tstandby copy (generation ", s.generation(), ")");
  std::string out;
  if (s.generation() > 1) absl::StrAppend(&out, "\tgeneration ", s.generation());
  if (!s.standby_replica().empty()) absl::StrAppend(&out, "\tstandby on ", s.standby_replica());
  return out;
}

int List(Client& c, const Args& a, bool json) {
  const bool all = a.flags.count("all-tenants") > 0;
  auto list = c.ListSequences(all);
  if (!list.ok()) return Fail(list.status(), "list");
  if (json) return PrintJson(*list);
  for (const auto& s : list->sequences()) {
    if (all) std::printf("%s\t", s.tenant().empty() ? "(anonymous)" : s.tenant().c_str());
    std::printf("%s\t%lld tokens\t%d pages\t%s%s%s\n", s.sequence_id().c_str(),
                static_cast<long long>(s.length()), s.num_pages(), Where(s).c_str(),
                s.in_step() ? "\tin step" : "", Role(s).c_str());
  }
  std::printf("%d sequence(s)\n", list->sequences_size());
  return 0;
}

int Describe(Client& c, const std::string& id, bool json) {
  auto s = c.DescribeSequence(id);
  if (!s.ok()) return Fail(s.status(), "describe");
  if (json) return PrintJson(*s);
  std::printf("%s\t%lld tokens\t%d pages\t%s%s%s%s\n", s->sequence_id().c_str(),
              static_cast<long long>(s->length()), s->num_pages(), Where(*s).c_str(),
              s->in_step() ? "\tin step" : "", s->importing() ? "\timporting" : "",
              Role(*s).c_str());
  return 0;
}

int Close(Client& c, const std::string& id) {
  if (auto s = c.CloseSequence(id); !s.ok()) return Fail(s, "close");
  std::printf("closed %s\n", id.c_str());
  return 0;
}

int Offload(Client& c, const std::vector<std::string>& ids) {
  if (auto s = c.OffloadSequences(ids); !s.ok()) return Fail(s, "offload");
  std::printf("offloaded %zu sequence(s)\n", ids.size());
  return 0;
}

int Prefetch(Client& c, const std::vector<std::string>& ids) {
  if (auto s = c.PrefetchSequences(ids); !s.ok()) return Fail(s, "prefetch");
  std::printf("prefetching %zu sequence(s)\n", ids.size());
  return 0;
}

// The connection flags: TLS files, a bearer token, acting as a tenant.
absl::StatusOr<ConnectOptions> ConnectFlags(const Args& a) {
  ConnectOptions o;
  o.tls_ca_file = a.Get("tls-ca", "");
  o.tls_cert_file = a.Get("tls-cert", "");
  o.tls_key_file = a.Get("tls-key", "");
  o.tls_server_name = a.Get("tls-server-name", "");
  o.act_as_tenant = a.Get("as-tenant", "");
  const std::string token_file = a.Get("token-file", "");
  if (!token_file.empty()) {
    auto token = ReadTokenFile(token_file);
    if (!token.ok())
      return absl::Status(token.status().code(),
                          absl::StrCat("--token-file: ", token.status().message()));
    o.token = *std::move(token);
  } else if (const char* env = std::getenv("ATTND_TOKEN")) {
    o.token = env;
  }
  return o;
}

// The rows of `v` ([T, ...] row-major, every field) in `rows` ([begin, end) token ranges).
std::vector<double> TakeRows(const std::vector<double>& v, int64_t T,
                             const std::vector<std::pair<int64_t, int64_t>>& rows) {
  std::vector<double> out;
  if (v.empty()) return out;
  const size_t width = v.size() / static_cast<size_t>(T);
  for (const auto& [b, e] : rows)
    out.insert(out.end(), v.begin() + b * width, v.begin() + e * width);
  return out;
}

reference::LayerValues TakeRows(const reference::LayerValues& v, int64_t T,
                                const std::vector<std::pair<int64_t, int64_t>>& rows) {
  reference::LayerValues out;
  out.q_latent = TakeRows(v.q_latent, T, rows);
  out.q_rope = TakeRows(v.q_rope, T, rows);
  out.kv_latent = TakeRows(v.kv_latent, T, rows);
  out.k_rope = TakeRows(v.k_rope, T, rows);
  out.index_q = TakeRows(v.index_q, T, rows);
  out.index_k = TakeRows(v.index_k, T, rows);
  out.index_w = TakeRows(v.index_w, T, rows);
  return out;
}

int Demo(Client& c, const Args& a) {
  auto info = c.Info();
  if (!info.ok()) return Fail(info.status(), "info");
  auto spec_or = ModelSpecFromProto(info->model());
  if (!spec_or.ok()) return Fail(spec_or.status(), "model spec");
  const ModelSpec spec = *spec_or;
  const DType cache = ParseDType(info->cache_datatype()).value_or(DType::kBF16);
  const int S = static_cast<int>(a.Int("sequences", 4));
  const int64_t prompt = a.Int("prompt", 2200), chunk = a.Int("chunk", 512);
  const int decode = static_cast<int>(a.Int("decode", 24));
  const int check_every = static_cast<int>(std::max<int64_t>(1, a.Int("check-every", 4)));
  // all: every sequence against float64; sample: the first and its forks (the oracle keeps
  // only their histories); none: no reference at all. (--check is one of these: CLI11.)
  const std::string check_mode = a.Get("check", "sample");
  std::mt19937_64 rng(a.Int("seed", 1));
  const std::string tag =
      absl::StrCat("demo-", std::chrono::system_clock::now().time_since_epoch().count());
  std::vector<std::string> ids;
  std::map<std::string, int64_t> remaining;
  std::vector<int64_t> final_lengths;
  for (int i = 0; i < S; ++i) {
    ids.push_back(absl::StrCat(tag, "-", i));
    remaining[ids.back()] = std::max<int64_t>(1, prompt * (S - i) / S + 17 * i);  // different
    final_lengths.push_back(remaining[ids.back()] + decode);
  }
  const int64_t prefix = std::min<int64_t>(remaining[ids[0]] - 1, spec.page_size * 3 + 5);
  for (int f = 0; f < 2; ++f) final_lengths.push_back(prefix + 9 + f + decode);
  if (auto s = CheckFits(*info, spec, final_lengths, "--prompt, --sequences or --decode"); !s.ok())
    return Fail(s, "demo");
  std::printf(
      "demo: model %s (%d layers, H=%d, L=%d, K=%d), %d sequences, prompts up to %lld "
      "tokens in chunks of %lld, %d decode steps, float64 check: %s\n",
      spec.name.c_str(), spec.num_layers(), spec.num_heads, spec.kv_lora_rank, spec.index_topk, S,
      static_cast<long long>(prompt), static_cast<long long>(chunk), decode,
      check_mode == "all"      ? "every sequence"
      : check_mode == "sample" ? "the first sequence and its forks (--check=all: every one)"
                               : "none");
  std::fflush(stdout);
  reference::StepOracle oracle(spec, cache);
  std::set<std::string> tracked;  // sequences the oracle follows
  auto track = [&](const std::string& id, bool first) {
    if (check_mode == "all" || (check_mode == "sample" && first)) tracked.insert(id);
  };
  Opened opened(c);
  for (int i = 0; i < S; ++i) {
    if (auto s = c.OpenSequence(ids[i]); !s.ok()) return Fail(s.status(), "open");
    opened.Add(ids[i]);
    track(ids[i], i == 0);
    if (tracked.count(ids[i])) oracle.Open(ids[i]);
  }
  auto stream = c.OpenStream();
  LatencyStats prefill_lat, decode_lat;
  int64_t prefill_tokens = 0, decode_tokens = 0;
  double prefill_secs = 0, decode_secs = 0, input_secs = 0, worst = 0;
  int checked_layers = 0, failed = 0;
  // Runs one step, a layer made and sent at a time (memory: one layer's inputs); adds its server
  // round trips to *secs. The oracle gets the tracked sequences' rows only.
  auto step = [&](const Batch& batch, LatencyStats* lat, bool verify,
                  double* secs) -> absl::Status {
    RETURN_IF_ERROR(Interrupted());  // Ctrl-C: stop here, Opened closes the sequences
    int64_t T = 0;
    Batch sub;
    std::vector<std::pair<int64_t, int64_t>> rows;
    for (const auto& e : batch) {
      if (tracked.count(e.first)) {
        sub.push_back(e);
        rows.emplace_back(T, T + e.second);
      }
      T += e.second;
    }
    verify = verify && !sub.empty();
    auto begun = stream->Begin(batch);
    if (!begun.ok()) return begun.status();
    std::vector<reference::LayerValues> values;
    std::vector<std::vector<double>> outs;
    for (int l = 0; l < spec.num_layers(); ++l) {
      const auto tg = Clock::now();
      GeneratedLayer g = GenerateLayer(spec, l, T, DType::kBF16, false, rng);
      input_secs += Since(tg);
      const auto t0 = Clock::now();
      auto out = stream->Layer(g.wire);
      if (!out.ok()) return out.status();
      lat->Add(Since(t0));
      *secs += Since(t0);
      if (sub.empty()) continue;
      values.push_back(TakeRows(g.values, T, rows));
      if (!verify) continue;
      auto f = TensorValues(out->out());
      if (!f.ok())
        return absl::InternalError(absl::StrCat("the server's reply: ", f.status().message()));
      outs.push_back(TakeRows(std::vector<double>(f->begin(), f->end()), T, rows));
    }
    if (sub.empty()) return absl::OkStatus();
    oracle.Commit(sub, values);
    if (!verify) return absl::OkStatus();
    const auto want = oracle.Expected(sub, values);
    for (size_t l = 0; l < outs.size(); ++l) {
      const double e = reference::RelL2(outs[l], want[l]);
      bool nan = false;
      for (double x : outs[l]) nan |= std::isnan(x);
      worst = std::max(worst, e);
      ++checked_layers;
      if (!(e <= 1e-2) || nan) ++failed;
    }
    return absl::OkStatus();
  };
  const auto started = Clock::now();
  auto progress = [&](const char* phase, int done, int of, int64_t tokens) {
    std::printf("  %s %d/%d: %lld tokens, %.1f s so far\n", phase, done, of,
                static_cast<long long>(tokens), Since(started));
    std::fflush(stdout);
  };
  // 1. Chunked prefill, every sequence's next chunk in one batch (continuous batching).
  int64_t longest = 0;
  for (const auto& [id, n] : remaining) longest = std::max(longest, n);
  const int rounds = static_cast<int>((longest + chunk - 1) / chunk);
  for (int round = 0;; ++round) {
    Batch batch;
    for (const auto& id : ids)
      if (remaining[id] > 0) batch.emplace_back(id, std::min(chunk, remaining[id]));
    if (batch.empty()) break;
    for (auto& [id, q] : batch) {
      remaining[id] -= q;
      prefill_tokens += q;
    }
    // Verify chunks small enough for the float64 oracle.
    int64_t checked_tokens = 0;
    for (const auto& [id, q] : batch) checked_tokens += tracked.count(id) ? q : 0;
    const bool verify = checked_tokens <= 64;
    if (auto s = step(batch, &prefill_lat, verify, &prefill_secs); !s.ok())
      return Fail(s, "prefill");
    progress("prefill", round + 1, rounds, prefill_tokens);
  }
  // 2. Prefix-cache hits: two forks of the first sequence at a non-page-aligned prefix.
  for (int f = 0; f < 2; ++f) {
    const std::string id = absl::StrCat(tag, "-fork", f);
    if (auto s = c.OpenSequence(id, ids[0], prefix); !s.ok()) return Fail(s.status(), "fork");
    opened.Add(id);
    track(id, true);
    if (tracked.count(id)) oracle.Fork(id, ids[0], prefix);
    ids.push_back(id);
    double secs = 0;
    if (auto s = step({{id, 9 + f}}, &prefill_lat, true, &secs); !s.ok())
      return Fail(s, "fork extend");
  }
  // 3. Decode: every sequence, one token per step.
  for (int d = 0; d < decode; ++d) {
    Batch batch;
    for (const auto& id : ids) batch.emplace_back(id, 1);
    decode_tokens += static_cast<int64_t>(batch.size());
    const bool verify = d % check_every == check_every - 1;
    if (auto s = step(batch, &decode_lat, verify, &decode_secs); !s.ok()) return Fail(s, "decode");
    if ((d + 1) % 8 == 0 || d + 1 == decode) progress("decode", d + 1, decode, decode_tokens);
  }
  if (auto s = stream->Close(); !s.ok()) return Fail(s, "close stream");

  std::printf("\n%-10s %10s %12s %12s %12s %12s\n", "phase", "tokens", "tokens/s", "layer p50",
              "layer p99", "layer calls");
  std::printf("%-10s %10lld %12.1f %10.2fms %10.2fms %12zu\n", "prefill",
              static_cast<long long>(prefill_tokens), prefill_tokens / prefill_secs,
              prefill_lat.Percentile(50) * 1e3, prefill_lat.Percentile(99) * 1e3,
              prefill_lat.count());
  std::printf("%-10s %10lld %12.1f %10.2fms %10.2fms %12zu\n", "decode",
              static_cast<long long>(decode_tokens), decode_tokens / decode_secs,
              decode_lat.Percentile(50) * 1e3, decode_lat.Percentile(99) * 1e3, decode_lat.count());
  std::printf("(making the random inputs took %.1f s of the client's time)\n", input_secs);
  if (check_mode == "none") {
    std::printf("\nreference check: skipped (--check=none)\n");
    return 0;
  }
  std::printf(
      "\nreference check: %d layer outputs of %zu sequence(s) against float64, worst relative "
      "L2 %.2e (limit 1e-2 for bf16): %s\n",
      checked_layers, tracked.size(), worst, failed == 0 && checked_layers > 0 ? "PASS" : "FAIL");
  return failed == 0 && checked_layers > 0 ? 0 : 1;
}

// Moves a sequence to another server and, with --close-source, closes it here.
int Handoff(Client& from, const Args& a, const ConnectOptions& options) {
  const std::string id = a.Get("sequence", "");
  const std::string to_target = a.Get("to", "");
  if (id.empty() || to_target.empty()) {
    std::fprintf(stderr, "attnctl handoff: --sequence=ID and --to=HOST:PORT are required\n");
    return 2;
  }
  auto to_or = Client::Connect(to_target, options);
  if (!to_or.ok()) return Fail(to_or.status(), "connect");
  auto to = std::move(to_or).value();
  auto info = from.DescribeSequence(id);
  if (!info.ok()) return Fail(info.status(), "describe");
  const auto t0 = Clock::now();
  if (auto s = HandOffSequence(from, *to, id, a.Int("chunk", 4096)); !s.ok())
    return Fail(s, "handoff");
  const double secs = Since(t0);
  auto there = to->DescribeSequence(id);
  if (!there.ok() || there->length() != info->length())
    return Fail(absl::InternalError("length differs after the handoff"), "verify");
  std::printf("handed off '%s' (%lld tokens) to %s in %.3f s\n", id.c_str(),
              static_cast<long long>(info->length()), to_target.c_str(), secs);
  if (a.flags.count("close-source")) {
    if (auto s = from.CloseSequence(id); !s.ok()) return Fail(s, "close source");
  }
  return 0;
}

}  // namespace
}  // namespace attnd::client

int main(int argc, char** argv) {
  using namespace attnd::client;
  Args a;
  CLI::App app{"attnctl: talks to a running attnd (see attnctl COMMAND --help)", "attnctl"};
  app.set_version_flag("--version", std::string("attnctl ") + attnd::BuildVersion() + " (" +
                                        attnd::BuildRevision() + ")");
  app.require_subcommand(1);
  app.fallthrough();  // connection flags may follow the command
  const char* env_target = std::getenv("ATTND_TARGET");
  std::string target = env_target && *env_target ? env_target : "localhost:50051";
  app.add_option("--target", target,
                 "HOST:PORT, unix:PATH or dns:NAME (default $ATTND_TARGET or localhost:50051)");
  auto str = [&a](CLI::App* cmd, const std::string& name, const std::string& help) {
    return cmd->add_option_function<std::string>(
        "--" + name, [&a, name](const std::string& v) { a.flags[name] = v; }, help);
  };
  auto num = [&a](CLI::App* cmd, const std::string& name, int64_t lo, int64_t hi,
                  const std::string& help) {
    return cmd
        ->add_option_function<int64_t>(
            "--" + name, [&a, name](int64_t v) { a.flags[name] = std::to_string(v); }, help)
        ->check(CLI::Range(lo, hi));
  };
  auto flag = [&a](CLI::App* cmd, const std::string& name, const std::string& help) {
    return cmd->add_flag_callback(
        "--" + name, [&a, name] { a.flags[name] = "1"; }, help);
  };
  for (const char* n :
       {"tls-ca", "tls-cert", "tls-key", "tls-server-name", "token-file", "as-tenant"})
    str(&app, n,
        std::string(n) == "token-file" ? "a file holding the bearer token (or $ATTND_TOKEN)"
        : std::string(n) == "as-tenant"
            ? "the admin only: act inside this tenant's namespace"
            : "TLS: the server's CA / this client's certificate / its key / the name to verify");
  std::string output = "text";
  app.add_option("--output", output, "text or json (info, list, describe, bench)")
      ->check(CLI::IsMember({"text", "json"}));
  double timeout_s = 60;
  CLI::Option* timeout = app.add_option("--timeout", timeout_s,
                                        "seconds each call may take (default 60; health 5; 0 = "
                                        "no limit)")
                             ->check(CLI::Range(0.0, 86400.0));
  CLI::App* info =
      app.add_subcommand("info", "the server's model, devices, limits and who you are");
  CLI::App* health = app.add_subcommand("health", "gRPC health: exit 0 when serving");
  std::string health_service = "attnd.v1.Attention";
  health->add_option("--service", health_service,
                     "\"\" (liveness) or attnd.v1.Attention (readiness)");
  CLI::App* list = app.add_subcommand("list", "this tenant's sequences");
  flag(list, "all-tenants", "the admin only: every tenant's");
  CLI::App* describe = app.add_subcommand("describe", "one sequence: length, pages, device, state");
  std::string describe_id;
  describe->add_option("sequence", describe_id, "the sequence id")->required();
  CLI::App* close = app.add_subcommand("close", "close a sequence: its pages go back to the cache");
  std::string close_id;
  close->add_option("sequence", close_id, "the sequence id")->required();
  CLI::App* offload =
      app.add_subcommand("offload", "spill sequences down a tier now (host, then disk)");
  std::vector<std::string> offload_ids;
  offload->add_option("sequences", offload_ids, "sequence ids")->required();
  CLI::App* prefetch =
      app.add_subcommand("prefetch", "bring spilled sequences back to their devices");
  std::vector<std::string> prefetch_ids;
  prefetch->add_option("sequences", prefetch_ids, "sequence ids")->required();
  CLI::App* drain = app.add_subcommand("drain", "the admin: hand every sequence off, then exit");
  str(drain, "to", "HOST:PORT,... instead of the server's --drain-peers");
  CLI::App* demo = app.add_subcommand("demo", "prefill, forks and decode, checked against float64");
  num(demo, "sequences", 1, 1024, "sequences (default 4)");
  num(demo, "prompt", 1, int64_t{1} << 24, "longest prompt in tokens (default 2200)");
  num(demo, "chunk", 1, int64_t{1} << 20, "prefill chunk (default 512)");
  num(demo, "decode", 0, 1 << 20, "decode steps (default 24)");
  num(demo, "check-every", 1, 1 << 20, "check every Nth decode step (default 4)");
  num(demo, "seed", 0, INT64_MAX, "random seed (default 1)");
  str(demo, "check", "float64 check: all, sample (the first sequence and its forks; default), none")
      ->check(CLI::IsMember({"all", "sample", "none"}));
  CLI::App* bench =
      app.add_subcommand("bench",
                         "wire bytes and per-layer round trips: latent, absorbed and fp8 "
                         "layers; stream, unary, shared memory, echo");
  num(bench, "batch", 1, 4096, "decode batch (default 8)");
  num(bench, "context", 1, int64_t{1} << 24, "tokens per sequence (default 4096)");
  num(bench, "steps", 1, 1 << 20, "decode steps (default 20)");
  str(bench, "shm-target", "unix:PATH of the server's --shm-socket, to measure shared memory");
  CLI::App* transport_bench = app.add_subcommand(
      "transport", "per-layer transport: gRPC bytes, UCX data plane, shared memory, micro-batches");
  num(transport_bench, "batch", 1, 4096, "decode batch (default 8)");
  num(transport_bench, "context", 1, int64_t{1} << 24, "tokens per sequence (default 1024)");
  num(transport_bench, "steps", 1, 1 << 20, "decode steps per measurement (default 10)");
  str(transport_bench, "shm-target", "unix:PATH of the server's --shm-socket");
  CLI::App* handoff = app.add_subcommand("handoff", "copy a sequence to another server");
  str(handoff, "sequence", "the sequence id")->required();
  str(handoff, "to", "HOST:PORT of the receiver")->required();
  num(handoff, "chunk", 1, int64_t{1} << 24, "tokens per chunk (default 4096)");
  flag(handoff, "close-source", "close it here once the copy is confirmed");
  CLI::App* soak = app.add_subcommand("soak", "a bounded mixed workload with an audit (loopback)");
  str(soak, "minutes", "duration (default 1)");
  num(soak, "clients", 1, 1024, "client threads (default 4)");
  num(soak, "sequences", 1, 1 << 16, "sequences per client (default 4)");
  num(soak, "report-seconds", 1, 86400, "report period (default 30)");
  num(soak, "server-pid", 0, INT32_MAX, "watch its RSS and descriptors");
  num(soak, "seed", 0, INT64_MAX, "random seed (default 1)");
  // "--flag=" is an empty value: CLI11 would take the next argument as the value instead
  // (attnctl health --service= --target=X ignored the target), so pass it apart.
  std::vector<std::string> words;
  for (int i = 0; i < argc; ++i) {
    const std::string w = argv[i];
    if (i > 0 && w.size() > 3 && w.rfind("--", 0) == 0 && w.back() == '=' &&
        w.find('=') == w.size() - 1) {
      words.push_back(w.substr(0, w.size() - 1));
      words.emplace_back();
    } else {
      words.push_back(w);
    }
  }
  std::vector<char*> args;
  for (std::string& w : words) args.push_back(w.data());
  try {
    app.parse(static_cast<int>(args.size()), args.data());
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);  // --help: the text on stdout, 0; errors on stderr
    return code == 0 ? 0 : 2;
  }
  a.flags["target"] = target;
  if (soak->parsed()) {
    SoakOptions o;
    o.target = a.Get("target", "127.0.0.1:50051");
    o.minutes = std::atof(a.Get("minutes", "1").c_str());
    o.clients = static_cast<int>(a.Int("clients", 4));
    o.sequences_per_client = static_cast<int>(a.Int("sequences", 4));
    o.report_seconds = static_cast<int>(a.Int("report-seconds", 30));
    o.server_pid = static_cast<int>(a.Int("server-pid", 0));
    o.seed = static_cast<uint64_t>(a.Int("seed", 1));
    return RunSoak(o);
  }
  auto options = ConnectFlags(a);
  if (!options.ok()) return Fail(options.status(), "connect");
  // A probe's default is short: a hung server must fail it well inside the kubelet's timeout.
  const double call_s = health->parsed() && timeout->count() == 0 ? 5 : timeout_s;
  options->call_timeout_ms = static_cast<int64_t>(call_s * 1000);
  auto client_or = Client::Connect(target, *options);
  if (!client_or.ok()) return Fail(client_or.status(), "connect");
  auto client = std::move(client_or).value();
  const bool json = output == "json";
  if (info->parsed()) return Info(*client, json);
  if (health->parsed()) return Health(*client, health_service);
  if (list->parsed()) return List(*client, a, json);
  if (describe->parsed()) return Describe(*client, describe_id, json);
  if (close->parsed()) return Close(*client, close_id);
  if (offload->parsed()) return Offload(*client, offload_ids);
  if (prefetch->parsed()) return Prefetch(*client, prefetch_ids);
  if (drain->parsed()) return Drain(*client, a);
  if (demo->parsed()) {
    StopOnInterrupt();
    return Demo(*client, a);
  }
  if (handoff->parsed()) return Handoff(*client, a, *options);
  StopOnInterrupt();
  if (transport_bench->parsed()) return TransportBench(target, a, *options, json);
  return Bench(*client, a, *options, json);
}
