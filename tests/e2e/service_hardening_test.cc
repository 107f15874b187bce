// Hostile and buggy clients against a real attnd over loopback (issue 9): every case here once
// wedged, crashed or starved the server, or was silently accepted. Each call must get a precise
// status with a short message, leave every sequence as it was, and the server keeps serving.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/attnd_client.h"
#include "client/soak.h"
#include "client/workload.h"
#include "tests/server_process.h"

namespace attnd::testing {
namespace {

using client::Batch;
using client::Client;

constexpr int64_t kMaxMessage = 256 << 10;

// The server's peak resident memory (VmHWM), bytes.
int64_t PeakRss(pid_t pid) { return client::ProcStatusBytes(pid, "VmHWM"); }

class HardeningTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = new ServerProcess(ATTND_BINARY, SharedServerArgs("hardening", 300, kMaxMessage));
  }
  static void TearDownTestSuite() {
    EXPECT_EQ(server_->Stop(), 0) << "attnd exits 0 on SIGTERM: it survived every case";
    delete server_;
  }
  void SetUp() override {
    // Over the Unix-socket listener, where shared memory is allowed (the cases use it).
    client_ = Client::Connect("unix:" + SocketPath("hardening"));
    auto info = client_->Info();
    ASSERT_TRUE(info.ok()) << info.status();
    info_ = *info;
    spec_ = ModelSpecFromProto(info->model()).value();
  }
  // Runs a whole step over unary calls.
  absl::Status Step(const Batch& batch, bool write_only = false) {
    int64_t T = 0;
    for (const auto& e : batch) T += e.second;
    auto g = client::GenerateStep(spec_, T, DType::kBF16, write_only, rng_);
    auto b = client_->BeginStep(batch, write_only);
    if (!b.ok()) return b.status();
    for (const auto& l : g) {
      auto o = client_->AttendLayer(b->step_id(), l.wire);
      if (!o.ok()) return o.status();
    }
    return absl::OkStatus();
  }
  void ExpectIdle(const std::string& id, int64_t length) {
    auto d = client_->DescribeSequence(id);
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(d->length(), length) << id;
    EXPECT_FALSE(d->in_step()) << id;
  }
  static void ExpectShort(const absl::Status& s, absl::StatusCode code) {
    EXPECT_EQ(s.code(), code) << s.message().substr(0, 200);
    EXPECT_LT(s.message().size(), 300u) << s.message().substr(0, 300);
  }

  static ServerProcess* server_;
  std::unique_ptr<Client> client_;
  v1::ServerInfoResponse info_;
  ModelSpec spec_;
  std::mt19937_64 rng_{9};
};
ServerProcess* HardeningTest::server_ = nullptr;

// Case 1, over both transports: the answer is OUT_OF_RANGE, the stream answers, nothing is held.
TEST_F(HardeningTest, HugeQLenGetsOutOfRangeOnBothTransportsAndHoldsNothing) {
  ASSERT_TRUE(client_->OpenSequence("h1").ok());
  ASSERT_TRUE(client_->OpenSequence("h2").ok());
  ASSERT_TRUE(Step({{"h1", 1}, {"h2", 1}}).ok());
  const int64_t free_before = client_->Info()->devices(0).pages_free();
  const Batch bad = {{"h1", 2}, {"h2", std::numeric_limits<int64_t>::max()}};
  ExpectShort(client_->BeginStep(bad).status(), absl::StatusCode::kOutOfRange);
  auto stream = client_->OpenStream();
  ExpectShort(stream->Begin(bad).status(), absl::StatusCode::kOutOfRange);
  ExpectIdle("h1", 1);
  ExpectIdle("h2", 1);
  EXPECT_EQ(client_->Info()->devices(0).pages_free(), free_before);
  EXPECT_TRUE(Step({{"h1", 3}, {"h2", 2}}).ok());
  EXPECT_TRUE(client_->CloseSequence("h1").ok());
  EXPECT_TRUE(client_->CloseSequence("h2").ok());
}

