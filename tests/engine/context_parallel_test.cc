// Context parallelism in the engine (docs/numerics.md): one sequence split over 2 and 3 engines,
// each holding a page-aligned slice, equals one engine holding it all (itself checked against the
// float64 oracle) for every layer kind and selection mode, through chunked prefill and decode:
// outputs merged by log-sum-exp (fp32, <= 1e-5 relative L2) and the attended keys.
#include "engine/context_parallel.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "common/status_macros.h"
#include "tests/context_parallel_split.h"
#include "tests/run_layer.h"

namespace attnd::testing {
namespace {

ModelSpec CpSpec(SelectionMode mode, PrefillMode prefill) {
  ModelSpec s = MixedLayerSpec(mode);
  s.sliding_window = 0;  // context parallelism serves no sliding window
  s.prefill = prefill;
  return s;
}

EngineOptions Options(const ModelSpec& spec) {
  EngineOptions o;
  o.spec = spec;
  o.cache_dtype = DType::kF32;
  o.pages_per_device = 96;
  o.threads = 2;
  return o;
}

using Param = std::tuple<SelectionMode, PrefillMode, int>;

class ContextParallel : public ::testing::TestWithParam<Param> {};

TEST_P(ContextParallel, EqualsOneEngineHoldingTheWholeSequence) {
  const auto [mode, prefill, parts] = GetParam();
  const ModelSpec spec = CpSpec(mode, prefill);
  // Slices of 3 and 2 pages (then the rest): prefill chunks cross no boundary, decode does.
  std::vector<int64_t> bounds =
      parts == 2 ? std::vector<int64_t>{0, 48, 1 << 20} : std::vector<int64_t>{0, 48, 80, 1 << 20};
  Harness whole(Options(spec));
  whole.Open("s");
  ContextParallelSplit split(Options(spec), bounds);
  std::vector<int64_t> steps = {30, 18, 20, 12};   // prefill to 80 in chunks within the slices
  for (int d = 0; d < 6; ++d) steps.push_back(1);  // then decode on the last part
  if (parts == 2) steps = {40, 8, 30, 10, 1, 1, 1, 1, 1};
  double worst = 0;
  uint64_t seed = 100;
  for (int64_t q : steps) {
    ++seed;
    const auto layers = RandomLayers(spec, q, DType::kF32, seed);
    const auto ref = whole.RunAndCheck({{"s", q}}, DType::kF32, seed, 1e-5);
    auto got = split.Step(q, layers);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(ref.size(), got->out.size());
    for (int l = 0; l < spec.num_layers(); ++l) {
      const double err = RelL2(got->out[l], ref[l]);
      ASSERT_FALSE(std::isnan(err));
      EXPECT_LE(err, 1e-5) << "layer " << l << " q " << q;
      worst = std::max(worst, err);
    }
  }
  EXPECT_GT(worst, 0.0) << "two summation orders: the comparison is live";
}

// The attended keys, against one engine's traces, with every layer kind and mode.
TEST_P(ContextParallel, SelectsWhatOneEngineSelects) {
  const auto [mode, prefill, parts] = GetParam();
  const ModelSpec spec = CpSpec(mode, prefill);
  std::vector<int64_t> bounds =
      parts == 2 ? std::vector<int64_t>{0, 64, 1 << 20} : std::vector<int64_t>{0, 32, 64, 1 << 20};
  auto whole = Engine::Create(Options(spec));
  ASSERT_TRUE(whole.ok());
  ASSERT_TRUE((*whole)->OpenSequence(SequenceKey("", "s")).ok());
  ContextParallelSplit split(Options(spec), bounds);
  std::vector<int64_t> steps =
      parts == 2 ? std::vector<int64_t>{64, 9, 1, 1, 1} : std::vector<int64_t>{32, 32, 7, 1, 1};
  uint64_t seed = 300;
  int sparse_checked = 0;
  for (int64_t q : steps) {
    const auto layers = RandomLayers(spec, q, DType::kF32, ++seed);
    auto id = (*whole)->BeginStep({{"s", q}});
    ASSERT_TRUE(id.ok());
    std::vector<LayerTrace> traces(spec.num_layers());
    std::vector<float> out(static_cast<size_t>(q) * spec.num_heads * spec.kv_lora_rank);
    for (int l = 0; l < spec.num_layers(); ++l)
      ASSERT_TRUE(
          RunLayerInto(**whole, *id, l, layers[l].inputs(), out.data(), 4 * out.size(), &traces[l])
              .ok());
    auto got = split.Step(q, layers);
    ASSERT_TRUE(got.ok()) << got.status();
    for (int l = 0; l < spec.num_layers(); ++l)
      for (int64_t t = 0; t < q; ++t) {
        EXPECT_EQ(got->keys[l][t], traces[l].keys[t]) << "layer " << l << " query " << t;
        if (spec.layers[l] != LayerKind::kDense &&
            traces[l].keys[t].size() < static_cast<size_t>(traces[l].keys[t].back() + 1))
          ++sparse_checked;  // a real selection, not every visible key
      }
  }
  EXPECT_GT(sparse_checked, 0);
}

// Every bad context-parallel request is refused with a precise status, aborts its step and
// leaves the sequence as it was.
TEST(ContextParallelHardening, BadRequestsAreRefusedAndChangeNothing) {
  const ModelSpec spec = CpSpec(SelectionMode::kToken, PrefillMode::kSparse);
  auto e = Engine::Create(Options(spec));
  ASSERT_TRUE(e.ok());
  Engine& engine = **e;
  ASSERT_TRUE(engine.OpenSequence(SequenceKey("", "s")).ok());
  ASSERT_TRUE(engine.OpenSequence(SequenceKey("", "empty")).ok());
  // 40 tokens at positions [16, 56): a second slice.
  StepOptions cp;
  cp.context_parallel = true;
  StepOptions attend = cp;
  attend.attend_only = true;
  StepEntry tail{"s", 40};
  tail.position_offset = 16;
  {
    auto id = engine.BeginStep({tail}, cp);
    ASSERT_TRUE(id.ok()) << id.status();
    const auto layers = RandomLayers(spec, 40, DType::kF32, 1);
    std::vector<float> out(40 * spec.num_heads * spec.kv_lora_rank);
    for (int l = 0; l < spec.num_layers(); ++l) {
      Candidates c;
      if (spec.layers[l] == LayerKind::kFull) {
        ASSERT_TRUE(RunCandidatesInto(engine, *id, l, Part(layers[l], true, false, true), &c).ok());
      }
      LayerInputs in = Part(layers[l], spec.layers[l] != LayerKind::kFull, true, false);
      const Candidates* sel = spec.layers[l] == LayerKind::kFull ? &c : nullptr;
      ASSERT_TRUE(
          RunLayerInto(engine, *id, l, in, out.data(), 4 * out.size(), nullptr, nullptr, sel).ok());
    }
  }
  ASSERT_EQ(engine.DescribeSequence(SequenceKey("", "s"))->length, 40);
  auto unchanged = [&] {
    EXPECT_EQ(engine.DescribeSequence(SequenceKey("", "s"))->length, 40);
    EXPECT_EQ(engine.num_open_steps(), 0);
  };
  auto begin_fails = [&](std::vector<StepEntry> b, const StepOptions& o, absl::StatusCode code,
                         const char* words) {
    auto id = engine.BeginStep(b, o);
    ASSERT_FALSE(id.ok());
    EXPECT_EQ(id.status().code(), code) << id.status();
    EXPECT_NE(id.status().message().find(words), std::string::npos) << id.status();
    unchanged();
  };
  StepEntry q{"s", 2};
  q.position_offset = 16;
  q.query_position = 56;
  StepOptions only = attend;
  only.context_parallel = false;
  begin_fails({q}, only, absl::StatusCode::kInvalidArgument, "context-parallel step's option");
  StepOptions wo = cp;
  wo.write_only = true;
  begin_fails({tail}, wo, absl::StatusCode::kInvalidArgument, "not with write_only");
  StepEntry odd = q;
  odd.position_offset = 17;
  begin_fails({odd}, attend, absl::StatusCode::kInvalidArgument, "multiple of the page size");
  StepEntry early = q;
  early.query_position = 55;
  begin_fails({early}, attend, absl::StatusCode::kOutOfRange, "must follow this slice's keys");
  StepEntry empty{"empty", 1};
  empty.query_position = 5;
  begin_fails({empty}, attend, absl::StatusCode::kInvalidArgument, "holds none");
  StepEntry stray = tail;
  stray.query_position = 3;
  begin_fails({stray}, cp, absl::StatusCode::kInvalidArgument, "attend-only steps");
  StepEntry far = tail;
  far.position_offset = spec.max_context - 32;
  begin_fails({far}, cp, absl::StatusCode::kOutOfRange, "exceeds max_context");

  const auto layers = RandomLayers(spec, 2, DType::kF32, 2);
  std::vector<float> out(2 * spec.num_heads * spec.kv_lora_rank);
  // Layer calls that are refused (each aborts its step).
  auto layer_fails = [&](const StepOptions& o, auto&& call, absl::StatusCode code,
                         const char* words) {
    auto id = engine.BeginStep({o.attend_only ? q : StepEntry{"s", 2, 16, 0}}, o);
    ASSERT_TRUE(id.ok()) << id.status();
    const absl::Status st = call(*id);
    EXPECT_EQ(st.code(), code) << st;
    EXPECT_NE(st.message().find(words), std::string::npos) << st;
    unchanged();
  };
  Candidates c;
  layer_fails(
      attend,
      [&](uint64_t id) {
        return RunLayerInto(engine, id, 0, Part(layers[0], false, true, false), out.data(),
                            4 * out.size());
      },
      absl::StatusCode::kFailedPrecondition, "first gives its candidates");
  layer_fails(
      attend, [&](uint64_t id) { return RunCandidatesInto(engine, id, 0, layers[0].inputs(), &c); },
      absl::StatusCode::kInvalidArgument, "an attend-only step writes nothing");
  layer_fails(
      cp,
      [&](uint64_t id) {
        RETURN_IF_ERROR(RunCandidatesInto(engine, id, 0, Part(layers[0], true, false, true), &c));
        return RunCandidatesInto(engine, id, 0, Part(layers[0], true, false, true), &c);
      },
      absl::StatusCode::kFailedPrecondition, "candidates were given already");
  // Selections that do not fit the step.
  auto bad_selection = [&](auto&& edit, const char* words) {
    layer_fails(
        attend,
        [&](uint64_t id) {
          Candidates got;
          RETURN_IF_ERROR(
              RunCandidatesInto(engine, id, 0, Part(layers[0], false, false, true), &got));
          EXPECT_EQ(got.count.size(), 2u);
          EXPECT_EQ(got.count[0], 24) << "the slice's 40 keys, top 24";
          edit(got);
          LayerInputs in = Part(layers[0], false, true, false);
          return RunLayerInto(engine, id, 0, in, out.data(), 4 * out.size(), nullptr, nullptr,
                              &got);
        },
        absl::StatusCode::kInvalidArgument, words);
  };
  bad_selection([](Candidates& g) { g.count.pop_back(); }, "counts for a step of 2 queries");
  bad_selection([](Candidates& g) { g.keys[0] = 57; }, "cannot see position 57");
  bad_selection([](Candidates& g) { g.keys[0] = -1; }, "cannot see position -1");
  bad_selection([](Candidates& g) { g.keys[1] = g.keys[0]; }, "twice");
  bad_selection([](Candidates& g) { g.scores.pop_back(); }, "scores given");
  bad_selection(
      [](Candidates& g) {
        g.count[0] += 1;
        g.keys.insert(g.keys.begin(), 0);
        g.scores.insert(g.scores.begin(), 0.0f);
      },
      "at most 24");
  bad_selection([](Candidates& g) { g.pages = true; }, "must be positions");
  // A selection on an ordinary step; candidates on an ordinary step or a shared layer.
  {
    auto id = engine.BeginStep({{"s", 2}});
    ASSERT_TRUE(id.ok());
    LayerInputs in = layers[0].inputs();
    const absl::Status st =
        RunLayerInto(engine, *id, 0, in, out.data(), 4 * out.size(), nullptr, nullptr, &c);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    unchanged();
    id = engine.BeginStep({{"s", 2}});
    EXPECT_EQ(RunCandidatesInto(engine, *id, 0, layers[0].inputs(), &c).code(),
              absl::StatusCode::kFailedPrecondition);
    unchanged();
  }
  // Still serving: an attend-only step over the slice.
  auto id = engine.BeginStep({q}, attend);
  ASSERT_TRUE(id.ok()) << id.status();
  for (int l = 0; l < spec.num_layers(); ++l) {
    Candidates got;
    if (spec.layers[l] == LayerKind::kFull) {
      ASSERT_TRUE(
          RunCandidatesInto(engine, *id, l, Part(layers[l], false, false, true), &got).ok());
    }
    LayerInputs in = Part(layers[l], false, true, false);
    const Candidates* sel = spec.layers[l] == LayerKind::kFull ? &got : nullptr;
    ASSERT_TRUE(
        RunLayerInto(engine, *id, l, in, out.data(), 4 * out.size(), nullptr, nullptr, sel).ok())
        << l;
  }
  unchanged();  // attend-only: nothing written
  for (float v : out) ASSERT_FALSE(std::isnan(v));
}

TEST(ContextParallelHardening, ASlidingWindowModelRefusesIt) {
  auto e = Engine::Create(Options(MixedLayerSpec(SelectionMode::kToken)));  // window 40
  ASSERT_TRUE(e.ok());
  ASSERT_TRUE((*e)->OpenSequence(SequenceKey("", "s")).ok());
  StepOptions cp;
  cp.context_parallel = true;
  auto id = (*e)->BeginStep({{"s", 4}}, cp);
  EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(id.status().message().find("sliding window"), std::string::npos);
}

std::string ParamName(const ::testing::TestParamInfo<Param>& info) {
  const char* mode = std::get<0>(info.param) == SelectionMode::kToken       ? "token"
                     : std::get<0>(info.param) == SelectionMode::kPageUnion ? "union"
                                                                            : "budget";
  return std::string(mode) +
         (std::get<1>(info.param) == PrefillMode::kDense ? "_dense_" : "_sparse_") +
         std::to_string(std::get<2>(info.param)) + "servers";
}

INSTANTIATE_TEST_SUITE_P(
    Modes, ContextParallel,
    ::testing::Combine(::testing::Values(SelectionMode::kToken, SelectionMode::kPageUnion,
                                         SelectionMode::kPageBudget),
                       ::testing::Values(PrefillMode::kSparse, PrefillMode::kDense),
                       ::testing::Values(2, 3)),
    ParamName);

}  // namespace
}  // namespace attnd::testing
