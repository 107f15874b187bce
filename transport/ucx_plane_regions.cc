// The regions of a UCX data plane as layer calls see them (transport/region.h): the input
// region, whose transfers a call waits for and reads in place, and the output region, whose
// outputs are built in the server's mirror and pushed to the client or staged for its pull.
#include <cstring>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "transport/plane_wire.h"
#include "transport/ucx_plane_state.h"

namespace attnd::transport {
namespace {

class InputRegion final : public Region {
 public:
  InputRegion(std::shared_ptr<UcxPlane::State> s, std::string name)
      : s_(std::move(s)), name_(std::move(name)) {}
  const std::string& name() const override { return name_; }
  int64_t size() const override { return s_->input_bytes; }
  absl::Status Read(int64_t offset, void* dst, size_t n, uint64_t transfer,
                    absl::Time deadline) const override {
    ASSIGN_OR_RETURN(const char* at, View(offset, n, transfer, deadline));
    std::memcpy(dst, at, n);
    return absl::OkStatus();
  }
  void WhenLanded(uint64_t transfer, std::function<void()> ready) const override {
    if (!Await(transfer, ready)) ready();  // outside the locks: `ready` may read a region
  }
  absl::StatusOr<const char*> View(int64_t offset, size_t n, uint64_t transfer,
                                   absl::Time deadline) const override {
    if (transfer == 0)
      return absl::InvalidArgumentError(
          absl::StrCat(name_, ": a data plane tensor names the transfer that brought it"));
    UcxPlane::State& s = *s_;
    std::shared_lock<std::shared_mutex> alive(s.link->mu);
    if (s.link->worker == nullptr) return s.Closed();  // the server's end is gone
    std::unique_lock<std::mutex> lock(s.mu);
    auto here = [&] { return s.landed.count(transfer) != 0 || !s.lost.ok(); };
    if (!here() && absl::Now() < deadline) {
      UcxWorker::Busy busy(s.link->worker);  // the progress thread polls while this waits
      s.cv.wait_until(lock, absl::ToChronoTime(deadline), here);
    }
    auto it = s.landed.find(transfer);
    if (it == s.landed.end()) {
      if (!s.lost.ok()) return s.lost;
      return absl::DeadlineExceededError(
          absl::StrCat("data plane transfer ", transfer, " did not arrive in time (", name_, ")"));
    }
    const auto l = it->second;
    if (!l.status.ok()) return l.status;
    const int64_t end = offset + static_cast<int64_t>(n);
    if (offset < l.offset || end > l.offset + l.length)
      return absl::InvalidArgumentError(absl::StrCat(
          "data plane transfer ", transfer, " brought bytes [", l.offset, ", ", l.offset + l.length,
          ") of ", name_, "; the call names [", offset, ", ", end, ")"));
    return static_cast<const char*>(s.input + offset);
  }
  absl::Status Write(int64_t, const void*, size_t, uint64_t) const override {
    return NotForOutputs();
  }
  // Asked of a call's output regions before its layer runs: an input region is refused there,
  // not after the layer (when its step may have committed).
  absl::Status CheckStillCovers(int64_t, size_t) const override {
    if (absl::Status lost = s_->Lost(); !lost.ok()) return lost;
    return NotForOutputs();
  }

