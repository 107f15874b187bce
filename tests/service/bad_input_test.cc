// The bad-input matrix at the service level, in-process (the same decoding and checks as over
// gRPC, without a transport): fields that do not apply to a step's kind, non-finite values, sizes
// that would overflow, names with NUL bytes, out-of-range lengths and layers out of order. Each
// gets INVALID_ARGUMENT, OUT_OF_RANGE or FAILED_PRECONDITION naming the field, in a short
// message, and leaves every sequence as it was. tests/e2e/service_hardening_test.cc keeps a smoke
// of it over the wire.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "client/attnd_client.h"
#include "client/workload.h"
#include "common/status_macros.h"
#include "tests/in_process_service.h"

namespace attnd::testing {
namespace {

class BadInput : public ::testing::Test {
 protected:
  void SetUp() override {
    ServiceOptions so;
    so.max_message_bytes = 256 << 10;
    so.shm_enabled = true;
    s_ = std::make_unique<InProcessService>(TinyEngine(400, 2), 2, so);
    engine_ = s_->engine.get();
    svc_ = s_->service.get();
    ASSERT_TRUE(caller_.ok()) << "socketpair";
  }
  absl::Status Open(const std::string& id, const std::string& parent = "", int64_t prefix = 0) {
    v1::OpenSequenceRequest r;
    r.set_sequence_id(id);
    r.set_fork_parent_id(parent);
    r.set_fork_prefix_len(prefix);
    v1::SequenceInfo info;
    return svc_->DoOpenSequence(caller_, r, &info);
  }
  absl::StatusOr<uint64_t> Begin(const client::Batch& batch, bool write_only = false) {
    v1::BeginStepResponse resp;
    return svc_->Begin(caller_, client::MakeBeginRequest(batch, write_only, 0), &resp);
  }
  absl::Status Layer(uint64_t step, const v1::LayerInputs& in) {
    v1::LayerOutput out;
    return svc_->Layer(caller_, step, in, &out, Transport::kUnary);
  }
  // A whole step of random keys and queries.
  absl::Status Step(const client::Batch& batch) {
    int64_t tokens = 0;
    for (const auto& e : batch) tokens += e.second;
    auto g = client::GenerateStep(engine_->spec(), tokens, DType::kBF16, false, rng_);
    ASSIGN_OR_RETURN(const uint64_t step, Begin(batch));
    for (const auto& l : g) RETURN_IF_ERROR(Layer(step, l.wire));
    return absl::OkStatus();
  }
  // The sequence holds `length` tokens and no step holds it.
  void ExpectIdle(const std::string& id, int64_t length) {
    v1::DescribeSequenceRequest r;
    r.set_sequence_id(id);
    v1::SequenceInfo d;
    ASSERT_TRUE(svc_->DoDescribeSequence(caller_, r, &d).ok()) << id;
    EXPECT_EQ(d.length(), length) << id;
    EXPECT_FALSE(d.in_step()) << id;
  }
  static void Expect(const absl::Status& s, absl::StatusCode code, const std::string& needle) {
    EXPECT_EQ(s.code(), code) << s;
    EXPECT_NE(s.message().find(needle), absl::string_view::npos) << s;
    EXPECT_LT(s.message().size(), 300u) << s.message().substr(0, 300);
  }

