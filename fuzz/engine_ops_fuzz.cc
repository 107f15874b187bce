// libFuzzer target: random sequences of engine operations (open, fork, close, migrate, begin,
// layers with random or broken inputs, context-parallel steps with random offsets and tampered
// selections, abort, expire, and the tiers': offload, prefetch, idle spills, and the spills and
// restores steps, forks and migrations make), the prefix cache's (opens on a prompt's cached
// blocks, by token ids or hashes; the blocks indexed, kept, sent down the tiers and evicted as the
// rest goes on) and the standby replicas' (standby copies fed by write-only imports naming
// generations, promoted at random generations and lengths, cut back) on two CPU devices over a
// small host tier and a disk tier, checked after every operation against a model of the expected
// state, the way database stress tools check themselves: every sequence's length and step
// membership, every page's reference count, free pages per device, page 0 untouched, the tiers'
// bookkeeping (every page in exactly one tier, holders and pool counts, slots;
// Engine::CheckInvariants), and the outputs of every committed step against the float64 oracle (so
// a page that came back from a tier changed would show). Any mismatch aborts (a crash for
// libFuzzer).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/block_hash.h"
#include "engine/engine.h"
#include "fuzz/fuzz_input.h"
#include "kernels/reference/step_oracle.h"
#include "tests/run_layer.h"

