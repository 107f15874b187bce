// attnctl transport (docs/data-plane.md): the per-layer transport of each way a decode layer's
// tensors may travel, gRPC bytes, shared memory and the UCX data plane, beside a bare UCX round
// trip of the same bytes measured in the same process, and a worker's wait per layer with one
// and with two micro-batches in flight against a stand-in FFN of measured length.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/attnctl_common.h"
#include "client/attnd_client.h"
#include "client/wire_variants.h"
#include "client/workload.h"
#include "transport/ucx_plane.h"
#include "transport/ucx_plane_client.h"

namespace attnd::client::ctl {
namespace {

struct Figures {
  LatencyStats round_trip, transport;
  double request_bytes = 0, reply_bytes = 0;  // tensor payloads, per call
  int64_t calls = 0;
  // With a bare trip after each call: those trips, and each call's transport over its trip's.
  LatencyStats bare, paired_ratio;
};

double TensorBytes(const v1::Tensor& t) {
  return static_cast<double>(t.data().size() + t.scales().data().size() +
                             (t.has_shm() ? t.shm().byte_size() : 0));
}

double PayloadOf(const v1::LayerInputs& in) {
  double b = 0;
  for (const v1::Tensor* t : {&in.q_latent(), &in.q_nope(), &in.q_rope(), &in.kv_latent(),
                              &in.k_rope(), &in.index_q(), &in.index_k(), &in.index_w()})
    b += TensorBytes(*t);
  return b;
}

// The bare UCX round trip of `request` bytes out and `reply` bytes back between two workers of
// this process (the plane's own code without gRPC or the engine; the reply pushed, as a plane
// whose client gave its address sends outputs): the transports UCX_TLS allows.
// Interleaved with the UCX plane's layer calls, one trip after each call with that call's bytes,
// so that both see the machine as it is at that moment (on a shared 2-core VM the same trip
// measured 1.7 ms in one run and 8 ms in the next).
class BareTrip {
 public:
  static absl::StatusOr<std::unique_ptr<BareTrip>> Create(size_t max_bytes) {
    std::unique_ptr<BareTrip> b(new BareTrip);
    transport::UcxPlane::Options o;
    o.max_region_bytes = static_cast<int64_t>(max_bytes) + 4096;
    o.push = true;  // the reply sent as it is ready: no pull request on the way
    auto server = transport::UcxPlane::Create(o);
    if (!server.ok()) return server.status();
    b->server_ = std::move(*server);
    auto client = transport::UcxPlaneClient::Create(o.max_region_bytes);
    if (!client.ok()) return client.status();
    b->client_ = std::move(*client);
    auto conn = b->server_->Connect("bench", o.max_region_bytes, o.max_region_bytes, 0,
                                    b->client_->address());
    if (!conn.ok()) return conn.status();
    if (auto s = b->client_->Attach(conn->id, conn->token, conn->server_address, o.max_region_bytes,
                                    conn->pushes);
        !s.ok())
      return s;
    auto in = b->server_->Resolve("bench", "in", conn->input_region, 0, o.max_region_bytes);
    auto out = b->server_->Resolve("bench", "out", conn->output_region, 0, o.max_region_bytes);
    if (!in.ok() || !out.ok()) return absl::InternalError("bare UCX: regions");
    b->in_ = std::move(*in);
    b->out_ = std::move(*out);
    b->payload_.assign(max_bytes, 'q');
    b->staged_ = b->out_->Staging(0, max_bytes);
    std::memset(b->staged_, 'o', max_bytes);
    for (int k = 0; k < 3; ++k)  // warm-up trips
      if (auto t = b->Once(max_bytes, max_bytes); !t.ok()) return t.status();
    return b;
  }

  // One round trip: its seconds.
  absl::StatusOr<double> Once(size_t request, size_t reply) {
    const uint64_t t = client_->NextTransfer(), r = client_->NextTransfer();
    client_->Want(r);
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    const auto t0 = Clock::now();
    auto sent = client_->Put(payload_.data(), request, 0, t);
    auto view = in_->View(0, request, t, deadline);
    if (!view.ok()) return view.status();
    if (auto w = out_->Write(0, staged_, reply, r); !w.ok()) return w;
    auto got = client_->Await(r, 0, reply, deadline);
    if (!got.ok()) return got.status();
    if (auto s = sent->Wait(deadline); !s.ok()) return s;
    return Since(t0);
  }

