#include "transport/ucx_plane.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <random>
#include <shared_mutex>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"
#include "transport/deadline_timer.h"
#include "transport/plane_wire.h"

namespace attnd::transport {
namespace {

constexpr size_t kAlignment = 4096;

std::string RandomToken() {
  std::random_device rd;  // /dev/urandom
  std::string t(kTokenBytes, '\0');
  for (size_t i = 0; i < kTokenBytes; i += 4) {
    const uint32_t r = rd();
    std::memcpy(&t[i], &r, 4);
  }
  return t;
}

bool SameToken(const uint8_t* a, const std::string& b) {
  uint8_t diff = 0;  // every byte compared, whatever differs first
  for (size_t i = 0; i < kTokenBytes; ++i) diff |= a[i] ^ static_cast<uint8_t>(b[i]);
  return diff == 0;
}

}  // namespace

// What a plane's regions reach of its worker and of the plane's timer. Closing the plane cuts it
// before the worker goes, so a region a call still holds (a State outlives its plane while one
// does) never touches a destroyed worker: its reads fail as the closed plane's, and its memory,
// unregistered as the worker went, is only freed.
struct UcxPlane::Link {
  std::shared_mutex mu;         // shared while a State uses the worker or timer, exclusive to cut
  UcxWorker* worker = nullptr;  // null once cut
  DeadlineTimer* timer = nullptr;  // the waits for landings (WhenLanded); null once cut
};

struct UcxPlane::State {
  uint64_t id = 0;
  std::string name, tenant, token;
  // The plane's own UCX worker and progress thread: its client's messages arrive in its own
  // shared-memory FIFO, so a client that dies mid-message (which leaves a FIFO slot claimed and
  // never completed, the FIFO stalled for good) stalls only its own plane. Reset by Shut, never
  // on its own thread.
  std::unique_ptr<UcxWorker> worker;
  std::shared_ptr<Link> link;
  std::atomic<int64_t> last_used{0};  // absl::Now() in ns at its last message or call
  // Rendezvous receives into the input region and replies (outputs) under way. One its client
  // stalls never ends (UCX 1.13 cannot cancel it): the plane's worker is then left to the
  // process's exit, and the closed plane still counts against the limits (UcxPlane::closing_).
  std::atomic<int> in_flight{0};
  absl::Duration timeout;
  int max_landed = 0;
  int max_waiting = 0;  // calls waiting for a landing, at most
  // The input region: server memory registered with UCX once.
  char* input = nullptr;
  int64_t input_bytes = 0;
  ucp_mem_h memh = nullptr;
  // The output region's server-side mirror: outputs are built here (registered too) and sent
  // from here to the same offsets of the client's region.
  char* output = nullptr;
  int64_t output_bytes = 0;
  ucp_mem_h output_memh = nullptr;
  // The plane's endpoint to its client's worker (0: none; the client pulls outputs). Set before
  // the plane is published.
  uint64_t push_ep = 0;
  std::shared_ptr<std::atomic<int64_t>> bytes_out;  // the UcxPlane's count

  struct Landed {
    int64_t offset = 0, length = 0;
    absl::Status status;  // non-OK: the transfer was refused or superseded, and why
  };
  mutable std::mutex mu;
  mutable std::condition_variable cv;
  std::map<uint64_t, Landed> landed;
  std::deque<uint64_t> order;  // landing order, for dropping the oldest
  // Outputs built in the mirror and not yet pulled (a plane without push_ep): transfer ->
  // (offset, length).
  std::map<uint64_t, std::pair<int64_t, int64_t>> staged;
  absl::Status lost;  // non-OK once the plane closed

  // Cuts the link and stops the worker: its thread ends first (its transfers end, or, with one
  // its peer left under way, the worker is left to the process's exit, unread and unprogressed),
  // then the registrations go with it. Not on the worker's thread; once only (later calls do
  // nothing). Handlers never read `worker` (they use the worker a message came by).
  void Shut() {
    if (link != nullptr) {
      std::unique_lock<std::shared_mutex> cut(link->mu);  // waits out Views (closed: they end)
      link->worker = nullptr;
      link->timer = nullptr;
    }
    worker.reset();
    memh = output_memh = nullptr;
  }