namespace attnd {
namespace {
using testing::RunCandidatesInto;
using testing::RunLayerInto;

#define FUZZ_CHECK(cond, ...)                                                                    \
  do {                                                                                           \
    if (!(cond)) {                                                                               \
      std::fprintf(stderr, "engine_ops_fuzz: %s:%d: check failed: %s: %s\n", __FILE__, __LINE__, \
                   #cond, absl::StrCat(__VA_ARGS__).c_str());                                    \
      std::abort();                                                                              \
    }                                                                                            \
  } while (0)

constexpr int kPages = 24;  // per device, incl. page 0: small, so exhaustion is common
constexpr int kIds = 6;
constexpr int kHostPages = 10, kDiskPages = 20;  // below the devices: full now and then too
// The prefix cache: a few prompts of 3 full blocks and a token. Every sequence opened on prompt p
// writes the same keys at its prompt's positions (PromptKeys), as a model's would for the same
// tokens, so a block cached by one holds what any other would have written there.
constexpr int kPrompts = 3, kPromptBlocks = 3;

// This process's disk tier directory (libFuzzer's jobs are processes; each has its own).
const std::string& DiskDir() {
  // Leaked: the exit handler that removes it runs after static destructors.
  static const std::string* dir = [] {
    auto* d =
        new std::string((std::filesystem::temp_directory_path() / "attnd-fuzz-XXXXXX").string());
    if (mkdtemp(d->data()) == nullptr) std::abort();
    std::atexit([] { std::filesystem::remove_all(DiskDir()); });
    return d;
  }();
  return *dir;
}

ModelSpec Spec() {
  ModelSpec s = PresetModelSpec("tiny").value();
  s.name = "fuzz";
  s.layers = {LayerKind::kFull, LayerKind::kShared, LayerKind::kDense};
  s.page_size = 4;
  s.index_topk = 6;
  s.num_heads = 2;
  s.max_context = 64;
  return s;
}

struct Tensor {
  std::vector<uint8_t> bytes;
  std::vector<double> values;
  TensorView View(std::initializer_list<int64_t> shape) const {
    return TensorView::Of(DType::kF32, shape, bytes.data(), bytes.size());
  }
};

Tensor Random(int64_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  Tensor t;
  std::vector<float> f(n);
  for (float& x : f) x = d(rng);
  t.bytes.resize(n * 4);
  if (n > 0) std::memcpy(t.bytes.data(), f.data(), n * 4);
  t.values.assign(f.begin(), f.end());
  return t;
}

struct Layer {
  Tensor ql, qr, kv, kr, iq, ik, iw;
};

std::vector<uint32_t> PromptTokens(int p, int32_t page_size) {
  std::vector<uint32_t> t;
  for (int i = 0; i < kPromptBlocks * page_size + 1; ++i) t.push_back(1000u * p + i);
  return t;
}

// The keys of prompt p at position pos of layer l (index_k only on full layers).
struct PromptRow {
  std::vector<float> kv, kr, ik;
};
PromptRow PromptKeys(const ModelSpec& s, int p, int l, int64_t pos) {
  std::mt19937_64 rng((uint64_t(p) << 40) ^ (uint64_t(l) << 20) ^ uint64_t(pos) ^ 0x5eedULL);
  std::normal_distribution<float> d(0.0f, 1.0f);
  PromptRow r;
  for (int i = 0; i < s.kv_lora_rank; ++i) r.kv.push_back(d(rng));
  for (int i = 0; i < s.qk_rope_head_dim; ++i) r.kr.push_back(d(rng));
  if (s.layers[l] == LayerKind::kFull)
    for (int i = 0; i < s.index_head_dim; ++i) r.ik.push_back(d(rng));
  return r;
}

void SetRow(Tensor& t, int64_t row, const std::vector<float>& v) {
  if (v.empty()) return;
  std::memcpy(t.bytes.data() + row * v.size() * 4, v.data(), v.size() * 4);
  for (size_t i = 0; i < v.size(); ++i) t.values[row * v.size() + i] = v[i];
}

struct Model {
  struct Seq {
    int64_t length = 0;
    int device = 0;
    int prompt = -1;          // opened on PromptTokens(prompt)
    int64_t known = 0;        // its blocks whose hashes the engine knows (PromptKeys there)
    bool standby = false;     // a standby copy (docs/replication.md)
    uint64_t generation = 1;  // promotions so far + 1
  };
  std::map<std::string, Seq> seqs;
};

class Run {
 public:
  Run() : spec_(Spec()), oracle_(spec_, DType::kF32) {
    EngineOptions o;
    o.spec = spec_;
    o.cache_dtype = DType::kF32;
    o.num_devices = 2;
    o.pages_per_device = kPages;
    o.threads = 1;
    o.limits.max_step_tokens = 48;
    o.limits.max_batch_entries = 4;
    o.limits.abort_wait = std::chrono::milliseconds(0);
    const size_t page =
        TierStride(CacheLayout::ForModel(o.spec, o.cache_dtype, kPages).BytesPerPage());
    o.tiers.host_bytes = page * kHostPages;
    o.tiers.disk_dir = DiskDir();
    o.tiers.disk_bytes = page * kDiskPages;
    engine_ = Engine::Create(o).value();
  }

  void Op(FuzzInput& in) {
    const std::string id = absl::StrCat("s", in.Int(0, kIds - 1));
    switch (in.Int(0, 16)) {
      case 0: {                            // open
        const int device = in.Int(-1, 2);  // 2 is out of range
        const absl::Status s = engine_->OpenSequence(id, device);
        const bool want = !model_.seqs.contains(id) && device < 2;
        FUZZ_CHECK(s.ok() == want, id, " open: ", s.ToString());
        if (s.ok()) {
          model_.seqs[id] = {0, engine_->DescribeSequence(id)->device};
          oracle_.Open(id);
        }
        break;
      }
      case 1: {  // fork
        const std::string parent = absl::StrCat("s", in.Int(0, kIds - 1));
        const int64_t prefix = in.Int(-2, 70);
        const int device = in.Int(-1, 1);
        const absl::Status s = engine_->ForkSequence(id, parent, prefix, device);
        auto p = model_.seqs.find(parent);
        const bool valid = !model_.seqs.contains(id) && p != model_.seqs.end() && prefix >= 0 &&
                           prefix <= p->second.length && !p->second.standby;
        FUZZ_CHECK(valid || !s.ok(), "fork accepted: ", s.ToString());
        if (valid)
          FUZZ_CHECK(s.ok() || s.code() == absl::StatusCode::kResourceExhausted, s.ToString());
        if (s.ok()) {
          model_.seqs[id] = {prefix, engine_->DescribeSequence(id)->device};
          model_.seqs[id].prompt = p->second.prompt;  // the hashes of the blocks it shares
          model_.seqs[id].known = std::min<int64_t>(p->second.known, prefix / spec_.page_size);
          oracle_.Fork(id, parent, prefix);
          FUZZ_CHECK(engine_->DescribeSequence(id)->tier == Tier::kDevice, id, " forked below");
        }
        break;
      }
      case 2: {  // close; a standby copy only by the replicas, naming its generation
        const auto m = model_.seqs.find(id);
        const bool standby = m != model_.seqs.end() && m->second.standby;
        const uint64_t g = standby && in.Int(0, 1) == 1 ? m->second.generation : 0;
        const absl::Status s = engine_->CloseSequence(id, g);
        FUZZ_CHECK(s.ok() == (m != model_.seqs.end() && standby == (g != 0)), s.ToString());
        if (s.ok()) {
          model_.seqs.erase(id);
          oracle_.Close(id);
        }
        break;
      }
      case 3: {  // migrate
        const int device = in.Int(0, 1);
        const absl::Status s = engine_->MigrateSequence(id, device);
        if (!model_.seqs.contains(id)) {
          FUZZ_CHECK(s.code() == absl::StatusCode::kNotFound, s.ToString());
        } else if (s.ok()) {
          model_.seqs[id].device = device;
          FUZZ_CHECK(engine_->DescribeSequence(id)->tier == Tier::kDevice, id, " migrated below");
        } else {
          FUZZ_CHECK(s.code() == absl::StatusCode::kResourceExhausted, s.ToString());
        }
        break;
      }
      case 4:
      case 5:
      case 6:
        StepOp(in);
        break;
      case 7:
        FUZZ_CHECK(engine_->ExpireIdleSteps(std::chrono::milliseconds(0)) == 0, "a step leaked");
        break;
      case 8:
        CpStepOp(in, id);
        break;
      case 9: {  // offload one or two (down a tier now)
        std::vector<SequenceKey> ids = {id};
        if (in.Bool(0.3)) ids.push_back(SequenceKey(absl::StrCat("s", in.Int(0, kIds - 1))));
        const absl::Status s = engine_->OffloadSequences(ids);
        bool known = true;
        for (const SequenceKey& x : ids) known = known && model_.seqs.contains(x.id);
        if (!known) {
          FUZZ_CHECK(s.code() == absl::StatusCode::kNotFound, s.ToString());
        } else if (s.ok()) {
          for (const SequenceKey& x : ids)
            FUZZ_CHECK(engine_->DescribeSequence(x.id)->tier != Tier::kDevice, x.id,
                       " not offloaded");
        } else {
          FUZZ_CHECK(s.code() == absl::StatusCode::kResourceExhausted ||
                         s.code() == absl::StatusCode::kFailedPrecondition,
                     s.ToString());
        }
        break;
      }
      case 10:  // prefetch (a background restore), waited for so what follows does not race it
        engine_->PrefetchSequences({id, absl::StrCat("s", in.Int(0, kIds - 1))});
        engine_->WaitForPrefetches();
        break;
      case 11:  // every sequence idle: each one a tier has room for goes down
        engine_->SpillIdleSequences(std::chrono::milliseconds(0));
        break;
      case 12:
        OpenCachedOp(in, id);
        break;
      case 13: {  // a standby copy (replication's receiving end)
        const uint64_t g = in.Int(0, 3);
        const absl::Status s = engine_->OpenStandby(id, g);
        FUZZ_CHECK(s.ok() == (!model_.seqs.contains(id) && g > 0), id, " standby: ", s.ToString());
        if (s.ok()) {
          Model::Seq m;
          m.device = engine_->DescribeSequence(id)->device;
          m.standby = true;
          m.generation = g;
          model_.seqs[id] = m;
          oracle_.Open(id);
        }
        break;
      }
      case 14:
        PromoteOp(in, id);
        break;
      case 15:
        ImportOp(in);
        break;
      case 16:
        ReadOp(in, id);
        break;
    }
    Audit();
  }

  // Closes everything and empties the prefix cache: every page must come back.
  void Finish() {
    for (const auto& [id, s] : model_.seqs)
      FUZZ_CHECK(engine_->CloseSequence(id, s.standby ? s.generation : 0).ok(), id);
    FUZZ_CHECK(engine_->ClearPrefixCache() >= 0 && engine_->PrefixCacheStats().blocks == 0,
               "the prefix cache kept blocks");
    for (const DeviceCapacity& d : engine_->Capacity())
      FUZZ_CHECK(d.pages_free == d.pages_total, d.name, " leaked ", d.pages_total - d.pages_free);
    for (const TierCapacity& t : engine_->Tiers())
      FUZZ_CHECK(t.pages_used == 0 && t.sequences == 0, TierName(t.tier), " leaked ", t.pages_used);
    FUZZ_CHECK(engine_->CheckInvariants().ok(), engine_->CheckInvariants().ToString());
  }

 private:
  // Layer l of a step over `batch`: positions of a sequence's prompt get the prompt's keys, as a
  // model's would for the same tokens (the blocks they complete may be indexed).
  void SetPromptKeys(const std::vector<StepEntry>& batch, int l, Layer* x) {
    int64_t row = 0;
    for (const auto& e : batch) {
      const Model::Seq& m = model_.seqs[e.sequence_id];
      for (int64_t j = 0; j < e.q_len; ++j)
        if (m.prompt >= 0 && m.length + j < m.known * spec_.page_size) {
          const PromptRow k = PromptKeys(spec_, m.prompt, l, m.length + j);
          SetRow(x->kv, row + j, k.kv);
          SetRow(x->kr, row + j, k.kr);
          SetRow(x->ik, row + j, k.ik);
        }
      row += e.q_len;
    }
  }

  void StepOp(FuzzInput& in) {
    std::vector<StepEntry> batch;
    const int n = in.Int(1, 5);  // 5 is beyond max_batch_entries
    for (int i = 0; i < n; ++i) {
      const int64_t q = in.Bool(0.05) ? in.Int64() : in.Int(0, 20);
      batch.push_back({absl::StrCat("s", in.Int(0, kIds - 1)), q});
    }
    const Model before = model_;
    const Placement placed = Placed();
    auto step = engine_->BeginStep(batch);
    if (!step.ok()) return CheckRefused(step.status(), placed);
    const std::vector<int32_t> free_begun = FreePages();
    for (const auto& e : batch)
      FUZZ_CHECK(engine_->DescribeSequence(e.sequence_id)->tier == Tier::kDevice, e.sequence_id,
                 " in a step below its device");
    // Accepted: the batch must have been valid.
    std::set<std::string> seen;
    int64_t T = 0;
    for (const auto& e : batch) {
      FUZZ_CHECK(model_.seqs.contains(e.sequence_id), "unknown sequence accepted");
      FUZZ_CHECK(!model_.seqs[e.sequence_id].standby, "an ordinary step on a standby copy");
      FUZZ_CHECK(seen.insert(e.sequence_id).second, "duplicate accepted");
      FUZZ_CHECK(e.q_len >= 1 && model_.seqs[e.sequence_id].length + e.q_len <= spec_.max_context,
                 "bad q_len accepted");
      T += e.q_len;
    }
    FUZZ_CHECK(T <= 48, "step tokens beyond the limit accepted");
    std::mt19937_64 rng(in.Int(0, 1 << 30));
    std::vector<Layer> layers;
    const int L = spec_.kv_lora_rank, R = spec_.qk_rope_head_dim, H = spec_.num_heads;
    const int Hi = spec_.index_n_heads, Di = spec_.index_head_dim;
    const int stop = in.Bool(0.7) ? spec_.num_layers() : in.Int(0, spec_.num_layers() - 1);
    const int broken = in.Bool(0.15) ? in.Int(0, spec_.num_layers() - 1) : -1;
    std::vector<std::vector<double>> outs;
    bool failed = false;
    for (int l = 0; l < stop && !failed; ++l) {
      Layer x{Random(T * H * L, rng), Random(T * H * R, rng), Random(T * L, rng),
              Random(T * R, rng),     Random(0, rng),         Random(0, rng),
              Random(0, rng)};
      const bool full = spec_.layers[l] == LayerKind::kFull;
      if (full) {
        x.iq = Random(T * Hi * Di, rng);
        x.ik = Random(T * Di, rng);
        x.iw = Random(T * Hi, rng);
      }
      SetPromptKeys(batch, l, &x);  // the blocks it may index
      LayerInputs v;
      v.q_latent = x.ql.View({T, H, L});
      v.q_rope = x.qr.View({T, H, R});
      v.kv_latent = x.kv.View({T, L});
      v.k_rope = x.kr.View({T, R});
      if (full) {
        v.index_q = x.iq.View({T, Hi, Di});
        v.index_k = x.ik.View({T, Di});
        v.index_w = x.iw.View({T, Hi});
      }
      if (l == broken) {
        switch (in.Int(0, 3)) {
          case 0:
            v.kv_latent.dims[1] += 1;
            break;
          case 1: {
            const float nan = NAN;
            std::memcpy(x.kr.bytes.data(), &nan, 4);
            break;
          }
          case 2:
            v.q_rope.nbytes -= 4;
            break;
          case 3:
            v.index_q.present = false;
            v.q_latent.present = false;
            break;
        }
      }
      std::vector<float> out(T * H * L);
      const int layer = in.Bool(0.03) ? in.Int(0, 3) : l;  // sometimes out of order
      const absl::Status s = RunLayerInto(*engine_, *step, layer, v, out.data(), out.size() * 4);
      if (!s.ok()) {
        failed = true;
        FUZZ_CHECK(l == broken || layer != l, "a good layer failed: ", s.ToString());
        break;
      }
      FUZZ_CHECK(l != broken, "a broken layer was accepted");
      for (float f : out) FUZZ_CHECK(std::isfinite(f), "non-finite output");
      outs.emplace_back(out.begin(), out.end());
      layers.push_back(std::move(x));
    }
    if (failed || stop < spec_.num_layers()) {
      if (!failed) FUZZ_CHECK(engine_->AbortStep(*step).ok(), "abort");
      model_ = before;
      // The restores and spills BeginStep made stay; what the step itself took goes back.
      const std::vector<int32_t> now = FreePages();
      for (size_t d = 0; d < now.size(); ++d)
        FUZZ_CHECK(now[d] >= free_begun[d], "an aborted step kept pages");
      return;
    }
    // Committed: lengths advance and every layer matches the float64 oracle.
    std::vector<std::pair<std::string, int64_t>> pairs;
    for (const auto& e : batch) {
      pairs.emplace_back(e.sequence_id, e.q_len);
      model_.seqs[e.sequence_id].length += e.q_len;
    }
    std::vector<reference::LayerValues> values;
    for (const Layer& x : layers)
      values.push_back({x.ql.values, x.qr.values, x.kv.values, x.kr.values, x.iq.values,
                        x.ik.values, x.iw.values});
    oracle_.Commit(pairs, values);
    const auto want = oracle_.Expected(pairs, values);
    for (size_t l = 0; l < outs.size(); ++l) {
      const double e = reference::RelL2(outs[l], want[l]);
      FUZZ_CHECK(e <= 1e-4, "layer ", l, " rel L2 ", e);
    }
  }

  // Failover: a copy promoted at a random generation and length. At its own generation it
  // becomes the sequence (cut back to the length when shorter: the oracle's history too); a
  // retry at the old generation answers it as it is; anything else is refused, nothing changed.
  void PromoteOp(FuzzInput& in, const std::string& id) {
    auto m = model_.seqs.find(id);
    const bool known = m != model_.seqs.end();
    // Mostly the worker's view (its generation, at most what the copy holds), sometimes any.
    const uint64_t g = known && in.Bool(0.7) ? m->second.generation : in.Int(0, 4);
    const int64_t len = known && in.Bool(0.6) ? in.Int(0, m->second.length)
                        : in.Bool(0.1)        ? in.Int(-3, 70)
                                              : in.Int(0, 64);
    const std::vector<int32_t> free_before = FreePages();
    auto r = engine_->PromoteSequence(id, g, len);
    if (m == model_.seqs.end()) {
      FUZZ_CHECK(r.status().code() == absl::StatusCode::kNotFound, r.status().ToString());
      return;
    }
    Model::Seq& seq = m->second;
    if (!seq.standby && seq.generation == g + 1) {  // promoted already: a retry
      FUZZ_CHECK(r.ok() && r->length == seq.length && r->generation == seq.generation,
                 r.status().ToString());
      return;
    }
    if (!seq.standby || seq.generation != g || len < 0) {
      FUZZ_CHECK(!r.ok() && FreePages() == free_before, id, " promote: ", r.status().ToString());
      return;
    }
    FUZZ_CHECK(r.ok(), id, " promote: ", r.status().ToString());
    FUZZ_CHECK(!r->standby && r->generation == g + 1 && r->length == std::min(len, seq.length), id,
               " promoted to ", r->length, " at ", r->generation);
    if (r->length < seq.length) {  // the oracle cut back as well
      oracle_.Fork("cut", id, r->length);
      oracle_.Close(id);
      oracle_.Fork(id, "cut", r->length);
      oracle_.Close("cut");
    }
    seq.standby = false;
    seq.generation = g + 1;
    seq.length = r->length;
  }

  // Replication's write-only step: random entries naming random generations. Accepted only over
  // standby copies alone or primaries alone, each at its generation (0: not named); the keys
  // commit to the oracle, so later steps on a promoted copy check them against float64.
  // An export's read of one layer's rows, wherever the sequence is: its committed rows bit for
  // bit (an fp32 cache); one on the device or the host stays there, one on the disk comes up
  // (docs/architecture.md#tiers).
  void ReadOp(FuzzInput& in, const std::string& id) {
    const int layer = in.Int(0, spec_.num_layers() - 1);
    auto m = model_.seqs.find(id);
    const int64_t len = m == model_.seqs.end() ? 0 : m->second.length;
    const int64_t begin = in.Int(0, static_cast<int>(len));
    const int64_t end = in.Int(static_cast<int>(begin), static_cast<int>(len) + 1);
    const Tier before =
        m == model_.seqs.end() ? Tier::kDevice : engine_->DescribeSequence(id)->tier;
    const auto rows = engine_->ReadRows(id, layer, begin, end);
    const absl::StatusCode code = rows.status().code();
    if (m == model_.seqs.end()) {
      FUZZ_CHECK(code == absl::StatusCode::kNotFound, id, " read: ", rows.status().ToString());
      return;
    }
    const Tier after = engine_->DescribeSequence(id)->tier;
    if (end > len) {
      FUZZ_CHECK(code == absl::StatusCode::kOutOfRange, id, " read: ", rows.status().ToString());
      return;
    }
    // Without room for it on the host or its device, a sequence on the disk stays there.
    FUZZ_CHECK(rows.ok() || (before == Tier::kDisk && code == absl::StatusCode::kResourceExhausted),
               id, " read: ", rows.status().ToString());
    if (!rows.ok()) return;
    FUZZ_CHECK(before == Tier::kDisk ? after != Tier::kDisk : after == before, id,
               " read moved it from ", TierName(before), " to ", TierName(after));
    const int L = spec_.kv_lora_rank, R = spec_.qk_rope_head_dim;
    const std::vector<double> want = oracle_.Rows(id, layer, begin, end);
    FUZZ_CHECK(rows->kv_latent.size() == static_cast<size_t>((end - begin) * L) * 4 &&
                   rows->k_rope.size() == static_cast<size_t>((end - begin) * R) * 4,
               id, " read sizes");
    for (int64_t r = 0; r < end - begin; ++r)
      for (int j = 0; j < L + R; ++j) {
        float got;
        std::memcpy(&got,
                    j < L ? rows->kv_latent.data() + (r * L + j) * 4
                          : rows->k_rope.data() + (r * R + j - L) * 4,
                    4);
        FUZZ_CHECK(static_cast<double>(got) == want[r * (L + R) + j], id, " layer ", layer, " row ",
                   begin + r, " value ", j, ": ", got, " want ", want[r * (L + R) + j]);
      }
  }

  void ImportOp(FuzzInput& in) {
    std::vector<StepEntry> batch;
    const int n = in.Int(1, 3);
    for (int i = 0; i < n; ++i) {
      StepEntry e{absl::StrCat("s", in.Int(0, kIds - 1)), in.Int(1, 12)};
      auto m = model_.seqs.find(e.sequence_id);
      e.generation = in.Bool(0.8) && m != model_.seqs.end() ? m->second.generation : in.Int(0, 3);
      batch.push_back(std::move(e));
    }
    const std::vector<int32_t> free_before = FreePages();
    auto step = engine_->BeginStep(batch, StepOptions::WriteOnly());
    if (!step.ok()) {
      if (step.status().code() != absl::StatusCode::kResourceExhausted)
        FUZZ_CHECK(FreePages() == free_before, "a refused import changed the pool");
      return;
    }
    std::set<std::string> seen;
    int64_t T = 0;
    const bool standby = model_.seqs[batch[0].sequence_id].standby;
    for (const auto& e : batch) {
      auto m = model_.seqs.find(e.sequence_id);
      FUZZ_CHECK(m != model_.seqs.end() && seen.insert(e.sequence_id).second, "bad batch");
      FUZZ_CHECK(m->second.standby == standby, "copies and primaries in one import");
      FUZZ_CHECK(e.generation == 0 || e.generation == m->second.generation, e.sequence_id,
                 " imported at generation ", e.generation);
      FUZZ_CHECK(m->second.length + e.q_len <= spec_.max_context, "beyond max_context");
      T += e.q_len;
    }
    std::mt19937_64 rng(in.Int(0, 1 << 30));
    std::vector<reference::LayerValues> values;
    std::vector<Layer> keep;
    for (int l = 0; l < spec_.num_layers(); ++l) {
      const bool full = spec_.layers[l] == LayerKind::kFull;
      Layer x{Random(0, rng),
              Random(0, rng),
              Random(T * spec_.kv_lora_rank, rng),
              Random(T * spec_.qk_rope_head_dim, rng),
              Random(0, rng),
              Random(full ? T * spec_.index_head_dim : 0, rng),
              Random(0, rng)};
      SetPromptKeys(batch, l, &x);  // as StepOp does
      LayerInputs v;
      v.kv_latent = x.kv.View({T, spec_.kv_lora_rank});
      v.k_rope = x.kr.View({T, spec_.qk_rope_head_dim});
      if (full) v.index_k = x.ik.View({T, spec_.index_head_dim});
      const absl::Status s = RunLayerInto(*engine_, *step, l, v, nullptr, 0);
      FUZZ_CHECK(s.ok(), "import layer ", l, ": ", s.ToString());
      values.push_back({{}, {}, x.kv.values, x.kr.values, {}, x.ik.values, {}});
      keep.push_back(std::move(x));
    }
    std::vector<std::pair<std::string, int64_t>> pairs;
    for (const auto& e : batch) {
      pairs.emplace_back(e.sequence_id, e.q_len);
      model_.seqs[e.sequence_id].length += e.q_len;
    }
    oracle_.Commit(pairs, values);
  }

  // A context-parallel step on this engine alone (it holds a slice starting at a random offset):
  // random offsets and query positions, and selections sometimes tampered with. Whatever is
  // refused changes nothing; a tail step with its own candidates untouched equals an ordinary
  // step (one part's merge is its own candidates), so the oracle checks it.
  void CpStepOp(FuzzInput& in, const std::string& id) {
    const bool attend = in.Bool(0.4);
    StepEntry e{id, in.Bool(0.05) ? in.Int(-1, 70) : in.Int(1, 6)};
    const int ps = spec_.page_size;
    e.position_offset = in.Bool(0.1) ? in.Int(-3, 70) : ps * in.Int(0, 8);
    auto m = model_.seqs.find(id);
    const int64_t len = m == model_.seqs.end() ? 0 : m->second.length;
    if (attend)
      e.query_position = in.Bool(0.1) ? in.Int(-5, 80) : e.position_offset + len + in.Int(0, 4);
    StepOptions o;
    o.context_parallel = true;
    o.attend_only = attend;
    const Placement before = Placed();
    auto step = engine_->BeginStep({e}, o);
    const bool aligned = e.position_offset >= 0 && e.position_offset % ps == 0 &&
                         e.position_offset <= spec_.max_context;
    const bool valid = m != model_.seqs.end() && !m->second.standby && e.q_len >= 1 &&
                       e.q_len <= 48 && aligned &&
                       (attend ? len > 0 && e.query_position >= e.position_offset + len &&
                                     e.query_position <= spec_.max_context - e.q_len
                               : e.q_len <= spec_.max_context - len - e.position_offset);
    FUZZ_CHECK(valid || !step.ok(), "a bad context-parallel step was accepted");
    if (valid && !step.ok())
      FUZZ_CHECK(step.status().code() == absl::StatusCode::kResourceExhausted,
                 step.status().ToString());
    if (!step.ok()) return CheckRefused(step.status(), before);
    const std::vector<int32_t> free_begun = FreePages();
    const int64_t T = e.q_len;
    const int L = spec_.kv_lora_rank, R = spec_.qk_rope_head_dim, H = spec_.num_heads;
    const int Hi = spec_.index_n_heads, Di = spec_.index_head_dim;
    std::mt19937_64 rng(in.Int(0, 1 << 30));
    std::vector<Layer> layers;
    std::vector<std::vector<double>> outs;
    bool tampered = false;
    for (int l = 0; l < spec_.num_layers(); ++l) {
      Layer x{Random(T * H * L, rng), Random(T * H * R, rng), Random(T * L, rng),
              Random(T * R, rng),     Random(0, rng),         Random(0, rng),
              Random(0, rng)};
      const bool full = spec_.layers[l] == LayerKind::kFull;
      LayerInputs v;
      v.q_latent = x.ql.View({T, H, L});
      v.q_rope = x.qr.View({T, H, R});
      if (!attend && !full) {
        v.kv_latent = x.kv.View({T, L});
        v.k_rope = x.kr.View({T, R});
      }
      Candidates c;
      if (full) {
        x.iq = Random(T * Hi * Di, rng);
        x.ik = Random(T * Di, rng);
        x.iw = Random(T * Hi, rng);
        LayerInputs cv;
        if (!attend) {
          cv.kv_latent = x.kv.View({T, L});
          cv.k_rope = x.kr.View({T, R});
          cv.index_k = x.ik.View({T, Di});
        }
        cv.index_q = x.iq.View({T, Hi, Di});
        cv.index_w = x.iw.View({T, Hi});
        const absl::Status s = RunCandidatesInto(*engine_, *step, l, cv, &c);
        FUZZ_CHECK(s.ok(), "good candidates refused: ", s.ToString());
        FUZZ_CHECK(static_cast<int64_t>(c.count.size()) == T, "candidates per query");
        if (!c.keys.empty() && in.Bool(0.2)) {  // tamper: some edits are valid, some not
          tampered = true;
          const size_t at = in.Int(0, static_cast<int>(c.keys.size()) - 1);
          switch (in.Int(0, 3)) {
            case 0:
              c.keys[at] = in.Int(-4, 200);
              break;
            case 1:
              c.keys[at] = c.keys[at == 0 ? c.keys.size() - 1 : 0];
              break;
            case 2:
              c.count[in.Int(0, static_cast<int>(T) - 1)] += in.Int(-2, 2);
              break;
            case 3:
              c.scores[at] = in.Bool(0.5) ? NAN : INFINITY;
              break;
          }
        }
      }
      std::vector<float> out(T * H * L);
      const absl::Status s = RunLayerInto(*engine_, *step, l, v, out.data(), out.size() * 4,
                                          nullptr, nullptr, full ? &c : nullptr);
      if (!s.ok()) {
        FUZZ_CHECK(tampered, "a good context-parallel layer failed: ", s.ToString());
        FUZZ_CHECK(FreePages() >= free_begun, "an aborted step kept pages");
        return;
      }
      for (float f : out) FUZZ_CHECK(!std::isnan(f) || tampered, "NaN output");
      outs.emplace_back(out.begin(), out.end());
      layers.push_back(std::move(x));
    }
    if (attend) {  // nothing written
      FUZZ_CHECK(FreePages() == free_begun, "an attend-only step took pages");
      return;
    }
    model_.seqs[id].length += T;
    model_.seqs[id].known = 0;  // a context-parallel commit: the engine forgets its hashes
    std::vector<reference::LayerValues> values;
    for (const Layer& x : layers)
      values.push_back({x.ql.values, x.qr.values, x.kv.values, x.kr.values, x.iq.values,
                        x.ik.values, x.iw.values});
    oracle_.Commit({{id, T}}, values);
    if (tampered) return;  // a valid edit selects other keys: not the oracle's
    const auto want = oracle_.Expected({{id, T}}, values);
    for (size_t l = 0; l < outs.size(); ++l) {
      const double err = reference::RelL2(outs[l], want[l]);
      FUZZ_CHECK(err <= 1e-4, "context-parallel layer ", l, " rel L2 ", err);
    }
  }

  // Each sequence's tier, in the model's order.
  // Opens `id` on the prefix cache's blocks of a prompt (token ids or hashes): what it maps is
  // what LookupPrefix said, and the oracle takes those rows as the prompt's keys, so every later
  // step on it checks that the cached pages hold them.
  void OpenCachedOp(FuzzInput& in, const std::string& id) {
    const int p = in.Int(0, kPrompts - 1);
    const int device = in.Int(-1, 1);
    const int32_t P = spec_.page_size;
    const std::vector<uint32_t> tokens = PromptTokens(p, P);
    PrefixQuery q;
    q.tokens.assign(tokens.begin(), tokens.begin() + kPromptBlocks * P);
    q.hashes = HashBlocks(q.tokens, P);
    q.max_blocks = (static_cast<int64_t>(tokens.size()) - 1) / P;
    if (in.Bool(0.3)) q.tokens.clear();  // hashes alone
    const PrefixLookup found = engine_->LookupPrefix("", q.hashes);
    auto cached = engine_->OpenSequence(id, device, q);
    FUZZ_CHECK(cached.ok() == !model_.seqs.contains(id), id,
               " open on a prompt: ", cached.status().ToString());
    if (!cached.ok()) return;
    FUZZ_CHECK(*cached % P == 0 && *cached <= kPromptBlocks * P, "cached ", *cached);
    FUZZ_CHECK(device >= 0 ? *cached <= found.blocks * P : *cached == found.blocks * P,
               "open mapped ", *cached, " tokens, LookupPrefix found ", found.blocks, " blocks");
    const auto info = engine_->DescribeSequence(id);
    FUZZ_CHECK(info.ok() && info->length == *cached, id, " length");
    model_.seqs[id] = {*cached, info->device};
    model_.seqs[id].prompt = p;
    model_.seqs[id].known = kPromptBlocks;
    oracle_.Open(id);
    if (*cached == 0) return;
    std::vector<reference::LayerValues> values(spec_.num_layers());
    for (int l = 0; l < spec_.num_layers(); ++l)
      for (int64_t pos = 0; pos < *cached; ++pos) {
        const PromptRow k = PromptKeys(spec_, p, l, pos);
        values[l].kv_latent.insert(values[l].kv_latent.end(), k.kv.begin(), k.kv.end());
        values[l].k_rope.insert(values[l].k_rope.end(), k.kr.begin(), k.kr.end());
        values[l].index_k.insert(values[l].index_k.end(), k.ik.begin(), k.ik.end());
      }
    oracle_.Commit({{id, *cached}}, values);
  }

  std::vector<Tier> Tiers() const {
    std::vector<Tier> t;
    for (const auto& [id, m] : model_.seqs) t.push_back(engine_->DescribeSequence(id)->tier);
    return t;
  }

  std::vector<int32_t> FreePages() const {
    std::vector<int32_t> f;
    for (const DeviceCapacity& d : engine_->Capacity()) f.push_back(d.pages_free);
    return f;
  }

  // Where the pages and the sequences are.
  struct Placement {
    std::vector<int32_t> free_pages;
    std::vector<Tier> tiers;
  };
  Placement Placed() const { return {FreePages(), Tiers()}; }

  // A step refused for what it is moves nothing; one refused for room may have spilled and
  // restored sequences trying (their contents as they were: the audit and the oracle).
  void CheckRefused(const absl::Status& s, const Placement& before) const {
    if (s.code() == absl::StatusCode::kResourceExhausted) return;
    FUZZ_CHECK(FreePages() == before.free_pages, "a refused step changed the pool: ", s.ToString());
    FUZZ_CHECK(Tiers() == before.tiers, "a refused step moved sequences: ", s.ToString());
  }

  // The engine agrees with the model; the tiers' bookkeeping with itself; a device page's count
  // is at least the references of the sequences on the device (holders below add to it).
  void Audit() {
    FUZZ_CHECK(engine_->num_sequences() == static_cast<int64_t>(model_.seqs.size()), "count");
    FUZZ_CHECK(engine_->num_open_steps() == 0, "open steps");
    const absl::Status invariants = engine_->CheckInvariants();
    FUZZ_CHECK(invariants.ok(), invariants.ToString());
    std::vector<std::vector<int32_t>> refs(2, std::vector<int32_t>(kPages, 0));
    const bool cache_empty = engine_->PrefixCacheStats().blocks == 0;
    for (int d = 0; d < 2; ++d) refs[d][0] = 1;
    bool all_on_device = true;
    for (const auto& [id, m] : model_.seqs) {
      auto info = engine_->DescribeSequence(id);
      FUZZ_CHECK(info.ok(), id);
      FUZZ_CHECK(info->length == m.length, id, " length ", info->length, " want ", m.length);
      FUZZ_CHECK(info->device == m.device, id, " device");
      FUZZ_CHECK(!info->in_step, id, " in_step");
      FUZZ_CHECK(!info->moving && !info->lost, id, " moving or lost");
      if (info->tier != Tier::kDevice) {
        FUZZ_CHECK(info->pages.empty(), id, " below its device with device pages");
        all_on_device = false;
        continue;
      }
      const int64_t pages = (m.length + spec_.page_size - 1) / spec_.page_size;
      FUZZ_CHECK(static_cast<int64_t>(info->pages.size()) == pages, id, " pages");
      for (int32_t p : info->pages) {
        FUZZ_CHECK(p > 0 && p < kPages, id, " page ", p);
        ++refs[m.device][p];
      }
    }
    for (int d = 0; d < 2; ++d) {
      const std::vector<int32_t> counts = engine_->PageRefcounts(d);
      int32_t free = 0;
      for (int p = 0; p < kPages; ++p) {
        // Holders below the device and the prefix cache add to a page's count.
        FUZZ_CHECK(all_on_device && cache_empty ? counts[p] == refs[d][p] : counts[p] >= refs[d][p],
                   "device ", d, " page ", p, ": count ", counts[p], ", ", refs[d][p],
                   " references");
        free += p > 0 && counts[p] == 0;
      }
      FUZZ_CHECK(engine_->Capacity()[d].pages_free == free, "free pages of device ", d);
      FUZZ_CHECK(engine_->ReservedPageUntouched(d), "page 0 written on device ", d);
    }
  }

  ModelSpec spec_;
  std::unique_ptr<Engine> engine_;
  reference::StepOracle oracle_;
  Model model_;
};

}  // namespace
}  // namespace attnd

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  attnd::FuzzInput in(data, size);
  attnd::Run run;
  for (int i = 0; i < 64 && !in.empty(); ++i) run.Op(in);
  run.Finish();
  return 0;
}