// Case 2: a registered object truncated under the server fails the call, never the server.
TEST_F(HardeningTest, ASharedMemoryObjectThatShrinksFailsTheCallNotTheServer) {
  ASSERT_TRUE(client_->OpenSequence("sh").ok());
  ASSERT_TRUE(Step({{"sh", 5}}).ok());
  const std::string key = absl::StrCat("/attnd-hard-", getpid());
  auto mem = client::SharedMemory::Create(key, 1 << 20);
  ASSERT_TRUE(mem.ok()) << mem.status();
  ASSERT_TRUE(client_->RegisterSharedMemory("shrink", key, 0, 1 << 20).ok());
  auto g = client::GenerateStep(spec_, 3, DType::kBF16, false, rng_);
  for (bool output_only : {false, true}) {
    v1::LayerInputs in = g[0].wire;
    if (output_only) {
      in.mutable_out_shm()->set_region("shrink");
      in.mutable_out_shm()->set_offset(4096);
      in.mutable_out_shm()->set_byte_size(3 * spec_.num_heads * spec_.kv_lora_rank * 2);
    } else {
      const auto& q = g[0].wire.q_latent();
      std::memcpy((*mem)->data() + 4096, q.data().data(), q.data().size());
      *in.mutable_q_latent() =
          client::ShmTensor(DType::kBF16, {3, spec_.num_heads, spec_.kv_lora_rank}, "shrink", 4096);
    }
    // The object shrinks (its owner truncates it) after registration.
    const int fd = shm_open(key.c_str(), O_RDWR, 0);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(ftruncate(fd, 0), 0);
    auto b = client_->BeginStep({{"sh", 3}});
    ASSERT_TRUE(b.ok());
    const absl::Status s = client_->AttendLayer(b->step_id(), in).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find("shrank"), absl::string_view::npos) << s;
    ASSERT_EQ(ftruncate(fd, 1 << 20), 0);  // grown back for the next round
    close(fd);
    ExpectIdle("sh", 5);
  }
  EXPECT_TRUE(client_->Info().ok()) << "the server is still serving";
  EXPECT_TRUE(client_->UnregisterSharedMemory("shrink").ok());
  EXPECT_TRUE(Step({{"sh", 2}}).ok());
  EXPECT_TRUE(client_->CloseSequence("sh").ok());
}

// Case 4: a 100 KB datatype string or a huge id gets its own status with a short message (a
// message that quoted it all would become gRPC's RESOURCE_EXHAUSTED for oversized metadata).
TEST_F(HardeningTest, StatusMessagesQuoteOnlyAShortPrefix) {
  ASSERT_TRUE(client_->OpenSequence("q").ok());
  auto g = client::GenerateStep(spec_, 2, DType::kBF16, false, rng_);
  v1::LayerInputs in = g[0].wire;
  in.mutable_q_rope()->set_datatype(std::string(100 << 10, 'B'));
  auto b = client_->BeginStep({{"q", 2}});
  ASSERT_TRUE(b.ok());
  ExpectShort(client_->AttendLayer(b->step_id(), in).status(), absl::StatusCode::kInvalidArgument);
  const std::string id(100 << 10, 'i');
  ExpectShort(client_->DescribeSequence(id).status(), absl::StatusCode::kNotFound);
  ExpectShort(client_->OpenSequence(id).status(), absl::StatusCode::kInvalidArgument);
  ExpectShort(client_->BeginStep({{id, 1}}).status(), absl::StatusCode::kInvalidArgument);
  ExpectShort(client_->OpenSequence("q2", id, 0).status(), absl::StatusCode::kNotFound);
  ExpectShort(client_->RegisterSharedMemory(id, "/k", 0, 1), absl::StatusCode::kInvalidArgument);
  ExpectIdle("q", 0);
  EXPECT_TRUE(client_->CloseSequence("q").ok());
}