  std::unique_ptr<InProcessService> s_;
  Engine* engine_ = nullptr;
  AttentionService* svc_ = nullptr;
  LocalCaller caller_;
  std::mt19937_64 rng_{9};
};

TEST_F(BadInput, FieldsThatDoNotApplyAndNonFiniteValuesAreRefusedAndChangeNothing) {
  ASSERT_TRUE(Open("sa").ok());
  ASSERT_TRUE(Step({{"sa", 3}}).ok());
  const auto invalid = absl::StatusCode::kInvalidArgument;
  Expect(Open("sb", "", 2), invalid, "fork_prefix_len");
  EXPECT_EQ(engine_->DescribeSequence(SequenceKey("sb")).status().code(),
            absl::StatusCode::kNotFound);
  auto g = client::GenerateStep(engine_->spec(), 2, DType::kBF16, false, rng_);
  // Each case: a layer message of a fresh step on "sa"; the step is aborted, "sa" unchanged.
  struct Case {
    std::string what, needle;
    bool write_only = false;
    std::function<void(v1::LayerInputs*)> mutate;
  };
  std::vector<Case> cases = {
      {"a shard on an unsharded step", "shard", false,
       [](v1::LayerInputs* in) { in->set_shard(1); }},
      {"out_shm on a write-only step", "out_shm", true,
       [](v1::LayerInputs* in) {
         in->mutable_out_shm()->set_region("any");
         in->mutable_out_shm()->set_byte_size(16);
       }},
      {"fp8 scales whose element count overflows int64", "kv_latent.scales: too many elements",
       false,
       [](v1::LayerInputs* in) {
         v1::Tensor* t = in->mutable_kv_latent();
         t->set_datatype("FP8_E4M3");
         t->clear_shape();
         t->add_shape(int64_t{1} << 62);
         t->add_shape(4);
         v1::Tensor* sc = t->mutable_scales();
         sc->set_datatype("FP32");
         sc->add_shape(int64_t{1} << 62);
         sc->add_shape(4);
       }},
      {"a layer beyond the model's", "layer", false,
       [](v1::LayerInputs* in) { in->set_layer(1000); }},
  };
  for (const char* tensor : {"q_latent", "kv_latent", "index_k", "index_w"})
    cases.push_back({absl::StrCat("a NaN in ", tensor), absl::StrCat(tensor, ": non-finite"), false,
                     [tensor](v1::LayerInputs* in) {
                       v1::Tensor* t = tensor[0] == 'q'   ? in->mutable_q_latent()
                                       : tensor[0] == 'k' ? in->mutable_kv_latent()
                                       : tensor[6] == 'k' ? in->mutable_index_k()
                                                          : in->mutable_index_w();
                       const uint16_t nan = 0x7fc0;  // bf16 NaN at element 3
                       std::memcpy(t->mutable_data()->data() + 6, &nan, 2);
                     }});
  auto w = client::GenerateStep(engine_->spec(), 2, DType::kBF16, true, rng_);
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    v1::LayerInputs in = c.write_only ? w[0].wire : g[0].wire;
    c.mutate(&in);
    auto step = Begin({{"sa", 2}}, c.write_only);
    ASSERT_TRUE(step.ok()) << step.status();
    const absl::Status s = Layer(*step, in);
    if (c.needle == "layer") {
      Expect(s, absl::StatusCode::kFailedPrecondition, "out of order");
    } else {
      Expect(s, invalid, c.needle);
    }
    ExpectIdle("sa", 3);
    // The step is gone: its next layer says so.
    EXPECT_FALSE(Layer(*step, g[0].wire).ok());
  }
  // A region whose key holds a NUL byte is refused before shm_open sees a cut name (which
  // names an object that exists).
  const std::string key = absl::StrCat("/attnd-nul-", getpid());
  auto mem = client::SharedMemory::Create(key, 4096);
  ASSERT_TRUE(mem.ok()) << mem.status();
  v1::RegisterSharedMemoryRequest reg;
  reg.set_name("nul");
  reg.set_key(key + std::string("\0x", 2));
  reg.set_byte_size(16);
  Expect(svc_->DoRegisterSharedMemory(caller_, reg), invalid, "NUL");
  ExpectIdle("sa", 3);
  EXPECT_TRUE(Step({{"sa", 1}}).ok());
  ExpectIdle("sa", 4);
}

TEST_F(BadInput, LengthsBeyondTheModelAreOutOfRangeAndHoldNothing) {
  ASSERT_TRUE(Open("h").ok());
  const int64_t max_context = engine_->spec().max_context;
  for (int64_t q : {max_context + 1, int64_t{1} << 40, std::numeric_limits<int64_t>::max()}) {
    SCOPED_TRACE(q);
    Expect(Begin({{"h", q}}).status(), absl::StatusCode::kOutOfRange, "q_len");
    ExpectIdle("h", 0);
  }
  Expect(Begin({{"h", -1}}).status(), absl::StatusCode::kInvalidArgument, "q_len");
  // A fork past its parent's end.
  Expect(Open("f", "h", 5), absl::StatusCode::kOutOfRange, "prefix_len");
  EXPECT_EQ(engine_->Capacity()[0].sequences, 1);
  EXPECT_TRUE(Step({{"h", 2}}).ok());
  ExpectIdle("h", 2);
}

}  // namespace
}  // namespace attnd::testing
