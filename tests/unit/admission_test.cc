// The admission rules (engine/admission.h) as pure functions: each refusal's status and words,
// and the attended-key bounds against a brute-force count.
#include "engine/admission.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>

namespace attnd::testing {
namespace {

ModelSpec Tiny() {
  auto s = PresetModelSpec("tiny");
  EXPECT_TRUE(s.ok()) << s.status();
  return *s;
}

void ExpectRefused(const absl::Status& s, absl::StatusCode code, const char* words) {
  EXPECT_EQ(s.code(), code) << s;
  EXPECT_NE(s.message().find(words), std::string::npos) << s;
}

TEST(Admission, CappedKeysEqualsTheSumOverEveryQuery) {
  std::mt19937 rng(7);
  for (int i = 0; i < 2000; ++i) {
    const int64_t len = rng() % 300, q = 1 + rng() % 300, k = 1 + rng() % 400;
    int64_t want = 0;
    for (int64_t p = len; p < len + q; ++p) want += std::min(p + 1, k);
    ASSERT_EQ(CappedKeys(len, q, k), want) << len << " " << q << " " << k;
  }
}

TEST(Admission, EntryKeysBoundWhatTheQueriesSee) {
  const ModelSpec s = Tiny();
  const AttendedKeys ordinary = EntryKeys(s, false, 10, 3);  // positions 10, 11, 12
  EXPECT_EQ(ordinary.visible, 11 + 12 + 13);
  EXPECT_EQ(ordinary.topk, CappedKeys(10, 3, s.index_topk));
  const AttendedKeys attend_only = EntryKeys(s, true, 10, 3);  // every query sees the slice
  EXPECT_EQ(attend_only.visible, 30);
  EXPECT_EQ(attend_only.topk, 3 * std::min<int64_t>(10, s.index_topk));
}

TEST(Admission, StepOptionsThatContradictEachOtherAreRefused) {
  StepOptions o;
  EXPECT_TRUE(CheckStepOptions(o).ok());
  o.attend_only = true;
  ExpectRefused(CheckStepOptions(o), absl::StatusCode::kInvalidArgument, "attend_only");
  o.context_parallel = true;
  EXPECT_TRUE(CheckStepOptions(o).ok());
  o.attend_only = false;
  o.write_only = true;
  ExpectRefused(CheckStepOptions(o), absl::StatusCode::kInvalidArgument, "not with write_only");
}

TEST(Admission, EntriesAreCheckedInOrderOfTheirRules) {
  const ModelSpec s = Tiny();
  EngineLimits lim;
  lim.max_step_tokens = 100;
  const StepOptions plain;
  EXPECT_TRUE(CheckEntry(s, lim, plain, 0, {"a", 4}, "a", 10, 0).ok());
  ExpectRefused(CheckEntry(s, lim, plain, 2, {"a", 0}, "a", 10, 0),
                absl::StatusCode::kInvalidArgument, "step batch[2] ('a'): q_len 0");
  ExpectRefused(CheckEntry(s, lim, plain, 0, {"a", 2}, "a", s.max_context - 1, 0),
                absl::StatusCode::kOutOfRange, "exceeds max_context");
  ExpectRefused(CheckEntry(s, lim, plain, 1, {"a", 5}, "a", 0, 96),
                absl::StatusCode::kInvalidArgument, "--max-step-tokens");
  EXPECT_TRUE(CheckEntry(s, lim, plain, 1, {"a", 4}, "a", 0, 96).ok());  // exactly at the limit
}

TEST(Admission, ContextParallelSlicesArePageAlignedAndQueriesFollowTheirKeys) {
  const ModelSpec s = Tiny();
  const int64_t P = s.page_size;
  StepEntry e{"a", 2};
  e.position_offset = P;
  EXPECT_TRUE(CheckSlice(s, 0, "a", 5, e, false).ok());
  e.position_offset = P + 1;
  ExpectRefused(CheckSlice(s, 0, "a", 5, e, false), absl::StatusCode::kInvalidArgument,
                "multiple of the page size");
  e.position_offset = -P;
  ExpectRefused(CheckSlice(s, 0, "a", 5, e, false), absl::StatusCode::kInvalidArgument,
                "position_offset");
  e.position_offset = P;
  e.query_position = P + 5;
  ExpectRefused(CheckSlice(s, 0, "a", 5, e, false), absl::StatusCode::kInvalidArgument,
                "attend-only steps");
  EXPECT_TRUE(CheckSlice(s, 0, "a", 5, e, true).ok());
  e.query_position = P + 4;  // before the slice's last key
  ExpectRefused(CheckSlice(s, 0, "a", 5, e, true), absl::StatusCode::kOutOfRange,
                "must follow this slice's keys");
  e.query_position = P + 5;
  ExpectRefused(CheckSlice(s, 0, "a", 0, e, true), absl::StatusCode::kInvalidArgument,
                "holds none");
  e.query_position = 0;
  e.position_offset = 0;
  ExpectRefused(CheckSlice(s, 0, "a", s.max_context - 1, e, false), absl::StatusCode::kOutOfRange,
                "exceeds max_context");
}

}  // namespace
}  // namespace attnd::testing
