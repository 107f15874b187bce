// Context parallelism over gRPC (docs/numerics.md): the C++ client's ContextParallelSequence drives
// a sequence split over 2 and 3 real attnd servers on loopback and gets, through chunked prefill
// and decode, the same outputs (fp32, <= 1e-5 relative L2) and attended keys as one server
// holding the whole sequence; bad context-parallel calls get precise statuses.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>

#include "client/context_parallel.h"
#include "client/workload.h"
#include "tests/server_process.h"

namespace attnd::testing {
namespace {

using client::Client;
using client::ContextParallelSequence;

std::string ModelFile(const std::string& selection) {
  const std::string path = "/tmp/attnd-cp-" + std::to_string(getpid()) + "-" +
                           selection.substr(0, selection.find(':')) + ".json";
  std::ofstream(path) << R"({"base": "tiny", "name": "cp", "layers": "FSFD", "selection": ")"
                      << selection << R"(", "page_union_max_pages": 3})";
  return path;
}

double RelL2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double{a[i]} - b[i]) * (double{a[i]} - b[i]);
    den += double{b[i]} * b[i];
  }
  return std::sqrt(num / den);
}

class ContextParallelService : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(ContextParallelService, EqualsOneServerHoldingItAll) {
  const auto [selection, parts] = GetParam();
  const std::string model = ModelFile(selection);
  const std::vector<std::string> args = {"--model-file=" + model, "--cache-dtype=fp32",
                                         "--kv-pages=64", "--threads=1", "--metrics-port=0"};
  std::vector<std::unique_ptr<ServerProcess>> procs;
  std::vector<std::unique_ptr<Client>> clients;
  for (int k = 0; k <= parts; ++k) {
    procs.push_back(std::make_unique<ServerProcess>(AttndBinary(ATTND_BINARY), args));
    clients.push_back(Client::Connect(procs.back()->target()));
  }
  Client& whole = *clients[parts];
  auto info = whole.Info();
  ASSERT_TRUE(info.ok());
  auto spec = ModelSpecFromProto(info->model());
  ASSERT_TRUE(spec.ok()) << spec.status();
  std::vector<Client*> servers;
  for (int k = 0; k < parts; ++k) servers.push_back(clients[k].get());
  const std::vector<int64_t> starts =
      parts == 2 ? std::vector<int64_t>{0, 48} : std::vector<int64_t>{0, 32, 64};
  ContextParallelSequence seq(servers, starts, "s");
  ASSERT_TRUE(seq.Open().ok());
  ASSERT_TRUE(whole.OpenSequence("s").ok());
  // Prefill in chunks that end at the boundaries, then decode on the last server.
  const std::vector<int64_t> steps = parts == 2 ? std::vector<int64_t>{30, 18, 20, 1, 1, 1}
                                                : std::vector<int64_t>{32, 20, 12, 9, 1, 1};
  std::mt19937_64 rng(11);
  double worst = 0;
  int sparse = 0;
  for (int64_t q : steps) {
    auto layers = client::GenerateStep(*spec, q, DType::kF32, false, rng);
    std::vector<v1::LayerInputs> wire;
    for (auto& l : layers) wire.push_back(l.wire);
    auto got = seq.Step(q, wire, true);
    ASSERT_TRUE(got.ok()) << got.status();
    auto b = whole.BeginStep({{"s", q}});
    ASSERT_TRUE(b.ok());
    for (size_t l = 0; l < wire.size(); ++l) {
      v1::LayerInputs in = wire[l];
      in.set_return_attended(true);
      auto ref = whole.AttendLayer(b->step_id(), in);
      ASSERT_TRUE(ref.ok()) << ref.status();
      auto want = client::TensorValues(ref->out());
      ASSERT_TRUE(want.ok());
      const auto& r = (*got)[l];
      ASSERT_EQ(r.out.size(), want->size());
      const double err = RelL2(r.out, *want);
      ASSERT_FALSE(std::isnan(err));
      EXPECT_LE(err, 1e-5) << "layer " << l << " q " << q;
      worst = std::max(worst, err);
      for (int64_t t = 0; t < q; ++t) {
        const auto& keys = ref->attended(t).positions();
        EXPECT_EQ(r.attended[t], std::vector<int32_t>(keys.begin(), keys.end()))
            << "layer " << l << " query " << t;
        sparse += l != 3 && keys.size() < static_cast<int>(keys[keys.size() - 1] + 1);
      }
    }
  }
  EXPECT_GT(worst, 0.0);
  EXPECT_GT(sparse, 0) << "some queries attended a real selection";
  EXPECT_EQ(seq.length(), whole.DescribeSequence("s")->length());
  // A chunk across a boundary is refused before anything is sent.
  if (parts == 3) {
    auto fresh = ContextParallelSequence(servers, starts, "t");
    ASSERT_TRUE(fresh.Open().ok());
    auto layers = client::GenerateStep(*spec, 40, DType::kF32, false, rng);
    std::vector<v1::LayerInputs> wire;
    for (auto& l : layers) wire.push_back(l.wire);
    auto bad = fresh.Step(40, wire);
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(bad.status().message().find("split the chunk"), std::string::npos);
    EXPECT_TRUE(fresh.Close().ok());
  }
  EXPECT_TRUE(seq.Close().ok());
  std::remove(model.c_str());
}

