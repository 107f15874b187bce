// Integration tests: a real attnd process on loopback, driven through the C++ client over the
// stream and unary paths, checked against the float64 oracle.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <future>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/attnd_client.h"
#include "client/workload.h"
#include "tests/server_process.h"

namespace attnd::testing {
namespace {

using client::Batch;
using client::Client;
using client::GeneratedLayer;

constexpr int64_t kMaxMessage = 4 << 20;

class ServiceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = new ServerProcess(ATTND_BINARY, SharedServerArgs("service", 400, kMaxMessage));
  }
  static void TearDownTestSuite() {
    EXPECT_EQ(server_->Stop(), 0) << "attnd exits 0 on SIGTERM";
    delete server_;
  }
  void SetUp() override {
    client_ = Client::Connect(server_->target());
    auto info = client_->Info();
    ASSERT_TRUE(info.ok()) << info.status();
    spec_ = ModelSpecFromProto(info->model()).value();
    if (TestDataPlane()) {  // every layer call of this client goes by the data plane
      ASSERT_TRUE(client_->ConnectDataPlane().ok());
      ASSERT_FALSE(client_->DataPlaneName().empty());
    }
    oracle_ = std::make_unique<reference::StepOracle>(spec_, DType::kBF16);
  }

  void Open(const std::string& id, const std::string& parent = "", int64_t prefix = 0) {
    auto s = client_->OpenSequence(id, parent, prefix);
    ASSERT_TRUE(s.ok()) << s.status();
    if (parent.empty()) {
      oracle_->Open(id);
    } else {
      oracle_->Fork(id, parent, prefix);
    }
  }

  static std::vector<double> Decode(const v1::Tensor& t) {
    const DType dt = ParseDType(t.datatype()).value();
    const size_t n = t.data().size() / DTypeSize(dt);
    std::vector<float> f(n);
    ConvertToF32(dt, t.data().data(), f.data(), n);
    return {f.begin(), f.end()};
  }

  // Runs a step over `stream` (or unary calls when null) and returns per-layer outputs.
  absl::StatusOr<std::vector<std::vector<double>>> RunStep(client::StepStream* stream,
                                                           const Batch& batch,
                                                           const std::vector<GeneratedLayer>& g) {
    std::vector<std::vector<double>> outs;
    uint64_t step = 0;
    if (stream) {
      auto b = stream->Begin(batch);
      if (!b.ok()) return b.status();
    } else {
      auto b = client_->BeginStep(batch);
      if (!b.ok()) return b.status();
      step = b->step_id();
    }
    for (size_t l = 0; l < g.size(); ++l) {
      auto o = stream ? stream->Layer(g[l].wire) : client_->AttendLayer(step, g[l].wire);
      if (!o.ok()) return o.status();
      EXPECT_EQ(o->committed(), l + 1 == g.size());
      outs.push_back(Decode(o->out()));
    }
    return outs;
  }

  // Checks outputs against the oracle (after committing the step's keys to it).
  void Check(const Batch& batch, const std::vector<GeneratedLayer>& g,
             const std::vector<std::vector<double>>& outs) {
    std::vector<reference::LayerValues> v;
    for (const auto& l : g) v.push_back(l.values);
    const auto want = oracle_->Expected(batch, v);
    ASSERT_EQ(want.size(), outs.size());
    for (size_t l = 0; l < outs.size(); ++l) {
      for (double x : outs[l]) ASSERT_FALSE(std::isnan(x));
      EXPECT_LE(reference::RelL2(outs[l], want[l]), 1e-2) << "layer " << l;
    }
  }
  void Commit(const Batch& batch, const std::vector<GeneratedLayer>& g) {
    std::vector<reference::LayerValues> v;
    for (const auto& l : g) v.push_back(l.values);
    oracle_->Commit(batch, v);
  }

  int64_t Length(const std::string& id) {
    auto d = client_->DescribeSequence(id);
    EXPECT_TRUE(d.ok()) << d.status();
    return d.ok() ? d->length() : -1;
  }

  static ServerProcess* server_;
  std::unique_ptr<Client> client_;
  ModelSpec spec_;
  std::unique_ptr<reference::StepOracle> oracle_;
  std::mt19937_64 rng_{42};
};
ServerProcess* ServiceTest::server_ = nullptr;

