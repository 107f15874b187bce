#include "client/context_parallel.h"

#include <algorithm>
#include <chrono>
#include <future>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/attention_merge.h"
#include "common/candidates.h"

namespace attnd::client {
namespace {

Candidates FromWire(const v1::Candidates& w) {
  Candidates c;
  c.pages = w.pages();
  c.keep = w.keep();
  c.count.assign(w.count().begin(), w.count().end());
  c.keys.assign(w.keys().begin(), w.keys().end());
  c.scores.assign(w.scores().begin(), w.scores().end());
  return c;
}

void ToWire(const Candidates& c, v1::Candidates* w) {
  w->set_pages(c.pages);
  w->set_keep(c.keep);
  w->mutable_count()->Add(c.count.begin(), c.count.end());
  w->mutable_keys()->Add(c.keys.begin(), c.keys.end());
  w->mutable_scores()->Add(c.scores.begin(), c.scores.end());
}

// Calls on every server at once; the replies in server order, or the first error.
template <typename Fn>
absl::StatusOr<std::vector<v1::LayerOutput>> OnEach(size_t n, Fn fn) {
  std::vector<std::future<absl::StatusOr<v1::LayerOutput>>> calls;
  for (size_t k = 0; k < n; ++k) calls.push_back(std::async(std::launch::async, fn, k));
  std::vector<v1::LayerOutput> outs;
  absl::Status first = absl::OkStatus();
  for (auto& c : calls) {
    auto r = c.get();
    if (!r.ok() && first.ok()) first = r.status();
    if (r.ok()) outs.push_back(std::move(r).value());
  }
  if (!first.ok()) return first;
  return outs;
}

}  // namespace

ContextParallelSequence::ContextParallelSequence(std::vector<Client*> servers,
                                                 std::vector<int64_t> starts, std::string id)
    : servers_(std::move(servers)), starts_(std::move(starts)), id_(std::move(id)) {}

absl::Status ContextParallelSequence::Open() {
  if (servers_.empty() || servers_.size() != starts_.size() || starts_[0] != 0 ||
      !std::is_sorted(starts_.begin(), starts_.end()) ||
      std::adjacent_find(starts_.begin(), starts_.end()) != starts_.end())
    return absl::InvalidArgumentError(
        "context parallelism: one start per server, the first 0, strictly ascending");
  // Every server must serve it (an older one would ignore the fields and write an attend-only
  // step's tokens) and serve the same model, with slices starting on its pages.
  std::string model;
  for (size_t k = 0; k < servers_.size(); ++k) {
    auto info = servers_[k]->Info();
    if (!info.ok()) return info.status();
    if (!info->context_parallel())
      return absl::FailedPreconditionError(
          absl::StrCat("context parallelism: server ", k, " (", info->version(),
                       ") does not serve it (an older attnd, or a model with a sliding window)"));
    if (k == 0) model = info->model().SerializeAsString();
    if (info->model().SerializeAsString() != model)
      return absl::FailedPreconditionError(
          absl::StrCat("context parallelism: server ", k, " serves another model than server 0"));
    if (info->model().page_size() <= 0 || starts_[k] % info->model().page_size() != 0)
      return absl::InvalidArgumentError(absl::StrCat("context parallelism: start ", starts_[k],
                                                     " is not a multiple of the page size ",
                                                     info->model().page_size()));
  }
  for (size_t k = 0; k < servers_.size(); ++k) {
    if (auto s = servers_[k]->OpenSequence(id_); !s.ok()) {
      for (size_t j = 0; j < k; ++j) (void)servers_[j]->CloseSequence(id_);
      return s.status();
    }
  }
  return absl::OkStatus();
}

absl::Status ContextParallelSequence::Close() {
  absl::Status first = absl::OkStatus();
  for (Client* c : servers_) {
    absl::Status s = c->CloseSequence(id_);
    if (first.ok()) first = s;
  }
  return first;
}

absl::StatusOr<std::vector<ContextParallelSequence::LayerResult>> ContextParallelSequence::Step(
    int64_t q_len, const std::vector<v1::LayerInputs>& layers, bool attended) {
  const int64_t begin = length_, end = length_ + q_len;
  size_t tail = 0;
  while (tail + 1 < starts_.size() && begin >= starts_[tail + 1]) ++tail;
  if (tail + 1 < starts_.size() && end > starts_[tail + 1])
    return absl::InvalidArgumentError(absl::StrCat(
        "context parallelism: tokens [", begin, ", ", end, ") cross the slice boundary at ",
        starts_[tail + 1], "; split the chunk there into two steps"));
  const size_t n = tail + 1;
  std::vector<uint64_t> steps(n);
  auto abort_all = [&](size_t opened) {
    for (size_t k = 0; k < opened; ++k) (void)servers_[k]->AbortStep(steps[k]);
  };
  for (size_t k = 0; k < n; ++k) {
    v1::BeginStepRequest req;
    auto* e = req.add_batch();
    e->set_sequence_id(id_);
    e->set_q_len(q_len);
    e->set_position_offset(starts_[k]);
    req.set_context_parallel(true);
    if (k < tail) {
      req.set_attend_only(true);
      e->set_query_position(begin);
    }
    auto b = servers_[k]->BeginStep(req);
    if (!b.ok()) {
      abort_all(k);
      return b.status();
    }
    steps[k] = b->step_id();
  }
  candidates_seconds_ = 0;
  std::vector<LayerResult> results;
  for (const v1::LayerInputs& in : layers) {
    const bool full = in.has_index_q();
    auto call = [&](size_t k, bool candidates, const v1::Candidates* selection) {
      v1::LayerInputs mine = in;
      if (k < tail || selection != nullptr) {  // another server's tokens, or written already
        mine.clear_kv_latent();
        mine.clear_k_rope();
        mine.clear_index_k();
      }
      if (candidates) {
        mine.clear_q_latent();
        mine.clear_q_nope();
        mine.clear_q_rope();
        mine.set_return_candidates(true);
      } else {
        mine.clear_index_q();
        mine.clear_index_w();
        if (selection != nullptr) *mine.mutable_selection() = *selection;
        mine.set_return_lse(true);
        mine.set_return_attended(attended);
        mine.set_out_datatype("FP32");  // the parts merge in fp32
      }
      return servers_[k]->AttendLayer(steps[k], mine);
    };
    v1::Candidates selection;
    if (full) {
      const auto t0 = std::chrono::steady_clock::now();
      auto c = OnEach(n, [&](size_t k) { return call(k, true, nullptr); });
      candidates_seconds_ +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (!c.ok()) {
        abort_all(n);
        return c.status();
      }
      std::vector<Candidates> parts;
      for (const auto& o : *c) parts.push_back(FromWire(o.candidates()));
      std::vector<const Candidates*> ptrs;
      for (const auto& p : parts) ptrs.push_back(&p);
      Candidates merged;
      if (absl::Status s = MergeCandidates(ptrs, &merged); !s.ok()) {
        abort_all(n);
        return s;
      }
      ToWire(merged, &selection);
    }
    auto outs = OnEach(n, [&](size_t k) { return call(k, false, full ? &selection : nullptr); });
    if (!outs.ok()) {
      abort_all(n);
      return outs.status();
    }
    std::vector<std::vector<float>> values, lses;
    for (const auto& o : *outs) {
      auto v = TensorValues(o.out());
      auto l = TensorValues(o.lse());
      if (!v.ok() || !l.ok() || v->size() % std::max<size_t>(1, l->size()) != 0 ||
          (!values.empty() && (v->size() != values[0].size() || l->size() != lses[0].size()))) {
        abort_all(n);
        return absl::InternalError("context parallelism: a server's output or lse is malformed");
      }
      values.push_back(std::move(v).value());
      lses.push_back(std::move(l).value());
    }
    LayerResult r;
    const int64_t rows = static_cast<int64_t>(lses[0].size());
    const int64_t dim = rows > 0 ? static_cast<int64_t>(values[0].size()) / rows : 0;
    std::vector<AttentionPart> parts;
    for (size_t k = 0; k < n; ++k) parts.push_back({values[k].data(), lses[k].data()});
    r.out.resize(values[0].size());
    r.lse.resize(rows);
    MergeAttention(parts, rows, dim, r.out.data(), r.lse.data());
    if (attended) {
      r.attended.resize(q_len);
      for (const auto& o : *outs)
        for (int64_t t = 0; t < q_len && t < o.attended_size(); ++t)
          r.attended[t].insert(r.attended[t].end(), o.attended(t).positions().begin(),
                               o.attended(t).positions().end());
      for (auto& a : r.attended) std::sort(a.begin(), a.end());
    }
    results.push_back(std::move(r));
  }
  length_ = end;
  return results;
}

}  // namespace attnd::client
