// attnctl bench (client/attnctl_common.h): wire bytes and per-layer round trips, moved out of
// attnctl.cc unchanged.
#include <google/protobuf/message.h>

#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/attnctl_common.h"
#include "client/attnd_client.h"
#include "client/wire_variants.h"
#include "client/workload.h"

namespace attnd::client::ctl {
namespace {

// Per-layer figures of one variant over the stream.
struct WireFigures {
  LatencyStats round_trip, server, transport, echo;
  double attention_bytes = 0, indexer_bytes = 0, request_bytes = 0, reply_bytes = 0;
  int64_t calls = 0, full_calls = 0;  // full layers: the ones with indexer tensors
};

}  // namespace

int Bench(Client& c, const Args& a, const ConnectOptions& options, bool json) {
  v1::ServerInfoResponse served;
  auto spec_or = ServedSpec(c, &served);
  if (!spec_or.ok()) return Fail(spec_or.status(), "info");
  const ModelSpec spec = *spec_or;
  const v1::ServerInfoResponse* info = &served;
  const int B = static_cast<int>(a.Int("batch", 8));
  const int64_t context = a.Int("context", 4096);
  const int steps = static_cast<int>(a.Int("steps", 20));
  // Each decode phase (up to five wire variants, unary, shared memory) adds `steps` tokens.
  if (auto s = CheckFits(*info, spec, std::vector<int64_t>(B, context + int64_t{7} * steps),
                         "--batch, --context or --steps");
      !s.ok())
    return Fail(s, "bench");
  std::mt19937_64 rng(7);
  const std::string tag =
      absl::StrCat("bench-", std::chrono::system_clock::now().time_since_epoch().count());
  Batch prefix, decode;
  Opened opened(c);
  for (int b = 0; b < B; ++b) {
    const std::string id = absl::StrCat(tag, "-", b);
    if (auto s = c.OpenSequence(id); !s.ok()) return Fail(s.status(), "open");
    opened.Add(id);
    prefix.emplace_back(id, context);
    decode.emplace_back(id, 1);
  }
  // Import the contexts with write-only steps (no attention computed).
  if (auto s = ImportContexts(c, spec, prefix, rng); !s.ok()) return Fail(s, "import");
  auto g = GenerateStep(spec, B, DType::kBF16, false, rng);
  size_t req_bytes = 0,
         resp_bytes = static_cast<size_t>(B) * spec.num_heads * spec.kv_lora_rank * 2;
  for (const auto& l : g) req_bytes += l.wire.ByteSizeLong();
  req_bytes /= g.size();
  // 1. Wire bytes and round trips of each way to send the same decode layers, over the stream.
  const bool absorbs = info->has_absorption();
  const int Dn = absorbs ? info->absorption().qk_nope_head_dim() : 0;
  std::vector<WireVariant> variants = {{"latent bf16", false, false, false},
                                       {"latent fp8 queries", false, true, false}};
  if (absorbs) {
    variants.push_back({"absorbed bf16", true, false, false});
    variants.push_back({"absorbed fp8 queries", true, true, false});
    variants.push_back({"absorbed fp8 q + reply", true, true, true});
  }
  std::vector<WireFigures> figures(variants.size());
  auto stream = c.OpenStream();
  for (size_t vi = 0; vi < variants.size(); ++vi) {
    const std::vector<v1::LayerInputs> layers =
        VariantLayers(g, variants[vi], B, spec.num_heads, Dn, rng);
    WireFigures& f = figures[vi];
    for (int s = 0; s < steps; ++s) {
      if (absl::Status i = Interrupted(); !i.ok()) return Fail(i, "bench");  // Ctrl-C
      if (auto b = stream->Begin(decode); !b.ok()) return Fail(b.status(), "begin");
      for (const auto& l : layers) {
        const auto t0 = Clock::now();
        auto o = stream->Layer(l);
        if (!o.ok()) return Fail(o.status(), variants[vi].name);
        const double rt = Since(t0);
        f.round_trip.Add(rt);
        f.server.Add(o->server_seconds());
        f.transport.Add(rt - o->server_seconds());
        const double indexer = l.has_index_q() ? static_cast<double>(l.index_q().ByteSizeLong() +
                                                                     l.index_k().ByteSizeLong() +
                                                                     l.index_w().ByteSizeLong())
                                               : 0.0;
        f.request_bytes += static_cast<double>(l.ByteSizeLong());
        f.reply_bytes += static_cast<double>(o->ByteSizeLong());
        f.indexer_bytes += indexer;
        f.full_calls += l.has_index_q() ? 1 : 0;
        f.attention_bytes += static_cast<double>(l.ByteSizeLong() + o->ByteSizeLong()) - indexer;
        ++f.calls;
      }
    }
    // The bare transport of the same bytes: an echo of the mean request and reply.
    const std::string payload(static_cast<size_t>(f.request_bytes / f.calls), 'x');
    for (int64_t k = 0; k < f.calls; ++k) {
      const auto t0 = Clock::now();
      if (auto e = c.Echo(payload, static_cast<int64_t>(f.reply_bytes / f.calls)); !e.ok())
        return Fail(e, "echo");
      f.echo.Add(Since(t0));
    }
  }
  // 2. The latent bf16 layers over each transport.
  LatencyStats unary_lat, shm_lat;
  // The same layers with every tensor in a shared-memory region (co-located client), over the
  // server's Unix-socket listener (--shm-target=unix:PATH; the server runs with --shm).
  const std::string shm_target = a.Get("shm-target", "");
  std::unique_ptr<Client> local;
  std::unique_ptr<StepStream> local_stream;
  const std::string key = absl::StrCat("/attnd-", tag);
  const size_t out_bytes = resp_bytes;
  std::vector<v1::LayerInputs> shm_layers;
  absl::StatusOr<std::unique_ptr<SharedMemory>> mem = absl::UnavailableError("no --shm-target");
  if (!shm_target.empty()) {
    auto l = Client::Connect(shm_target, options);
    if (!l.ok()) return Fail(l.status(), "connect --shm-target");
    local = std::move(l).value();
    mem = SharedMemory::Create(key, (req_bytes + out_bytes) * g.size() + (1 << 20));
    if (!mem.ok()) return Fail(mem.status(), "shared memory");
    if (auto r = local->RegisterSharedMemory(tag, key, 0, static_cast<int64_t>((*mem)->size()));
        !r.ok())
      return Fail(r, "register shared memory");
    local_stream = local->OpenStream();
  }
  if (local != nullptr) {
    std::vector<v1::LayerInputs> wire;
    for (const auto& l : g) wire.push_back(l.wire);
    shm_layers = InSharedMemory(wire, **mem, tag, out_bytes);
  }
  for (int s = 0; s < steps; ++s) {
    if (absl::Status i = Interrupted(); !i.ok()) return Fail(i, "bench");  // Ctrl-C
    if (s > 0 && s % 5 == 0) std::fprintf(stderr, "bench: %d/%d steps\n", s, steps);
    auto b = c.BeginStep(decode);
    if (!b.ok()) return Fail(b.status(), "begin");
    for (auto& l : g) {
      const auto t0 = Clock::now();
      if (auto o = c.AttendLayer(b->step_id(), l.wire); !o.ok())
        return Fail(o.status(), "unary layer");
      unary_lat.Add(Since(t0));
    }
    if (local_stream != nullptr) {
      if (auto b2 = local_stream->Begin(decode); !b2.ok()) return Fail(b2.status(), "begin");
      for (const auto& l : shm_layers) {
        const auto t0 = Clock::now();
        if (auto o = local_stream->Layer(l); !o.ok()) return Fail(o.status(), "shm layer");
        shm_lat.Add(Since(t0));
      }
    }
  }
  (void)stream->Close();
  if (local != nullptr) {
    (void)local_stream->Close();
    (void)local->UnregisterSharedMemory(tag);
  }
  // What both reports say: per wire variant, its bytes per token per layer and times (ms); per
  // transport, its round trips.
  struct VariantRow {
    const char* name;
    double attention, indexer, request, reply, rt50, rt99, server, transport, echo;
    int64_t calls;
  };
  std::vector<VariantRow> rows;
  for (size_t vi = 0; vi < variants.size(); ++vi) {
    const WireFigures& f = figures[vi];
    const double per = 1024.0 * B * static_cast<double>(f.calls);
    rows.push_back({variants[vi].name, f.attention_bytes / per,
                    f.full_calls > 0 ? f.indexer_bytes / (1024.0 * B * f.full_calls) : 0.0,
                    f.request_bytes / per, f.reply_bytes / per, f.round_trip.Percentile(50) * 1e3,
                    f.round_trip.Percentile(99) * 1e3, f.server.Percentile(50) * 1e3,
                    f.transport.Percentile(50) * 1e3, f.echo.Percentile(50) * 1e3, f.calls});
  }
  struct Transport {
    const char* text;  // the table's label
    const char* json;  // the JSON report's name
    const LatencyStats* stats;
  };
  const Transport transports[] = {{"stream", "stream", &figures[0].round_trip},
                                  {"unary", "unary", &unary_lat},
                                  {"stream + shared mem", "stream + shared memory", &shm_lat},
                                  {"echo (same bytes)", "echo", &figures[0].echo}};
  if (json) {
    nlohmann::json out = {{"model", spec.name},
                          {"batch", B},
                          {"context", context},
                          {"heads", spec.num_heads},
                          {"layers", spec.num_layers()},
                          {"steps", steps},
                          {"absorbed_measured", absorbs},
                          {"shared_memory_measured", local != nullptr},
                          {"latent_request_bytes", req_bytes},
                          {"latent_reply_bytes", resp_bytes}};
    for (const VariantRow& r : rows)
      out["variants"].push_back({{"name", r.name},
                                 {"attention_kib_per_token", r.attention},
                                 {"indexer_kib_per_token", r.indexer},
                                 {"request_kib_per_token", r.request},
                                 {"reply_kib_per_token", r.reply},
                                 {"round_trip_ms_p50", r.rt50},
                                 {"round_trip_ms_p99", r.rt99},
                                 {"server_ms_p50", r.server},
                                 {"transport_ms_p50", r.transport},
                                 {"echo_ms_p50", r.echo},
                                 {"calls", r.calls}});
    for (const Transport& t : transports)
      if (t.stats->count() > 0)
        out["round_trips"].push_back({{"transport", t.json},
                                      {"p50_ms", t.stats->Percentile(50) * 1e3},
                                      {"p99_ms", t.stats->Percentile(99) * 1e3},
                                      {"calls", t.stats->count()}});
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }
  std::printf("decode batch %d, context %lld, %d heads, %d layers (%s)\n", B,
              static_cast<long long>(context), spec.num_heads, spec.num_layers(),
              spec.name.c_str());
  std::printf(
      "\nwire bytes per token per layer (KiB = 1024 B; attention = queries, new keys and the "
      "reply, mean over the model's layers; indexer = index_q/k/w, mean over its full layers; "
      "request and reply: means over the layers) and per-layer times (ms, p50 but rt p99, over "
      "the stream; transport = round trip - LayerOutput.server_seconds; echo = the bare round "
      "trip of the same bytes):\n");
  std::printf("%-24s %9s %9s %9s %9s %8s %8s %8s %10s %8s\n", "variant", "attention", "indexer",
              "request", "reply", "rt p50", "rt p99", "server", "transport", "echo");
  for (const VariantRow& r : rows)
    std::printf("%-24s %9.2f %9.2f %9.2f %9.2f %8.3f %8.3f %8.3f %10.3f %8.3f\n", r.name,
                r.attention, r.indexer, r.request, r.reply, r.rt50, r.rt99, r.server, r.transport,
                r.echo);
  if (!absorbs)
    std::printf(
        "(absorbed variants not measured: the server holds no absorption weights; start it with "
        "--absorb-from=CHECKPOINT_DIR)\n");
  std::printf("\nlatent bf16 layers: request %.1f KB, reply %.1f KB per layer\n", req_bytes / 1e3,
              resp_bytes / 1e3);
  std::printf("%-22s %10s %10s %8s\n", "per-layer round trip", "p50", "p99", "calls");
  for (const Transport& t : transports)
    if (t.stats->count() > 0)
      std::printf("%-22s %8.3fms %8.3fms %8zu\n", t.text, t.stats->Percentile(50) * 1e3,
                  t.stats->Percentile(99) * 1e3, t.stats->count());
  if (local == nullptr)
    std::printf(
        "(shared memory not measured: give --shm-target=unix:PATH of a server run "
        "with --shm --shm-socket=PATH)\n");
  return 0;
}

}  // namespace attnd::client::ctl