  // Closing paths Shut first (holding a reference, so that no State goes on its own worker's
  // thread); this is for a plane whose Connect failed part-way. Were it ever on that thread, the
  // worker could not be stopped from there: it is left to the process's exit.
  ~State() {
    if (worker != nullptr && worker->OnThread()) (void)worker.release();
    Shut();
    std::free(input);
    std::free(output);
  }

  // Calls waiting for a transfer to land (InputRegion::WhenLanded), by transfer: each runs once
  // the transfer lands or is refused, the plane closes, or its deadline passes.
  struct Waiter {
    uint64_t id = 0, timer = 0;  // timer: its deadline's DeadlineTimer id (0 until set)
    std::function<void()> ready;
  };
  std::map<std::pair<uint64_t, uint64_t>, Waiter> waiting;  // (transfer, id) -> waiter
  uint64_t next_waiter = 1;

  // Records transfer `t` (progress thread): earlier transfers it overlaps are superseded. Calls
  // waiting for it are run.
  void Land(uint64_t t, int64_t offset, int64_t length, absl::Status status) {
    std::vector<Waiter> ready;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (status.ok())
        for (auto& [id, l] : landed)
          if (l.status.ok() && id != t && l.offset < offset + length &&
              offset < l.offset + l.length)
            l.status = absl::FailedPreconditionError(
                absl::StrCat("data plane transfer ", id, " was overwritten by transfer ", t));
      RecordLocked(t, offset, length, std::move(status));
      TakeWaitersLocked(t, &ready);
    }
    Run(std::move(ready));
  }

  void Lose(absl::Status s) {
    std::vector<Waiter> ready;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (lost.ok()) lost = std::move(s);
      cv.notify_all();
      for (auto& [t, w] : waiting) ready.push_back(std::move(w));
      waiting.clear();
    }
    Run(std::move(ready));
  }

  // Waiter `id`'s deadline passed (the timer's thread): unless its transfer came meanwhile, the
  // transfer is recorded as not arrived, so that the call, run now, fails at once.
  void Expire(uint64_t t, uint64_t id) {
    std::vector<Waiter> ready;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = waiting.find({t, id});
      if (it == waiting.end()) return;  // ran already
      it->second.timer = 0;             // its deadline is the one passing: nothing to cancel
      ready.push_back(std::move(it->second));
      waiting.erase(it);
      if (landed.find(t) == landed.end())
        RecordLocked(t, 0, 0,
                     absl::DeadlineExceededError(
                         absl::StrCat("data plane transfer ", t, " did not arrive within ",
                                      absl::FormatDuration(timeout), " (", name, ".in)")));
    }
    Run(std::move(ready));
  }

  void RecordLocked(uint64_t t, int64_t offset, int64_t length, absl::Status status) {
    if (landed.find(t) == landed.end()) order.push_back(t);
    landed[t] = {offset, length, std::move(status)};
    while (static_cast<int>(order.size()) > max_landed) {
      landed.erase(order.front());
      order.pop_front();
    }
    cv.notify_all();
  }

  void TakeWaitersLocked(uint64_t t, std::vector<Waiter>* out) {
    auto first = waiting.lower_bound({t, 0}), last = waiting.lower_bound({t + 1, 0});
    if (t == UINT64_MAX) last = waiting.end();
    for (auto it = first; it != last; ++it) out->push_back(std::move(it->second));
    waiting.erase(first, last);
  }

  // Runs waiters taken from `waiting` (no lock held), their deadlines cancelled first.
  void Run(std::vector<Waiter> ready) {
    if (ready.empty()) return;
    {
      std::shared_lock<std::shared_mutex> alive(link->mu);
      if (link->timer != nullptr)
        for (const Waiter& w : ready)
          if (w.timer != 0) link->timer->Cancel(w.timer);
    }
    for (Waiter& w : ready) w.ready();
  }

  absl::Status Lost() const {
    std::lock_guard<std::mutex> lock(mu);
    return lost;
  }

  void Touch() { last_used.store(absl::ToUnixNanos(absl::Now()), std::memory_order_relaxed); }

  // Output `t` is in the mirror at [offset, +length): the client may pull it. Outputs it
  // overlaps are gone (their bytes overwritten); the oldest go beyond the bound.
  void Stage(uint64_t t, int64_t offset, int64_t length) {
    std::lock_guard<std::mutex> lock(mu);
    for (auto it = staged.begin(); it != staged.end();) {
      const auto [o, n] = it->second;
      it = o < offset + length && offset < o + n ? staged.erase(it) : std::next(it);
    }
    staged[t] = {offset, length};
    while (static_cast<int>(staged.size()) > max_landed) staged.erase(staged.begin());
  }
};

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
    if (s.link->worker == nullptr) {  // the server's end is gone
      absl::Status lost = s.Lost();
      return lost.ok() ? absl::UnavailableError("data plane closed") : lost;
    }
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
      if (s.landed.count(transfer) != 0 || !s.lost.ok() ||
          static_cast<int>(s.waiting.size()) >= s.max_waiting)
        return false;
      id = s.next_waiter++;
      s.waiting.emplace(std::make_pair(transfer, id),
                        UcxPlane::State::Waiter{id, 0, std::move(ready)});
    }
    // The deadline set after the waiter is in place, so that it cannot pass unseen; its timer id
    // kept for the landing to cancel, unless the waiter ran meanwhile.
    const uint64_t timer = s.link->timer->At(
        absl::Now() + s.timeout, [w = std::weak_ptr<UcxPlane::State>(s_), transfer, id] {
          if (auto live = w.lock()) live->Expire(transfer, id);
        });
    std::lock_guard<std::mutex> lock(s.mu);
    if (auto it = s.waiting.find({transfer, id}); it != s.waiting.end()) it->second.timer = timer;
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
    if (s.link->worker == nullptr) {  // the server's end is gone
      absl::Status lost = s.Lost();
      return lost.ok() ? absl::UnavailableError("data plane closed") : lost;
    }
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

