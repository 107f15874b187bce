// The service's own concurrency without a gRPC server, so ThreadSanitizer sees every thread
// (Debian's gRPC is uninstrumented): unsharded steps from several threads with aborts racing
// them, sharded steps whose shards arrive from different threads, and shared-memory regions
// registered, unregistered and shrunk while layers read them. Ends with a state audit.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <future>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/attnd_client.h"
#include "client/workload.h"
#include "metrics/metrics.h"
#include "service/attention_service.h"
#include "service/executor.h"
#include "service/service_metrics.h"
#include "tests/in_process_service.h"

namespace attnd::testing {
namespace {

class ServiceConcurrency : public ::testing::Test {
 protected:
  void SetUp() override {
    ServiceOptions so;
    so.shm_enabled = true;
    s_ = std::make_unique<InProcessService>(TinyEngine(400, 2), 4, so);
    engine_ = s_->engine.get();
    svc_ = s_->service.get();
    ASSERT_TRUE(caller_.ok()) << "socketpair";
  }
  void TearDown() override {
    EXPECT_EQ(engine_->ExpireIdleSteps(std::chrono::milliseconds(0)), 0) << "a step leaked";
    for (const auto& d : engine_->Capacity()) {
      EXPECT_EQ(d.sequences, 0);
      EXPECT_EQ(d.pages_free, d.pages_total) << "pages leaked";
    }
    EXPECT_TRUE(engine_->ReservedPageUntouched(0));
  }
  v1::BeginStepRequest Begin(const client::Batch& b, int shards = 0) {
    return client::MakeBeginRequest(b, false, shards);
  }
  void Open(const std::string& id) {
    v1::OpenSequenceRequest r;
    r.set_sequence_id(id);
    v1::SequenceInfo info;
    ASSERT_TRUE(svc_->DoOpenSequence(caller_, r, &info).ok());
  }
  void Close(const std::string& id) {
    v1::CloseSequenceRequest r;
    r.set_sequence_id(id);
    EXPECT_TRUE(svc_->DoCloseSequence(caller_, r).ok()) << id;
  }
  int64_t Length(const std::string& id) { return engine_->DescribeSequence(id)->length; }
  // Sequence prefix + t holds exactly the tokens of its committed steps; then it is closed.
  void ExpectCommittedAndClose(const std::string& prefix, const std::vector<int64_t>& committed) {
    for (size_t t = 0; t < committed.size(); ++t) {
      EXPECT_EQ(Length(absl::StrCat(prefix, t)), committed[t]);
      Close(absl::StrCat(prefix, t));
    }
  }

