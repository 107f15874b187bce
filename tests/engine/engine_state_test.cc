// Step and sequence bookkeeping: aborts, exhaustion, forks, page 0, and the status of every bad
// input, each leaving the engine exactly as it was.
#include <gtest/gtest.h>

#include <thread>

#include "tests/engine_harness.h"
#include "tests/run_layer.h"

namespace attnd::testing {
namespace {

ModelSpec Spec() {
  ModelSpec s = PresetModelSpec("tiny").value();
  s.layers = {LayerKind::kFull, LayerKind::kShared, LayerKind::kFull, LayerKind::kShared};
  return s;
}

EngineOptions Options(int32_t pages = 256) { return TestEngineOptions(Spec(), pages); }

// Two prefilled sequences, one forked, so there are shared pages and partial pages.
void Populate(Harness& h) {
  h.Open("a");
  h.Open("b");
  h.RunAndCheck({{"a", 40}, {"b", 21}}, DType::kF32, 1, 1e-5);
  h.Fork("c", "a", 35);
}
const std::vector<std::string> kIds = {"a", "b", "c"};

TEST(EngineState, AbortAfterAnyLayerRestoresTheExactPriorState) {
  for (int stop = 0; stop <= Spec().num_layers() - 1; ++stop) {
    Harness h(Options());
    Populate(h);
    const EngineSnapshot before = TakeSnapshot(h.engine(), kIds);
    const std::vector<StepEntry> batch = {{"a", 1}, {"c", 30}, {"b", 12}};
    const auto in = h.MakeInputs(batch, DType::kF32, 50 + stop);
    auto step = h.engine().BeginStep(batch);
    ASSERT_TRUE(step.ok());
    EXPECT_FALSE(TakeSnapshot(h.engine(), kIds) == before);  // pages are reserved while open
    for (int l = 0; l < stop; ++l) {
      std::vector<uint8_t> out(43 * 4 * 32 * 4);
      ASSERT_TRUE(RunLayerInto(h.engine(), *step, l, in[l].inputs(), out.data(), out.size()).ok());
    }
    ASSERT_TRUE(h.engine().AbortStep(*step).ok());
    EXPECT_TRUE(TakeSnapshot(h.engine(), kIds) == before) << "aborted after " << stop << " layers";
    EXPECT_EQ(h.engine().AbortStep(*step).code(), absl::StatusCode::kNotFound);
    // The sequences go on as if the step never happened (the reference has no trace of it).
    h.RunAndCheck(batch, DType::kF32, 99, 1e-5);
  }
}

TEST(EngineState, ExhaustingThePoolFailsCleanlyAndChangesNothing) {
  Harness h(Options(12));  // 11 usable pages of 16 tokens
  Populate(h);             // a: 3 pages, b: 2, c: 2 shared + 1 copied = 6 used
  const EngineSnapshot before = TakeSnapshot(h.engine(), kIds);
  EXPECT_EQ(before.free_pages, 5);
  auto step = h.engine().BeginStep({{"a", 1}, {"b", 100}});
  ASSERT_EQ(step.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(step.status().message().find("KV cache full"), std::string::npos);
  EXPECT_NE(step.status().message().find("pages"), std::string::npos);
  EXPECT_TRUE(TakeSnapshot(h.engine(), kIds) == before);
  EXPECT_EQ(h.engine().ForkSequence("d", "b", 20).code(), absl::StatusCode::kOk);
  // Fill the pool exactly, then a fork needing a page for its partial tail fails cleanly.
  h.RunAndCheck({{"a", 16 * 4 - 40}}, DType::kF32, 3, 1e-5);  // a: 4 pages, exactly full
  const auto mid = TakeSnapshot(h.engine(), kIds);
  auto fill = h.engine().BeginStep({{"b", 16 * mid.free_pages + 11}});  // b has 11 free rows
  ASSERT_TRUE(fill.ok()) << fill.status();
  ASSERT_TRUE(h.engine().AbortStep(*fill).ok());
  h.RunAndCheck({{"b", 16 * mid.free_pages + 11}}, DType::kF32, 4, 1e-5);
  EXPECT_EQ(h.engine().Capacity()[0].pages_free, 0);
  const EngineSnapshot full = TakeSnapshot(h.engine(), kIds);
  EXPECT_EQ(h.engine().ForkSequence("e", "a", 20).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(h.engine().ForkSequence("f", "a", 32).ok());  // page aligned: shares, no copy
  EXPECT_TRUE(h.engine().CloseSequence("f").ok());
  EXPECT_TRUE(TakeSnapshot(h.engine(), kIds) == full);
}

TEST(EngineState, PageZeroNeverHoldsATokenAndIsNeverWritten) {
  Harness h(Options(64));
  Populate(h);
  for (int i = 0; i < 5; ++i)
    h.RunAndCheck({{"a", 1}, {"b", 7}, {"c", 3}}, DType::kF32, 10 + i, 1e-5);
  for (const auto& id : kIds) {
    auto info = h.engine().DescribeSequence(id);
    ASSERT_TRUE(info.ok());
    for (int32_t p : info->pages) EXPECT_NE(p, 0) << id;
  }
  EXPECT_EQ(h.engine().PageRefcounts(0)[0], 1);
  EXPECT_TRUE(h.engine().ReservedPageUntouched(0));
}

TEST(EngineState, ClosingAForkedParentKeepsTheChildIntact) {
  Harness h(Options());
  Populate(h);
  const auto child = h.engine().DescribeSequence("c");
  ASSERT_TRUE(child.ok());
  h.Close("a");
  for (int i = 0; i < 2; ++i) {
    auto refs = h.engine().PageRefcounts(0);
    for (int32_t p : child->pages) EXPECT_EQ(refs[p], 1) << "page " << p;
  }
  h.RunAndCheck({{"c", 1}}, DType::kF32, 20, 1e-5);
  h.RunAndCheck({{"c", 17}}, DType::kF32, 21, 1e-5);
  h.Close("c");
  h.Close("b");
  EXPECT_EQ(h.engine().Capacity()[0].pages_free, 255);
}

// A handoff target serves ordinary steps only once write-only steps brought it to its import
// length: a worker that finds a moved sequence early is told to retry, never decodes on half of it.
TEST(EngineState, AnImportingSequenceRefusesOrdinaryStepsUntilComplete) {
  Harness h(Options());
  h.Open("moved", -1, 40);
  EXPECT_EQ(h.engine().OpenSequence("bad", -1, -1).code(), absl::StatusCode::kOutOfRange);
  EXPECT_TRUE(h.engine().DescribeSequence("moved")->importing);
  const auto part = h.MakeInputs({{"moved", 25}}, DType::kF32, 61);
  ASSERT_TRUE(h.engine().BeginStep({{"moved", 1}}).status().code() ==
              absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(h.Run({{"moved", 25}}, part, StepOptions::WriteOnly()).status.ok());
  const auto early = h.engine().BeginStep({{"moved", 1}});
  EXPECT_EQ(early.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(early.status().message().find("being imported (25 of 40 tokens)"), std::string::npos)
      << early.status();
  const auto rest = h.MakeInputs({{"moved", 15}}, DType::kF32, 62);
  ASSERT_TRUE(h.Run({{"moved", 15}}, rest, StepOptions::WriteOnly()).status.ok());
  EXPECT_FALSE(h.engine().DescribeSequence("moved")->importing);
  h.RunAndCheck({{"moved", 1}}, DType::kF32, 63, 1e-4);  // a decode on every imported key
}

TEST(EngineState, IdleStepsExpireAndAbort) {
  Harness h(Options());
  Populate(h);
  const EngineSnapshot before = TakeSnapshot(h.engine(), kIds);
  auto step = h.engine().BeginStep({{"a", 3}});
  ASSERT_TRUE(step.ok());
  EXPECT_EQ(h.engine().ExpireIdleSteps(std::chrono::hours(1)), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(h.engine().ExpireIdleSteps(std::chrono::milliseconds(5)), 1);
  EXPECT_TRUE(TakeSnapshot(h.engine(), kIds) == before);
  EXPECT_EQ(h.engine().steps_aborted(), 1);
}

// A sequence's lease: opened or last stepped longer ago than the timeout, in no open step, it is
// closed (pages back, counted); a step renews it; a sequence in an open step is never closed.
TEST(EngineState, IdleSequencesExpireAndEveryStepRenewsTheLease) {
  Harness h(Options());
  h.Open("stale");
  h.Open("renewed");
  h.Open("held");
  h.RunAndCheck({{"stale", 5}, {"renewed", 5}, {"held", 5}}, DType::kF32, 70, 1e-4);
  const int32_t free_before = h.engine().Capacity()[0].pages_free;
  EXPECT_EQ(h.engine().ExpireIdleSequences(std::chrono::hours(1)), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(60));
  auto held = h.engine().BeginStep({{"held", 1}});  // open across the expiry
  ASSERT_TRUE(held.ok()) << held.status();
  h.RunAndCheck({{"renewed", 1}}, DType::kF32, 71, 1e-4);  // renews its lease now
  EXPECT_EQ(h.engine().ExpireIdleSequences(std::chrono::milliseconds(40)), 1);
  EXPECT_EQ(h.engine().DescribeSequence("stale").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(h.engine().DescribeSequence("renewed")->length, 6);
  EXPECT_EQ(h.engine().DescribeSequence("held")->length, 5);
  EXPECT_GT(h.engine().Capacity()[0].pages_free, free_before) << "the stale pages came back";
  EXPECT_EQ(h.engine().Counters().sequences_expired, 1);
  ASSERT_TRUE(h.engine().AbortStep(*held).ok());
}

// A layer sent while another layer of the same step runs is an error and, like every error, aborts
// the step: the running layer reports the abort and nothing changes.
TEST(EngineState, ALayerSentWhileOneRunsAbortsTheStep) {
  Harness h(Options(1024));
  Populate(h);
  const EngineSnapshot before = TakeSnapshot(h.engine(), kIds);
  const std::vector<StepEntry> batch = {{"b", 4000}};  // a slow layer 0
  const auto in = h.MakeInputs(batch, DType::kF32, 30);
  std::vector<uint8_t> out(4000 * 4 * 32 * 4);
  bool overlapped = false;
  for (int attempt = 0; attempt < 10 && !overlapped; ++attempt) {
    auto step = h.engine().BeginStep(batch);
    ASSERT_TRUE(step.ok());
    absl::Status first;
    std::thread t([&] {
      first = RunLayerInto(h.engine(), *step, 0, in[0].inputs(), out.data(), out.size());
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    const absl::Status second =
        RunLayerInto(h.engine(), *step, 2, in[2].inputs(), out.data(), out.size());
    t.join();
    EXPECT_EQ(second.code(), absl::StatusCode::kFailedPrecondition) << second;
    if (second.message().find("already running") != std::string::npos) {
      overlapped = true;
      EXPECT_EQ(first.code(), absl::StatusCode::kCancelled) << first;
    }
    EXPECT_TRUE(TakeSnapshot(h.engine(), kIds) == before) << "attempt " << attempt;
  }
  EXPECT_TRUE(overlapped) << "layer 0 never seen running";
}

// Each bad input: its status code, a message naming what was wrong, and no change.
TEST(EngineState, EveryBadInputGetsItsStatusAndChangesNothing) {
  Harness h(Options());
  Populate(h);
  Engine& e = h.engine();
  const EngineSnapshot before = TakeSnapshot(e, kIds);
  auto expect = [&](absl::Status st, absl::StatusCode code, const char* needle) {
    EXPECT_EQ(st.code(), code) << st;
    EXPECT_NE(st.message().find(needle), std::string::npos) << st.message();
    EXPECT_TRUE(TakeSnapshot(e, kIds) == before) << needle;
  };
  // Sequences.
  expect(e.OpenSequence("a"), absl::StatusCode::kAlreadyExists, "already exists");
  expect(e.OpenSequence(""), absl::StatusCode::kInvalidArgument, "empty");
  expect(e.ForkSequence("d", "zzz", 1), absl::StatusCode::kNotFound, "zzz");
  expect(e.ForkSequence("b", "a", 1), absl::StatusCode::kAlreadyExists, "already exists");
  expect(e.ForkSequence("d", "a", 41), absl::StatusCode::kOutOfRange, "prefix_len");
  expect(e.CloseSequence("zzz"), absl::StatusCode::kNotFound, "zzz");
  expect(e.DescribeSequence("zzz").status(), absl::StatusCode::kNotFound, "zzz");
  // Step metadata.
  expect(e.BeginStep({}).status(), absl::StatusCode::kInvalidArgument, "empty");
  expect(e.BeginStep({{"zzz", 1}}).status(), absl::StatusCode::kNotFound, "zzz");
  expect(e.BeginStep({{"a", 0}}).status(), absl::StatusCode::kInvalidArgument, "q_len");
  expect(e.BeginStep({{"a", 1}, {"a", 2}}).status(), absl::StatusCode::kInvalidArgument, "twice");
  expect(e.BeginStep({{"a", 1}, {"b", Spec().max_context}}).status(), absl::StatusCode::kOutOfRange,
         "max_context");
  expect(RunLayerInto(e, 12345, 0, {}, nullptr, 0), absl::StatusCode::kNotFound, "12345");

  // Layer inputs: each malformed tensor in turn, on a fresh step that the error aborts.
  const std::vector<StepEntry> batch = {{"a", 2}, {"b", 1}};
  const auto good = h.MakeInputs(batch, DType::kBF16, 7);
  const auto fp32 = h.MakeInputs(batch, DType::kF32, 7);
  const size_t out_bytes = 3 * 4 * 32 * 2;
  struct Case {
    const char* name;
    std::function<void(LayerInputs&, size_t&)> mutate;
    const char* needle;
  };
  std::vector<uint8_t> extra(4096, 1);
  const std::vector<Case> cases = {
      {"q_latent shape", [](LayerInputs& in, size_t&) { in.q_latent.dims[1] = 5; },
       "q_latent: shape [3, 5, 32], expected [3, 4, 32]"},
      {"q_rope rank", [](LayerInputs& in, size_t&) { in.q_rope.rank = 2; }, "q_rope: shape"},
      {"kv_latent bytes", [](LayerInputs& in, size_t&) { in.kv_latent.nbytes -= 2; },
       "kv_latent: 190 bytes, expected 192"},
      {"k_rope dtype vs bytes", [](LayerInputs& in, size_t&) { in.k_rope.dtype = DType::kF32; },
       "k_rope:"},
      {"token count", [](LayerInputs& in, size_t&) { in.kv_latent.dims[0] = 4; },
       "kv_latent: shape [4, 32], expected [3, 32]"},
      {"missing index_q", [](LayerInputs& in, size_t&) { in.index_q = TensorView{}; },
       "index_q: missing"},
      {"index_w shape", [](LayerInputs& in, size_t&) { in.index_w.dims[1] = 3; }, "index_w: shape"},
      {"output size", [](LayerInputs&, size_t& n) { n -= 2; }, "output buffer"},
      // Well-formed on its own, but FP32 beside BF16: refused, never converted silently.
      {"mixed datatypes", [&](LayerInputs& in, size_t&) { in.index_w = fp32[0].index_w.view(); },
       "index_w: FP32, but q_latent is BF16; every tensor of a layer call has one datatype"},
  };
  for (const auto& c : cases) {
    auto step = e.BeginStep(batch);
    ASSERT_TRUE(step.ok());
    LayerInputs in = good[0].inputs();
    size_t n = out_bytes;
    c.mutate(in, n);
    std::vector<uint8_t> out(out_bytes + 16);
    expect(RunLayerInto(e, *step, 0, in, out.data(), n), absl::StatusCode::kInvalidArgument,
           c.needle);
    EXPECT_EQ(RunLayerInto(e, *step, 0, good[0].inputs(), out.data(), out_bytes).code(),
              absl::StatusCode::kCancelled)
        << "the failed step was aborted: " << c.name;
  }
  // Indexer tensors on a shared layer.
  {
    auto step = e.BeginStep(batch);
    ASSERT_TRUE(step.ok());
    std::vector<uint8_t> out(out_bytes);
    ASSERT_TRUE(RunLayerInto(e, *step, 0, good[0].inputs(), out.data(), out_bytes).ok());
    LayerInputs in = good[1].inputs();
    in.index_k = good[0].index_k.view();
    expect(RunLayerInto(e, *step, 1, in, out.data(), out_bytes), absl::StatusCode::kInvalidArgument,
           "index_k: given for layer 1, a shared layer");
  }
  // Layer out of order, then a sequence already in an open step.
  {
    auto step = e.BeginStep(batch);
    ASSERT_TRUE(step.ok());
    std::vector<uint8_t> out(out_bytes);
    auto busy = e.BeginStep({{"c", 1}, {"b", 1}});
    EXPECT_EQ(busy.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(busy.status().message().find("'b' is already in open step"), std::string::npos);
    EXPECT_EQ(e.CloseSequence("a").code(), absl::StatusCode::kFailedPrecondition);
    expect(RunLayerInto(e, *step, 2, good[2].inputs(), out.data(), out_bytes),
           absl::StatusCode::kFailedPrecondition, "layer 2 out of order, expected layer 0");
  }
  EXPECT_EQ(e.num_open_steps(), 0);
  // After all that, the engine still computes correctly.
  h.RunAndCheck({{"a", 1}, {"b", 1}, {"c", 1}}, DType::kBF16, 8, 1e-2);
}

}  // namespace
}  // namespace attnd::testing