// Two sequences with identical histories, one driven over the stream and one over unary calls:
// chunked prefill, a mixed batch (decode + extend), forks and decode; outputs must be identical
// and match the float64 reference.
TEST_F(ServiceTest, StreamAndUnaryAgreeAndMatchTheReference) {
  Open("su-s");
  Open("su-u");
  Open("su-other");
  auto stream = client_->OpenStream();
  auto both = [&](const std::vector<std::pair<int64_t, int64_t>>& plan, bool with_other) {
    // plan: per transport sequence, q_len (same for s and u).
    const int64_t q = plan[0].first;
    Batch bs = {{"su-s", q}}, bu = {{"su-u", q}};
    if (with_other) {
      bs.emplace_back("su-other", plan[0].second);
      bu.emplace_back("su-other", plan[0].second);
    }
    const int64_t T = q + (with_other ? plan[0].second : 0);
    auto g = client::GenerateStep(spec_, T, DType::kBF16, false, rng_);
    auto s = RunStep(stream.get(), bs, g);
    ASSERT_TRUE(s.ok()) << s.status();
    Commit(bs, g);
    Check(bs, g, *s);
    if (with_other) return;  // "su-other" moved on; the unary twin runs alone below
    auto u = RunStep(nullptr, bu, g);
    ASSERT_TRUE(u.ok()) << u.status();
    Commit(bu, g);
    for (size_t l = 0; l < g.size(); ++l) EXPECT_EQ((*s)[l], (*u)[l]) << "layer " << l;
  };
  both({{41, 0}}, false);  // three prefill chunks, not page aligned
  both({{30, 0}}, false);
  both({{29, 0}}, false);
  for (int i = 0; i < 4; ++i) both({{1, 0}}, false);  // decode past K = 24
  EXPECT_EQ(Length("su-s"), 104);
  EXPECT_EQ(Length("su-u"), 104);
  // A mixed batch: s decodes while another sequence prefills.
  both({{1, 50}}, true);
  // Forks of s at a non-aligned prefix, extended through each transport.
  Open("su-f1", "su-s", 70);
  Open("su-f2", "su-s", 70);
  auto g = client::GenerateStep(spec_, 5, DType::kBF16, false, rng_);
  auto a = RunStep(stream.get(), {{"su-f1", 5}}, g);
  auto b = RunStep(nullptr, {{"su-f2", 5}}, g);
  ASSERT_TRUE(a.ok() && b.ok());
  Commit({{"su-f1", 5}}, g);
  Commit({{"su-f2", 5}}, g);
  Check({{"su-f1", 5}}, g, *a);
  for (size_t l = 0; l < g.size(); ++l) EXPECT_EQ((*a)[l], (*b)[l]);
  EXPECT_TRUE(stream->Close().ok());
  for (const char* id : {"su-s", "su-u", "su-other", "su-f1", "su-f2"})
    EXPECT_TRUE(client_->CloseSequence(id).ok());
}

TEST_F(ServiceTest, SeveralClientsAtOnceOnDifferentSequences) {
  const int kClients = 4;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c] {
      auto cl = Client::Connect(server_->target());
      reference::StepOracle oracle(spec_, DType::kBF16);
      std::mt19937_64 rng(100 + c);
      const std::string id = absl::StrCat("many-", c);
      if (!cl->OpenSequence(id).ok()) ++failures;
      oracle.Open(id);
      auto stream = cl->OpenStream();
      for (int step = 0; step < 6; ++step) {
        const int64_t q = step == 0 ? 30 + c : 1;
        const Batch batch = {{id, q}};
        auto g = client::GenerateStep(spec_, q, DType::kBF16, false, rng);
        if (!stream->Begin(batch).ok()) {
          ++failures;
          return;
        }
        std::vector<std::vector<double>> outs;
        for (auto& l : g) {
          auto o = stream->Layer(l.wire);
          if (!o.ok()) {
            ++failures;
            return;
          }
          outs.push_back(Decode(o->out()));
        }
        std::vector<reference::LayerValues> v;
        for (auto& l : g) v.push_back(l.values);
        oracle.Commit(batch, v);
        const auto want = oracle.Expected(batch, v);
        for (size_t l = 0; l < outs.size(); ++l)
          if (!(reference::RelL2(outs[l], want[l]) <= 1e-2)) ++failures;
      }
      if (!stream->Close().ok() || !cl->CloseSequence(id).ok()) ++failures;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
}

