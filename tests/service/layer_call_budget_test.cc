// The layer call's budget (docs/architecture.md, "the layer path"): one call of one layer takes
// one step lookup and at most two acquisitions of the engine's lock, on the thread that receives
// it and the thread that runs it together, with standby replicas or without. Counted by the
// engine's mutex itself (engine/engine_mutex.h), per thread, through the service in-process.
#include <gtest/gtest.h>

#include <future>
#include <random>

#include "client/workload.h"
#include "cluster/replication.h"
#include "engine/engine_mutex.h"
#include "metrics/metrics.h"
#include "service/attention_service.h"
#include "service/executor.h"
#include "service/service_metrics.h"
#include "tests/in_process_service.h"
#include "tests/server_process.h"

namespace attnd::testing {
namespace {

EngineCallCounts operator-(const EngineCallCounts& a, const EngineCallCounts& b) {
  return {a.lock_acquisitions - b.lock_acquisitions, a.step_lookups - b.step_lookups};
}
EngineCallCounts operator+(const EngineCallCounts& a, const EngineCallCounts& b) {
  return {a.lock_acquisitions + b.lock_acquisitions, a.step_lookups + b.step_lookups};
}

class LayerCallBudget : public ::testing::Test {
 protected:
  void Start(const std::string& standby) {
    s_ = std::make_unique<InProcessService>(TinyEngine(64, 1), 1);
    engine_ = s_->engine.get();
    svc_ = s_->service.get();
    if (!standby.empty()) {
      ReplicationOptions ro;
      ro.mode = ReplicationOptions::Mode::kSync;
      ro.peers = {standby};
      ro.self_name = "primary";
      ro.ack_timeout = std::chrono::milliseconds(5000);
      replicator_ = Replicator::Create(engine_, ro).value();
      svc_->SetReplicator(replicator_.get());
    }
  }
  void TearDown() override {
    replicator_.reset();
    s_.reset();
  }

  // What the executor's one thread has counted so far.
  EngineCallCounts OnExecutor() {
    std::promise<EngineCallCounts> p;
    s_->executor.Post([&] { p.set_value(EngineMutex::CountsOnThisThread()); });
    return p.get_future().get();
  }

  // Runs every layer of a step over `batch`; checks each call's count, returns the protections
  // of its last layer.
  std::vector<std::string> Step(const std::vector<std::pair<std::string, int64_t>>& batch) {
    v1::BeginStepRequest begin;
    int64_t tokens = 0;
    for (const auto& [id, q] : batch) {
      v1::BatchEntry* e = begin.add_batch();
      e->set_sequence_id(id);
      e->set_q_len(q);
      tokens += q;
    }
    v1::BeginStepResponse resp;
    auto step = svc_->Begin(caller_, begin, &resp);
    EXPECT_TRUE(step.ok()) << step.status();
    if (!step.ok()) return {};
    auto g = client::GenerateStep(engine_->spec(), tokens, DType::kBF16, false, rng_);
    v1::LayerOutput out;
    for (size_t l = 0; l < g.size(); ++l) {
      out.Clear();
      const EngineCallCounts exec0 = OnExecutor(), here0 = EngineMutex::CountsOnThisThread();
      std::promise<absl::Status> done;
      svc_->LayerAsync(caller_, StepRef(*step), &g[l].wire, &out, Transport::kStream,
                       [&](absl::Status s) { done.set_value(s); });
      const absl::Status s = done.get_future().get();
      const EngineCallCounts used =
          (EngineMutex::CountsOnThisThread() - here0) + (OnExecutor() - exec0);
      EXPECT_TRUE(s.ok()) << "layer " << l << ": " << s;
      EXPECT_EQ(out.committed(), l + 1 == g.size());
      EXPECT_EQ(used.step_lookups, 1) << "layer " << l;
      EXPECT_LE(used.lock_acquisitions, 2) << "layer " << l;
      EXPECT_GE(used.lock_acquisitions, 1) << "layer " << l << ": the counter counts nothing?";
    }
    return {out.protection().begin(), out.protection().end()};
  }

  void Open(const std::string& id) {
    v1::OpenSequenceRequest q;
    q.set_sequence_id(id);
    v1::SequenceInfo info;
    ASSERT_TRUE(svc_->DoOpenSequence(caller_, q, &info).ok());
  }

  std::unique_ptr<InProcessService> s_;
  Engine* engine_ = nullptr;
  AttentionService* svc_ = nullptr;
  std::unique_ptr<Replicator> replicator_;
  Caller caller_;
  std::mt19937_64 rng_{7};
};

TEST_F(LayerCallBudget, OneLookupAndAtMostTwoLockAcquisitionsALayer) {
  Start("");
  Open("a");
  Open("b");
  Step({{"a", 20}, {"b", 13}});  // prefill
  Step({{"a", 1}, {"b", 1}});    // decode
  // A refused call counts too: a layer out of order is one lookup, and aborts the step.
  v1::BeginStepRequest begin;
  v1::BatchEntry* e = begin.add_batch();
  e->set_sequence_id("a");
  e->set_q_len(1);
  v1::BeginStepResponse resp;
  auto step = svc_->Begin(caller_, begin, &resp);
  ASSERT_TRUE(step.ok()) << step.status();
  auto g = client::GenerateStep(engine_->spec(), 1, DType::kBF16, false, rng_);
  const EngineCallCounts exec0 = OnExecutor();
  std::promise<absl::Status> done;
  v1::LayerOutput out;
  svc_->LayerAsync(caller_, StepRef(*step), &g[1].wire, &out, Transport::kUnary,
                   [&](absl::Status s) { done.set_value(s); });
  EXPECT_EQ(done.get_future().get().code(), absl::StatusCode::kFailedPrecondition);
  const EngineCallCounts used = OnExecutor() - exec0;
  EXPECT_EQ(used.step_lookups, 1);
  EXPECT_LE(used.lock_acquisitions, 2);
}

TEST_F(LayerCallBudget, AStandbyPeerAddsNoLookupAndNoLock) {
  ServerProcess standby(ATTND_BINARY,
                        {"--model=tiny", "--kv-pages=64", "--threads=1", "--metrics-port=0"});
  Start(standby.target());
  // The standby answers ServerInfo before the replicator ranks it.
  for (int i = 0; i < 500 && replicator_->Stats().peers.empty(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_FALSE(replicator_->Stats().peers.empty()) << "the standby never answered";
  Open("a");
  Open("b");
  // Sync replication: the committing layer's reply waits for the standby, and says so.
  EXPECT_EQ(Step({{"a", 20}, {"b", 13}}), (std::vector<std::string>{"replicated", "replicated"}));
  EXPECT_EQ(Step({{"a", 1}, {"b", 1}}), (std::vector<std::string>{"replicated", "replicated"}));
  EXPECT_EQ(standby.Stop(), 0);
}

}  // namespace
}  // namespace attnd::testing