 private:
  BareTrip() = default;
  std::unique_ptr<transport::UcxPlane> server_;
  std::unique_ptr<transport::UcxPlaneClient> client_;
  std::shared_ptr<const Region> in_, out_;
  std::string payload_;
  char* staged_ = nullptr;
};

// `steps` decode steps of `layers` over a fresh stream of `c`: per layer, the round trip and the
// transport (round trip - server_seconds + transfer_seconds); with `bare`, a bare trip of the same
// bytes after each call.
absl::Status Measure(Client& c, const Batch& decode, const std::vector<v1::LayerInputs>& layers,
                     size_t out_bytes, int steps, Figures* f, BareTrip* bare = nullptr) {
  // The output goes where a worker wants it, its own buffer (out_bytes 0: the layers name a
  // shared-memory region for it).
  std::string out(out_bytes, '\0');
  auto stream = c.OpenStream();
  for (int s = 0; s < steps; ++s) {
    if (absl::Status i = Interrupted(); !i.ok()) return i;
    if (auto b = stream->Begin(decode); !b.ok()) return b.status();
    for (const v1::LayerInputs& l : layers) {
      const auto t0 = Clock::now();
      auto o = out_bytes > 0 ? stream->Layer(l, out.data(), out_bytes) : stream->Layer(l);
      if (!o.ok()) return o.status();
      const double rt = Since(t0);
      f->round_trip.Add(rt);
      const double transport = rt - o->server_seconds() + o->transfer_seconds();
      f->transport.Add(transport);
      const double request = PayloadOf(l);
      const double reply = out_bytes > 0 ? static_cast<double>(out_bytes) : TensorBytes(o->out());
      f->request_bytes += request;
      f->reply_bytes += reply;
      ++f->calls;
      if (bare == nullptr) continue;
      auto trip = bare->Once(static_cast<size_t>(request), static_cast<size_t>(reply));
      if (!trip.ok()) return trip.status();
      f->bare.Add(*trip);
      f->paired_ratio.Add(transport / *trip);
    }
  }
  return stream->Close();
}

void SleepFor(double seconds) {  // the FFN runs elsewhere: the worker's CPU is idle meanwhile
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
}

struct MicroBatches {
  double ffn = 0;
  LatencyStats serial_wait, overlapped_wait;
  double serial_seconds = 0, overlapped_seconds = 0;  // per step of both micro-batches
};

// Two micro-batches of the same size, `steps` steps: first one after the other (each layer's
// attention, then its FFN), then with one micro-batch's attention in flight while the worker
// runs the other's FFN (StepStream::LayerAsync). The wait is the time the worker blocks on an
// attention result.
absl::Status RunMicroBatches(Client& c, const Batch& mb0, const Batch& mb1,
                             const std::vector<v1::LayerInputs>& layers, int steps, double ffn,
                             MicroBatches* m) {
  m->ffn = ffn;
  auto s0 = c.OpenStream(), s1 = c.OpenStream();
  const size_t L = layers.size();
  for (int s = 0; s < steps; ++s) {
    auto t_step = Clock::now();
    for (auto [stream, batch] : {std::pair{s0.get(), &mb0}, std::pair{s1.get(), &mb1}}) {
      if (auto b = stream->Begin(*batch); !b.ok()) return b.status();
      for (const auto& l : layers) {
        const auto t0 = Clock::now();
        if (auto o = stream->Layer(l); !o.ok()) return o.status();
        m->serial_wait.Add(Since(t0));
        SleepFor(ffn);
      }
    }
    m->serial_seconds += Since(t_step);
    if (auto b = s0->Begin(mb0); !b.ok()) return b.status();
    if (auto b = s1->Begin(mb1); !b.ok()) return b.status();
    t_step = Clock::now();
    for (size_t l = 0; l < L; ++l) {
      auto f0 = s0->LayerAsync(layers[l]);
      if (l > 0) SleepFor(ffn);  // micro-batch 1's FFN of the layer before
      auto t0 = Clock::now();
      auto o0 = f0.get();
      m->overlapped_wait.Add(Since(t0));
      if (!o0.ok()) return o0.status();
      auto f1 = s1->LayerAsync(layers[l]);
      SleepFor(ffn);  // micro-batch 0's FFN of this layer
      t0 = Clock::now();
      auto o1 = f1.get();
      m->overlapped_wait.Add(Since(t0));
      if (!o1.ok()) return o1.status();
    }
    SleepFor(ffn);  // micro-batch 1's last FFN
    m->overlapped_seconds += Since(t_step);
  }
  m->serial_seconds /= steps;
  m->overlapped_seconds /= steps;
  (void)s0->Close();
  return s1->Close();
}

}  // namespace

int TransportBench(const std::string& target, const Args& a, const ConnectOptions& options,
                   bool json) {
  ConnectOptions grpc_only = options, with_plane = options;
  grpc_only.data_plane = "off";
  with_plane.data_plane = "auto";
  auto bytes_client = Client::Connect(target, grpc_only);
  if (!bytes_client.ok()) return Fail(bytes_client.status(), "connect");
  Client& c = **bytes_client;
  v1::ServerInfoResponse served;
  auto spec_or = ServedSpec(c, &served);
  if (!spec_or.ok()) return Fail(spec_or.status(), "info");
  const ModelSpec spec = *spec_or;
  const v1::ServerInfoResponse* info = &served;
  const int B = static_cast<int>(a.Int("batch", 8));
  const int64_t context = a.Int("context", 1024);
  const int steps = static_cast<int>(a.Int("steps", 10));
  const bool absorbs = info->has_absorption();
  std::vector<WireVariant> variants = {{"latent bf16", false, false, false},
                                       {"latent fp8 queries", false, true, false}};
  if (absorbs) {
    variants.push_back({"absorbed bf16", true, false, false});
    variants.push_back({"absorbed fp8 queries", true, true, false});
  }
  // The planes this server offers this process.
  struct Plane {
    std::string name;
    std::unique_ptr<Client> client;
    bool shm = false, ucx = false;
  };
  std::vector<Plane> planes;
  planes.push_back({"grpc bytes", std::move(*bytes_client), false});
  Client& base = *planes[0].client;
  auto ucx = Client::Connect(target, with_plane);
  if (ucx.ok() && (*ucx)->ConnectDataPlane().ok())
    planes.push_back(
        {absl::StrCat("ucx (", transport::UcxTransports(), ")"), std::move(*ucx), false, true});
  const std::string shm_target = a.Get("shm-target", "");
  if (!shm_target.empty()) {
    auto l = Client::Connect(shm_target, grpc_only);
    if (!l.ok()) return Fail(l.status(), "connect --shm-target");
    planes.push_back({"shared memory", std::move(*l), true});
  }
  const int rounds = static_cast<int>(planes.size() * variants.size()) + 3;
  if (auto s = CheckFits(*info, spec, std::vector<int64_t>(2 * B, context + rounds * steps),
                         "--batch, --context or --steps");
      !s.ok())
    return Fail(s, "transport");
  std::mt19937_64 rng(11);
  const std::string tag =
      absl::StrCat("transport-", std::chrono::system_clock::now().time_since_epoch().count());
  Batch prefix, decode, prefix2, decode2;
  Opened opened(base);
  for (int b = 0; b < 2 * B; ++b) {
    const std::string id = absl::StrCat(tag, "-", b);
    if (auto s = base.OpenSequence(id); !s.ok()) return Fail(s.status(), "open");
    opened.Add(id);
    (b < B ? prefix : prefix2).emplace_back(id, context);
    (b < B ? decode : decode2).emplace_back(id, 1);
  }
  if (auto s = ImportContexts(base, spec, prefix, rng); !s.ok()) return Fail(s, "import");
  auto g = GenerateStep(spec, B, DType::kBF16, false, rng);
  const int Dn = absorbs ? info->absorption().qk_nope_head_dim() : 0;
  std::unique_ptr<SharedMemory> mem;
  struct Row {
    std::string plane, variant;
    Figures f;
  };
  std::vector<Row> rows;
  std::vector<std::pair<std::string, LatencyStats>> bare;  // per variant
  for (const WireVariant& v : variants) {
    const std::vector<v1::LayerInputs> layers = VariantLayers(g, v, B, spec.num_heads, Dn, rng);
    const size_t out = static_cast<size_t>(B) * spec.num_heads *
                       (v.absorbed ? info->absorption().v_head_dim() : spec.kv_lora_rank) * 2;
    size_t largest = out;
    for (const auto& l : layers) largest = std::max(largest, static_cast<size_t>(PayloadOf(l)));
    auto trip = BareTrip::Create(largest);
    if (!trip.ok()) return Fail(trip.status(), "bare UCX");
    std::optional<size_t> paired;  // the UCX plane's row (its bare trips interleaved)
    for (Plane& p : planes) {
      std::vector<v1::LayerInputs> sent = layers;
      if (p.shm) {
        if (v.fp8_queries) continue;  // FP8 replies aside, every tensor goes: the same bytes
        size_t need = 1 << 20;
        for (const auto& l : layers) need += static_cast<size_t>(PayloadOf(l)) + out;
        mem.reset();  // the previous variant's object goes first
        auto m = SharedMemory::Create(absl::StrCat("/attnd-", tag, "-", rows.size()), need);
        if (!m.ok()) return Fail(m.status(), "shared memory");
        mem = std::move(*m);
        (void)p.client->UnregisterSharedMemory(tag);
        if (auto r = p.client->RegisterSharedMemory(tag, mem->key(), 0,
                                                    static_cast<int64_t>(mem->size()));
            !r.ok())
          return Fail(r, "register shared memory");
        sent = InSharedMemory(layers, *mem, tag, out);
      }
      rows.push_back({p.name, v.name, {}});
      if (auto s = Measure(*p.client, decode, sent, p.shm ? 0 : out, steps, &rows.back().f,
                           p.ucx ? trip->get() : nullptr);
          !s.ok())
        return Fail(s, absl::StrCat(p.name, ", ", v.name).c_str());
      if (p.ucx) paired = rows.size() - 1;
    }
    if (paired.has_value()) {
      bare.emplace_back(v.name, rows[*paired].f.bare);
      continue;
    }
    // No UCX plane on this server: bare trips of the calls' mean bytes, after them.
    const Figures& f = rows.back().f;
    LatencyStats alone;
    for (int k = 0; k < steps * spec.num_layers(); ++k) {
      auto t = (*trip)->Once(static_cast<size_t>(f.request_bytes / f.calls),
                             static_cast<size_t>(f.reply_bytes / f.calls));
      if (!t.ok()) return Fail(t.status(), "bare UCX");
      alone.Add(*t);
    }
    bare.emplace_back(v.name, std::move(alone));
  }
  // The control floor: a gRPC round trip of a few bytes (the layer call's message without its
  // tensors), the part of any plane's transport that is not moving tensors.
  LatencyStats control;
  for (int k = 0; k < steps * spec.num_layers() + 3; ++k) {
    const auto t0 = Clock::now();
    if (auto e = base.Echo(std::string(512, 'c'), 512); !e.ok()) return Fail(e, "echo");
    if (k >= 3) control.Add(Since(t0));
  }
  // Micro-batches over the fastest plane the server offers (the UCX plane when there is one).
  Client& mc = planes.size() > 1 && !planes[1].shm ? *planes[1].client : base;
  if (auto s = ImportContexts(base, spec, prefix2, rng); !s.ok()) return Fail(s, "import");
  const double ffn = rows[planes.size() > 1 && !planes[1].shm ? 1 : 0].f.round_trip.Percentile(50);
  MicroBatches mb;
  std::vector<v1::LayerInputs> wire;
  for (const auto& l : g) wire.push_back(l.wire);
  if (auto s = RunMicroBatches(mc, decode, decode2, wire, steps, ffn, &mb); !s.ok())
    return Fail(s, "micro-batches");
  if (json) {
    nlohmann::json out = {{"model", spec.name},
                          {"batch", B},
                          {"context", context},
                          {"heads", spec.num_heads},
                          {"layers", spec.num_layers()},
                          {"steps", steps},
                          {"ucx_transports", transport::UcxTransports()},
                          {"ucx_version", transport::UcxVersion()}};
    for (const Row& r : rows) {
      nlohmann::json row = {{"plane", r.plane},
                            {"variant", r.variant},
                            {"request_bytes", r.f.request_bytes / r.f.calls},
                            {"reply_bytes", r.f.reply_bytes / r.f.calls},
                            {"round_trip_ms_p50", r.f.round_trip.Percentile(50) * 1e3},
                            {"transport_ms_p50", r.f.transport.Percentile(50) * 1e3},
                            {"transport_ms_p99", r.f.transport.Percentile(99) * 1e3},
                            {"calls", r.f.calls}};
      if (r.f.paired_ratio.count() > 0) row["paired_ratio_p50"] = r.f.paired_ratio.Percentile(50);
      out["rows"].push_back(std::move(row));
    }
    out["control_ms_p50"] = control.Percentile(50) * 1e3;
    out["control_ms_p99"] = control.Percentile(99) * 1e3;
    for (const auto& [name, st] : bare)
      out["bare_ucx"].push_back({{"variant", name},
                                 {"round_trip_ms_p50", st.Percentile(50) * 1e3},
                                 {"round_trip_ms_p99", st.Percentile(99) * 1e3}});
    out["micro_batches"] = {{"plane", mc.DataPlaneName().empty() ? "grpc bytes" : "ucx"},
                            {"ffn_ms", mb.ffn * 1e3},
                            {"serial_wait_ms_p50", mb.serial_wait.Percentile(50) * 1e3},
                            {"overlapped_wait_ms_p50", mb.overlapped_wait.Percentile(50) * 1e3},
                            {"overlapped_wait_ms_p99", mb.overlapped_wait.Percentile(99) * 1e3},
                            {"serial_step_ms", mb.serial_seconds * 1e3},
                            {"overlapped_step_ms", mb.overlapped_seconds * 1e3}};
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }
  std::printf("decode batch %d, context %lld, %d heads, %d layers (%s); UCX %s, UCX_TLS=%s\n", B,
              static_cast<long long>(context), spec.num_heads, spec.num_layers(), spec.name.c_str(),
              transport::UcxVersion().c_str(), transport::UcxTransports().c_str());
  std::printf("per-layer transport = round trip - server_seconds + transfer_seconds (ms)\n");
  std::printf("%-22s %-22s %10s %10s %9s %9s %9s\n", "plane", "variant", "request", "reply",
              "rt p50", "tr p50", "tr p99");
  for (const Row& r : rows) {
    std::printf("%-22s %-22s %9.0fK %9.0fK %9.3f %9.3f %9.3f", r.plane.c_str(), r.variant.c_str(),
                r.f.request_bytes / r.f.calls / 1024, r.f.reply_bytes / r.f.calls / 1024,
                r.f.round_trip.Percentile(50) * 1e3, r.f.transport.Percentile(50) * 1e3,
                r.f.transport.Percentile(99) * 1e3);
    if (r.f.paired_ratio.count() > 0)
      std::printf("  (p50 %.2fx the bare trip after each call)", r.f.paired_ratio.Percentile(50));
    std::printf("\n");
  }
  std::printf("control floor (gRPC echo of 512 bytes): p50 %.3f ms, p99 %.3f ms\n",
              control.Percentile(50) * 1e3, control.Percentile(99) * 1e3);
  for (const auto& [name, st] : bare)
    std::printf("bare UCX round trip, %-22s p50 %.3f ms, p99 %.3f ms\n", name.c_str(),
                st.Percentile(50) * 1e3, st.Percentile(99) * 1e3);
  std::printf(
      "micro-batches (%s, latent bf16, FFN stand-in %.3f ms): wait per layer serial p50 %.3f "
      "ms; two in flight p50 %.3f ms, p99 %.3f ms; a step of both %.2f -> %.2f ms\n",
      mc.DataPlaneName().empty() ? "grpc bytes" : "ucx", mb.ffn * 1e3,
      mb.serial_wait.Percentile(50) * 1e3, mb.overlapped_wait.Percentile(50) * 1e3,
      mb.overlapped_wait.Percentile(99) * 1e3, mb.serial_seconds * 1e3,
      mb.overlapped_seconds * 1e3);
  return 0;
}

}  // namespace attnd::client::ctl