absl::StatusOr<std::unique_ptr<UcxPlane>> UcxPlane::Create(const Options& options) {
  // UCX itself is checked here (a server asked for a plane it cannot give fails to start, not at
  // its first client): a worker is made and let go. Each plane then gets its own.
  if (auto probe = UcxWorker::Create("attnd", {}, options.devices); !probe.ok())
    return probe.status();
  std::unique_ptr<UcxPlane> p(new UcxPlane(options));
  p->timer_ = std::make_unique<DeadlineTimer>();
  return p;
}

UcxPlane::~UcxPlane() { CloseAll(); }

void UcxPlane::OnToServer(const UcxWorker::Message& m, uint64_t arrived_on) {
  ToServerHeader h;
  std::shared_ptr<State> s;
  if (UnpackHeader(m.header, m.header_length, &h) && h.transfer != 0 && h.plane == arrived_on) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = planes_.find(h.plane);
    if (it != planes_.end() && SameToken(h.token, it->second->token)) {
      s = it->second;
      // Counted before mu_ goes, so a Close from now on sees the receive (undone below where
      // none starts).
      if (m.rndv) s->in_flight.fetch_add(1);
    }
  }
  if (s == nullptr) {
    refused_.fetch_add(1);
    return;  // not this plane's: dropped, nothing written
  }
  s->Touch();
  // m.length is the sender's word (a rendezvous's claimed size): compared unsigned, before any
  // conversion, so no claim wraps past the checks.
  if (m.length > static_cast<size_t>(s->input_bytes) || h.offset < 0 ||
      h.offset > s->input_bytes - static_cast<int64_t>(m.length)) {
    if (m.rndv) s->in_flight.fetch_sub(1);
    s->Land(h.transfer, h.offset, 0,
            absl::InvalidArgumentError(absl::StrCat(
                "data plane transfer ", h.transfer, ": ", m.length, " bytes at offset ", h.offset,
                " overrun ", s->name, ".in (", s->input_bytes, " bytes); nothing written")));
    return;
  }
  const int64_t length = static_cast<int64_t>(m.length);
  bytes_in_.fetch_add(length, std::memory_order_relaxed);
  if (!m.rndv) {
    std::memcpy(s->input + h.offset, m.data, m.length);
    s->Land(h.transfer, h.offset, length, absl::OkStatus());
    return;
  }
  if (m.worker == nullptr) {  // a handler called by a test, not by UCX: nothing to receive with
    s->in_flight.fetch_sub(1);
    return s->Land(h.transfer, h.offset, 0, absl::InternalError("no worker to receive with"));
  }
  // On this plane's own worker (the handler runs on its thread).
  m.worker->Receive(m.data, s->input + h.offset, m.length, [s, h, length](absl::Status st) {
    s->in_flight.fetch_sub(1);
    s->Land(h.transfer, h.offset, length, st);
  });
}

