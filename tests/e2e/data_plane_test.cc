// The C++ client on the UCX data plane (docs/data-plane.md), against real attnd processes: the
// fallback to bytes when a server has no plane, outputs landing in the caller's buffer with the
// same bits as the reply's, pushed and pulled outputs alike, layer calls kept in flight with
// LayerAsync, and a plane the server no longer holds replaced after the one call it fails (that
// call's step aborted, nothing changed). (Every layer-call test of service_test runs over the plane
// too: ctest's ucx.* tests.)
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/attnd_client.h"
#include "client/data_plane_session.h"
#include "client/workload.h"
#include "tests/server_process.h"

namespace attnd::testing {
namespace {

using client::Client;

std::vector<std::string> PlaneArgs(const std::string& tag) {
  std::vector<std::string> a = SharedServerArgs(tag, 400, 4 << 20);
  a.push_back("--data-plane=ucx");
  a.push_back("--data-plane-timeout-ms=500");
  a.push_back("--data-plane-push=true");  // ctest's ucx.* pass covers pulls
  return a;
}

class DataPlaneTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { server_ = new ServerProcess(ATTND_BINARY, PlaneArgs("plane")); }
  static void TearDownTestSuite() {
    EXPECT_EQ(server_->Stop(), 0);
    delete server_;
  }
  void SetUp() override {
    client_ = Client::Connect(server_->target());
    auto info = client_->Info();
    ASSERT_TRUE(info.ok()) << info.status();
    spec_ = ModelSpecFromProto(info->model()).value();
  }
  // Whether `c` has a plane within 10 s (under "auto" a call that finds none connects one in the
  // background: that call and those before the plane is ready go as bytes).
  static bool GetsAPlane(Client& c) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (c.DataPlaneName().empty() && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    return c.DataPlaneName().rfind("ucx-", 0) == 0;
  }
  // Opens `id` and runs a step of `tokens` over all layers; returns the last layer's output.
  std::string Step(Client& c, const std::string& id, int64_t tokens) {
    auto g = client::GenerateStep(spec_, tokens, DType::kBF16, false, rng_);
    auto b = c.BeginStep({{id, tokens}});
    EXPECT_TRUE(b.ok()) << b.status();
    std::string out;
    for (const auto& l : g) {
      auto o = c.AttendLayer(b->step_id(), l.wire);
      EXPECT_TRUE(o.ok()) << o.status();
      if (o.ok()) out = o->out().data();
    }
    return out;
  }
  static ServerProcess* server_;
  std::unique_ptr<Client> client_;
  ModelSpec spec_;
  std::mt19937_64 rng_{7};
};
ServerProcess* DataPlaneTest::server_ = nullptr;

TEST_F(DataPlaneTest, AClientUsesThePlaneWhenOfferedAndBytesWhenNot) {
  ASSERT_TRUE(client_->OpenSequence("auto-1").ok());
  EXPECT_FALSE(Step(*client_, "auto-1", 3).empty());
  EXPECT_TRUE(GetsAPlane(*client_)) << "auto: connected after the first call";
  EXPECT_FALSE(Step(*client_, "auto-1", 1).empty());  // over it
  ServerProcess plain(ATTND_BINARY, SharedServerArgs("plain", 400, 4 << 20));
  auto other = Client::Connect(plain.target());
  ASSERT_TRUE(other->OpenSequence("auto-2").ok());
  EXPECT_FALSE(Step(*other, "auto-2", 3).empty());
  EXPECT_EQ(other->DataPlaneName(), "") << "no plane offered: bytes in the messages";
  EXPECT_EQ(other->ConnectDataPlane().code(), absl::StatusCode::kFailedPrecondition);
  other.reset();
  EXPECT_EQ(plain.Stop(), 0);
}

TEST_F(DataPlaneTest, OutputsLandInTheCallersBufferWithTheRepliesBits) {
  client::ConnectOptions off;
  off.data_plane = "off";
  auto bytes = Client::Connect(server_->target(), off).value();
  ASSERT_TRUE(client_->ConnectDataPlane().ok());
  for (const char* id : {"buf-plane", "buf-bytes"}) ASSERT_TRUE(client_->OpenSequence(id).ok());
  auto g = client::GenerateStep(spec_, 4, DType::kBF16, false, rng_);
  auto s1 = client_->OpenStream();
  auto s2 = bytes->OpenStream();
  ASSERT_TRUE(s1->Begin({{"buf-plane", 4}}).ok());
  ASSERT_TRUE(s2->Begin({{"buf-bytes", 4}}).ok());
  for (const auto& l : g) {
    auto want = s2->Layer(l.wire);
    ASSERT_TRUE(want.ok()) << want.status();
    const std::string& w = want->out().data();
    std::string got(w.size(), '\0');
    auto o = s1->Layer(l.wire, got.data(), got.size());
    ASSERT_TRUE(o.ok()) << o.status();
    EXPECT_TRUE(o->out().data().empty()) << "the output is in the caller's buffer";
    EXPECT_EQ(got, w);
  }
  EXPECT_FALSE(client_->DataPlaneName().empty());
  // The wrong size: refused (the layer ran; the step is the caller's to abort).
  ASSERT_TRUE(s1->Begin({{"buf-plane", 4}}).ok());
  std::string small(16, '\0');
  EXPECT_EQ(s1->Layer(g[0].wire, small.data(), small.size()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(DataPlaneTest, OutputsPushedAndOutputsPulledHaveTheSameBits) {
  // This suite's server pushes each output as it is built (the client gave its worker's
  // address); one with --data-plane-push=false leaves the client to pull it after the reply.
  std::vector<std::string> args = PlaneArgs("pull");
  args.push_back("--data-plane-push=false");
  ServerProcess pulled(ATTND_BINARY, args);
  auto other = Client::Connect(pulled.target());
  ASSERT_TRUE(client_->ConnectDataPlane().ok());
  ASSERT_TRUE(other->ConnectDataPlane().ok());
  for (Client* c : {client_.get(), other.get()}) ASSERT_TRUE(c->OpenSequence("push-pull").ok());
  for (int64_t tokens : {3, 1}) {
    auto g = client::GenerateStep(spec_, tokens, DType::kBF16, false, rng_);
    auto a = client_->BeginStep({{"push-pull", tokens}});
    auto b = other->BeginStep({{"push-pull", tokens}});
    ASSERT_TRUE(a.ok() && b.ok());
    for (const auto& l : g) {
      auto x = client_->AttendLayer(a->step_id(), l.wire);
      auto y = other->AttendLayer(b->step_id(), l.wire);
      ASSERT_TRUE(x.ok() && y.ok()) << x.status() << y.status();
      ASSERT_FALSE(x->out().data().empty());
      EXPECT_EQ(x->out().data(), y->out().data());
    }
  }
  EXPECT_EQ(other->DataPlaneName().rfind("ucx-", 0), 0u);
  other.reset();
  EXPECT_EQ(pulled.Stop(), 0);
}

TEST_F(DataPlaneTest, LayerAsyncKeepsTwoMicroBatchesInFlightInOrder) {
  for (const char* id : {"mb-0", "mb-1"}) ASSERT_TRUE(client_->OpenSequence(id).ok());
  auto s0 = client_->OpenStream(), s1 = client_->OpenStream();
  for (int step = 0; step < 3; ++step) {
    auto g0 = client::GenerateStep(spec_, 2, DType::kBF16, false, rng_);
    auto g1 = client::GenerateStep(spec_, 2, DType::kBF16, false, rng_);
    ASSERT_TRUE(s0->Begin({{"mb-0", 2}}).ok());
    ASSERT_TRUE(s1->Begin({{"mb-1", 2}}).ok());
    // Every layer of both queued at once: each stream runs its own in order.
    std::vector<std::future<absl::StatusOr<v1::LayerOutput>>> f0, f1;
    for (size_t l = 0; l < g0.size(); ++l) {
      f0.push_back(s0->LayerAsync(g0[l].wire));
      f1.push_back(s1->LayerAsync(g1[l].wire));
    }
    for (size_t l = 0; l < g0.size(); ++l) {
      auto a = f0[l].get(), b = f1[l].get();
      ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
      EXPECT_EQ(a->layer(), static_cast<int>(l));
      EXPECT_EQ(a->committed(), l + 1 == g0.size());
      EXPECT_EQ(b->committed(), l + 1 == g0.size());
    }
  }
  EXPECT_EQ(client_->DescribeSequence("mb-0")->length(), 6);
  EXPECT_EQ(client_->DescribeSequence("mb-1")->length(), 6);
}

TEST_F(DataPlaneTest, APlaneTheServerNoLongerHoldsFailsOneCallThenIsReplaced) {
  ASSERT_TRUE(client_->ConnectDataPlane().ok());
  const std::string first = client_->DataPlaneName();
  ASSERT_TRUE(client_->OpenSequence("dropped").ok());
  Step(*client_, "dropped", 2);
  {  // as the server does to a plane idle too long
    grpc::ClientContext ctx;
    client_->PrepareUnary(&ctx);
    v1::CloseDataPlaneRequest req;
    req.set_plane(first);
    v1::CloseDataPlaneResponse resp;
    ASSERT_TRUE(client_->stub()->CloseDataPlane(&ctx, req, &resp).ok());
  }
  auto g = client::GenerateStep(spec_, 1, DType::kBF16, false, rng_);
  auto b = client_->BeginStep({{"dropped", 1}});
  ASSERT_TRUE(b.ok());
  auto o = client_->AttendLayer(b->step_id(), g[0].wire);
  EXPECT_EQ(o.status().code(), absl::StatusCode::kNotFound) << o.status();
  EXPECT_EQ(client_->DescribeSequence("dropped")->length(), 2) << "its step aborted";
  EXPECT_FALSE(Step(*client_, "dropped", 1).empty());  // a new plane
  EXPECT_NE(client_->DataPlaneName(), first);
  EXPECT_EQ(client_->DataPlaneName().rfind("ucx-", 0), 0u);
  EXPECT_EQ(client_->DescribeSequence("dropped")->length(), 3);
}

TEST_F(DataPlaneTest, ACancelledStreamEndsItsQueuedLayersAndLeavesThePlaneToOthers) {
  // Cancel (from another thread, as a worker giving up on a micro-batch does) while layers are
  // queued: it waits for the one running, the rest end at once, nothing uses the stream's gRPC
  // call at the same time, and they say CANCELLED.
  ASSERT_TRUE(client_->OpenSequence("cancelled").ok());
  auto s = client_->OpenStream();
  auto g = client::GenerateStep(spec_, 2, DType::kBF16, false, rng_);
  ASSERT_TRUE(s->Begin({{"cancelled", 2}}).ok());
  std::vector<std::future<absl::StatusOr<v1::LayerOutput>>> f;
  // All but the last layer (which commits): the step stays open whenever the cancel comes.
  for (size_t i = 0; i + 1 < g.size(); ++i) f.push_back(s->LayerAsync(g[i].wire));
  std::thread canceller([&] { s->Cancel(); });
  canceller.join();
  auto after = s->LayerAsync(g.back().wire);  // queued after the cancel: ends at once
  ASSERT_EQ(after.wait_for(std::chrono::seconds(0)), std::future_status::ready);
  EXPECT_EQ(after.get().status().code(), absl::StatusCode::kCancelled);
  for (auto& r : f) {
    ASSERT_EQ(r.wait_for(std::chrono::seconds(0)), std::future_status::ready);
    auto out = r.get();  // those that ran before the cancel went through
    if (!out.ok()) {
      EXPECT_EQ(out.status().code(), absl::StatusCode::kCancelled) << out.status();
    }
  }
  EXPECT_EQ(client_->DescribeSequence("cancelled")->length(), 0) << "its step aborted";
  // A stream cancelled with no layer under way: its later calls send nothing and do not break
  // the plane every other call of the client shares (a layer in flight at a cancel does: its
  // outcome is unknown).
  EXPECT_FALSE(Step(*client_, "cancelled", 1).empty());
  ASSERT_TRUE(GetsAPlane(*client_));
  const std::string plane = client_->DataPlaneName();
  auto idle = client_->OpenStream();
  ASSERT_TRUE(idle->Begin({{"cancelled", 1}}).ok());
  idle->Cancel();
  auto late = idle->Layer(g[0].wire);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kCancelled) << late.status();
  EXPECT_FALSE(Step(*client_, "cancelled", 1).empty());
  EXPECT_EQ(client_->DataPlaneName(), plane) << "the cancelled stream broke the client's plane";
  EXPECT_EQ(client_->DescribeSequence("cancelled")->length(), 2);
}

TEST_F(DataPlaneTest, APlaneWhoseCallHasAnUnknownOutcomeStagesNoMoreCalls) {
  // A call the client gave up on (its deadline) may still be read and written by the server in
  // the plane's regions: the plane takes no more calls (they go as bytes, the client connects a
  // new plane), and the call's space is not given back (a call that took the plane before it
  // broke finishes on it).
  auto info = client_->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  auto session = client::DataPlaneSession::Connect(
      client_->stub(), *info, 1 << 20,
      [this](grpc::ClientContext* ctx) { client_->PrepareUnary(ctx); }, true);
  ASSERT_TRUE(session.ok()) << session.status();
  auto g = client::GenerateStep(spec_, 2, DType::kBF16, false, rng_);
  v1::LayerInputs a_wire, b_wire, c_wire;
  client::DataPlaneSession::Call b;
  {
    client::DataPlaneSession::Call a;
    ASSERT_TRUE((*session)->Stage(g[0].wire, &a_wire, &a));
    ASSERT_TRUE((*session)->Stage(g[0].wire, &b_wire, &b));
    EXPECT_FALSE((*session)->broken());
    (*session)->Failed(absl::DeadlineExceededError("Deadline Exceeded"));
    EXPECT_TRUE((*session)->broken());
  }
  client::DataPlaneSession::Call c;
  EXPECT_FALSE((*session)->Stage(g[0].wire, &c_wire, &c)) << "a broken plane staged a call";
  EXPECT_FALSE(c_wire.q_latent().has_shm());
}

}  // namespace
}  // namespace attnd::testing
