#include "transport/ucx_plane_client.h"

#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "transport/plane_wire.h"

namespace attnd::transport {
namespace {
constexpr int64_t kPiece = 256;
constexpr size_t kAlignment = 4096;
constexpr size_t kMaxLanded = 4096;  // outputs landed and not awaited (a bound, not a target)
}  // namespace

int64_t SpaceMap::Take(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (bytes <= 0 || bytes > size_) return -1;  // checked before rounding: no overflow
  bytes = (bytes + kPiece - 1) / kPiece * kPiece;
  int64_t at = 0;
  for (const auto& [off, len] : used_) {
    if (off - at >= bytes) break;
    at = off + len;
  }
  if (at > size_ - bytes) return -1;
  used_[at] = bytes;
  return at;
}

void SpaceMap::Reset(int64_t size) {
  std::lock_guard<std::mutex> lock(mu_);
  size_ = size;
  used_.clear();
}

void SpaceMap::Give(int64_t offset) {
  std::lock_guard<std::mutex> lock(mu_);
  used_.erase(offset);
}

absl::StatusOr<std::unique_ptr<UcxPlaneClient>> UcxPlaneClient::Create(int64_t output_bytes,
                                                                       const std::string& devices) {
  if (output_bytes < 0) return absl::InvalidArgumentError("output_bytes < 0");
  std::unique_ptr<UcxPlaneClient> c(new UcxPlaneClient(output_bytes));
  auto w = UcxWorker::Create(
      "attnd-client",
      {{kToClient, [raw = c.get()](const UcxWorker::Message& m) { raw->OnToClient(m); }}}, devices);
  if (!w.ok()) return w.status();
  c->worker_ = std::move(*w);
  if (output_bytes > 0) {
    const size_t alloc =
        (static_cast<size_t>(output_bytes) + kAlignment - 1) / kAlignment * kAlignment;
    c->out_ = static_cast<char*>(std::aligned_alloc(kAlignment, alloc));
    if (c->out_ == nullptr) return absl::ResourceExhaustedError("data plane output region");
    auto memh = c->worker_->Register(c->out_, alloc);
    if (!memh.ok()) return memh.status();
    c->memh_ = *memh;
  }
  return c;
}

UcxPlaneClient::~UcxPlaneClient() {
  if (worker_ != nullptr) {
    if (endpoint_ != 0) worker_->Disconnect(endpoint_);
    if (memh_ != nullptr) worker_->Unregister(memh_);
    worker_.reset();  // the thread stops: nothing lands in out_ after this
  }
  std::free(out_);
}

absl::Status UcxPlaneClient::Attach(uint64_t plane, const std::string& token,
                                    const std::string& server_address, int64_t input_bytes,
                                    bool pushes) {
  if (token.size() != kTokenBytes)
    return absl::InvalidArgumentError("data plane: the handshake's token has the wrong size");
  plane_ = plane;
  token_ = token;
  pushes_ = pushes;
  input_.Reset(input_bytes);
  auto ep = worker_->Connect(server_address, [this](absl::Status s) {
    std::lock_guard<std::mutex> lock(mu_);
    lost_ = std::move(s);
    cv_.notify_all();
  });
  if (!ep.ok()) return ep.status();
  endpoint_ = *ep;
  return absl::OkStatus();
}

void UcxPlaneClient::KeepAlive(absl::Duration period) {
  PullHeader h;  // a pull of transfer 0, which names no output: "this end lives"
  h.plane = plane_;
  std::memcpy(h.token, token_.data(), kTokenBytes);
  // On the worker's own thread, which stops before the worker goes (and the endpoint, once
  // disconnected, takes no more sends).
  worker_->Every(period, [w = worker_.get(), ep = endpoint_, header = PackHeader(h)] {
    (void)w->Send(ep, kPull, header, nullptr, 0);
  });
}

std::shared_ptr<UcxWorker::Pending> UcxPlaneClient::Put(const void* src, size_t n, int64_t offset,
                                                        uint64_t transfer) {
  ToServerHeader h;
  h.plane = plane_;
  std::memcpy(h.token, token_.data(), kTokenBytes);
  h.transfer = transfer;
  h.offset = offset;
  return worker_->Send(endpoint_, kToServer, PackHeader(h), src, n);
}

std::shared_ptr<UcxWorker::Pending> UcxPlaneClient::PutPieces(std::vector<UcxWorker::Piece> pieces,
                                                              int64_t offset, uint64_t transfer) {
  ToServerHeader h;
  h.plane = plane_;
  std::memcpy(h.token, token_.data(), kTokenBytes);
  h.transfer = transfer;
  h.offset = offset;
  return worker_->SendPieces(endpoint_, kToServer, PackHeader(h), std::move(pieces));
}

void UcxPlaneClient::Land(uint64_t transfer, int64_t offset, int64_t length, absl::Status s) {
  std::lock_guard<std::mutex> lock(mu_);
  LandLocked(transfer, offset, length, std::move(s));
}

void UcxPlaneClient::LandLocked(uint64_t transfer, int64_t offset, int64_t length, absl::Status s) {
  if (landed_.size() >= kMaxLanded) landed_.erase(landed_.begin());  // the oldest id
  landed_[transfer] = {offset, length, std::move(s)};
  cv_.notify_all();
}

void UcxPlaneClient::OnToClient(const UcxWorker::Message& m) {
  ToClientHeader h;
  if (!UnpackHeader(m.header, m.header_length, &h) || h.plane != plane_) return;
  if (h.refused != 0) {
    std::lock_guard<std::mutex> lock(mu_);
    landed_[h.transfer] = {h.offset, 0,
                           absl::NotFoundError(absl::StrCat("data plane: the server holds no "
                                                            "output ",
                                                            h.transfer, " to send"))};
    cv_.notify_all();
    return;
  }
  // m.length is the sender's word (compared unsigned, before any conversion).
  if (h.offset < 0 || m.length > static_cast<size_t>(output_.size()) ||
      h.offset > output_.size() - static_cast<int64_t>(m.length))
    return Land(h.transfer, h.offset, 0,
                absl::InternalError("data plane: the server sent an output outside the region"));
  const int64_t length = static_cast<int64_t>(m.length);
  char* dest = out_ + h.offset;
  // Into the caller's buffer, or pushed: written while Forget waits (counted), so that no buffer
  // is freed and no space handed to another call with a write into it under way.
  bool counted = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Sent unasked: only an output of a call this client waits for (one given up on may come
    // late, into space another call took since).
    if (pushes_ && wanted_.erase(h.transfer) == 0) return;
    auto it = expected_.find(h.transfer);
    if (it != expected_.end()) {
      if (it->second.second != m.length) {
        expected_.erase(it);
        landed_[h.transfer] = {h.offset, length,
                               absl::InternalError("data plane: an output of the wrong size")};
        cv_.notify_all();
        return;
      }
      dest = it->second.first;
    }
    if (it != expected_.end() || pushes_) {
      if (!m.rndv) {  // copied under mu_: Forget cannot return meanwhile
        std::memcpy(dest, m.data, m.length);
        return LandLocked(h.transfer, h.offset, length, absl::OkStatus());
      }
      ++receiving_[h.transfer];
      counted = true;
    }
  }
  if (!m.rndv) {
    std::memcpy(dest, m.data, m.length);
    return Land(h.transfer, h.offset, length, absl::OkStatus());
  }
  worker_->Receive(m.data, dest, m.length, [this, h, length, counted](absl::Status s) {
    if (counted) {
      std::lock_guard<std::mutex> lock(mu_);
      if (--receiving_[h.transfer] == 0) receiving_.erase(h.transfer);
    }
    Land(h.transfer, h.offset, length, std::move(s));
  });
}

absl::Status UcxPlaneClient::Lost() {
  std::lock_guard<std::mutex> lock(mu_);
  return lost_;
}

void UcxPlaneClient::Want(uint64_t transfer) {
  std::lock_guard<std::mutex> lock(mu_);
  if (pushes_) wanted_.insert(transfer);
}

void UcxPlaneClient::Expect(uint64_t transfer, char* dest, size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  expected_[transfer] = {dest, n};
}

absl::StatusOr<const char*> UcxPlaneClient::Await(uint64_t transfer, int64_t offset, size_t n,
                                                  absl::Time deadline) {
  UcxWorker::Busy busy(worker_.get());  // the progress thread polls while this waits
  if (pushes_) return AwaitLanding(transfer, offset, n, deadline);
  // Ask for it: the server answers on this message's endpoint (kToClient).
  PullHeader pull;
  pull.plane = plane_;
  std::memcpy(pull.token, token_.data(), kTokenBytes);
  pull.transfer = transfer;
  pull.offset = offset;
  pull.length = static_cast<int64_t>(n);
  // A pull that cannot go (the endpoint failed or was closed) ends the wait at once.
  auto asked = worker_->Send(
      endpoint_, kPull, PackHeader(pull), nullptr, 0,
      [this](absl::Status s) {
        if (s.ok()) return;
        std::lock_guard<std::mutex> lock(mu_);
        if (lost_.ok()) lost_ = std::move(s);
        cv_.notify_all();
      },
      nullptr, /*want_reply=*/true);
  return AwaitLanding(transfer, offset, n, deadline);
}

absl::StatusOr<const char*> UcxPlaneClient::AwaitLanding(uint64_t transfer, int64_t offset,
                                                         size_t n, absl::Time deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_until(lock, absl::ToChronoTime(deadline),
                 [&] { return landed_.count(transfer) != 0 || !lost_.ok(); });
  auto it = landed_.find(transfer);
  if (it == landed_.end()) {
    wanted_.erase(transfer);
    if (!lost_.ok()) return lost_;
    return absl::DeadlineExceededError(
        absl::StrCat("data plane: output transfer ", transfer, " did not arrive"));
  }
  const Landed l = it->second;
  landed_.erase(it);
  wanted_.erase(transfer);
  auto ex = expected_.find(transfer);
  const char* dest = ex != expected_.end() ? ex->second.first : out_ + offset;
  if (ex != expected_.end()) expected_.erase(ex);
  if (!l.status.ok()) return l.status;
  if (l.offset != offset || l.length != static_cast<int64_t>(n))
    return absl::InternalError(absl::StrCat("data plane: output transfer ", transfer,
                                            " landed at [", l.offset, ", +", l.length,
                                            "), expected [", offset, ", +", n, ")"));
  return dest;
}

void UcxPlaneClient::Forget(uint64_t transfer) {
  std::unique_lock<std::mutex> lock(mu_);
  landed_.erase(transfer);
  wanted_.erase(transfer);
  // A receive of this transfer already under way (into the caller's buffer, or pushed into the
  // region) still writes: it is waited out (UCX 1.13 cannot cancel a receive; it ends when its
  // bytes land or the endpoint fails, which UCX detects for a server that died). Receives of
  // other transfers are not.
  expected_.erase(transfer);
  cv_.wait(lock, [&] { return receiving_.count(transfer) == 0; });
}

}  // namespace attnd::transport
