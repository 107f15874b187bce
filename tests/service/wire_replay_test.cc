// Wire compatibility: requests recorded from a client of an earlier attnd (the file names the
// commit), with the replies that attnd gave, are replayed through today's service in-process
// (AttentionService's Do* calls and Layer: the same decoding and checks as over gRPC). Every
// reply must give an old client what the recorded one gave: the status code, and every field the
// recorded reply set (each LayerOutput field but server_seconds), bit for bit (the CPU backend's
// bits do not depend on threads or on AVX2 vs AVX-512); fields added to the proto since may be
// set beside them. A change to the proto or the layer path that breaks an old client fails here.
//
// Re-record only for a deliberate change of results:
//   wire_replay_test --record=tests/wire_corpus/v1_session.txt
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <random>
#include <sstream>

#include "absl/algorithm/container.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "client/attnd_client.h"
#include "client/workload.h"
#include "google/protobuf/util/message_differencer.h"
#include "kernels/cpu/cpu_isa.h"
#include "metrics/metrics.h"
#include "service/attention_service.h"
#include "service/executor.h"
#include "service/service_metrics.h"
#include "tests/in_process_service.h"

namespace attnd::testing {
namespace {

std::string g_record;  // --record=FILE: write the corpus instead of checking it

// One call of the session and what it answered.
struct Record {
  std::string kind;     // "open", "begin", "layer", "close"
  std::string request;  // the serialized request
  int code = 0;         // the status code
  std::string reply;    // the serialized reply (LayerOutput without server_seconds, ...)
};

class Session {
 public:
  Session() {
    s_ = std::make_unique<InProcessService>(TinyEngine(64, 1, "avx2"), 2);
    engine_ = s_->engine.get();
    svc_ = s_->service.get();
  }
  const ModelSpec& spec() const { return engine_->spec(); }

  // Runs one recorded (or to-be-recorded) call; fills code and reply.
  void Play(Record& r) {
    absl::Status s;
    std::string reply;
    if (r.kind == "open") {
      v1::OpenSequenceRequest q;
      EXPECT_TRUE(q.ParseFromString(r.request));
      v1::SequenceInfo info;
      s = svc_->DoOpenSequence(caller_, q, &info);
      reply = info.SerializeAsString();
    } else if (r.kind == "begin") {
      v1::BeginStepRequest q;
      EXPECT_TRUE(q.ParseFromString(r.request));
      v1::BeginStepResponse resp;
      auto step = svc_->Begin(caller_, q, &resp);
      s = step.status();
      if (step.ok()) step_ = *step;
      resp.clear_step_id();  // random
      reply = resp.SerializeAsString();
    } else if (r.kind == "layer") {
      v1::LayerInputs q;
      EXPECT_TRUE(q.ParseFromString(r.request));
      v1::LayerOutput out;
      s = svc_->Layer(caller_, StepRef(step_), q, &out, Transport::kUnary);
      out.clear_server_seconds();
      reply = out.SerializeAsString();
    } else if (r.kind == "close") {
      v1::CloseSequenceRequest q;
      EXPECT_TRUE(q.ParseFromString(r.request));
      s = svc_->DoCloseSequence(caller_, q);
    } else {
      ADD_FAILURE() << "unknown record kind " << r.kind;
    }
    r.code = static_cast<int>(s.code());
    r.reply = std::move(reply);
  }

