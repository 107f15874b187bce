// The layer call: Engine::RunLayer (engine/layer_request.h says the order of its stages).
#include <future>
#include <new>

#include "absl/strings/str_cat.h"
#include "common/guarded.h"
#include "common/status_macros.h"
#include "engine/context_parallel.h"
#include "engine/engine_impl.h"
#include "engine/layer_check.h"

namespace attnd {
namespace {

// Runs fn(i) for every i in [0, n): i > 0 on their own threads, i = 0 on this one (devices
// compute concurrently); returns the first error.
template <typename Fn>
absl::Status ForEachConcurrently(size_t n, Fn fn) {
  std::vector<std::future<absl::Status>> rest;
  for (size_t i = 1; i < n; ++i) rest.push_back(std::async(std::launch::async, fn, i));
  absl::Status status = n > 0 ? fn(size_t{0}) : absl::OkStatus();
  for (auto& f : rest) {
    const absl::Status s = f.get();
    if (status.ok()) status = s;
  }
  return status;
}

}  // namespace

const char* LayerModeName(LayerMode mode) {
  static constexpr const char* kNames[] = {"attend", "candidates", "selection"};
  return kNames[static_cast<int>(mode)];
}

absl::StatusOr<void*> BufferSink::Prepare(const LayerShape& shape) {
  if (bytes_ != shape.out_bytes)
    return absl::InvalidArgumentError(absl::StrCat(
        "output buffer: ", bytes_, " bytes, expected ", shape.out_bytes,
        shape.absorbed ? " ([T, H, V] in " : " ([T, H, L] in ", DTypeName(shape.out_dtype), ")"));
  return data_;
}

absl::StatusOr<LayerShape> Engine::Impl::CheckRequest(const Step& st, const LayerRequest& r,
                                                      const Absorption* absorb) const {
  const ModelSpec& s = spec();
  const int layer = r.layer;  // the step's next layer (Run checked it)
  const LayerInputs& in = r.tensors;
  const bool write_only = st.options.write_only;
  const bool candidates = r.mode == LayerMode::kCandidates;
  const bool full = s.layers[layer] == LayerKind::kFull;
  if ((r.mode == LayerMode::kSelection) != (r.selection != nullptr))
    return absl::InvalidArgumentError(
        r.selection == nullptr ? "selection: the call's mode is selection, but none is given"
                               : "selection: given on a call whose mode is not selection");
  LayerShape shape;
  shape.tokens = st.tokens;
  shape.heads = s.num_heads;
  shape.kind = s.layers[layer];
  shape.last_layer = layer == s.num_layers() - 1;
  const bool output = !write_only && !candidates;
  if (output) {
    shape.out_dtype = OutputDType(in);
    shape.width = OutputHeadDim(s, in, absorb);
    shape.absorbed = in.q_nope.present;
    shape.out_bytes =
        static_cast<size_t>(st.tokens) * s.num_heads * shape.width * DTypeSize(shape.out_dtype);
  }
  if (!st.options.context_parallel) {
    if (candidates)
      return absl::FailedPreconditionError(absl::StrCat(
          "step ", st.id, ": candidates belong to context-parallel steps (a full layer there)"));
    if (r.selection != nullptr)
      return absl::InvalidArgumentError(
          "selection: only context-parallel steps take one (BeginStep context_parallel)");
    RETURN_IF_ERROR(CheckLayerShapes(s, options.cache_dtype, st.tokens, write_only, layer, in,
                                     shape.out_bytes, absorb));
  } else {
    if (candidates && !full)
      return absl::InvalidArgumentError(absl::StrCat("candidates: layer ", layer, " is a ",
                                                     LayerKindName(s.layers[layer]),
                                                     " layer; only full layers select"));
    if (full && candidates == st.candidates_given)
      return absl::FailedPreconditionError(absl::StrCat(
          "step ", st.id, ": layer ", layer,
          candidates
              ? ": its candidates were given already; send the selection and the queries"
              : ": a context-parallel full layer first gives its candidates (RunCandidates)"));
    const CpMessage m = !full        ? CpMessage::kLayer
                        : candidates ? CpMessage::kCandidates
                                     : CpMessage::kSelection;
    RETURN_IF_ERROR(CheckContextParallelShapes(s, options.cache_dtype, st.tokens, layer, m,
                                               st.options.attend_only, r.selection != nullptr, in,
                                               shape.out_bytes, absorb));
  }
  if (candidates && (r.want_lse || r.want_trace))
    return absl::InvalidArgumentError("candidates call: it attends nothing (no lse, no trace)");
  if (write_only && r.want_lse)
    return absl::InvalidArgumentError("return_lse: a write-only step attends nothing");
  if (write_only && r.want_trace)
    return absl::InvalidArgumentError("return_attended: a write-only step attends nothing");
  if (r.want_lse) shape.lse_floats = static_cast<size_t>(st.tokens) * s.num_heads;
  if (r.want_trace) {
    // Token-mode sparse layers with sparse prefill attend at most K keys per query.
    const bool capped = s.layers[layer] != LayerKind::kDense &&
                        s.selection == SelectionMode::kToken && s.prefill == PrefillMode::kSparse;
    shape.trace_positions = capped ? st.topk_keys : st.visible_keys;
  }
  if (candidates) shape.candidates_per_query = CandidatesPerQuery(s);
  return shape;
}

absl::Status Engine::Impl::Compute(Step& st, const LayerRequest& r, const LayerShape& shape,
                                   void* out, const Absorption* absorb, LayerResult* result) {
  const ModelSpec& s = spec();
  const LayerInputs& in = r.tensors;
  const bool candidates = r.mode == LayerMode::kCandidates;
  if (options.limits.check_finite) RETURN_IF_ERROR(CheckLayerFinite(in));
  RETURN_IF_ERROR(CheckFp8Scales(in));
  const LayerKind kind = s.layers[r.layer];
  if (r.want_lse) result->lse.assign(shape.lse_floats, 0.0f);
  LayerCall call;
  call.layer = r.layer;
  call.in = &in;
  call.select = kind == LayerKind::kFull;  // IndexShare: other sparse layers reuse it
  call.out_dtype = shape.out_bytes > 0 ? shape.out_dtype : DType::kBF16;
  call.out = shape.out_bytes > 0 ? static_cast<uint8_t*>(out) : nullptr;
  call.lse = r.want_lse ? result->lse.data() : nullptr;
  if (in.q_nope.present) call.absorb = absorb;
  // Context parallelism: each share's local candidates, or its part of the merged selection.
  const size_t num_shares = st.plan.shares.size();
  std::vector<std::vector<LayerCall::LocalCandidates>> local(candidates ? num_shares : 0);
  std::vector<std::vector<std::vector<int32_t>>> kept;
  if (r.selection != nullptr)
    RETURN_IF_ERROR(LocalSelections(s, st.plan, st.tokens, *r.selection, &kept));
  RETURN_IF_ERROR(ForEachConcurrently(num_shares, [&](size_t i) {
    const StepPlan::Share& sh = st.plan.shares[i];
    LayerCall mine = call;
    if (candidates) {
      local[i].assign(sh.share.size(), {});
      mine.candidates = &local[i];
    }
    if (r.selection != nullptr) mine.selection = &kept[i];
    const auto t0 = EngineClock::now();
    absl::Status status = devices[sh.device]->RunLayer(sh.share, *st.on_device[i], mine);
    compute_ns[sh.device] +=
        std::chrono::duration_cast<std::chrono::nanoseconds>(EngineClock::now() - t0).count();
    return status;
  }));
  if (candidates) {
    result->candidates = GatherCandidates(s, st.plan, st.tokens, local);
    return absl::OkStatus();
  }
  if (!r.want_trace) return absl::OkStatus();
  result->trace.keys.assign(st.tokens, {});
  for (size_t i = 0; i < st.plan.shares.size(); ++i) {
    const StepShare& share = st.plan.shares[i].share;
    std::vector<std::vector<int32_t>> selected;
    if (kind != LayerKind::kDense)
      RETURN_IF_ERROR(
          devices[st.plan.shares[i].device]->SelectedPositions(share, *st.on_device[i], &selected));
    TraceAttended(s, kind, share, &selected, &result->trace.keys);
  }
  return absl::OkStatus();
}

absl::StatusOr<LayerResult> Engine::Impl::Run(const StepRef& ref, LayerSource& source,
                                              LayerSink* sink) {
  const uint64_t step_id = ref.id;
  std::unique_ptr<Step> ended;  // destroyed after the lock is released
  Step* st = nullptr;
  {
    std::lock_guard<EngineMutex> lock(mu);
    ASSIGN_OR_RETURN(st, FindStep(ref));
    if (st->busy) {
      st->abort_requested = true;  // every error aborts the step: the running layer does it
      st->abort_reason = AbortReason::kError;
      return absl::FailedPreconditionError(
          absl::StrCat("step ", step_id, ": a layer is already running; step aborted"));
    }
    if (source.layer() != st->next_layer) {
      const absl::Status why = absl::FailedPreconditionError(
          absl::StrCat("step ", step_id, ": layer ", source.layer(),
                       " out of order, expected layer ", st->next_layer, "; step aborted"));
      ended = AbortLocked(
          st, absl::CancelledError(absl::StrCat("step ", step_id, " was aborted: ", why.message())),
          AbortReason::kError);
      return why;
    }
    st->busy = true;
  }
  // The step is ours until busy is cleared: its fields are read without the lock.
  LayerResult result;
  absl::Status status;
  const LayerRequest* request = nullptr;
  try {
    status = [&]() -> absl::Status {
      ASSIGN_OR_RETURN(request, source.Decode(InfoOf(*st)));
      const LayerRequest& r = *request;
      if (r.layer != st->next_layer)
        return absl::InternalError(absl::StrCat("step ", step_id, ": a call that named layer ",
                                                source.layer(), " decoded as layer ", r.layer));
      const std::shared_ptr<const Absorption> absorb = absorption.Get();  // held for the layer
      ASSIGN_OR_RETURN(result.shape, CheckRequest(*st, r, absorb.get()));
      if (result.shape.last_layer && st->options.commit_by != EngineClock::time_point{} &&
          EngineClock::now() > st->options.commit_by)
        return absl::UnavailableError(absl::StrCat(
            "step ", step_id,
            ": this replica's lease on its standby copies ran out before the "
            "last layer, which would commit (docs/replication.md#leases); step aborted"));
      void* out = nullptr;
      if (sink != nullptr) {
        ASSIGN_OR_RETURN(out, sink->Prepare(result.shape));
      } else if (result.shape.out_bytes > 0) {
        return absl::InvalidArgumentError("output: the call has an output but no sink for it");
      }
      return Compute(*st, r, result.shape, out, absorb.get(), &result);
    }();
  } catch (const std::bad_alloc&) {
    status = absl::ResourceExhaustedError(absl::StrCat("step ", step_id, " layer ", st->next_layer,
                                                       ": out of host memory; step aborted"));
  } catch (const std::exception& e) {
    status = absl::InternalError(
        absl::StrCat("step ", step_id, " layer ", st->next_layer, ": ", e.what()));
  }
  std::lock_guard<EngineMutex> lock(mu);
  st->busy = false;
  st->last_used = EngineClock::now();
  if (!status.ok() || st->abort_requested) {
    const absl::Status fate =
        status.ok() ? absl::CancelledError(absl::StrCat("step ", step_id, " was aborted"))
                    : absl::CancelledError(absl::StrCat(
                          "step ", step_id, " was aborted after an error: ", status.message()));
    ended = AbortLocked(st, fate, status.ok() ? st->abort_reason : AbortReason::kError);
    return status.ok() ? fate : status;
  }
  const LayerRequest& r = *request;
  if (r.mode == LayerMode::kCandidates) {  // the same layer runs next, with the selection
    st->candidates_given = true;
    step_ended.notify_all();
    return result;
  }
  st->candidates_given = false;
  if (++st->next_layer == spec().num_layers()) {
    if (r.want_committed) {
      result.committed_sequences.reserve(st->seqs.size());
      for (const StepSeq& s : st->seqs)
        result.committed_sequences.push_back({s.seq->id, s.new_len});
    }
    ended = CommitLocked(st);
    result.committed = true;
  } else {
    step_ended.notify_all();  // BeginStep may wait for this layer (see TryBegin)
  }
  return result;
}

absl::StatusOr<LayerResult> Engine::RunLayer(const StepRef& step, const LayerRequest& request,
                                             LayerSink* sink) {
  class Given final : public LayerSource {
   public:
    explicit Given(const LayerRequest& r) : r_(r) {}
    int layer() const override { return r_.layer; }
    absl::StatusOr<const LayerRequest*> Decode(const StepInfo&) override { return &r_; }

   private:
    const LayerRequest& r_;
  } given(request);
  return impl_->Run(step, given, sink);
}

absl::StatusOr<LayerResult> Engine::RunLayer(const StepRef& step, LayerSource& source,
                                             LayerSink* sink) {
  return impl_->Run(step, source, sink);
}

}  // namespace attnd