void UcxPlane::OnPull(const UcxWorker::Message& m, uint64_t arrived_on) {
  PullHeader h;
  std::shared_ptr<State> s;
  if (UnpackHeader(m.header, m.header_length, &h) && m.length == 0 && h.plane == arrived_on) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = planes_.find(h.plane);
    if (it != planes_.end() && SameToken(h.token, it->second->token)) s = it->second;
  }
  if (s == nullptr || m.reply_ep == nullptr || m.worker == nullptr) {
    refused_.fetch_add(1);
    return;  // not this plane's, or no way to answer: dropped
  }
  s->Touch();
  ToClientHeader reply;
  reply.plane = h.plane;
  reply.transfer = h.transfer;
  reply.offset = h.offset;
  bool found = false;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    auto it = s->staged.find(h.transfer);
    found = it != s->staged.end() && it->second.first == h.offset && it->second.second == h.length;
    if (found) s->staged.erase(it);
  }
  if (!found) {
    reply.refused = 1;  // answered, so that the client's wait ends at once
    m.worker->Reply(m.reply_ep, kToClient, PackHeader(reply), nullptr, 0, nullptr, nullptr);
    return;
  }
  bytes_out_->fetch_add(h.length, std::memory_order_relaxed);
  // From the mirror, which the plane (held until the send completes) keeps; counted while under
  // way, as receives are (a client that stalls a pull leaves it so).
  s->in_flight.fetch_add(1);
  m.worker->Reply(m.reply_ep, kToClient, PackHeader(reply), s->output + h.offset,
                  static_cast<size_t>(h.length), s,
                  [s](absl::Status) { s->in_flight.fetch_sub(1); });
}

std::vector<std::shared_ptr<UcxPlane::State>> UcxPlane::TakeIdle() {
  std::vector<std::shared_ptr<State>> idle;
  const int64_t cutoff = absl::ToUnixNanos(absl::Now() - options_.idle_timeout);
  for (auto it = planes_.begin(); it != planes_.end();) {
    // A stalled worker's client is gone (it died mid-message), and so is one whose push
    // endpoint failed: nothing will arrive any more.
    if (it->second->last_used.load(std::memory_order_relaxed) < cutoff ||
        it->second->worker->stalled() || !it->second->Lost().ok()) {
      idle.push_back(it->second);
      closing_.push_back(it->second);
      it = planes_.erase(it);
    } else {
      ++it;
    }
  }
  return idle;
}