INSTANTIATE_TEST_SUITE_P(Modes, ContextParallelService,
                         ::testing::Values(std::make_tuple("token", 2), std::make_tuple("token", 3),
                                           std::make_tuple("page_union", 3),
                                           std::make_tuple("page_budget:2", 2)),
                         [](const auto& info) {
                           std::string m = std::get<0>(info.param);
                           return m.substr(0, m.find(':')) + "_" +
                                  std::to_string(std::get<1>(info.param));
                         });

TEST(ContextParallelService, BadCallsGetPreciseStatuses) {
  const std::string model = ModelFile("token");
  ServerProcess proc(AttndBinary(ATTND_BINARY),
                     {"--model-file=" + model, "--kv-pages=32", "--threads=1", "--metrics-port=0"});
  auto c = Client::Connect(proc.target());
  ASSERT_TRUE(c->OpenSequence("s").ok());
  auto spec = ModelSpecFromProto(c->Info()->model());
  std::mt19937_64 rng(3);
  auto layers = client::GenerateStep(*spec, 4, DType::kBF16, false, rng);
  // The driver checks what each server serves before it opens anything.
  EXPECT_TRUE(c->Info()->context_parallel());
  ContextParallelSequence misaligned({c.get(), c.get()}, {0, 20}, "m");
  EXPECT_EQ(misaligned.Open().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(c->DescribeSequence("m").ok());
  // Candidates on an ordinary step.
  auto b = c->BeginStep({{"s", 4}});
  v1::LayerInputs in = layers[0].wire;
  in.set_return_candidates(true);
  auto r = c->AttendLayer(b->step_id(), in);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  // Offsets on an ordinary step; a sharded context-parallel step.
  v1::BeginStepRequest req = client::MakeBeginRequest({{"s", 4}});
  req.mutable_batch(0)->set_position_offset(16);
  EXPECT_EQ(c->BeginStep(req).status().code(), absl::StatusCode::kInvalidArgument);
  req.set_context_parallel(true);
  req.set_num_shards(2);
  EXPECT_EQ(c->BeginStep(req).status().code(), absl::StatusCode::kInvalidArgument);
  // A candidates call that also asks for the lse; then a full layer without its candidates.
  req.set_num_shards(0);
  b = c->BeginStep(req);
  ASSERT_TRUE(b.ok()) << b.status();
  in.set_return_lse(true);
  r = c->AttendLayer(b->step_id(), in);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("attends nothing"), std::string::npos);
  b = c->BeginStep(req);
  ASSERT_TRUE(b.ok());
  r = c->AttendLayer(b->step_id(), layers[0].wire);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_EQ(c->DescribeSequence("s")->length(), 0);
  // Still serving: the same step, done right.
  b = c->BeginStep(req);
  ASSERT_TRUE(b.ok());
  for (size_t l = 0; l < layers.size(); ++l) {
    v1::LayerInputs mine = layers[l].wire;
    if (mine.has_index_q()) {
      v1::LayerInputs cand = mine;
      cand.clear_q_latent();
      cand.clear_q_rope();
      cand.set_return_candidates(true);
      auto got = c->AttendLayer(b->step_id(), cand);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(got->candidates().count_size(), 4);
      mine.clear_kv_latent();
      mine.clear_k_rope();
      mine.clear_index_k();
      mine.clear_index_q();
      mine.clear_index_w();
      *mine.mutable_selection() = got->candidates();
    }
    auto out = c->AttendLayer(b->step_id(), mine);
    ASSERT_TRUE(out.ok()) << l << ": " << out.status();
  }
  EXPECT_EQ(c->DescribeSequence("s")->length(), 4);
  std::remove(model.c_str());
}

}  // namespace
}  // namespace attnd::testing