// Case 5: a stream whose step expired may begin the next one; a layer of an expired step says
// DEADLINE_EXCEEDED (the proto's code for aborted steps), not NOT_FOUND.
TEST_F(HardeningTest, AStreamWhoseStepExpiredBeginsAgainAndLateLayersSaySo) {
  ASSERT_TRUE(client_->OpenSequence("ex").ok());
  auto g = client::GenerateStep(spec_, 4, DType::kBF16, false, rng_);
  auto stream = client_->OpenStream();
  ASSERT_TRUE(stream->Begin({{"ex", 4}}).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(900));  // idle timeout 300 ms
  auto again = stream->Begin({{"ex", 4}});
  ASSERT_TRUE(again.ok()) << again.status();
  for (const auto& l : g) ASSERT_TRUE(stream->Layer(l.wire).ok());
  ExpectIdle("ex", 4);
  ASSERT_TRUE(stream->Begin({{"ex", 4}}).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(900));
  const absl::Status late = stream->Layer(g[0].wire).status();
  EXPECT_EQ(late.code(), absl::StatusCode::kDeadlineExceeded) << late;
  ExpectIdle("ex", 4);
  EXPECT_TRUE(client_->CloseSequence("ex").ok());
}

// Case 6: after a client cancels a stream mid-step, the next step with the same sequences can
// begin at once.
TEST_F(HardeningTest, AfterACancelTheSameSequencesBeginAtOnce) {
  ASSERT_TRUE(client_->OpenSequence("cr").ok());
  auto g = client::GenerateStep(spec_, 17, DType::kBF16, false, rng_);
  for (int i = 0; i < 20; ++i) {
    auto stream = client_->OpenStream();
    ASSERT_TRUE(stream->Begin({{"cr", 17}}).ok());
    ASSERT_TRUE(stream->Layer(g[0].wire).ok());
    stream->Cancel();
    auto b = client_->BeginStep({{"cr", 17}});
    ASSERT_TRUE(b.ok()) << "round " << i << ": " << b.status();
    ASSERT_TRUE(client_->AbortStep(b->step_id()).ok());
  }
  ExpectIdle("cr", 0);
  EXPECT_TRUE(client_->CloseSequence("cr").ok());
}