  std::unique_ptr<InProcessService> s_;
  Engine* engine_ = nullptr;
  AttentionService* svc_ = nullptr;
  LocalCaller caller_;
};

TEST_F(ServiceConcurrency, StepsFromManyThreadsWithRacingAbortsKeepEveryLength) {
  const ModelSpec& spec = engine_->spec();
  constexpr int kThreads = 4, kSteps = 25;
  std::vector<int64_t> committed(kThreads, 0);
  std::atomic<uint64_t> last_step{0};
  std::atomic<bool> done{false};
  for (int t = 0; t < kThreads; ++t) Open(absl::StrCat("c", t));
  // An aborter that keeps aborting whatever step was opened last.
  std::thread aborter([&] {
    std::mt19937 rng(1);
    while (!done) {
      v1::AbortStepRequest r;
      r.set_step_id(last_step.load());
      if (rng() % 3 == 0) (void)svc_->DoAbortStep(caller_, r);
      std::this_thread::sleep_for(std::chrono::microseconds(300));
    }
  });
  std::vector<std::thread> workers;
  for (int t = 0; t < kThreads; ++t)
    workers.emplace_back([&, t] {
      std::mt19937_64 rng(10 + t);
      const std::string id = absl::StrCat("c", t);
      for (int i = 0; i < kSteps; ++i) {
        const int64_t q = 1 + static_cast<int64_t>(rng() % 9);
        auto g = client::GenerateStep(spec, q, DType::kBF16, false, rng);
        v1::BeginStepResponse br;
        auto step = svc_->Begin(caller_, Begin({{id, q}}), &br);
        ASSERT_TRUE(step.ok()) << step.status();
        last_step = *step;
        bool ok = true;
        for (const auto& l : g) {
          v1::LayerOutput out;
          const absl::Status s = svc_->Layer(caller_, *step, l.wire, &out, Transport::kUnary);
          if (!s.ok()) {
            ASSERT_TRUE(s.code() == absl::StatusCode::kCancelled) << s;
            ok = false;
            break;
          }
        }
        if (ok) committed[t] += q;
      }
    });
  for (auto& w : workers) w.join();
  done = true;
  aborter.join();
  ExpectCommittedAndClose("c", committed);
}

TEST_F(ServiceConcurrency, ShardedStepsGatherShardsArrivingFromDifferentThreads) {
  const ModelSpec& spec = engine_->spec();
  const int S = 2, Hs = spec.num_heads / S;
  Open("sh");
  std::mt19937_64 rng(5);
  int64_t length = 0;
  for (int round = 0; round < 6; ++round) {
    const int64_t T = 1 + static_cast<int64_t>(rng() % 7);
    auto g = client::GenerateStep(spec, T, DType::kBF16, false, rng);
    v1::BeginStepResponse br;
    auto step = svc_->Begin(caller_, Begin({{"sh", T}}, S), &br);
    ASSERT_TRUE(step.ok()) << step.status();
    ASSERT_TRUE(svc_->Join(*step, 1).ok());
    // Each shard's slice of the heads; shard 0 also carries the keys.
    std::vector<std::vector<v1::LayerInputs>> in(S, std::vector<v1::LayerInputs>(g.size()));
    for (size_t l = 0; l < g.size(); ++l)
      for (int k = 0; k < S; ++k) {
        v1::LayerInputs& x = in[k][l];
        x.set_layer(static_cast<int>(l));
        x.set_shard(k);
        auto slice = [&](const v1::Tensor& t, v1::Tensor* o, int dim) {
          o->set_datatype(t.datatype());
          o->add_shape(T);
          o->add_shape(Hs);
          o->add_shape(dim);
          const size_t row = static_cast<size_t>(Hs) * dim * 2;
          for (int64_t i = 0; i < T; ++i)
            o->mutable_data()->append(t.data().substr((i * S + k) * row, row));
        };
        slice(g[l].wire.q_latent(), x.mutable_q_latent(), spec.kv_lora_rank);
        slice(g[l].wire.q_rope(), x.mutable_q_rope(), spec.qk_rope_head_dim);
        if (k == 0) {
          *x.mutable_kv_latent() = g[l].wire.kv_latent();
          *x.mutable_k_rope() = g[l].wire.k_rope();
          if (g[l].wire.has_index_q()) {
            *x.mutable_index_q() = g[l].wire.index_q();
            *x.mutable_index_k() = g[l].wire.index_k();
            *x.mutable_index_w() = g[l].wire.index_w();
          }
        }
      }
    std::vector<std::thread> shards;
    std::vector<absl::Status> status(S);
    for (int k = 0; k < S; ++k)
      shards.emplace_back([&, k] {
        for (size_t l = 0; l < g.size(); ++l) {
          v1::LayerOutput out;
          std::promise<absl::Status> p;
          svc_->LayerAsync(caller_, *step, &in[k][l], &out, Transport::kStream,
                           [&p](absl::Status s) { p.set_value(s); });
          status[k] = p.get_future().get();
          if (!status[k].ok()) return;
          EXPECT_EQ(out.out().data().size(), static_cast<size_t>(T * Hs * spec.kv_lora_rank * 2));
        }
      });
    for (auto& t : shards) t.join();
    for (int k = 0; k < S; ++k) ASSERT_TRUE(status[k].ok()) << k << ": " << status[k];
    length += T;
    EXPECT_EQ(Length("sh"), length);
  }
  Close("sh");
}

TEST_F(ServiceConcurrency, RegionsChangingUnderRunningLayersFailOnlyThoseCalls) {
  const ModelSpec& spec = engine_->spec();
  const std::string key = absl::StrCat("/attnd-conc-", getpid());
  auto mem = client::SharedMemory::Create(key, 1 << 20);
  ASSERT_TRUE(mem.ok());
  std::atomic<bool> done{false};
  // Registers, unregisters and shrinks the region while the workers use it.
  std::thread churn([&] {
    std::mt19937 rng(2);
    const int fd = shm_open(key.c_str(), O_RDWR, 0);
    while (!done) {
      v1::RegisterSharedMemoryRequest r;
      r.set_name("reg");
      r.set_key(key);
      r.set_byte_size(1 << 20);
      (void)svc_->DoRegisterSharedMemory(caller_, r);
      if (rng() % 2) {
        if (ftruncate(fd, rng() % 2 ? 0 : 1 << 20) != 0) break;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      if (rng() % 3 == 0) {
        v1::UnregisterSharedMemoryRequest u;
        u.set_name("reg");
        (void)svc_->DoUnregisterSharedMemory(caller_, u);
      }
    }
    if (ftruncate(fd, 1 << 20) != 0) ADD_FAILURE() << "ftruncate";
    close(fd);
  });
  constexpr int kThreads = 3;
  std::vector<int64_t> committed(kThreads, 0);
  std::vector<std::thread> workers;
  for (int t = 0; t < kThreads; ++t) Open(absl::StrCat("m", t));
  for (int t = 0; t < kThreads; ++t)
    workers.emplace_back([&, t] {
      std::mt19937_64 rng(20 + t);
      const std::string id = absl::StrCat("m", t);
      for (int i = 0; i < 20; ++i) {
        const int64_t q = 1 + static_cast<int64_t>(rng() % 5);
        auto g = client::GenerateStep(spec, q, DType::kBF16, false, rng);
        v1::BeginStepResponse br;
        auto step = svc_->Begin(caller_, Begin({{id, q}}), &br);
        ASSERT_TRUE(step.ok()) << step.status();
        bool ok = true;
        for (auto& l : g) {
          // q_rope by shared memory at this worker's slot, the output into the region too.
          v1::LayerInputs in = l.wire;
          const int64_t off = t * 65536;
          // pwrite, not the mapping: the churn thread truncates the object (the test would get
          // SIGBUS through a mapping; the server never maps it).
          const int fd = shm_open(key.c_str(), O_RDWR, 0);
          ASSERT_GE(fd, 0);
          ASSERT_EQ(pwrite(fd, in.q_rope().data().data(), in.q_rope().data().size(), off),
                    static_cast<ssize_t>(in.q_rope().data().size()));
          close(fd);
          *in.mutable_q_rope() = client::ShmTensor(
              DType::kBF16, {q, spec.num_heads, spec.qk_rope_head_dim}, "reg", off);
          in.mutable_out_shm()->set_region("reg");
          in.mutable_out_shm()->set_offset(off + 32768);
          in.mutable_out_shm()->set_byte_size(q * spec.num_heads * spec.kv_lora_rank * 2);
          v1::LayerOutput out;
          const absl::Status s = svc_->Layer(caller_, *step, in, &out, Transport::kUnary);
          if (!s.ok()) {
            ASSERT_TRUE(s.code() == absl::StatusCode::kNotFound ||
                        s.code() == absl::StatusCode::kFailedPrecondition)
                << s;
            ok = false;
            break;
          }
        }
        if (ok) committed[t] += q;
      }
    });
  for (auto& w : workers) w.join();
  done = true;
  churn.join();
  ExpectCommittedAndClose("m", committed);
}

}  // namespace
}  // namespace attnd::testing