absl::StatusOr<UcxPlane::Connection> UcxPlane::Connect(const std::string& tenant,
                                                       int64_t input_bytes, int64_t output_bytes,
                                                       int tenant_limit,
                                                       const std::string& client_address) {
  for (const auto& [what, v, lo] : {std::tuple{"input_bytes", input_bytes, int64_t{1}},
                                    std::tuple{"output_bytes", output_bytes, int64_t{0}}})
    if (v < lo || v > options_.max_region_bytes)
      return absl::InvalidArgumentError(absl::StrCat(what, ": ", v, " is outside [", lo, ", ",
                                                     options_.max_region_bytes,
                                                     "] (--data-plane-region-bytes)"));
  if (client_address.size() > kMaxClientAddressBytes)
    return absl::InvalidArgumentError(absl::StrCat("worker_address: ", client_address.size(),
                                                   " bytes; a UCX worker address has at most ",
                                                   kMaxClientAddressBytes));
  // Planes closed for idleness are shut after mu_ (stopping a worker waits for its thread, whose
  // handlers take mu_).
  std::vector<std::shared_ptr<State>> idle;
  {
    std::lock_guard<std::mutex> lock(mu_);
    idle = TakeIdle();
  }
  for (auto& gone : idle) {
    gone->Lose(absl::UnavailableError(
        gone->worker != nullptr && gone->worker->stalled()
            ? "data plane closed: its worker stalled (a message its client began never ended)"
            : "data plane closed after it stood idle"));
    gone->Shut();
  }
  auto s = std::make_shared<State>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Planes being connected count as connected (their memory is being taken), so concurrent
    // handshakes cannot pass the limits together; so do closed planes whose client has left a
    // receive under way (their memory stays taken until it ends).
    int closing = 0, mine = 0;
    for (auto it = closing_.begin(); it != closing_.end();) {
      std::shared_ptr<State> c = it->lock();
      if (c == nullptr || c->in_flight.load() == 0) {
        it = closing_.erase(it);
        continue;
      }
      ++closing;
      mine += c->tenant == tenant;
      ++it;
    }
    int connecting = 0;
    for (const auto& [t, n] : connecting_of_) connecting += n;
    if (static_cast<int>(planes_.size()) + connecting + closing >= options_.max_planes)
      return absl::ResourceExhaustedError(absl::StrCat(
          "data plane: ", options_.max_planes, " planes connected (--data-plane-max-planes)"));
    if (auto c = connecting_of_.find(tenant); c != connecting_of_.end()) mine += c->second;
    for (const auto& [id, p] : planes_) mine += p->tenant == tenant;
    if (tenant_limit > 0 && mine >= tenant_limit)
      return absl::ResourceExhaustedError(
          absl::StrCat("data plane: this tenant holds its quota of ", tenant_limit, " planes"));
    s->id = next_id_++;
    ++connecting_of_[tenant];
  }
  struct Reserved {  // the slot taken above, given back however this returns
    UcxPlane* p;
    const std::string& tenant;
    bool held = true;
    void Release() {  // mu_ held
      held = false;
      if (--p->connecting_of_[tenant] == 0) p->connecting_of_.erase(tenant);
    }
    ~Reserved() {
      if (!held) return;
      std::lock_guard<std::mutex> lock(p->mu_);
      Release();
    }
  } reserved{this, tenant};
  s->name = absl::StrCat("ucx-", s->id);
  s->tenant = tenant;
  s->token = RandomToken();
  const uint64_t id = s->id;
  ASSIGN_OR_RETURN(s->worker,
                   UcxWorker::Create(
                       s->name,
                       {{kToServer, [this, id](const UcxWorker::Message& m) { OnToServer(m, id); }},
                        {kPull, [this, id](const UcxWorker::Message& m) { OnPull(m, id); }}},
                       options_.devices));
  s->link = std::make_shared<Link>();
  s->link->worker = s->worker.get();
  s->link->timer = timer_.get();
  s->timeout = options_.transfer_timeout;
  s->max_landed = options_.max_landed;
  s->max_waiting = options_.max_waiting_calls;
  s->input_bytes = input_bytes;
  s->output_bytes = output_bytes;
  s->bytes_out = bytes_out_;
  for (auto [bytes, at, memh] : {std::tuple{input_bytes, &s->input, &s->memh},
                                 std::tuple{output_bytes, &s->output, &s->output_memh}}) {
    if (bytes == 0) continue;
    const size_t alloc = (static_cast<size_t>(bytes) + kAlignment - 1) / kAlignment * kAlignment;
    *at = static_cast<char*>(std::aligned_alloc(kAlignment, alloc));
    if (*at == nullptr)
      return absl::ResourceExhaustedError(
          absl::StrCat("data plane: cannot allocate ", bytes, " bytes"));
    ASSIGN_OR_RETURN(*memh, s->worker->Register(*at, alloc));
  }
  if (options_.push && output_bytes > 0 && !client_address.empty()) {
    // The endpoint failing (its client died or left) ends the plane: calls then fail at once
    // rather than wait for outputs that cannot arrive. A client that cannot be reached pulls.
    auto ep = s->worker->Connect(client_address, [w = std::weak_ptr<State>(s)](absl::Status st) {
      if (auto live = w.lock())
        live->Lose(absl::UnavailableError(absl::StrCat(
            "data plane ", live->name, ": its endpoint to the client failed: ", st.message())));
    });
    if (ep.ok()) s->push_ep = *ep;
  }
  s->Touch();
  // Built before the plane is published: from then on a Close (or another handshake's reaping)
  // may stop its worker at any moment.
  Connection c{s->name,          s->id,          s->token, s->worker->address(), s->name + ".in",
               s->name + ".out", s->push_ep != 0};
  {
    std::lock_guard<std::mutex> lock(mu_);
    reserved.Release();
    planes_[s->id] = s;
  }
  return c;
}