 private:
  std::unique_ptr<InProcessService> s_;
  Engine* engine_ = nullptr;
  AttentionService* svc_ = nullptr;
  Caller caller_;
  uint64_t step_ = 0;
};

// The session the corpus holds: a prefill, decodes asking for the lse, the attended positions
// and an FP32 reply, an import (write-only step), and refused calls (a layer out of order, a
// write-only call with queries) whose statuses must stay the same.
std::vector<Record> MakeSession(const ModelSpec& spec) {
  std::mt19937_64 rng(2026);
  std::vector<Record> calls;
  auto add = [&](const char* kind, const google::protobuf::Message& m) {
    calls.push_back({kind, m.SerializeAsString(), 0, ""});
  };
  for (const char* id : {"a", "b"}) {
    v1::OpenSequenceRequest o;
    o.set_sequence_id(id);
    add("open", o);
  }
  auto step = [&](const char* id, int64_t q, bool write_only, auto&& edit) {
    add("begin", client::MakeBeginRequest({{id, q}}, write_only, 0));
    auto layers = client::GenerateStep(spec, q, DType::kBF16, write_only, rng);
    for (size_t l = 0; l < layers.size(); ++l) {
      edit(static_cast<int>(l), layers[l].wire);
      add("layer", layers[l].wire);
    }
  };
  step("a", 9, false, [](int, v1::LayerInputs&) {});
  step("a", 1, false, [](int, v1::LayerInputs& in) { in.set_return_lse(true); });
  step("a", 1, false, [](int, v1::LayerInputs& in) { in.set_return_attended(true); });
  step("a", 2, false, [](int, v1::LayerInputs& in) { in.set_out_datatype("FP32"); });
  step("b", 5, true, [](int, v1::LayerInputs&) {});
  // Refused: layer 1 first (out of order: the step aborts), then a write-only call with queries.
  {
    add("begin", client::MakeBeginRequest({{"a", 1}}, false, 0));
    auto layers = client::GenerateStep(spec, 1, DType::kBF16, false, rng);
    add("layer", layers[1].wire);
  }
  {
    add("begin", client::MakeBeginRequest({{"b", 1}}, true, 0));
    auto layers = client::GenerateStep(spec, 1, DType::kBF16, false, rng);
    add("layer", layers[0].wire);
  }
  step("b", 1, false, [](int, v1::LayerInputs& in) { in.set_return_lse(true); });
  for (const char* id : {"a", "b"}) {
    v1::CloseSequenceRequest c;
    c.set_sequence_id(id);
    add("close", c);
  }
  return calls;
}

// Whether today's reply gives an old client what the recorded one gave: every field the recorded
// reply set has the same value, bit for bit (fields added to the proto since may be set too:
// an old client skips them).
bool SameForAnOldClient(const std::string& kind, const std::string& want, const std::string& got) {
  std::unique_ptr<google::protobuf::Message> w, g;
  if (kind == "open") {
    w = std::make_unique<v1::SequenceInfo>();
  } else if (kind == "begin") {
    w = std::make_unique<v1::BeginStepResponse>();
  } else if (kind == "layer") {
    w = std::make_unique<v1::LayerOutput>();
  } else {
    return want == got;  // close: no reply
  }
  g.reset(w->New());
  if (!w->ParseFromString(want) || !g->ParseFromString(got)) return false;
  google::protobuf::util::MessageDifferencer d;
  d.set_scope(google::protobuf::util::MessageDifferencer::PARTIAL);
  std::string why;
  d.ReportDifferencesToString(&why);
  const bool same = d.Compare(*w, *g);
  if (!same) ADD_FAILURE() << why;
  return same;
}

std::string CorpusPath() {
  return std::string(ATTND_SOURCE_DIR) + "/tests/wire_corpus/v1_session.txt";
}

TEST(WireReplay, RecordedRequestsGetTheRecordedReplies) {
  if (!absl::c_linear_search(cpu::SupportedIsas(), cpu::Isa::kAvx2))
    GTEST_SKIP() << "the corpus was recorded with the AVX2 inner loops";
  Session session;
  if (!g_record.empty()) {
    std::vector<Record> calls = MakeSession(session.spec());
    std::ofstream f(g_record);
    f << "# attnd wire corpus, recorded at COMMIT: KIND CODE REQUEST REPLY (base64), one call a "
         "line\n";
    for (Record& r : calls) {
      session.Play(r);
      f << r.kind << " " << r.code << " " << absl::Base64Escape(r.request) << " "
        << absl::Base64Escape(r.reply) << "\n";
    }
    ASSERT_TRUE(f.good());
    GTEST_SKIP() << "recorded " << calls.size() << " calls to " << g_record;
  }
  std::ifstream f(CorpusPath());
  ASSERT_TRUE(f.good()) << CorpusPath();
  std::string line;
  int n = 0, layers = 0, refused = 0;
  while (std::getline(f, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream in(line);
    Record want, got;
    std::string req64, reply64;
    in >> want.kind >> want.code >> req64 >> reply64;
    ASSERT_TRUE(absl::Base64Unescape(req64, &want.request)) << line;
    ASSERT_TRUE(absl::Base64Unescape(reply64, &want.reply)) << line;
    got.kind = want.kind;
    got.request = want.request;
    session.Play(got);
    ++n;
    layers += want.kind == "layer";
    refused += want.code != 0;
    EXPECT_EQ(got.code, want.code) << "call " << n << " (" << want.kind << ")";
    EXPECT_TRUE(SameForAnOldClient(want.kind, want.reply, got.reply))
        << "call " << n << " (" << want.kind << ")";
  }
  // The corpus is what it says: a whole session with its refusals.
  EXPECT_EQ(n, 38);
  EXPECT_EQ(layers, 26);
  EXPECT_EQ(refused, 2);
}

}  // namespace
}  // namespace attnd::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--record=", 0) == 0) attnd::testing::g_record = a.substr(9);
  }
  return RUN_ALL_TESTS();
}
