#include "client/sequence_import.h"

#include "absl/strings/str_cat.h"
#include "client/attnd_client.h"

namespace attnd::client {

absl::Status ImportSequence(Client& to, const ImportTarget& target, const ExportChunkSource& next) {
  v1::OpenSequenceRequest open;
  open.set_sequence_id(target.id);
  open.set_import_length(target.length);
  open.set_import_generation(target.generation);
  if (auto s = to.OpenSequence(open); !s.ok()) return s.status();
  uint64_t step = 0;  // the open write-only step, if any
  auto fail = [&](absl::Status s) {
    // A sequence in a step cannot be closed: the step goes first.
    if (step != 0) (void)to.AbortStep(step);
    (void)to.CloseSequence(target.id);
    return s;
  };
  v1::ExportChunk chunk;
  for (;;) {
    absl::StatusOr<bool> more = next(&chunk);
    if (!more.ok()) return fail(more.status());
    if (!*more) break;
    if (chunk.keys().layer() == 0) {
      v1::BeginStepRequest begin;
      begin.set_write_only(true);
      v1::BatchEntry* e = begin.add_batch();
      e->set_sequence_id(target.id);
      e->set_q_len(chunk.tokens());
      *e->mutable_block_hashes() = chunk.block_hashes();  // its blocks, for the prefix cache
      auto begun = to.BeginStep(begin);
      if (!begun.ok()) return fail(begun.status());
      step = begun->step_id();
    }
    if (step == 0)
      return fail(absl::InternalError(absl::StrCat(
          "import of ", target.id, ": a chunk began at layer ", chunk.keys().layer(), ", not 0")));
    auto out = to.AttendLayer(step, chunk.keys());
    if (!out.ok()) return fail(out.status());
    if (out->committed()) step = 0;  // the chunk's last layer commits its step
  }
  if (step != 0)
    return fail(absl::InternalError(
        absl::StrCat("import of ", target.id, ": the source ended inside a chunk")));
  auto there = to.DescribeSequence(target.id);
  if (!there.ok()) return fail(there.status());
  if (there->length() != target.length || there->importing())
    return fail(
        absl::InternalError(absl::StrCat("import of ", target.id, ": the receiver holds ",
                                         there->length(), " of ", target.length, " tokens")));
  if (there->generation() != target.generation)  // an older attnd drops import_generation
    return fail(absl::FailedPreconditionError(absl::StrCat(
        "import of ", target.id, ": the receiver holds it at generation ", there->generation(),
        ", not ", target.generation, " (an attnd that keeps no generations?)")));
  return absl::OkStatus();
}

}  // namespace attnd::client