 private:
  // Registers `ready` to run when `transfer` lands (or fails to, or the plane's timeout passes);
  // false, `ready` untouched, when it should run now: the transfer already landed, the plane is
  // closed, or the plane holds its most calls waiting (then the call runs and, if its bytes are
  // not there, fails at once).
  bool Await(uint64_t transfer, std::function<void()>& ready) const {
    UcxPlane::State& s = *s_;
    std::shared_lock<std::shared_mutex> alive(s.link->mu);
    if (transfer == 0 || s.link->worker == nullptr) return false;  // View says why
    uint64_t id = 0;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      if (s.landed.count(transfer) != 0 || !s.lost.ok()) return false;
      if (static_cast<int>(s.waiting.size()) >= s.max_waiting) {
        // Not waited for: the call runs now and finds this, unless the bytes land first (their
        // landing replaces it).
        s.RecordLocked(
            transfer, 0, 0,
            absl::ResourceExhaustedError(absl::StrCat(
                "data plane transfer ", transfer, " had not arrived, and ", s.max_waiting,
                " calls already wait for transfers on ", name_, "; this one could not")));
        return false;
      }
      id = s.next_waiter++;
      s.waiting.emplace(std::make_pair(transfer, id),
                        UcxPlane::State::Waiter{id, 0, std::move(ready)});
    }
    // The deadline set after the waiter is in place, so that it cannot pass unseen; its timer id
    // kept for the landing to cancel, or cancelled here when the waiter ran meanwhile.
    const uint64_t timer = s.link->timer->At(
        absl::Now() + s.timeout, [w = std::weak_ptr<UcxPlane::State>(s_), transfer, id] {
          if (auto live = w.lock()) live->Expire(transfer, id);
        });
    {
      std::lock_guard<std::mutex> lock(s.mu);
      if (auto it = s.waiting.find({transfer, id}); it != s.waiting.end()) {
        it->second.timer = timer;
        return true;
      }
    }
    s.link->timer->Cancel(timer);  // it ran meanwhile (landed): no deadline left pending
    return true;
  }

  absl::Status NotForOutputs() const {
    return absl::InvalidArgumentError(
        absl::StrCat(name_, " is an input region; outputs go to the plane's output region"));
  }

  std::shared_ptr<UcxPlane::State> s_;
  std::string name_;
};

class OutputRegion final : public Region {
 public:
  OutputRegion(std::shared_ptr<UcxPlane::State> s, std::string name)
      : s_(std::move(s)), name_(std::move(name)) {}
  const std::string& name() const override { return name_; }
  int64_t size() const override { return s_->output_bytes; }
  absl::Status Read(int64_t, void*, size_t, uint64_t, absl::Time) const override {
    return absl::InvalidArgumentError(
        absl::StrCat(name_, " is an output region; inputs come from the plane's input region"));
  }
  char* Staging(int64_t offset, size_t n) const override { return s_->output + offset; }
  absl::Status Write(int64_t offset, const void* src, size_t n, uint64_t transfer) const override {
    if (transfer == 0)
      return absl::InvalidArgumentError(
          absl::StrCat(name_, ": an output sent by the data plane names its transfer"));
    if (absl::Status s = s_->Lost(); !s.ok()) return s;
    if (static_cast<const char*>(src) != s_->output + offset)
      return absl::InternalError(absl::StrCat(name_, ": outputs are built in its staging"));
    if (s_->push_ep != 0) return Push(transfer, offset, n);
    // The client pulls it once the reply names it (UcxPlane::OnPull).
    s_->Stage(transfer, offset, static_cast<int64_t>(n));
    return absl::OkStatus();
  }
  absl::Status CheckStillCovers(int64_t, size_t) const override { return s_->Lost(); }

 private:
  // Sends the output to the same place of the client's region now, beside the reply (which the
  // client waits for too): from the mirror, which the plane (held until the send completes)
  // keeps; counted while under way, as receives are. A send that fails is the client's to see
  // (its wait ends when the endpoint fails, or at its deadline).
  absl::Status Push(uint64_t transfer, int64_t offset, size_t n) const {
    UcxPlane::State& s = *s_;
    std::shared_lock<std::shared_mutex> alive(s.link->mu);
    if (s.link->worker == nullptr) return s.Closed();  // the server's end is gone
    ToClientHeader h;
    h.plane = s.id;
    h.transfer = transfer;
    h.offset = offset;
    s.in_flight.fetch_add(1);
    s.bytes_out->fetch_add(static_cast<int64_t>(n), std::memory_order_relaxed);
    s.link->worker->Send(
        s.push_ep, kToClient, PackHeader(h), s.output + offset, n,
        [held = s_](absl::Status) { held->in_flight.fetch_sub(1); }, s_);
    return absl::OkStatus();
  }

  std::shared_ptr<UcxPlane::State> s_;
  std::string name_;
};

}  // namespace

std::shared_ptr<const Region> PlaneRegion(std::shared_ptr<UcxPlane::State> s, std::string name,
                                          bool input) {
  if (input) return std::make_shared<InputRegion>(std::move(s), std::move(name));
  return std::make_shared<OutputRegion>(std::move(s), std::move(name));
}

}  // namespace attnd::transport