// Case 7: the documented limits are the ones that work, framing included.
TEST_F(HardeningTest, EchoAndExportLimitsAreTheOnesThatWork) {
  const auto& lim = info_.limits();
  ASSERT_GT(lim.max_echo_bytes(), kMaxMessage / 2);
  EXPECT_TRUE(client_->Echo("x", lim.max_echo_bytes()).ok());
  ExpectShort(client_->Echo("x", lim.max_echo_bytes() + 1), absl::StatusCode::kInvalidArgument);
  ExpectShort(client_->Echo("x", kMaxMessage), absl::StatusCode::kInvalidArgument);
  // A sequence longer than the largest chunk, built from write-only steps.
  const int64_t chunk = lim.max_export_chunk_tokens();
  ASSERT_GT(chunk, 100);
  ASSERT_TRUE(client_->OpenSequence("exp").ok());
  int64_t length = 0;
  while (length < chunk + 50) {
    ASSERT_TRUE(Step({{"exp", 600}}, true).ok());
    length += 600;
  }
  // Exports "exp" in chunks of `c`: the call's status and the tokens it sent.
  auto export_all = [&](int64_t c) {
    v1::ExportSequenceRequest req;
    req.set_sequence_id("exp");
    req.set_chunk_tokens(c);
    grpc::ClientContext ctx;
    auto reader = client_->stub()->ExportSequence(&ctx, req);
    v1::ExportChunk msg;
    int64_t tokens = 0;
    while (reader->Read(&msg))
      if (msg.keys().layer() == 0) tokens += msg.tokens();
    return std::make_pair(reader->Finish(), tokens);
  };
  for (int64_t c : {chunk, int64_t{0}}) {
    const auto [status, tokens] = export_all(c);
    EXPECT_TRUE(status.ok()) << "chunk_tokens " << c;
    EXPECT_EQ(tokens, length);
  }
  for (int64_t c : {chunk + 1, int64_t{8192}, int64_t{-1}})
    EXPECT_EQ(export_all(c).first.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c;
  EXPECT_TRUE(client_->CloseSequence("exp").ok());
}

// Case 9: input that was silently accepted is refused with INVALID_ARGUMENT naming the field.
// A smoke of the bad-input matrix over the wire (the whole matrix runs in-process:
// tests/service/bad_input_test.cc): the status and its message reach the client, and the
// sequence is as it was.
TEST_F(HardeningTest, FieldsThatDoNotApplyAndNonFiniteValuesAreRefused) {
  ASSERT_TRUE(client_->OpenSequence("sa").ok());
  ASSERT_TRUE(Step({{"sa", 3}}).ok());
  auto expect = [](const absl::Status& s, const char* needle) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(needle), absl::string_view::npos) << s;
  };
  expect(client_->OpenSequence("sb", "", 2).status(), "fork_prefix_len");
  EXPECT_EQ(client_->DescribeSequence("sb").status().code(), absl::StatusCode::kNotFound);
  auto g = client::GenerateStep(spec_, 2, DType::kBF16, false, rng_);
  v1::LayerInputs in = g[0].wire;
  const uint16_t nan = 0x7fc0;  // bf16 NaN at element 3
  std::memcpy(in.mutable_q_latent()->mutable_data()->data() + 6, &nan, 2);
  auto b = client_->BeginStep({{"sa", 2}});
  ASSERT_TRUE(b.ok());
  expect(client_->AttendLayer(b->step_id(), in).status(), "q_latent: non-finite");
  ExpectIdle("sa", 3);
  EXPECT_TRUE(Step({{"sa", 1}}).ok());
  EXPECT_TRUE(client_->CloseSequence("sa").ok());
}

// Case 9, flags: a value that does not fit its flag is an error, not a truncation.
TEST(HardeningFlags, OutOfRangeFlagValuesStopTheServerWithAMessage) {
  for (const char* flag : {"--kv-pages=4294967360", "--max-shm-regions=4294967296", "--threads=-1",
                           "--max-step-tokens=0", "--check-finite=maybe"}) {
    const std::string cmd =
        absl::StrCat(AttndBinary(ATTND_BINARY), " --grpc-port=0 --metrics-port=0 ", flag, " 2>&1");
    FILE* p = popen(cmd.c_str(), "r");
    ASSERT_NE(p, nullptr);
    std::string out;
    char buf[256];
    while (fgets(buf, sizeof(buf), p)) out += buf;
    const int status = pclose(p);
    EXPECT_NE(status, 0) << flag;
    EXPECT_NE(out.find("bad value"), std::string::npos) << flag << ": " << out.substr(0, 300);
  }
}

// A server with the production message limit (1 GiB) and a wide model (128 heads, L = 512:
// DeepSeek-V3.2's per-head dims), where a layer takes long enough to be caught running.
class WideTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_ = absl::StrCat(::testing::TempDir(), "/wide-", getpid(), ".json");
    {
      std::ofstream f(model_);
      f << R"({"base": "tiny", "name": "wide", "layers": "FS", "num_heads": 128,
               "kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_head_dim": 128,
               "page_size": 64, "max_context": 32768})";
    }
    server_ = new ServerProcess(
        ATTND_BINARY, {absl::StrCat("--model-file=", model_), "--kv-pages=300", "--threads=1",
                       "--metrics-port=0", "--begin-wait-ms=120000"});
  }
  static void TearDownTestSuite() {
    EXPECT_EQ(server_->Stop(), 0);
    delete server_;
    std::remove(model_.c_str());
  }
  static ServerProcess* server_;
  static std::string model_;
};
ServerProcess* WideTest::server_ = nullptr;
std::string WideTest::model_;