// Every malformed field gets its own status and a message naming it; nothing changes; the
// server keeps serving.
TEST_F(ServiceTest, BadInputMatrix) {
  Open("bad-a");
  Open("bad-b");
  {
    auto g = client::GenerateStep(spec_, 20, DType::kBF16, false, rng_);
    ASSERT_TRUE(RunStep(nullptr, {{"bad-a", 20}}, g).ok());
    Commit({{"bad-a", 20}}, g);
  }
  auto state = [&] { return std::make_pair(Length("bad-a"), Length("bad-b")); };
  const auto before = state();
  const Batch batch = {{"bad-a", 2}, {"bad-b", 1}};
  const auto good = client::GenerateStep(spec_, 3, DType::kBF16, false, rng_);
  struct Case {
    const char* what;
    std::function<void(v1::LayerInputs&)> mutate;
    absl::StatusCode code;
    const char* needle;
  };
  const std::vector<Case> cases = {
      {"datatype", [](v1::LayerInputs& in) { in.mutable_q_latent()->set_datatype("BF17"); },
       absl::StatusCode::kInvalidArgument, "q_latent: datatype 'BF17'"},
      {"lower-case datatype",
       [](v1::LayerInputs& in) { in.mutable_k_rope()->set_datatype("bf16"); },
       absl::StatusCode::kInvalidArgument, "k_rope: datatype"},
      {"shape", [](v1::LayerInputs& in) { in.mutable_q_rope()->set_shape(1, 3); },
       absl::StatusCode::kInvalidArgument, "q_rope: shape [3, 3, 16], expected [3, 4, 16]"},
      {"byte count",
       [](v1::LayerInputs& in) { in.mutable_kv_latent()->mutable_data()->pop_back(); },
       absl::StatusCode::kInvalidArgument, "kv_latent: 191 bytes, expected 192"},
      {"tokens vs batch", [](v1::LayerInputs& in) { in.mutable_index_k()->set_shape(0, 4); },
       absl::StatusCode::kInvalidArgument, "index_k: shape [4, 16], expected [3, 16]"},
      {"missing indexer", [](v1::LayerInputs& in) { in.clear_index_w(); },
       absl::StatusCode::kInvalidArgument, "index_w: missing"},
      {"layer out of order", [](v1::LayerInputs& in) { in.set_layer(2); },
       absl::StatusCode::kFailedPrecondition, "layer 2 out of order, expected layer 0"},
  };
  for (bool use_stream : {true, false}) {
    for (const auto& c : cases) {
      v1::LayerInputs in = good[0].wire;
      c.mutate(in);
      absl::Status st;
      if (use_stream) {
        auto stream = client_->OpenStream();
        ASSERT_TRUE(stream->Begin(batch).ok());
        st = stream->Layer(in).status();
      } else {
        auto b = client_->BeginStep(batch);
        ASSERT_TRUE(b.ok());
        st = client_->AttendLayer(b->step_id(), in).status();
        // The error aborted the step: a later layer is told so.
        EXPECT_EQ(client_->AttendLayer(b->step_id(), good[0].wire).status().code(),
                  absl::StatusCode::kCancelled);
      }
      EXPECT_EQ(st.code(), c.code) << c.what << ": " << st;
      EXPECT_NE(st.message().find(c.needle), std::string::npos) << c.what << ": " << st;
      EXPECT_EQ(state(), before) << c.what;
    }
  }
  // Sequence and step metadata.
  EXPECT_EQ(client_->OpenSequence("bad-a").status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(client_->BeginStep({{"nope", 1}}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->AttendLayer(999999, good[0].wire).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->BeginStep({{"bad-a", 0}}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->OpenSequence("bad-c", "bad-a", 21).status().code(),
            absl::StatusCode::kOutOfRange);
  auto too_long = client_->BeginStep({{"bad-b", spec_.max_context + 1}});
  EXPECT_EQ(too_long.status().code(), absl::StatusCode::kOutOfRange);
  auto too_many = client_->BeginStep({{"bad-b", 399 * 16}});  // more pages than the pool has
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(too_many.status().message().find("KV cache full"), std::string::npos);
  {  // a sequence already in an open step
    auto open = client_->BeginStep({{"bad-a", 1}});
    ASSERT_TRUE(open.ok());
    auto busy = client_->BeginStep({{"bad-b", 1}, {"bad-a", 1}});
    EXPECT_EQ(busy.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(busy.status().message().find("'bad-a' is already in open step"), std::string::npos);
    EXPECT_EQ(client_->CloseSequence("bad-a").code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE(client_->AbortStep(open->step_id()).ok());
  }
  {  // oversize: gRPC's own limit, RESOURCE_EXHAUSTED before attnd sees it; on the data plane
     // the bytes are not in the message, and the engine's size check refuses them (step aborted)
    v1::LayerInputs in = good[0].wire;
    in.mutable_q_latent()->mutable_data()->resize(kMaxMessage + 1024);
    auto b = client_->BeginStep(batch);
    ASSERT_TRUE(b.ok());
    auto st = client_->AttendLayer(b->step_id(), in).status();
    if (TestDataPlane()) {
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
      EXPECT_NE(st.message().find("q_latent: 4195328 bytes, expected 768"), std::string::npos)
          << st;
      EXPECT_EQ(client_->AbortStep(b->step_id()).code(), absl::StatusCode::kNotFound);
    } else {
      EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
      EXPECT_TRUE(client_->AbortStep(b->step_id()).ok());
    }
  }
  {  // a stream message with nothing set
    auto stream = client_->OpenStream();
    auto st = stream->Abort();  // abort with no step open: fine, answered
    EXPECT_TRUE(st.ok()) << st;
    EXPECT_EQ(stream->Layer(good[0].wire).status().code(), absl::StatusCode::kFailedPrecondition);
  }
  EXPECT_EQ(state(), before);
  // Still serving, and still exact.
  auto g = client::GenerateStep(spec_, 3, DType::kBF16, false, rng_);
  auto out = RunStep(nullptr, batch, g);
  ASSERT_TRUE(out.ok()) << out.status();
  Commit(batch, g);
  Check(batch, g, *out);
  EXPECT_TRUE(client_->CloseSequence("bad-a").ok());
  EXPECT_TRUE(client_->CloseSequence("bad-b").ok());
}

TEST_F(ServiceTest, CancelOrDisconnectMidStepLeavesSequencesAsBefore) {
  Open("cx");
  auto g0 = client::GenerateStep(spec_, 33, DType::kBF16, false, rng_);
  ASSERT_TRUE(RunStep(nullptr, {{"cx", 33}}, g0).ok());
  Commit({{"cx", 33}}, g0);
  const auto before = client_->DescribeSequence("cx").value();
  auto wait_idle = [&] {
    for (int i = 0; i < 100; ++i) {
      auto d = client_->DescribeSequence("cx");
      if (d.ok() && !d->in_step()) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  };
  auto g = client::GenerateStep(spec_, 17, DType::kBF16, false, rng_);
  {  // cancel after two layers
    auto stream = client_->OpenStream();
    ASSERT_TRUE(stream->Begin({{"cx", 17}}).ok());
    ASSERT_TRUE(stream->Layer(g[0].wire).ok());
    ASSERT_TRUE(stream->Layer(g[1].wire).ok());
    stream->Cancel();
  }
  wait_idle();
  {  // half-close with a step open
    auto stream = client_->OpenStream();
    ASSERT_TRUE(stream->Begin({{"cx", 17}}).ok());
    ASSERT_TRUE(stream->Layer(g[0].wire).ok());
    EXPECT_EQ(stream->Close().code(), absl::StatusCode::kCancelled);
  }
  wait_idle();
  {  // a unary step left idle expires (--step-idle-timeout-ms=400)
    auto b = client_->BeginStep({{"cx", 17}});
    ASSERT_TRUE(b.ok());
    ASSERT_TRUE(client_->AttendLayer(b->step_id(), g[0].wire).ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(1200));
    EXPECT_EQ(client_->AttendLayer(b->step_id(), g[1].wire).status().code(),
              absl::StatusCode::kDeadlineExceeded);
  }
  const auto after = client_->DescribeSequence("cx").value();
  EXPECT_EQ(after.length(), before.length());
  EXPECT_EQ(after.num_pages(), before.num_pages());
  EXPECT_FALSE(after.in_step());
  // The sequence continues exactly as if those steps never happened.
  auto out = RunStep(nullptr, {{"cx", 17}}, g);
  ASSERT_TRUE(out.ok()) << out.status();
  Commit({{"cx", 17}}, g);
  Check({{"cx", 17}}, g, *out);
  EXPECT_TRUE(client_->CloseSequence("cx").ok());
}

// Shard k's view of a layer: its slice of the heads of q_latent / q_rope; shard 0 also carries
// the keys and indexer tensors.
v1::LayerInputs ShardOf(const v1::LayerInputs& in, int S, int k) {
  auto slice = [&](const v1::Tensor& t) {
    v1::Tensor o = t;
    const int64_t T = t.shape(0), H = t.shape(1), X = t.shape(2);
    const size_t es = t.data().size() / (T * H * X), row = (H / S) * X * es;
    o.set_shape(1, H / S);
    o.mutable_data()->clear();
    for (int64_t i = 0; i < T; ++i)
      o.mutable_data()->append(t.data().substr((i * S + k) * row, row));
    return o;
  };
  v1::LayerInputs out;
  out.set_layer(in.layer());
  out.set_shard(k);
  *out.mutable_q_latent() = slice(in.q_latent());
  *out.mutable_q_rope() = slice(in.q_rope());
  if (k == 0) {
    *out.mutable_kv_latent() = in.kv_latent();
    *out.mutable_k_rope() = in.k_rope();
    if (in.has_index_q()) {
      *out.mutable_index_q() = in.index_q();
      *out.mutable_index_k() = in.index_k();
      *out.mutable_index_w() = in.index_w();
    }
  }
  return out;
}

// Reassembles [T, H, L] from the shards' [T, H/S, L] outputs.
std::vector<double> Unshard(const std::vector<std::vector<double>>& parts, int64_t T, int L) {
  const int S = static_cast<int>(parts.size());
  const size_t row = parts[0].size() / T;
  std::vector<double> out;
  for (int64_t t = 0; t < T; ++t)
    for (int k = 0; k < S; ++k)
      out.insert(out.end(), parts[k].begin() + t * row, parts[k].begin() + (t + 1) * row);
  (void)L;
  return out;
}

TEST_F(ServiceTest, ShardedStepsGatherHeadsAndEqualAnUnshardedStep) {
  const int S = 2;
  Open("sh-a");
  Open("sh-b");
  for (const auto& round :
       std::vector<std::pair<int64_t, bool>>{{40, true}, {1, true}, {3, false}, {1, false}}) {
    const int64_t q = round.first;  // named copies: lambdas below capture them
    const bool stream_transport = round.second;
    auto g = client::GenerateStep(spec_, q, DType::kBF16, false, rng_);
    auto want = RunStep(nullptr, {{"sh-b", q}}, g);
    ASSERT_TRUE(want.ok()) << want.status();
    Commit({{"sh-b", q}}, g);
    std::vector<std::vector<std::vector<double>>> got(S);  // [shard][layer]
    std::vector<absl::Status> status(S);
    std::promise<uint64_t> step_id;
    auto shared_id = step_id.get_future().share();
    std::vector<std::thread> shards;
    for (int k = 0; k < S; ++k) {
      shards.emplace_back([&, k] {
        auto cl = Client::Connect(server_->target());
        auto stream = cl->OpenStream();
        if (k == 0) {
          auto b = stream_transport ? stream->Begin({{"sh-a", q}}, false, S)
                                    : cl->BeginStep({{"sh-a", q}}, false, S);
          step_id.set_value(b.ok() ? b->step_id() : 0);
          if (!b.ok()) {
            status[k] = b.status();
            return;
          }
        } else if (stream_transport) {
          auto j = stream->Join(shared_id.get(), k);
          if (!j.ok()) {
            status[k] = j.status();
            return;
          }
        }
        for (const auto& l : g) {
          auto o = stream_transport ? stream->Layer(ShardOf(l.wire, S, k))
                                    : cl->AttendLayer(shared_id.get(), ShardOf(l.wire, S, k));
          if (!o.ok()) {
            status[k] = o.status();
            return;
          }
          EXPECT_EQ(o->out().shape(1), spec_.num_heads / S);
          got[k].push_back(Decode(o->out()));
        }
        status[k] = stream->Close();
      });
    }
    for (auto& t : shards) t.join();
    for (int k = 0; k < S; ++k) ASSERT_TRUE(status[k].ok()) << "shard " << k << ": " << status[k];
    Commit({{"sh-a", q}}, g);
    for (size_t l = 0; l < g.size(); ++l)
      EXPECT_EQ(Unshard({got[0][l], got[1][l]}, q, spec_.kv_lora_rank), (*want)[l])
          << "layer " << l << (stream_transport ? " (stream)" : " (unary)");
  }
  EXPECT_EQ(Length("sh-a"), Length("sh-b"));
  // Bad sharding: heads not divisible, a joining shard out of range, keys from shard 1.
  EXPECT_EQ(client_->BeginStep({{"sh-a", 1}}, false, 3).status().code(),
            absl::StatusCode::kInvalidArgument);
  const int64_t before = Length("sh-a");
  {
    auto s0 = client_->OpenStream();
    auto b = s0->Begin({{"sh-a", 1}}, false, S);
    ASSERT_TRUE(b.ok()) << b.status();
    auto s1 = client_->OpenStream();
    EXPECT_EQ(s1->Join(b->step_id(), 5).status().code(), absl::StatusCode::kInvalidArgument);
    auto s2 = client_->OpenStream();
    ASSERT_TRUE(s2->Join(b->step_id(), 1).ok());
    auto g = client::GenerateStep(spec_, 1, DType::kBF16, false, rng_);
    {  // a joined stream must speak as the shard it joined as
      auto s3 = client_->OpenStream();
      auto b3 = s3->Begin({{"sh-b", 1}}, false, S);
      ASSERT_TRUE(b3.ok());
      auto s4 = client_->OpenStream();
      ASSERT_TRUE(s4->Join(b3->step_id(), 1).ok());
      auto st = s4->Layer(ShardOf(g[0].wire, S, 0)).status();
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
      EXPECT_NE(st.message().find("this stream is shard 1"), std::string::npos) << st;
    }
    v1::LayerInputs bad = ShardOf(g[0].wire, S, 1);
    *bad.mutable_kv_latent() = g[0].wire.kv_latent();
    std::thread t0([&] {
      auto st = s0->Layer(ShardOf(g[0].wire, S, 0)).status();
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    });
    auto st = s2->Layer(bad).status();
    t0.join();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("only shard 0 sends"), std::string::npos) << st;
  }
  {  // a shard that disconnects while another waits: the step aborts for both
    auto s0 = client_->OpenStream();
    auto b = s0->Begin({{"sh-a", 1}}, false, S);
    ASSERT_TRUE(b.ok());
    auto s1 = client_->OpenStream();
    ASSERT_TRUE(s1->Join(b->step_id(), 1).ok());
    auto g = client::GenerateStep(spec_, 1, DType::kBF16, false, rng_);
    std::thread t0([&] {
      auto st = s0->Layer(ShardOf(g[0].wire, S, 0)).status();
      EXPECT_EQ(st.code(), absl::StatusCode::kCancelled) << st;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    s1->Cancel();
    t0.join();
  }
  for (int i = 0; i < 50 && client_->DescribeSequence("sh-a")->in_step(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(Length("sh-a"), before);
  EXPECT_FALSE(client_->DescribeSequence("sh-a")->in_step());
  EXPECT_TRUE(client_->CloseSequence("sh-a").ok());
  EXPECT_TRUE(client_->CloseSequence("sh-b").ok());
}

// An error on the last layer of a sharded step (here shard 1's output reference) commits nothing.
TEST_F(ServiceTest, ShardedStepFailingOnItsLastLayerLeavesTheSequenceAsBefore) {
  const int S = 2;
  Open("sh-last");
  auto g0 = client::GenerateStep(spec_, 5, DType::kBF16, false, rng_);
  ASSERT_TRUE(RunStep(nullptr, {{"sh-last", 5}}, g0).ok());
  Commit({{"sh-last", 5}}, g0);
  const int64_t before = Length("sh-last");
  auto g = client::GenerateStep(spec_, 3, DType::kBF16, false, rng_);
  auto b = client_->BeginStep({{"sh-last", 3}}, false, S);
  ASSERT_TRUE(b.ok()) << b.status();
  std::vector<absl::Status> status(S);
  std::vector<std::thread> shards;
  for (int k = 0; k < S; ++k) {
    shards.emplace_back([&, k] {
      auto cl = Client::Connect(server_->target());
      for (size_t l = 0; l < g.size(); ++l) {
        v1::LayerInputs in = ShardOf(g[l].wire, S, k);
        if (k == 1 && l + 1 == g.size()) in.mutable_out_shm()->set_byte_size(3);
        status[k] = cl->AttendLayer(b->step_id(), in).status();
        if (!status[k].ok()) return;
      }
    });
  }
  for (auto& t : shards) t.join();
  for (int k = 0; k < S; ++k)
    EXPECT_EQ(status[k].code(), absl::StatusCode::kInvalidArgument) << "shard " << k << status[k];
  EXPECT_NE(status[1].message().find("out_shm: byte_size 3"), std::string::npos) << status[1];
  EXPECT_EQ(Length("sh-last"), before);
  EXPECT_FALSE(client_->DescribeSequence("sh-last")->in_step());
  // The sequence goes on as if the failed step never happened.
  auto out = RunStep(nullptr, {{"sh-last", 3}}, g);
  ASSERT_TRUE(out.ok()) << out.status();
  Commit({{"sh-last", 3}}, g);
  Check({{"sh-last", 3}}, g, *out);
  EXPECT_TRUE(client_->CloseSequence("sh-last").ok());
}

// Each shard's shared-memory references are judged by its own caller's transport, not by the
// caller whose message completed the layer: a TCP shard's reference into a region is refused
// even when a local shard arrives last, and a local shard's is served when a TCP one does.
TEST_F(ServiceTest, EachShardsSharedMemoryIsJudgedByItsOwnTransport) {
  const int S = 2;
  const std::string key = absl::StrCat("/attnd-shard-", getpid());
  auto mem = client::SharedMemory::Create(key, 1 << 20);
  ASSERT_TRUE(mem.ok()) << mem.status();
  std::memset((*mem)->data(), 0xab, 1 << 20);
  auto local = Client::Connect("unix:" + SocketPath("service"));
  auto tcp = Client::Connect(server_->target());
  ASSERT_TRUE(local->RegisterSharedMemory("shards", key, 0, 1 << 20).ok());
  Open("sh-mem");
  const int64_t T = 3, out_bytes = T * (spec_.num_heads / S) * spec_.kv_lora_rank * 2;
  auto g = client::GenerateStep(spec_, T, DType::kBF16, false, rng_);
  auto to_region = [&](v1::LayerInputs in) {
    in.mutable_out_shm()->set_region("shards");
    in.mutable_out_shm()->set_byte_size(out_bytes);
    return in;
  };
  // Shard 1 over TCP names the region and waits; shard 0 over the socket completes the layer.
  {
    auto b = local->BeginStep({{"sh-mem", T}}, false, S);
    ASSERT_TRUE(b.ok()) << b.status();
    absl::Status first;
    std::thread shard1([&] {
      first = tcp->AttendLayer(b->step_id(), to_region(ShardOf(g[0].wire, S, 1))).status();
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // parked
    const absl::Status last = local->AttendLayer(b->step_id(), ShardOf(g[0].wire, S, 0)).status();
    shard1.join();
    EXPECT_EQ(first.code(), absl::StatusCode::kPermissionDenied) << first;
    EXPECT_FALSE(last.ok());  // the step is aborted for both
    for (int64_t i = 0; i < out_bytes; ++i)
      ASSERT_EQ(static_cast<uint8_t>((*mem)->data()[i]), 0xab) << "byte " << i << " written";
    EXPECT_EQ(Length("sh-mem"), 0);
    EXPECT_FALSE(client_->DescribeSequence("sh-mem")->in_step());
  }
  // Shard 0 over the socket names the region and waits; shard 1 over TCP completes each layer.
  {
    auto b = local->BeginStep({{"sh-mem", T}}, false, S);
    ASSERT_TRUE(b.ok()) << b.status();
    for (size_t l = 0; l < g.size(); ++l) {
      absl::Status first;
      std::thread shard0([&] {
        first = local->AttendLayer(b->step_id(), to_region(ShardOf(g[l].wire, S, 0))).status();
      });
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      const absl::Status last = tcp->AttendLayer(b->step_id(), ShardOf(g[l].wire, S, 1)).status();
      shard0.join();
      ASSERT_TRUE(first.ok() && last.ok()) << "layer " << l << ": " << first << " / " << last;
    }
    EXPECT_EQ(Length("sh-mem"), T);
    int64_t written = 0;  // shard 0's heads went there
    for (int64_t i = 0; i < out_bytes; ++i)
      written += static_cast<uint8_t>((*mem)->data()[i]) != 0xab;
    EXPECT_GT(written, out_bytes / 2);
  }
  EXPECT_TRUE(local->UnregisterSharedMemory("shards").ok());
  EXPECT_TRUE(client_->CloseSequence("sh-mem").ok());
}

// Moves every tensor of a layer message into `mem` (from *offset on) and points the message at
// it, with the output into the region too.
v1::LayerInputs ToShm(const v1::LayerInputs& in, client::SharedMemory& mem,
                      const std::string& region, int64_t* offset, int64_t out_bytes) {
  v1::LayerInputs o = in;
  auto move = [&](v1::Tensor* t) {
    if (t->datatype().empty()) return;
    std::memcpy(mem.data() + *offset, t->data().data(), t->data().size());
    std::vector<int64_t> shape(t->shape().begin(), t->shape().end());
    *t = client::ShmTensor(*ParseDType(t->datatype()), shape, region, *offset);
    *offset += t->shm().byte_size();
  };
  for (v1::Tensor* t :
       {o.mutable_q_latent(), o.mutable_q_rope(), o.mutable_kv_latent(), o.mutable_k_rope(),
        o.mutable_index_q(), o.mutable_index_k(), o.mutable_index_w()})
    move(t);
  o.mutable_out_shm()->set_region(region);
  o.mutable_out_shm()->set_offset(*offset);
  o.mutable_out_shm()->set_byte_size(out_bytes);
  *offset += out_bytes;
  return o;
}

TEST_F(ServiceTest, SharedMemoryTensorsGiveTheSameResultsAsBytes) {
  const std::string key = absl::StrCat("/attnd-test-", getpid());
  auto mem = client::SharedMemory::Create(key, 8 << 20);
  ASSERT_TRUE(mem.ok()) << mem.status();
  // Over TCP shared memory is refused; over the Unix-socket listener it works.
  const absl::Status tcp = client_->RegisterSharedMemory("worker0", key, 0, 8 << 20);
  EXPECT_EQ(tcp.code(), absl::StatusCode::kPermissionDenied) << tcp;
  EXPECT_NE(tcp.message().find("Unix-socket"), std::string::npos) << tcp;
  client_ = Client::Connect("unix:" + SocketPath("service"));
  ASSERT_TRUE(client_->RegisterSharedMemory("worker0", key, 0, 8 << 20).ok());
  EXPECT_EQ(client_->RegisterSharedMemory("worker0", key, 0, 16).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(client_->RegisterSharedMemory("nokey", "/attnd-no-such-object", 0, 16).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->RegisterSharedMemory("toolong", key, 0, 16 << 20).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->RegisterSharedMemory("overflow", key, INT64_MAX - 8, 16).code(),
            absl::StatusCode::kInvalidArgument);
  Open("shm-a");
  Open("shm-b");
  auto stream = client_->OpenStream();
  for (int64_t q : {37, 1, 1}) {
    auto g = client::GenerateStep(spec_, q, DType::kBF16, false, rng_);
    auto want = RunStep(nullptr, {{"shm-b", q}}, g);
    ASSERT_TRUE(want.ok());
    Commit({{"shm-b", q}}, g);
    ASSERT_TRUE(stream->Begin({{"shm-a", q}}).ok());
    int64_t offset = 0;
    const int64_t out_bytes = q * spec_.num_heads * spec_.kv_lora_rank * 2;
    for (size_t l = 0; l < g.size(); ++l) {
      const v1::LayerInputs in = ToShm(g[l].wire, **mem, "worker0", &offset, out_bytes);
      auto o = stream->Layer(in);
      ASSERT_TRUE(o.ok()) << o.status();
      EXPECT_TRUE(o->out().data().empty());  // the bytes went to shared memory
      EXPECT_EQ(o->out().shm().region(), "worker0");
      v1::Tensor t = o->out();
      t.set_data((*mem)->data() + in.out_shm().offset(), out_bytes);
      t.clear_shm();
      EXPECT_EQ(Decode(t), (*want)[l]) << "layer " << l;
    }
    Commit({{"shm-a", q}}, g);
  }
  EXPECT_TRUE(stream->Close().ok());
  // Bad references: unknown region, a range past the region, both data and shm.
  auto g = client::GenerateStep(spec_, 1, DType::kBF16, false, rng_);
  struct Case {
    std::function<void(v1::LayerInputs&)> mutate;
    absl::StatusCode code;
    const char* needle;
  };
  const std::vector<Case> cases = {
      {[](v1::LayerInputs& in) { in.mutable_q_latent()->mutable_shm()->set_region("nope"); },
       absl::StatusCode::kNotFound, "q_latent: shared memory region 'nope' not registered"},
      {[](v1::LayerInputs& in) { in.mutable_k_rope()->mutable_shm()->set_offset(8 << 20); },
       absl::StatusCode::kInvalidArgument, "k_rope: offset"},
      {[](v1::LayerInputs& in) { in.mutable_kv_latent()->set_data("xx"); },
       absl::StatusCode::kInvalidArgument, "kv_latent: both data and shm"},
      {[](v1::LayerInputs& in) { in.mutable_out_shm()->set_byte_size(3); },
       absl::StatusCode::kInvalidArgument, "out_shm: byte_size 3"},
  };
  const int64_t before = Length("shm-a");
  for (const auto& c : cases) {
    int64_t offset = 0;
    v1::LayerInputs in =
        ToShm(g[0].wire, **mem, "worker0", &offset, spec_.num_heads * spec_.kv_lora_rank * 2);
    c.mutate(in);
    auto b = client_->BeginStep({{"shm-a", 1}});
    ASSERT_TRUE(b.ok());
    auto st = client_->AttendLayer(b->step_id(), in).status();
    EXPECT_EQ(st.code(), c.code) << st;
    EXPECT_NE(st.message().find(c.needle), std::string::npos) << st;
  }
  EXPECT_EQ(Length("shm-a"), before);
  EXPECT_TRUE(client_->UnregisterSharedMemory("worker0").ok());
  EXPECT_EQ(client_->UnregisterSharedMemory("worker0").code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(client_->CloseSequence("shm-a").ok());
  EXPECT_TRUE(client_->CloseSequence("shm-b").ok());
}

TEST_F(ServiceTest, HandOffMovesASequenceToAnotherServerExactly) {
  ServerProcess other(ATTND_BINARY,
                      {"--model=tiny", "--kv-pages=100", "--threads=1", "--metrics-port=0"});
  auto to = Client::Connect(other.target());
  Open("ho");
  auto g = client::GenerateStep(spec_, 70, DType::kBF16, false, rng_);
  ASSERT_TRUE(RunStep(nullptr, {{"ho", 70}}, g).ok());
  Commit({{"ho", 70}}, g);
  Open("ho-twin", "ho", 70);
  // Small chunks: several write-only steps on the receiver, the last one partial.
  ASSERT_TRUE(client::HandOffSequence(*client_, *to, "ho", 32).ok());
  auto there = to->DescribeSequence("ho");
  ASSERT_TRUE(there.ok()) << there.status();
  EXPECT_EQ(there->length(), 70);
  // The moved sequence computes exactly what its twin here computes.
  auto step = client::GenerateStep(spec_, 2, DType::kBF16, false, rng_);
  auto here = RunStep(nullptr, {{"ho-twin", 2}}, step);
  auto b = to->BeginStep({{"ho", 2}});
  ASSERT_TRUE(here.ok() && b.ok());
  for (size_t l = 0; l < step.size(); ++l) {
    auto o = to->AttendLayer(b->step_id(), step[l].wire);
    ASSERT_TRUE(o.ok()) << o.status();
    EXPECT_EQ(Decode(o->out()), (*here)[l]) << "layer " << l;
  }
  Commit({{"ho-twin", 2}}, step);
  // Errors: unknown source sequence (and nothing left behind), an id already on the target.
  EXPECT_EQ(client::HandOffSequence(*client_, *to, "nope").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(to->DescribeSequence("nope").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client::HandOffSequence(*client_, *to, "ho").code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(Length("ho"), 70);  // the source is untouched
  EXPECT_EQ(other.Stop(), 0);
  EXPECT_TRUE(client_->CloseSequence("ho").ok());
  EXPECT_TRUE(client_->CloseSequence("ho-twin").ok());
}

TEST_F(ServiceTest, ShutdownAnswersAShardThatWaitsForAnotherShard) {
  // No idle expiry: only the shutdown grace period can answer the waiting shard. The drain first
  // waits --drain-timeout-ms for the open step (peers or none), then the grace period runs.
  auto other = std::make_unique<ServerProcess>(
      ATTND_BINARY, std::vector<std::string>{"--model=tiny", "--kv-pages=64", "--threads=1",
                                             "--metrics-port=0", "--step-idle-timeout-ms=0",
                                             "--drain-timeout-ms=500", "--shutdown-grace-ms=300"});
  auto c = Client::Connect(other->target());
  ASSERT_TRUE(c->OpenSequence("wait").ok());
  auto b = c->BeginStep({{"wait", 1}}, false, 2);
  ASSERT_TRUE(b.ok()) << b.status();
  auto g = client::GenerateStep(spec_, 1, DType::kBF16, false, rng_);
  absl::Status parked;
  std::thread shard0(
      [&] { parked = c->AttendLayer(b->step_id(), ShardOf(g[0].wire, 2, 0)).status(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(other->Stop(), 0);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
  shard0.join();
  EXPECT_FALSE(parked.ok());
}

TEST_F(ServiceTest, ServerInfoDescribesModelAndCapacity) {
  auto info = client_->Info();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->model().name(), "tiny");
  EXPECT_EQ(info->model().layers_size(), 4);
  EXPECT_EQ(info->backend(), "cpu");
  ASSERT_EQ(info->devices_size(), 1);
  EXPECT_EQ(info->devices(0).pages_total(), 399);
  EXPECT_EQ(info->max_message_bytes(), kMaxMessage);
  EXPECT_TRUE(client_->Echo("ping", 1000).ok());
}

}  // namespace
}  // namespace attnd::testing
