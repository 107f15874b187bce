// libFuzzer target: the request decoding and validation path. Each input is a sequence of
// requests, each either parsed from raw fuzzer bytes (the protobuf decoder on anything) or built
// semi-valid and then damaged, sent through the service's own handlers (AttentionService::Do*,
// Begin, Layer) on a real engine, with a registered shared-memory object that the fuzzer also
// shrinks and regrows. Afterwards every step is aborted and every sequence closed: all pages must
// come back and page 0 must be untouched. A crash, sanitizer report or leaked page is a failure.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/attnd_client.h"
#include "fuzz/fuzz_input.h"
#include "metrics/metrics.h"
#include "service/attention_service.h"
#include "service/executor.h"
#include "service/service_metrics.h"

namespace attnd {
namespace {

constexpr int64_t kShmBytes = 1 << 16;

struct World {
  std::unique_ptr<Engine> engine;
  Executor executor{1};
  metrics::Registry registry;
  std::unique_ptr<ServiceMetrics> metrics;
  std::unique_ptr<AttentionService> service;
  std::string shm_key;
  int shm_fd = -1;
  // Every request acts for tenant "a" over a local connection (shared memory allowed); tenant
  // "b" pokes at a's names and must be told they do not exist.
  int sockets[2] = {-1, -1};
  Caller owner, intruder;

  World() {
    EngineOptions o;
    o.spec = PresetModelSpec("tiny").value();
    o.spec.max_context = 256;
    o.pages_per_device = 40;
    o.threads = 1;
    o.limits.max_step_tokens = 64;
    o.limits.max_batch_entries = 8;
    o.limits.max_sequences = 16;
    o.limits.max_id_bytes = 32;
    o.limits.abort_wait = std::chrono::milliseconds(0);
    engine = Engine::Create(o).value();
    metrics = std::make_unique<ServiceMetrics>(&registry, engine.get());
    ServiceOptions so;
    so.max_message_bytes = 1 << 20;
    so.max_echo_bytes = 1 << 16;
    so.max_shm_regions = 4;
    so.shm_enabled = true;
    service = std::make_unique<AttentionService>(engine.get(), &executor, metrics.get(), so);
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sockets) != 0) std::abort();
    owner.tenant = "a";
    owner.local = true;
    owner.socket_fd = sockets[0];
    intruder = owner;
    intruder.tenant = "b";
    shm_key = absl::StrCat("/attnd-fuzz-", getpid());
    shm_fd = shm_open(shm_key.c_str(), O_RDWR | O_CREAT, 0600);
    if (shm_fd < 0 || ftruncate(shm_fd, kShmBytes) != 0) std::abort();
  }
  ~World() {
    close(shm_fd);
    shm_unlink(shm_key.c_str());
  }
};

World& TheWorld() {
  static World* w = new World;  // one server for the whole run, like a real one
  return *w;
}

std::set<std::string>& Regions() {
  static std::set<std::string> r;
  return r;
}

void Check(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "request_fuzz: %s\n", what.c_str());
    std::abort();
  }
}

std::string Id(FuzzInput& in) {
  if (in.Bool(0.1)) return in.Bytes(40);  // any bytes, NULs and overlong ones included
  return absl::StrCat("q", in.Int(0, 5));
}

void FillTensor(FuzzInput& in, v1::Tensor* t, std::initializer_list<int64_t> shape,
                std::mt19937_64& rng, const std::string& region) {
  static const char* kTypes[] = {"BF16", "FP16", "FP32", "bf16", "INT8", ""};
  const char* dt = in.Bool(0.9) ? "BF16" : kTypes[in.Int(0, 5)];
  t->set_datatype(dt);
  int64_t n = 1;
  for (int64_t d : shape) {
    const int64_t dim = in.Bool(0.95) ? d : in.Int64() % 70;
    t->add_shape(dim);
    n *= d;
  }
  const size_t bytes = static_cast<size_t>(n) * 2 + (in.Bool(0.95) ? 0 : in.Int(0, 5));
  if (!region.empty() && in.Bool(0.3)) {
    t->mutable_shm()->set_region(region);
    t->mutable_shm()->set_offset(in.Bool(0.9) ? in.Int(0, 4096) : in.Int64());
    t->mutable_shm()->set_byte_size(in.Bool(0.9) ? static_cast<int64_t>(bytes) : in.Int64());
    return;
  }
  std::string* d = t->mutable_data();
  d->resize(bytes);
  for (size_t i = 0; i + 1 < bytes; i += 2) {
    const uint16_t v = static_cast<uint16_t>(0x3c00 + (rng() % 0x200) - 0x100);  // finite
    std::memcpy(d->data() + i, &v, 2);
  }
  if (bytes >= 2 && in.Bool(0.05))
    (*d)[1] = static_cast<char>(0x7f), (*d)[0] = static_cast<char>(0xc0);
}