// Case 3: work and memory are bounded before they are spent: a 7-byte Echo asking for 1 GiB,
// and a 12-byte layer message for a 16K-token step (whose output would be 2 GiB), must not move
// the server's peak memory.
TEST_F(WideTest, TinyRequestsCannotMakeTheServerAllocateGigabytes) {
  auto c = Client::Connect(server_->target());
  ASSERT_TRUE(c->Info().ok());
  const int64_t base = PeakRss(server_->pid());
  ASSERT_GT(base, 0);
  EXPECT_EQ(c->Echo("abcdefg", int64_t{1} << 30).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(c->OpenSequence("w").ok());
  auto b = c->BeginStep({{"w", 16384}});
  ASSERT_TRUE(b.ok()) << b.status();
  v1::LayerInputs in;
  in.set_layer(0);
  const absl::Status s = c->AttendLayer(b->step_id(), in).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  const int64_t peak = PeakRss(server_->pid());
  EXPECT_LT(peak - base, int64_t{256} << 20)
      << "peak RSS grew from " << base << " to " << peak << " bytes";
  EXPECT_FALSE(c->DescribeSequence("w")->in_step());
  EXPECT_TRUE(c->CloseSequence("w").ok());
}

// Case 6, the hard way: the stream is cancelled while its layer is still running (a raw call, no
// client-side wait). The next BeginStep with the same sequence must still succeed at once: the
// server waits for the running layer, which then aborts.
TEST_F(WideTest, ACancelWhileALayerRunsReleasesTheSequenceAtOnce) {
  auto c = Client::Connect(server_->target());
  auto info = c->Info();
  ASSERT_TRUE(info.ok());
  const ModelSpec spec = ModelSpecFromProto(info->model()).value();
  std::mt19937_64 rng(3);
  ASSERT_TRUE(c->OpenSequence("cw").ok());
  auto g = client::GenerateStep(spec, 128, DType::kBF16, false, rng);
  for (int i = 0; i < 4; ++i) {
    grpc::ClientContext ctx;
    auto rw = c->stub()->Step(&ctx);
    v1::StepRequest begin;
    auto* e = begin.mutable_begin()->add_batch();
    e->set_sequence_id("cw");
    e->set_q_len(128);
    v1::StepResponse resp;
    ASSERT_TRUE(rw->Write(begin) && rw->Read(&resp));
    v1::StepRequest layer;
    *layer.mutable_layer() = g[0].wire;
    ASSERT_TRUE(rw->Write(layer));
    std::this_thread::sleep_for(std::chrono::milliseconds(30));  // the layer is running
    ctx.TryCancel();
    (void)rw->Finish();
    // Let the cancel reach the server (it is asynchronous there; the clients' Cancel() waits for
    // the release, this raw call does not), but well before the ~0.4 s layer ends.
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    auto b = c->BeginStep({{"cw", 128}});
    ASSERT_TRUE(b.ok()) << "round " << i << ": " << b.status();
    ASSERT_TRUE(c->AbortStep(b->step_id()).ok());
  }
  auto d = c->DescribeSequence("cw");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->length(), 0);
  EXPECT_TRUE(c->CloseSequence("cw").ok());
}

