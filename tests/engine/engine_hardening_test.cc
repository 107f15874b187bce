// Hostile input at the engine: every client-supplied number is range-checked before arithmetic,
// every request is bounded before work is spent, NaN/Inf never reaches a cache, late messages
// learn what became of their step, and a failed or refused call leaves everything as it was.
#include <gtest/gtest.h>

#include <cmath>
#include <future>
#include <limits>
#include <thread>

#include "absl/strings/str_cat.h"
#include "tests/engine_harness.h"
#include "tests/run_layer.h"

namespace attnd::testing {
namespace {

ModelSpec Spec() {
  ModelSpec s = PresetModelSpec("tiny").value();
  s.layers = {LayerKind::kFull, LayerKind::kShared};
  return s;
}

EngineOptions Options(int32_t pages = 256) { return TestEngineOptions(Spec(), pages); }

// Runs every layer of a step with fresh random inputs; returns the first error.
absl::Status RunAll(Harness& h, uint64_t step, const std::vector<LayerData>& in) {
  const ModelSpec& s = h.spec();
  for (int l = 0; l < s.num_layers(); ++l) {
    const int64_t T = in[l].q_latent.shape[0];
    std::vector<uint8_t> out(T * s.num_heads * s.kv_lora_rank * DTypeSize(in[l].q_latent.dtype));
    absl::Status st = RunLayerInto(h.engine(), step, l, in[l].inputs(), out.data(), out.size());
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

// Issue 9, case 1: q_len = INT64_MAX on a sequence with one committed token wrapped the length
// sum past the max_context check, then ran a per-token loop under the lock until bad_alloc,
// leaving that sequence and every earlier one of the batch in a step that did not exist.
TEST(EngineHardening, HugeQLenIsRefusedBeforeAnyArithmeticAndChangesNothing) {
  Harness h(Options());
  h.Open("a");
  h.Open("b");
  h.RunAndCheck({{"a", 5}, {"b", 1}}, DType::kF32, 1, 1e-5);
  const std::vector<std::string> ids = {"a", "b"};
  const EngineSnapshot before = TakeSnapshot(h.engine(), ids);
  const int64_t huge[] = {std::numeric_limits<int64_t>::max(),
                          std::numeric_limits<int64_t>::max() - 1,
                          h.spec().max_context,  // 1 + max_context: one past the limit
                          int64_t{1} << 62};
  for (int64_t q : huge) {
    auto r = h.engine().BeginStep({{"a", 3}, {"b", q}});
    EXPECT_EQ(r.status().code(), absl::StatusCode::kOutOfRange) << q << ": " << r.status();
    EXPECT_NE(r.status().message().find("max_context"), absl::string_view::npos);
    EXPECT_TRUE(TakeSnapshot(h.engine(), ids) == before) << "q_len " << q;
  }
  EXPECT_EQ(h.engine().BeginStep({{"a", -7}}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(h.engine().BeginStep({{"a", std::numeric_limits<int64_t>::min()}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(TakeSnapshot(h.engine(), ids) == before);
  // Both sequences go on at once, exactly.
  h.RunAndCheck({{"a", 2}, {"b", 3}}, DType::kF32, 2, 1e-5);
  EXPECT_TRUE(h.engine().CloseSequence("a").ok());
  EXPECT_TRUE(h.engine().CloseSequence("b").ok());
}

TEST(EngineHardening, StepTokensBatchEntriesSequencesAndIdsAreBounded) {
  EngineOptions o = Options(64);
  o.limits.max_step_tokens = 100;
  o.limits.max_batch_entries = 3;
  o.limits.max_sequences = 5;
  o.limits.max_id_bytes = 8;
  Harness h(o);
  for (const char* id : {"a", "b", "c", "d"}) h.Open(id);
  const std::vector<std::string> ids = {"a", "b", "c", "d"};
  const EngineSnapshot before = TakeSnapshot(h.engine(), ids);
  // Each entry fits max_context; together they pass the step bound.
  auto r = h.engine().BeginStep({{"a", 60}, {"b", 41}});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("--max-step-tokens"), absl::string_view::npos);
  r = h.engine().BeginStep({{"a", 1}, {"b", 1}, {"c", 1}, {"d", 1}});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("--max-batch-entries"), absl::string_view::npos);
  EXPECT_TRUE(TakeSnapshot(h.engine(), ids) == before);
  EXPECT_TRUE(h.engine().BeginStep({{"a", 60}, {"b", 40}}).ok());  // exactly at the bound
  // Ids: length, then count.
  EXPECT_EQ(h.engine().OpenSequence("123456789").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(h.engine().OpenSequence("12345678").ok());
  EXPECT_EQ(h.engine().OpenSequence("f").code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(h.engine().ForkSequence("f", "a", 0).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(h.engine().CloseSequence("12345678").ok());
  EXPECT_TRUE(h.engine().OpenSequence("f").ok());
}

TEST(EngineHardening, DuplicatesInALargeBatchAreFoundAndNameTheSequence) {
  EngineOptions o = Options(64);
  o.limits.max_batch_entries = 20000;
  Harness h(o);
  std::vector<StepEntry> batch;
  for (int i = 0; i < 20000; ++i) {
    ASSERT_TRUE(h.engine().OpenSequence(absl::StrCat("s", i)).ok());
    batch.push_back({absl::StrCat("s", i), 1});
  }
  batch.back().sequence_id = "s1234";
  auto r = h.engine().BeginStep(batch);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("'s1234' appears twice"), absl::string_view::npos)
      << r.status();
  EXPECT_EQ(h.engine().num_open_steps(), 0);
}

// Issue 9, case 4: client text in messages is a short escaped prefix.
TEST(EngineHardening, MessagesQuoteAShortPrefixOfClientText) {
  Harness h(Options());
  const std::string big(1 << 20, 'x');
  for (const absl::Status& s :
       {h.engine().DescribeSequence(big).status(), h.engine().CloseSequence(big),
        h.engine().BeginStep({{big, 1}}).status(), h.engine().ForkSequence("n", big, 0),
        h.engine().OpenSequence(big)}) {
    EXPECT_FALSE(s.ok());
    EXPECT_LT(s.message().size(), 200u) << s.message().substr(0, 300);
    EXPECT_NE(s.message().find("(1048576 bytes)"), absl::string_view::npos) << s.message();
  }
  auto s = h.engine().DescribeSequence(std::string("a\0b\n", 4)).status();
  EXPECT_NE(s.message().find("'a\\x00"), absl::string_view::npos) << s.message();
  EXPECT_EQ(s.message().find('\0'), absl::string_view::npos);
  EXPECT_EQ(s.message().find('\n'), absl::string_view::npos);
}

// Issue 9, case 8: with page_union_max_pages x page_size < K, a query that sees at most K keys
// still attends at most page_union_max_pages pages (+ its own), as the float64 oracle does.
TEST(EngineHardening, PageUnionCapHoldsBelowTopK) {
  EngineOptions o = Options();
  o.spec.selection = SelectionMode::kPageUnion;
  o.spec.page_size = 4;
  o.spec.page_union_max_pages = 2;  // 8 keys < K = 24
  Harness h(o);
  h.Open("u");
  h.Open("v");
  std::vector<std::vector<double>> got = h.RunAndCheck({{"u", 20}, {"v", 3}}, DType::kF32, 3, 1e-5);
  ASSERT_EQ(got.size(), 2u);
  for (int i = 0; i < 6; ++i) h.RunAndCheck({{"u", 1}, {"v", 1}}, DType::kF32, 4 + i, 1e-5);
  // The traces: never more than (max_pages + 1) pages of keys.
  const std::vector<StepEntry> batch = {{"u", 1}};
  const auto in = h.MakeInputs(batch, DType::kF32, 77);
  const auto res = h.Run(batch, in);
  ASSERT_TRUE(res.status.ok()) << res.status;
  for (const auto& tr : res.traces)
    for (const auto& keys : tr.keys) {
      EXPECT_LE(keys.size(), 3u * 4u);
      EXPECT_GT(keys.size(), 0u);
    }
}

// Issue 9, case 9: NaN or Inf in any input tensor is refused, naming the tensor and the first
// index; the step is aborted and nothing reaches the caches (a NaN index key would poison every
// later selection of that sequence).
TEST(EngineHardening, NonFiniteInputsAreRefusedNamingTensorAndIndex) {
  Harness h(Options());
  h.Open("n");
  h.RunAndCheck({{"n", 9}}, DType::kF32, 5, 1e-5);
  const EngineSnapshot before = TakeSnapshot(h.engine(), {"n"});
  const std::vector<StepEntry> batch = {{"n", 3}};
  struct Case {
    const char* tensor;
    HostTensor LayerData::*member;
    int64_t element;
    float value;
  };
  const Case cases[] = {{"q_latent", &LayerData::q_latent, 200, NAN},
                        {"q_rope", &LayerData::q_rope, 0, INFINITY},
                        {"kv_latent", &LayerData::kv_latent, 95, -INFINITY},
                        {"k_rope", &LayerData::k_rope, 47, NAN},
                        {"index_q", &LayerData::index_q, 100, NAN},
                        {"index_k", &LayerData::index_k, 17, INFINITY},
                        {"index_w", &LayerData::index_w, 11, NAN}};
  for (const Case& c : cases) {
    auto in = h.MakeInputs(batch, DType::kF32, 6);
    HostTensor& t = in[0].*c.member;
    std::memcpy(t.bytes.data() + c.element * 4, &c.value, 4);
    auto step = h.engine().BeginStep(batch);
    ASSERT_TRUE(step.ok());
    absl::Status s = RunAll(h, *step, in);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.tensor;
    EXPECT_NE(s.message().find(absl::StrCat(c.tensor, ": non-finite")), absl::string_view::npos)
        << s;
    EXPECT_NE(s.message().find(absl::StrCat("(element ", c.element, ")")), absl::string_view::npos)
        << s;
    EXPECT_TRUE(TakeSnapshot(h.engine(), {"n"}) == before) << c.tensor;
  }
  // The sequence is exactly as before: later steps match the reference (no NaN key cached).
  h.RunAndCheck({{"n", 40}}, DType::kF32, 7, 1e-5);
  h.RunAndCheck({{"n", 1}}, DType::kF32, 8, 1e-5);
  // bf16 and fp16 NaNs are found too, with the multi-index.
  auto in = h.MakeInputs(batch, DType::kBF16, 9);
  const uint16_t nan16 = 0x7fc1;
  std::memcpy(in[0].index_q.bytes.data() + 2 * (1 * 4 * 16 + 2 * 16 + 5), &nan16, 2);
  auto step = h.engine().BeginStep(batch);
  ASSERT_TRUE(step.ok());
  absl::Status s = RunAll(h, *step, in);
  EXPECT_NE(s.message().find("index_q: non-finite value (NaN or Inf) at [1, 2, 5]"),
            absl::string_view::npos)
      << s;
}

TEST(EngineHardening, TheFiniteCheckCanBeTurnedOff) {
  EngineOptions o = Options();
  o.limits.check_finite = false;
  Harness h(o);
  h.Open("t");
  const std::vector<StepEntry> batch = {{"t", 2}};
  auto in = h.MakeInputs(batch, DType::kF32, 10);
  const float nan = NAN;
  std::memcpy(in[0].q_latent.bytes.data(), &nan, 4);
  auto step = h.engine().BeginStep(batch);
  ASSERT_TRUE(step.ok());
  EXPECT_TRUE(RunAll(h, *step, in).ok());
}

// Found by request_fuzz: index_k on a shared layer of a write-only step went unchecked, and the
// finite scan then read past its bytes. Now it is refused like any indexer tensor there.
TEST(EngineHardening, IndexKeysOnANonFullLayerOfAWriteOnlyStepAreRefused) {
  Harness h(Options());
  h.Open("w");
  const std::vector<StepEntry> batch = {{"w", 3}};
  StepOptions wo;
  wo.write_only = true;
  auto in = h.MakeInputs(batch, DType::kF32, 13);
  auto step = h.engine().BeginStep(batch, wo);
  ASSERT_TRUE(step.ok());
  auto keys = [](const LayerData& d) {
    LayerInputs v;
    v.kv_latent = d.kv_latent.view();
    v.k_rope = d.k_rope.view();
    v.index_k = d.index_k.view();
    return v;
  };
  ASSERT_TRUE(RunLayerInto(h.engine(), *step, 0, keys(in[0]), nullptr, 0).ok());
  LayerInputs bad = keys(in[1]);  // layer 1 is shared: no index_k
  const std::vector<uint8_t> short_keys(5, 0x7f);
  bad.index_k = TensorView::Of(DType::kF32, {1 << 20, 16}, short_keys.data(), short_keys.size());
  const absl::Status s = RunLayerInto(h.engine(), *step, 1, bad, nullptr, 0);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("index_k"), absl::string_view::npos) << s;
  EXPECT_EQ(h.engine().DescribeSequence("w")->length, 0);
}

// Issue 9, case 5: a message for a step that ended learns how it ended.
TEST(EngineHardening, LateMessagesLearnTheirStepsFate) {
  Harness h(Options());
  h.Open("f");
  const std::vector<StepEntry> batch = {{"f", 2}};
  const auto in = h.MakeInputs(batch, DType::kF32, 11);
  std::vector<uint8_t> out(2 * 4 * 32 * 4);
  auto run0 = [&](uint64_t step) {
    return RunLayerInto(h.engine(), step, 0, in[0].inputs(), out.data(), out.size());
  };
  auto aborted = h.engine().BeginStep(batch).value();
  ASSERT_TRUE(h.engine().AbortStep(aborted).ok());
  EXPECT_EQ(run0(aborted).code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(h.engine().DescribeStep(aborted).status().code(), absl::StatusCode::kCancelled);

  auto expired = h.engine().BeginStep(batch).value();
  EXPECT_EQ(h.engine().ExpireIdleSteps(std::chrono::milliseconds(0)), 1);
  const absl::Status e = run0(expired);
  EXPECT_EQ(e.code(), absl::StatusCode::kDeadlineExceeded) << e;
  EXPECT_NE(e.message().find("expired"), absl::string_view::npos);

  auto committed = h.engine().BeginStep(batch).value();
  ASSERT_TRUE(RunAll(h, committed, in).ok());
  EXPECT_EQ(run0(committed).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(run0(987654321).code(), absl::StatusCode::kNotFound);

  auto failed = h.engine().BeginStep(batch).value();
  EXPECT_FALSE(RunLayerInto(h.engine(), failed, 1, in[1].inputs(), out.data(), out.size()).ok());
  const absl::Status f = run0(failed);
  EXPECT_EQ(f.code(), absl::StatusCode::kCancelled);
  EXPECT_NE(f.message().find("out of order"), absl::string_view::npos) << f;
}

// Issue 9, case 6: aborting a step while its layer runs, then beginning a new step with the same
// sequence at once, succeeds: BeginStep waits for the running layer to finish the abort.
TEST(EngineHardening, ABeginRightAfterAnAbortOfARunningLayerSucceeds) {
  EngineOptions o = Options(1024);
  o.threads = 1;
  o.limits.abort_wait = std::chrono::seconds(120);  // longer than any layer, sanitizers included
  Harness h(o);
  h.Open("r");
  const std::vector<StepEntry> big = {{"r", 3000}};
  const auto in = h.MakeInputs(big, DType::kF32, 12);
  int aborted_while_running = 0;
  for (int i = 0; i < 5; ++i) {
    auto step = h.engine().BeginStep(big).value();
    std::vector<uint8_t> out(3000 * 4 * 32 * 4);
    std::promise<void> started;
    auto f = std::async(std::launch::async, [&] {
      started.set_value();
      return RunLayerInto(h.engine(), step, 0, in[0].inputs(), out.data(), out.size());
    });
    started.get_future().wait();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    ASSERT_TRUE(h.engine().AbortStep(step).ok());
    auto again = h.engine().BeginStep({{"r", 1}});
    EXPECT_TRUE(again.ok()) << again.status();
    const absl::Status layer = f.get();
    aborted_while_running += layer.code() == absl::StatusCode::kCancelled;
    if (again.ok()) {
      ASSERT_TRUE(h.engine().AbortStep(*again).ok());
    }
  }
  EXPECT_GT(aborted_while_running, 0) << "the layer should still be running at the abort";
  EXPECT_EQ(h.engine().DescribeSequence("r")->length, 0);
}

}  // namespace
}  // namespace attnd::testing