void OneRequest(FuzzInput& in, std::set<std::string>& ids, std::set<uint64_t>& steps) {
  World& w = TheWorld();
  AttentionService& svc = *w.service;
  const ModelSpec& s = w.engine->spec();
  const bool raw = in.Bool(0.25);
  const std::string bytes = raw ? in.Bytes(300) : "";
  std::mt19937_64 rng(in.Int(0, 1 << 20));
  switch (in.Int(0, 11)) {
    case 0: {
      v1::OpenSequenceRequest r;
      if (raw) {
        (void)r.ParseFromString(bytes);
      } else {
        r.set_sequence_id(Id(in));
        if (in.Bool(0.3)) r.set_fork_parent_id(Id(in));
        if (in.Bool(0.3)) r.set_fork_prefix_len(in.Bool(0.8) ? in.Int(0, 40) : in.Int64());
      }
      v1::SequenceInfo resp;
      if (svc.DoOpenSequence(w.owner, r, &resp).ok()) ids.insert(resp.sequence_id());
      break;
    }
    case 1: {
      v1::CloseSequenceRequest r;
      raw ? (void)r.ParseFromString(bytes) : r.set_sequence_id(Id(in));
      if (svc.DoCloseSequence(w.owner, r).ok()) ids.erase(r.sequence_id());
      break;
    }
    case 2: {
      v1::BeginStepRequest r;
      if (raw) {
        (void)r.ParseFromString(bytes);
      } else {
        const int n = in.Int(0, 9);
        for (int i = 0; i < n; ++i) {
          auto* e = r.add_batch();
          e->set_sequence_id(Id(in));
          e->set_q_len(in.Bool(0.9) ? in.Int(0, 12) : in.Int64());
        }
        r.set_write_only(in.Bool(0.2));
        if (in.Bool(0.1)) r.set_num_shards(in.Int(-1, 5));
      }
      v1::BeginStepResponse resp;
      auto step = svc.Begin(w.owner, r, &resp);
      if (step.ok()) steps.insert(*step);
      break;
    }
    case 3:
    case 4:
    case 5: {  // a layer of an open step (or of a made-up one)
      if (steps.empty() && !raw) break;
      const uint64_t step =
          !steps.empty() && in.Bool(0.95)
              ? *std::next(steps.begin(), in.Int(0, static_cast<int>(steps.size()) - 1))
              : static_cast<uint64_t>(in.Int64());
      v1::LayerInputs li;
      const StepRef ref("a", step);
      auto info = w.engine->DescribeStep(ref);
      if (raw || !info.ok()) {
        (void)li.ParseFromString(bytes);
      } else {
        const int64_t T = info->tokens;
        const int layer = in.Bool(0.95) ? info->next_layer : in.Int(-1, 5);
        li.set_layer(layer);
        const bool full =
            layer >= 0 && layer < s.num_layers() && s.layers[layer] == LayerKind::kFull;
        const std::string region = in.Bool(0.5) ? "r0" : "";
        FillTensor(in, li.mutable_kv_latent(), {T, s.kv_lora_rank}, rng, region);
        FillTensor(in, li.mutable_k_rope(), {T, s.qk_rope_head_dim}, rng, region);
        if (full || in.Bool(0.05))
          FillTensor(in, li.mutable_index_k(), {T, s.index_head_dim}, rng, region);
        if (!info->write_only || in.Bool(0.05)) {
          FillTensor(in, li.mutable_q_latent(), {T, s.num_heads, s.kv_lora_rank}, rng, region);
          FillTensor(in, li.mutable_q_rope(), {T, s.num_heads, s.qk_rope_head_dim}, rng, region);
          if (full || in.Bool(0.05)) {
            FillTensor(in, li.mutable_index_q(), {T, s.index_n_heads, s.index_head_dim}, rng,
                       region);
            FillTensor(in, li.mutable_index_w(), {T, s.index_n_heads}, rng, region);
          }
        }
        if (in.Bool(0.1)) {
          li.mutable_out_shm()->set_region("r0");
          li.mutable_out_shm()->set_offset(in.Int(0, 8192));
          li.mutable_out_shm()->set_byte_size(T * s.num_heads * s.kv_lora_rank * 2);
        }
        if (in.Bool(0.03)) li.set_shard(in.Int(-2, 3));
      }
      v1::LayerOutput out;
      const absl::Status st = svc.Layer(w.owner, ref, li, &out, Transport::kUnary);
      if (!st.ok() || out.committed()) steps.erase(step);
      break;
    }
    case 6: {
      v1::AbortStepRequest r;
      if (!steps.empty() && !raw) {
        r.set_step_id(*steps.begin());
      } else {
        (void)r.ParseFromString(bytes);
      }
      (void)svc.DoAbortStep(w.owner, r);
      steps.erase(r.step_id());
      break;
    }
    case 7: {
      v1::RegisterSharedMemoryRequest r;
      if (raw) {
        (void)r.ParseFromString(bytes);
      } else {
        r.set_name(in.Bool(0.8) ? "r0" : Id(in));
        r.set_key(in.Bool(0.9) ? w.shm_key : in.Bytes(20));
        r.set_offset(in.Bool(0.9) ? in.Int(0, 1024) : in.Int64());
        r.set_byte_size(in.Bool(0.9) ? in.Int(1, kShmBytes) : in.Int64());
      }
      if (svc.DoRegisterSharedMemory(w.owner, r).ok()) Regions().insert(r.name());
      if (in.Bool(0.2)) {
        v1::UnregisterSharedMemoryRequest u;
        u.set_name(r.name());
        if (svc.DoUnregisterSharedMemory(w.owner, u).ok()) Regions().erase(r.name());
      }
      break;
    }
    case 8:  // the object's owner shrinks or regrows it under the server
      if (ftruncate(w.shm_fd, in.Bool(0.5) ? kShmBytes : in.Int(0, kShmBytes)) != 0) std::abort();
      break;
    case 9: {
      v1::EchoRequest r;
      raw ? (void)r.ParseFromString(bytes) : r.set_response_bytes(in.Int64() >> in.Int(0, 63));
      v1::EchoResponse resp;
      const absl::Status st = svc.DoEcho(r, &resp);
      Check(!st.ok() || static_cast<int64_t>(resp.payload().size()) <= svc.max_echo_bytes(),
            "echo beyond its limit");
      break;
    }
    case 10: {
      v1::ExportSequenceRequest r;
      raw ? (void)r.ParseFromString(bytes) : r.set_chunk_tokens(in.Int64() >> in.Int(0, 63));
      auto c = svc.ExportChunkTokens(r);
      Check(!c.ok() || (*c >= 1 && *c <= svc.max_export_chunk_tokens()), "chunk beyond its limit");
      v1::DescribeSequenceRequest d;
      d.set_sequence_id(Id(in));
      v1::SequenceInfo info;
      (void)svc.DoDescribeSequence(w.owner, d, &info);
      break;
    }
    case 11: {  // another tenant names a's sequences, steps and regions: none of them exists
      const auto not_found = [](const absl::Status& st, const char* what) {
        Check(st.code() == absl::StatusCode::kNotFound,
              absl::StrCat("tenant b ", what, " of tenant a: ", st.ToString()));
      };
      if (!ids.empty()) {
        const std::string id = *std::next(ids.begin(), in.Int(0, static_cast<int>(ids.size()) - 1));
        v1::DescribeSequenceRequest d;
        d.set_sequence_id(id);
        v1::SequenceInfo info;
        not_found(svc.DoDescribeSequence(w.intruder, d, &info), "describe");
        v1::CloseSequenceRequest c;
        c.set_sequence_id(id);
        not_found(svc.DoCloseSequence(w.intruder, c), "close");
        v1::BeginStepResponse resp;
        not_found(svc.Begin(w.intruder, client::MakeBeginRequest({{id, 1}}), &resp).status(),
                  "begin");
        v1::OpenSequenceRequest f;
        f.set_sequence_id("fork-by-b");
        f.set_fork_parent_id(id);
        not_found(svc.DoOpenSequence(w.intruder, f, &info), "fork");
      }
      if (!steps.empty()) {
        const uint64_t step = *steps.begin();
        v1::LayerOutput out;
        not_found(
            svc.Layer(w.intruder, StepRef("b", step), v1::LayerInputs(), &out, Transport::kUnary),
            "layer");
        v1::AbortStepRequest a;
        a.set_step_id(step);
        not_found(svc.DoAbortStep(w.intruder, a), "abort");
      }
      if (!Regions().empty()) {
        v1::UnregisterSharedMemoryRequest u;
        u.set_name(*Regions().begin());
        not_found(svc.DoUnregisterSharedMemory(w.intruder, u), "unregister");
      }
      break;
    }
  }
}

}  // namespace
}  // namespace attnd

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace attnd;
  World& w = TheWorld();
  FuzzInput in(data, size);
  std::set<std::string> ids;
  std::set<uint64_t> steps;
  for (int i = 0; i < 48 && !in.empty(); ++i) OneRequest(in, ids, steps);
  // Restore the world: no step or sequence may outlive the input, and every page comes back.
  for (uint64_t s : steps) (void)w.engine->AbortStep(StepRef("a", s));
  Check(w.engine->ExpireIdleSteps(std::chrono::milliseconds(0)) == 0, "a step was leaked");
  for (const std::string& id : ids) {  // a standby copy closes at its generation (the replicas')
    const auto info = w.engine->DescribeSequence(SequenceKey("a", id));
    const uint64_t g = info.ok() && info->standby ? info->generation : 0;
    Check(w.engine->CloseSequence(SequenceKey("a", id), g).ok(), absl::StrCat("cannot close ", id));
  }
  Check(w.engine->num_sequences() == 0, "a sequence the fuzzer never saw opened");
  const DeviceCapacity d = w.engine->Capacity()[0];
  Check(d.pages_free == d.pages_total, absl::StrCat(d.pages_total - d.pages_free, " pages leaked"));
  Check(w.engine->ReservedPageUntouched(0), "page 0 was written");
  for (const std::string& r : Regions()) {
    v1::UnregisterSharedMemoryRequest u;
    u.set_name(r);
    Check(w.service->DoUnregisterSharedMemory(w.owner, u).ok(), "cannot unregister a region");
  }
  Regions().clear();
  if (ftruncate(w.shm_fd, kShmBytes) != 0) std::abort();
  return 0;
}