// A unary BeginStep whose client gives up before it is served (here, queued on the server's
// one executor thread behind another BeginStep waiting for a running layer) opens no step: the
// step's id would reach no one, and it would hold its sequence until --step-idle-timeout-ms (the
// client's retry: "already in open step"). The queueing rests on timing: an attempt where the
// BeginStep was served before the layer (in time, or with its reply late) proves nothing and is
// tried again.
TEST_F(WideTest, ABeginStepWhoseClientGaveUpOpensNothing) {
  ServerProcess one(ATTND_BINARY, {absl::StrCat("--model-file=", model_), "--kv-pages=300",
                                   "--threads=1", "--executor-threads=1", "--metrics-port=0"});
  auto c = Client::Connect(one.target()), w = Client::Connect(one.target());
  auto info = c->Info();
  ASSERT_TRUE(info.ok() && w->Info().ok());
  const ModelSpec spec = ModelSpecFromProto(info->model()).value();
  std::mt19937_64 rng(4);
  ASSERT_TRUE(c->OpenSequence("long").ok());
  ASSERT_TRUE(c->OpenSequence("gw").ok());
  auto g = client::GenerateStep(spec, 512, DType::kBF16, false, rng);
  // A 512-token layer of "long": the time to carry it (sent for a layer that does not exist,
  // refused once received) and the time it then runs.
  auto timed = [&](int layer) {
    auto b = c->BeginStep({{"long", 512}});
    EXPECT_TRUE(b.ok()) << b.status();
    v1::LayerInputs in = g[0].wire;
    in.set_layer(layer);
    const auto sent = std::chrono::steady_clock::now();
    (void)c->AttendLayer(b->step_id(), in);
    (void)c->AbortStep(b->step_id());
    return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                                 sent);
  };
  for (int attempt = 0; attempt < 5; ++attempt) {
    const std::chrono::milliseconds carry = std::min(timed(7), timed(7));
    const std::chrono::milliseconds run = timed(0) - carry;
    std::fprintf(stderr, "attempt %d: %lld ms to carry, %lld ms to run\n", attempt,
                 static_cast<long long>(carry.count()), static_cast<long long>(run.count()));
    if (run.count() < 40) continue;
    std::thread busy([&] { (void)timed(0); });
    std::this_thread::sleep_for(carry + run / 8);  // the layer runs
    std::thread waiting([&] {  // waits, on the executor thread, for that layer to end
      auto b = w->BeginStep({{"long", 1}});
      if (b.ok()) (void)w->AbortStep(b->step_id());  // came after the layer: no matter
    });
    std::this_thread::sleep_for(run / 4);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + run / 8);
    v1::BeginStepRequest req;
    auto* e = req.add_batch();
    e->set_sequence_id("gw");
    e->set_q_len(1);
    v1::BeginStepResponse resp;
    const grpc::Status gave_up = c->stub()->BeginStep(&ctx, req, &resp);
    // While the layer still runs (DescribeSequence is served off the executor): a BeginStep that
    // queued behind it has not opened yet; one the server took before the layer (a loaded
    // machine can then still miss a short deadline on the way back) has.
    auto early = c->DescribeSequence("gw");
    busy.join();  // the layer ended; the BeginSteps behind it ran
    waiting.join();
    if (gave_up.ok()) {  // served in time: nothing was queued
      ASSERT_TRUE(c->AbortStep(resp.step_id()).ok());
      continue;
    }
    ASSERT_EQ(gave_up.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << gave_up.error_message();
    ASSERT_TRUE(early.ok()) << early.status();
    if (early->in_step()) {  // served before the layer, its reply late: nothing was queued
      const auto b = c->BeginStep({{"gw", 1}});  // its error names the step, to abort it
      if (b.ok()) {  // the server saw the deadline pass after opening it, and aborted it
        ASSERT_TRUE(c->AbortStep(b->step_id()).ok());
        continue;
      }
      const std::string m(b.status().message());
      const size_t at = m.rfind(' ');
      uint64_t id = 0;
      ASSERT_TRUE(!b.ok() && at != std::string::npos && absl::SimpleAtoi(m.substr(at + 1), &id))
          << b.status();
      ASSERT_TRUE(c->AbortStep(id).ok());
      continue;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    auto d = c->DescribeSequence("gw");
    ASSERT_TRUE(d.ok());
    EXPECT_FALSE(d->in_step()) << "a step nobody knows of holds the sequence";
    auto b = c->BeginStep({{"gw", 1}});
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_TRUE(c->AbortStep(b->step_id()).ok());
    EXPECT_EQ(one.Stop(), 0);
    return;
  }
  GTEST_SKIP() << "no attempt queued the BeginStep behind a running layer on this machine";
}

}  // namespace
}  // namespace attnd::testing
