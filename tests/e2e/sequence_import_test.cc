// client::ImportSequence (client/sequence_import.h), the one import loop of a handoff and a
// drain, between two real attnd processes: every failure leaves nothing on the receiver and the
// source untouched; a whole import holds the source's rows bit for bit.
#include "client/sequence_import.h"

#include <gtest/gtest.h>

#include <random>

#include "client/attnd_client.h"
#include "client/workload.h"
#include "proto/convert/model_spec_proto.h"
#include "tests/server_process.h"

namespace attnd::testing {
namespace {

using client::Client;

// Every ExportChunk of `id` on `c`, in chunks of `chunk` tokens.
std::vector<v1::ExportChunk> Export(Client& c, const std::string& id, int64_t chunk) {
  grpc::ClientContext ctx;
  v1::ExportSequenceRequest req;
  req.set_sequence_id(id);
  req.set_chunk_tokens(chunk);
  auto reader = c.stub()->ExportSequence(&ctx, req);
  std::vector<v1::ExportChunk> rows;
  for (v1::ExportChunk m; reader->Read(&m);) rows.push_back(m);
  const grpc::Status s = reader->Finish();
  EXPECT_TRUE(s.ok()) << s.error_message();
  return rows;
}

// A source over rows[first, last) that fails with `error` when it reaches `fail_at` (-1: never).
client::ExportChunkSource Source(const std::vector<v1::ExportChunk>& rows, size_t first,
                                 size_t last, int64_t fail_at = -1, absl::Status error = {}) {
  return
      [&rows, i = first, last, fail_at, error](v1::ExportChunk* c) mutable -> absl::StatusOr<bool> {
        if (static_cast<int64_t>(i) == fail_at) return error;
        if (i == last) return false;
        *c = rows[i++];
        return true;
      };
}

TEST(SequenceImport, AFailedImportLeavesNothingOnTheReceiverAndAWholeOneHoldsEveryRow) {
  const std::vector<std::string> args = {"--model=tiny", "--kv-pages=100", "--threads=1",
                                         "--metrics-port=0"};
  ServerProcess from_server(ATTND_BINARY, args), to_server(ATTND_BINARY, args);
  auto from = Client::Connect(from_server.target());
  auto to = Client::Connect(to_server.target());
  auto info = from->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  const ModelSpec spec = ModelSpecFromProto(info->model()).value();
  // 45 random tokens: 2 chunks of 32 and 13 tokens, every layer each.
  ASSERT_TRUE(from->OpenSequence("im").ok());
  std::mt19937_64 rng(51);
  auto g = client::GenerateStep(spec, 45, DType::kBF16, false, rng);
  auto b = from->BeginStep({{"im", 45}});
  ASSERT_TRUE(b.ok()) << b.status();
  for (const auto& layer : g) ASSERT_TRUE(from->AttendLayer(b->step_id(), layer.wire).ok());
  const std::vector<v1::ExportChunk> rows = Export(*from, "im", 32);
  const int layers = spec.num_layers();
  ASSERT_EQ(rows.size(), size_t(2 * layers));

  const client::ImportTarget target{.id = "im", .length = 45, .generation = 1};
  struct Case {
    const char* what;
    int64_t length;  // claimed
    client::ExportChunkSource next;
    absl::StatusCode code;
  } cases[] = {
      {"the source fails inside the second chunk (a step open there)", 45,
       Source(rows, 0, rows.size(), layers + 1, absl::UnavailableError("connection lost")),
       absl::StatusCode::kUnavailable},
      {"the source fails before any chunk", 45,
       Source(rows, 0, rows.size(), 0, absl::DataLossError("rows lost")),
       absl::StatusCode::kDataLoss},
      {"the source ends inside a chunk", 45, Source(rows, 0, rows.size() - 1),
       absl::StatusCode::kInternal},
      {"a chunk that begins at layer 1", 45, Source(rows, 1, rows.size()),
       absl::StatusCode::kInternal},
      {"fewer rows than the length", 46, Source(rows, 0, rows.size()), absl::StatusCode::kInternal},
  };
  for (Case& c : cases) {
    SCOPED_TRACE(c.what);
    const absl::Status s =
        client::ImportSequence(*to, {.id = "im", .length = c.length, .generation = 1}, c.next);
    EXPECT_EQ(s.code(), c.code) << s;
    EXPECT_EQ(to->DescribeSequence("im").status().code(), absl::StatusCode::kNotFound);
    auto listed = to->ListSequences();
    ASSERT_TRUE(listed.ok()) << listed.status();
    EXPECT_EQ(listed->sequences_size(), 0);
  }
  // An id the receiver holds already is refused, and its sequence stays.
  ASSERT_TRUE(to->OpenSequence("im").ok());
  EXPECT_EQ(client::ImportSequence(*to, target, Source(rows, 0, rows.size())).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(to->DescribeSequence("im")->length(), 0);
  ASSERT_TRUE(to->CloseSequence("im").ok());

  // The whole export, at another generation: the copy holds every row as the source does, at
  // the generation it was opened with, and it exports the same bytes in other chunks.
  const client::ImportTarget at3{.id = "im", .length = 45, .generation = 3};
  ASSERT_TRUE(client::ImportSequence(*to, at3, Source(rows, 0, rows.size())).ok());
  auto there = to->DescribeSequence("im");
  ASSERT_TRUE(there.ok()) << there.status();
  EXPECT_EQ(there->length(), 45);
  EXPECT_EQ(there->generation(), 3u);
  EXPECT_FALSE(there->importing());
  const auto back = Export(*to, "im", 32);
  ASSERT_EQ(back.size(), rows.size());
  for (size_t i = 0; i < rows.size(); ++i)
    EXPECT_EQ(back[i].SerializeAsString(), rows[i].SerializeAsString()) << "message " << i;
  EXPECT_EQ(from->DescribeSequence("im")->length(), 45);  // the source is untouched
  EXPECT_EQ(from_server.Stop(), 0);
  EXPECT_EQ(to_server.Stop(), 0);
}

}  // namespace
}  // namespace attnd::testing
