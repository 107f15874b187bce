#include "transport/ucx_plane.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <random>
#include <shared_mutex>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"
#include "transport/deadline_timer.h"
#include "transport/plane_wire.h"
#include "transport/ucx_plane_state.h"

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

absl::StatusOr<std::unique_ptr<UcxPlane>> UcxPlane::Create(const Options& options) {
  // UCX itself is checked here (a server asked for a plane it cannot give fails to start, not at
  // its first client): a worker is made and let go. Each plane then gets its own.
  if (auto probe = UcxWorker::Create("attnd", {}, options.devices); !probe.ok())
    return probe.status();
  std::unique_ptr<UcxPlane> p(new UcxPlane(options));
  p->timer_ = std::make_unique<DeadlineTimer>();
  return p;
}

UcxPlane::~UcxPlane() {
  {  // handshakes under way end within UcxWorker::kConnectLimit (the timer decides them)
    std::unique_lock<std::mutex> lock(mu_);
    connects_done_.wait(lock, [&] { return connecting_of_.empty(); });
  }
  CloseAll();
}

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
  if (m.rndv && s->in_flight.load() > options_.max_transfers_under_way) {
    s->in_flight.fetch_sub(1);
    s->Land(h.transfer, h.offset, 0,
            absl::ResourceExhaustedError(absl::StrCat(
                "data plane transfer ", h.transfer, ": ", options_.max_transfers_under_way,
                " transfers already under way on ", s->name, "; nothing written")));
    return;  // not received: UCX drops it
  }
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
  if (!m.rndv) {
    std::memcpy(s->input + h.offset, m.data, m.length);
    bytes_in_->fetch_add(length, std::memory_order_relaxed);
    s->Land(h.transfer, h.offset, length, absl::OkStatus());
    return;
  }
  if (m.worker == nullptr) {  // a handler called by a test, not by UCX: nothing to receive with
    s->in_flight.fetch_sub(1);
    return s->Land(h.transfer, h.offset, 0, absl::InternalError("no worker to receive with"));
  }
  // On this plane's own worker (the handler runs on its thread).
  // Counted once every byte landed (a receive that fails brought none).
  m.worker->Receive(m.data, s->input + h.offset, m.length,
                    [s, h, length, in = bytes_in_](absl::Status st) {
                      if (st.ok()) in->fetch_add(length, std::memory_order_relaxed);
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
  if (s != nullptr && h.transfer == 0) {  // a keepalive: its client lives
    s->Touch();
    return;
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
    // Answered, so that the client's wait ends at once; counted as under way (a client that does
    // not take its answers leaves them queued in UCX), and beyond the plane's limit not answered.
    if (s->in_flight.fetch_add(1) >= options_.max_transfers_under_way) {
      s->in_flight.fetch_sub(1);
      refused_.fetch_add(1);
      return;
    }
    reply.refused = 1;
    m.worker->Reply(m.reply_ep, kToClient, PackHeader(reply), nullptr, 0, s,
                    [s](absl::Status) { s->in_flight.fetch_sub(1); });
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

int UcxPlane::CloseIdle() {
  // Shut after mu_ (stopping a worker waits for its thread, whose handlers take mu_).
  std::vector<std::pair<std::shared_ptr<State>, const char*>> idle;
  {
    std::lock_guard<std::mutex> lock(mu_);
    idle = TakeIdle();
  }
  for (auto& [gone, why] : idle) {
    gone->Lose(absl::UnavailableError(absl::StrCat("data plane closed: ", why)));
    gone->Shut();
  }
  return static_cast<int>(idle.size());
}

std::vector<std::pair<std::shared_ptr<UcxPlane::State>, const char*>> UcxPlane::TakeIdle() {
  std::vector<std::pair<std::shared_ptr<State>, const char*>> idle;
  const absl::Time now = absl::Now();
  for (auto it = planes_.begin(); it != planes_.end();) {
    // A stalled worker's client is gone (it died mid-message), and so is one whose push
    // endpoint failed, or that sends keepalives and missed three: nothing will arrive any more.
    const absl::Duration keepalive = it->second->keepalive;
    const int64_t cutoff = absl::ToUnixNanos(
        now - (keepalive > absl::ZeroDuration() ? 3 * keepalive : options_.idle_timeout));
    const bool quiet = it->second->last_used.load(std::memory_order_relaxed) < cutoff;
    int64_t* count = nullptr;  // the count it goes to, if it goes
    const char* why = nullptr;
    if (!it->second->Lost().ok()) {
      count = &closed_.lost;
      why = "its endpoint to the client failed";
    } else if (it->second->worker->stalled()) {
      count = &closed_.stalled;
      why = "its worker stalled (a message its client began never ended)";
    } else if (quiet && keepalive > absl::ZeroDuration()) {
      count = &closed_.silent;
      why = "its client stopped sending keepalives";
    } else if (quiet) {
      count = &closed_.idle;
      why = "it stood idle";
    }
    if (count != nullptr) {
      ++*count;
      idle.emplace_back(it->second, why);
      closing_.push_back(it->second);
      it = planes_.erase(it);
    } else {
      ++it;
    }
  }
  return idle;
}

// A handshake's slot against the limits, taken by Prepare, given back when the plane is
// published or, however the handshake ends otherwise, when the last holder lets it go.
struct UcxPlane::Reservation {
  UcxPlane* p = nullptr;
  std::string tenant;
  bool held = true;
  void Release() {  // mu_ held
    held = false;
    if (--p->connecting_of_[tenant] == 0) p->connecting_of_.erase(tenant);
  }
  ~Reservation() {
    if (!held) return;
    // Notified under mu_: once it is released, ~UcxPlane may go on (and its condition with it).
    std::lock_guard<std::mutex> lock(p->mu_);
    Release();
    p->connects_done_.notify_all();
  }
};

absl::StatusOr<std::shared_ptr<UcxPlane::State>> UcxPlane::Prepare(
    const std::string& tenant, int64_t input_bytes, int64_t output_bytes, int tenant_limit,
    const std::string& client_address, bool keepalives, std::shared_ptr<Reservation>* reserved) {
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
  (void)CloseIdle();
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
  *reserved = std::make_shared<Reservation>();
  (*reserved)->p = this;
  (*reserved)->tenant = tenant;
  s->name = absl::StrCat("ucx-", s->id);
  s->tenant = tenant;
  if (keepalives) s->keepalive = options_.keepalive;
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
  return s;
}

UcxPlane::Connection UcxPlane::Publish(const std::shared_ptr<State>& s, Reservation& reserved) {
  s->Touch();
  // Built before the plane is published: from then on a Close (or another handshake's reaping)
  // may stop its worker at any moment.
  Connection c{
      s->name,          s->id,           s->token,    s->worker->address(), s->name + ".in",
      s->name + ".out", s->push_ep != 0, s->keepalive};
  {
    std::lock_guard<std::mutex> lock(mu_);
    reserved.Release();
    planes_[s->id] = s;
    connects_done_.notify_all();  // under mu_, as in ~Reservation
  }
  return c;
}

void UcxPlane::Connect(const std::string& tenant, int64_t input_bytes, int64_t output_bytes,
                       int tenant_limit, const std::string& client_address, bool keepalives,
                       Connected done, absl::Duration wire_limit) {
  std::shared_ptr<Reservation> reserved;
  absl::StatusOr<std::shared_ptr<State>> prepared = Prepare(
      tenant, input_bytes, output_bytes, tenant_limit, client_address, keepalives, &reserved);
  if (!prepared.ok()) return done(prepared.status());
  std::shared_ptr<State> s = *std::move(prepared);
  if (!options_.push || output_bytes == 0 || client_address.empty())
    return done(Publish(s, *reserved));
  // The plane's worker connects to the client's: the plane is published once the endpoint is
  // wired up (outputs pushed), or failed, or not wired up within the limit (the client pulls).
  // Nothing waits meanwhile: a client whose address leads nowhere (a firewall, a network policy
  // that lets gRPC through and not UCX) holds no thread for it.
  struct Attempt {
    std::mutex mu;
    bool decided = false, pushing = false;
    uint64_t deadline = 0;  // the timer's id, once armed
    std::shared_ptr<State> s;
    std::shared_ptr<Reservation> reserved;
    Connected done;
  };
  auto a = std::make_shared<Attempt>();
  a->s = s;
  a->reserved = reserved;
  a->done = std::move(done);
  // Once, whichever comes first: publishes the plane, pushing on `push_ep` (0: pulled), and
  // closes `close_ep` (an endpoint given up on) before anyone else can reach the plane. What the
  // attempt held is let go (the endpoint's error callback holds the attempt).
  auto decide = [this, a](uint64_t push_ep, uint64_t close_ep) {
    std::shared_ptr<State> s;
    std::shared_ptr<Reservation> reserved;
    Connected done;
    uint64_t deadline = 0;
    {
      std::lock_guard<std::mutex> lock(a->mu);
      if (a->decided) return;
      a->decided = true;
      a->pushing = push_ep != 0;
      deadline = a->deadline;
      s.swap(a->s);
      reserved.swap(a->reserved);
      done.swap(a->done);
    }
    if (deadline != 0) timer_->Cancel(deadline);
    if (close_ep != 0) s->worker->DisconnectSoon(close_ep);
    s->push_ep = push_ep;
    done(Publish(s, *reserved));
  };
  auto ep = s->worker->BeginConnect(
      client_address,
      // Once pushing, the endpoint failing (its client died or left) ends the plane: calls then
      // fail at once rather than wait for outputs that cannot arrive. Before, a failure is the
      // try's (the flush reports it).
      [a, w = std::weak_ptr<State>(s)](absl::Status st) {
        {
          std::lock_guard<std::mutex> lock(a->mu);
          if (!a->pushing) return;
        }
        if (auto live = w.lock())
          live->Lose(absl::UnavailableError(absl::StrCat(
              "data plane ", live->name, ": its endpoint to the client failed: ", st.message())));
      },
      [decide](uint64_t id, absl::Status st) { decide(st.ok() ? id : 0, 0); });
  if (!ep.ok()) return decide(0, 0);  // no endpoint to it at all (a damaged address): pulled
  std::lock_guard<std::mutex> lock(a->mu);
  if (!a->decided)
    a->deadline = timer_->At(absl::Now() + std::min(wire_limit, UcxWorker::kConnectLimit),
                             [decide, id = *ep] { decide(0, id); });
}

absl::StatusOr<UcxPlane::Connection> UcxPlane::Connect(const std::string& tenant,
                                                       int64_t input_bytes, int64_t output_bytes,
                                                       int tenant_limit,
                                                       const std::string& client_address,
                                                       bool keepalives) {
  std::promise<absl::StatusOr<Connection>> connected;
  std::future<absl::StatusOr<Connection>> outcome = connected.get_future();
  Connect(tenant, input_bytes, output_bytes, tenant_limit, client_address, keepalives,
          [&connected](absl::StatusOr<Connection> c) { connected.set_value(std::move(c)); });
  return outcome.get();
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
        ++closed_.closed;
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
  return PlaneRegion(std::move(s), name, in);
}

UcxPlane::ClosedCounts UcxPlane::closed_counts() const {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
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