absl::Status UcxPlane::Close(const std::string& tenant, const std::string& name) {
  std::shared_ptr<State> s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = planes_.begin(); it != planes_.end(); ++it)
      if (it->second->name == name && it->second->tenant == tenant) {
        s = it->second;
        closing_.push_back(s);
        planes_.erase(it);
        break;
      }
  }
  if (s == nullptr) return absl::NotFoundError(absl::StrCat("no data plane ", name));
  s->Lose(absl::FailedPreconditionError(absl::StrCat("data plane ", name, " was closed")));
  s->Shut();
  return absl::OkStatus();
}

void UcxPlane::CloseAll() {
  std::map<uint64_t, std::shared_ptr<State>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    all.swap(planes_);
  }
  for (auto& [id, s] : all) {
    s->Lose(absl::UnavailableError("the server is stopping"));
    s->Shut();
  }
}

bool UcxPlane::Names(const std::string& region) { return absl::StartsWith(region, "ucx-"); }

absl::StatusOr<std::shared_ptr<const Region>> UcxPlane::Resolve(const std::string& tenant,
                                                                const std::string& what,
                                                                const std::string& name,
                                                                int64_t offset,
                                                                int64_t size) const {
  absl::string_view rest = name;
  const bool in = absl::ConsumeSuffix(&rest, ".in");
  const bool out = !in && absl::ConsumeSuffix(&rest, ".out");
  uint64_t id = 0;
  std::shared_ptr<State> s;
  if ((in || out) && absl::ConsumePrefix(&rest, "ucx-") && absl::SimpleAtoi(rest, &id)) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = planes_.find(id);
    if (it != planes_.end() && it->second->tenant == tenant &&
        it->second->name == absl::StrCat("ucx-", rest))
      s = it->second;
  }
  if (s == nullptr) return absl::NotFoundError(absl::StrCat(what, ": no data plane region ", name));
  s->Touch();
  const int64_t bytes = in ? s->input_bytes : s->output_bytes;
  if (offset < 0 || size < 0 || offset > bytes || size > bytes - offset)
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": [", offset, ", +", size, ") lies outside ", name, " (", bytes, " bytes)"));
  if (in) return std::make_shared<InputRegion>(std::move(s), name);
  return std::make_shared<OutputRegion>(std::move(s), name);
}

int UcxPlane::num_planes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(planes_.size());
}

int UcxPlane::planes_of(const std::string& tenant) const {
  std::lock_guard<std::mutex> lock(mu_);
  int n = 0;
  for (const auto& [id, p] : planes_) n += p->tenant == tenant;
  return n;
}

}  // namespace attnd::transport
