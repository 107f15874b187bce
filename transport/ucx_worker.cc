#include "transport/ucx_worker.h"

#include <ifaddrs.h>
#include <net/if.h>
#include <poll.h>
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <future>
#include <initializer_list>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace attnd::transport {
namespace {

absl::Status UcxError(const char* what, ucs_status_t s) {
  return absl::UnavailableError(absl::StrCat(what, ": ", ucs_status_string(s)));
}

// Whether UCX_TLS's value `tls` lets UCX pick any of the transports `names` ("all", a list
// naming one, or a "^" list of exclusions naming none).
bool MayUse(const std::string& tls, std::initializer_list<const char*> names) {
  if (tls == "all") return true;
  const bool named = std::any_of(names.begin(), names.end(),
                                 [&](const char* n) { return tls.find(n) != std::string::npos; });
  return tls[0] == '^' ? !named : named;
}

// attnd's settings for UCX where the operator set none of `set_by` in the environment: given to
// each worker's context (ucp_config_modify), never written to the process's environment (which
// the client library shares with its host program, and child processes inherit). Each only where
// UCX_TLS may pick one of `transports` (UCX warns about a setting no transport took).
struct Default {
  std::initializer_list<const char*> set_by;
  const char* key;  // UCX's name for the setting, without the transport's own prefix
  const char* value;
  std::initializer_list<const char*> transports;
};
const Default kDefaults[] = {
    // Endpoints detect a dead peer (UCP_ERR_HANDLING_MODE_PEER), which drops the shared-memory
    // transports unless their error handling is on.
    {{"UCX_POSIX_ERROR_HANDLING", "UCX_SYSV_ERROR_HANDLING"},
     "MM_ERROR_HANDLING",
     "y",
     {"sm", "shm", "posix", "sysv"}},
    // TCP connects without blocking: UCX 1.13's default blocks in connect() inside
    // ucp_ep_create, on the progress thread, until the kernel gives up on a peer that never
    // answers (two minutes with Linux's SYN retries), and no Connect limit of ours would hold.
    {{"UCX_TCP_CONN_NB"}, "CONN_NB", "y", {"tcp"}},
};

// How long the progress thread polls after activity before it sleeps on the worker's event fd:
// a message that follows soon is picked up without a wakeup (ATTND_UCX_SPIN_US, default 50).
constexpr auto kBusySpin = std::chrono::milliseconds(10);
// Events pending that progress never takes for this long: the worker is stalled (a shared-memory
// FIFO whose writer died between claiming a slot and filling it reads as pending forever). The
// thread then looks again every kStalledNap instead of spinning.
constexpr auto kStall = std::chrono::seconds(10);
constexpr auto kStalledNap = std::chrono::milliseconds(10);

// Sends this large keep the worker polling until they finish (UcxWorker::Busy); smaller ones go
// eagerly. ATTND_UCX_SEND_BUSY=0: none do.
constexpr size_t kBusySendBytes = 64 << 10;

bool SendsHoldBusy() {
  const char* v = getenv("ATTND_UCX_SEND_BUSY");
  return v == nullptr || std::string(v) != "0";
}

std::chrono::microseconds SpinTime() {
  const char* v = getenv("ATTND_UCX_SPIN_US");
  const long us = v != nullptr ? strtol(v, nullptr, 10) : 50;
  return std::chrono::microseconds(us < 0 ? 0 : us > 100000 ? 100000 : us);
}

}  // namespace

std::string UcxVersion() {
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  return absl::StrCat(major, ".", minor, ".", release);
}

std::string LoopbackDevices() {
  ifaddrs* all = nullptr;
  if (getifaddrs(&all) != 0) return "";
  std::set<std::string> names;
  for (const ifaddrs* a = all; a != nullptr; a = a->ifa_next)
    if ((a->ifa_flags & IFF_LOOPBACK) != 0 && a->ifa_name != nullptr) names.insert(a->ifa_name);
  freeifaddrs(all);
  return absl::StrJoin(names, ",");
}

std::string UcxNetDevices(const std::string& devices) {
  if (const char* set = getenv("UCX_NET_DEVICES"); set != nullptr)
    return *set != '\0' ? set : "none";  // UCX reads an empty list as no device
  return devices.empty() ? "all" : devices;
}

std::string UcxTransports() {
  const char* tls = getenv("UCX_TLS");
  return tls != nullptr && *tls != '\0' ? tls : "all";
}

absl::StatusOr<std::unique_ptr<UcxWorker>> UcxWorker::Create(const std::string& name,
                                                             std::map<uint16_t, Handler> handlers,
                                                             const std::string& devices) {
  std::unique_ptr<UcxWorker> w(new UcxWorker());
  ucp_config_t* config = nullptr;
  if (ucs_status_t s = ucp_config_read(nullptr, nullptr, &config); s != UCS_OK)
    return UcxError("UCX configuration", s);
  if (!devices.empty() && getenv("UCX_NET_DEVICES") == nullptr)
    if (ucs_status_t s = ucp_config_modify(config, "NET_DEVICES", devices.c_str()); s != UCS_OK) {
      ucp_config_release(config);
      return UcxError("UCX network devices", s);
    }
  const std::string tls = UcxTransports();
  for (const Default& d : kDefaults) {
    if (std::any_of(d.set_by.begin(), d.set_by.end(),
                    [](const char* v) { return getenv(v) != nullptr; }) ||
        !MayUse(tls, d.transports))
      continue;
    if (ucs_status_t s = ucp_config_modify(config, d.key, d.value); s != UCS_OK) {
      ucp_config_release(config);
      return UcxError(absl::StrCat("UCX setting ", d.key).c_str(), s);
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  // Active messages only, never RMA: with UCP_FEATURE_RMA a peer's put through UCX's own API,
  // with an rkey the peer packed for its own memory, lands at any address it names in this
  // process, over shared memory and TCP alike (ucx_plane_test's AnRmaPut... fails so).
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.name = name.c_str();
  ucs_status_t s = ucp_init(&params, config, &w->context_);
  ucp_config_release(config);
  if (s != UCS_OK) return UcxError("UCX init", s);
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  if (s = ucp_worker_create(w->context_, &wp, &w->worker_); s != UCS_OK)
    return UcxError("UCX worker", s);
  ucp_address_t* addr = nullptr;
  size_t addr_len = 0;
  if (s = ucp_worker_get_address(w->worker_, &addr, &addr_len); s != UCS_OK)
    return UcxError("UCX worker address", s);
  w->address_.assign(reinterpret_cast<const char*>(addr), addr_len);
  ucp_worker_release_address(w->worker_, addr);
  for (auto& [id, fn] : handlers) {
    auto slot = std::make_unique<HandlerSlot>(HandlerSlot{w.get(), std::move(fn)});
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    hp.id = id;
    hp.cb = &UcxWorker::OnMessage;
    hp.arg = slot.get();
    hp.flags = UCP_AM_FLAG_WHOLE_MSG;
    if (s = ucp_worker_set_am_recv_handler(w->worker_, &hp); s != UCS_OK)
      return UcxError("UCX handler", s);
    w->handlers_[id] = std::move(slot);
  }
  w->thread_ = std::thread([raw = w.get()] { raw->Loop(); });
  return w;
}

UcxWorker::~UcxWorker() {
  if (thread_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    ucp_worker_signal(worker_);
    thread_.join();
  }
  if (in_flight_.load() > 0) {
    // Transfers with a peer that died mid-way never complete, and UCX asserts (aborts) when a
    // worker with such requests is destroyed: the worker is left to the process's exit instead.
    std::fprintf(stderr,
                 "attnd: data plane: %d transfer(s) with a lost peer never completed; the UCX "
                 "worker is released at exit\n",
                 in_flight_.load());
    return;
  }
  // Memory still registered (its owner outlives this worker) is released here: UCX asserts when
  // a context goes with registrations in use.
  for (ucp_mem_h memh : registered_) (void)ucp_mem_unmap(context_, memh);
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
  if (context_ != nullptr) ucp_cleanup(context_);
}

void UcxWorker::Post(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(fn));
  }
  ucp_worker_signal(worker_);
}

void UcxWorker::Every(absl::Duration period, std::function<void()> fn) {
  Post([this, period = absl::ToChronoNanoseconds(period), fn = std::move(fn)]() mutable {
    periodic_.push_back({period, std::chrono::steady_clock::now() + period, std::move(fn)});
  });
}

void UcxWorker::Run(const std::function<void()>& fn) {
  if (std::this_thread::get_id() == thread_.get_id()) return fn();
  std::promise<void> done;
  Post([&] {
    fn();
    done.set_value();
  });
  done.get_future().wait();
}

void UcxWorker::Loop() {
  int efd = -1;
  (void)ucp_worker_get_efd(worker_, &efd);
  const auto spin = SpinTime();
  auto active = std::chrono::steady_clock::now();
  for (;;) {
    std::deque<std::function<void()>> work;
    bool stop;
    {
      std::lock_guard<std::mutex> lock(mu_);
      work.swap(queue_);
      stop = stop_;
    }
    for (auto& fn : work) fn();
    if (stop && work.empty()) break;
    bool progressed = !work.empty();
    while (ucp_worker_progress(worker_) != 0) progressed = true;
    const auto now = std::chrono::steady_clock::now();
    for (Periodic& p : periodic_)
      if (now >= p.next) {
        p.fn();
        p.next = now + p.period;
      }
    if (progressed) {
      active = now;
      stalled_.store(false, std::memory_order_relaxed);
    }
    // Busy (someone waits, or a transfer is under way): poll on while anything moved in the
    // last kBusySpin; a transfer that stalls (its peer died) does not keep a core spinning.
    if (now - active < (busy_.load(std::memory_order_relaxed) > 0 ? kBusySpin : spin)) continue;
    if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) {
      if (now - active >= kStall) {
        stalled_.store(true, std::memory_order_relaxed);
        std::this_thread::sleep_for(kStalledNap);
      }
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!queue_.empty() || stop_) continue;
    }
    pollfd p{efd, POLLIN, 0};
    (void)poll(&p, 1, efd >= 0 ? 100 : 1);
  }
  // Closing: every endpoint forced shut (their pending sends complete with an error).
  std::vector<ucs_status_ptr_t> closing;
  for (auto& [id, e] : endpoints_) {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    closing.push_back(ucp_ep_close_nbx(e->ep, &p));
  }
  for (ucs_status_ptr_t r : closing) {
    if (r == nullptr || UCS_PTR_IS_ERR(r)) continue;
    while (ucp_request_check_status(r) == UCS_INPROGRESS) ucp_worker_progress(worker_);
    ucp_request_free(r);
  }
  endpoints_.clear();
  // Transfers still under way get a moment to finish (or fail) before the worker goes.
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
  while (in_flight_.load() > 0 && std::chrono::steady_clock::now() < until)
    ucp_worker_progress(worker_);
  while (ucp_worker_progress(worker_) != 0) {
  }
}

ucs_status_t UcxWorker::OnMessage(void* arg, const void* header, size_t header_length, void* data,
                                  size_t length, const ucp_am_recv_param_t* param) {
  auto* slot = static_cast<HandlerSlot*>(arg);
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  ucp_ep_h reply =
      (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 ? param->reply_ep : nullptr;
  slot->fn(Message{header, header_length, data, length, rndv, reply, slot->worker});
  return UCS_OK;  // eager data is copied by the handler; a rendezvous it did not take is dropped
}

void UcxWorker::OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* e = static_cast<Endpoint*>(arg);
  UcxWorker* w = e->worker;
  const uint64_t id = e->id;
  if (e->on_error)
    e->on_error(
        absl::UnavailableError(absl::StrCat("data plane peer lost: ", ucs_status_string(status))));
  // The endpoint is closed after this callback returns (UCX's rule for failed endpoints).
  w->Post([w, id] { w->Disconnect(id); });
}

absl::StatusOr<uint64_t> UcxWorker::BeginConnect(const std::string& address, EndpointError on_error,
                                                 Wired wired) {
  absl::StatusOr<uint64_t> result = absl::InternalError("not run");
  Run([&] {
    auto e = std::make_unique<Endpoint>();
    e->on_error = std::move(on_error);
    e->id = next_endpoint_++;
    e->worker = this;
    ucp_ep_params_t p{};
    p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                   UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.address = reinterpret_cast<const ucp_address_t*>(address.data());
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = &UcxWorker::OnEndpointError;
    p.err_handler.arg = e.get();
    if (ucs_status_t s = ucp_ep_create(worker_, &p, &e->ep); s != UCS_OK) {
      result = UcxError("data plane endpoint", s);
      return;
    }
    result = e->id;
    endpoints_[e->id] = std::move(e);
  });
  if (!result.ok()) return result;
  // Wired up once a flush completes (it waits for the endpoint to connect), with this worker
  // polling meanwhile: the first transfer does not wait for the handshake, which a sleeping
  // progress thread on either side would otherwise stretch past a call's transfer timeout.
  struct Flush {
    std::unique_ptr<Busy> busy;
    Wired wired;
    UcxWorker* w;
    uint64_t id;
    void Done(ucs_status_t s) {
      busy.reset();
      // A failed endpoint is closed after UCX's callback returns (UCX's rule for them).
      if (s != UCS_OK) w->Post([w = w, id = id] { w->Disconnect(id); });
      wired(id, s == UCS_OK ? absl::OkStatus() : UcxError("data plane connection", s));
    }
  };
  auto* f = new Flush{std::make_unique<Busy>(this), std::move(wired), this, *result};
  Post([this, f] {
    auto it = endpoints_.find(f->id);
    if (it == endpoints_.end()) {  // given up on (Disconnect) before the flush began
      f->Done(UCS_ERR_CANCELED);
      delete f;
      return;
    }
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = [](void* request, ucs_status_t status, void* user_data) {
      auto* flush = static_cast<Flush*>(user_data);
      flush->Done(status);
      delete flush;
      ucp_request_free(request);
    };
    p.user_data = f;
    ucs_status_ptr_t r = ucp_ep_flush_nbx(it->second->ep, &p);
    if (r == nullptr || UCS_PTR_IS_ERR(r)) {
      f->Done(r == nullptr ? UCS_OK : UCS_PTR_STATUS(r));
      delete f;
    }
  });
  return result;
}

absl::StatusOr<uint64_t> UcxWorker::Connect(const std::string& address, EndpointError on_error) {
  auto wired = std::make_shared<std::promise<absl::Status>>();
  std::future<absl::Status> outcome = wired->get_future();
  ASSIGN_OR_RETURN(const uint64_t id,
                   BeginConnect(address, std::move(on_error), [wired](uint64_t, absl::Status s) {
                     wired->set_value(std::move(s));
                   }));
  if (outcome.wait_for(absl::ToChronoSeconds(kConnectLimit)) != std::future_status::ready) {
    Disconnect(id);  // completes the flush (with an error)
    return absl::UnavailableError(
        absl::StrCat("data plane: the peer did not answer the connection in ",
                     absl::FormatDuration(kConnectLimit)));
  }
  if (absl::Status s = outcome.get(); !s.ok()) return s;
  return id;
}

void UcxWorker::DisconnectSoon(uint64_t endpoint) {
  Post([this, endpoint] { Disconnect(endpoint); });
}

void UcxWorker::Disconnect(uint64_t endpoint) {
  Run([&] {
    auto it = endpoints_.find(endpoint);
    if (it == endpoints_.end()) return;
    // Out of the table first: closing completes the endpoint's requests (a connect's flush
    // among them), whose callbacks may Disconnect it again.
    std::unique_ptr<Endpoint> e = std::move(it->second);
    endpoints_.erase(it);
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t r = ucp_ep_close_nbx(e->ep, &p);
    if (r != nullptr && !UCS_PTR_IS_ERR(r)) ucp_request_free(r);  // released once complete
  });
}

void UcxWorker::Pending::Finish(absl::Status s) {
  std::function<void(absl::Status)> done;
  std::shared_ptr<const void> keep;
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    status_ = s;
    done.swap(done_fn_);
    keep.swap(keep_);
    cv_.notify_all();
  }
  worker_->in_flight_.fetch_sub(1);
  if (busy_) worker_->busy_.fetch_sub(1);
  if (done) done(std::move(s));
}

absl::Status UcxWorker::Pending::Wait(absl::Time deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  const auto until = absl::ToChronoTime(deadline);
  if (!cv_.wait_until(lock, until, [&] { return done_; })) {
    lock.unlock();
    // Past the deadline: the endpoint is forced shut, which completes the send (with an error),
    // so UCX reads the payload no more once this returns.
    worker_->Disconnect(endpoint_);
    lock.lock();
    cv_.wait(lock, [&] { return done_; });
    return absl::DeadlineExceededError("data plane send did not complete in time; endpoint closed");
  }
  return status_;
}

std::shared_ptr<UcxWorker::Pending> UcxWorker::Send(
    uint64_t endpoint, uint16_t id, std::string header, const void* data, size_t length,
    std::function<void(absl::Status)> done, std::shared_ptr<const void> keep, bool want_reply) {
  auto pending = std::make_shared<Pending>();
  pending->done_fn_ = std::move(done);
  pending->keep_ = std::move(keep);
  pending->worker_ = this;
  pending->endpoint_ = endpoint;
  pending->header_ = std::move(header);
  Post(endpoint, id, pending, data, length, false, want_reply);
  return pending;
}

void UcxWorker::Reply(ucp_ep_h reply_ep, uint16_t id, std::string header, const void* data,
                      size_t length, std::shared_ptr<const void> keep,
                      std::function<void(absl::Status)> done) {
  auto pending = std::make_shared<Pending>();
  pending->done_fn_ = std::move(done);
  pending->keep_ = std::move(keep);
  pending->worker_ = this;
  pending->header_ = std::move(header);
  in_flight_.fetch_add(1);  // until the send finishes (Pending::Finish)
  HoldBusyWhileSending(pending.get(), length);
  Start(reply_ep, id, pending, data, length, false, false);
}

std::shared_ptr<UcxWorker::Pending> UcxWorker::SendPieces(uint64_t endpoint, uint16_t id,
                                                          std::string header,
                                                          std::vector<Piece> pieces) {
  auto pending = std::make_shared<Pending>();
  pending->worker_ = this;
  pending->endpoint_ = endpoint;
  pending->header_ = std::move(header);
  for (const Piece& p : pieces) pending->iov_.push_back({const_cast<void*>(p.data), p.length});
  Post(endpoint, id, pending, pending->iov_.data(), pending->iov_.size(), true);
  return pending;
}

void UcxWorker::HoldBusyWhileSending(Pending* pending, size_t bytes) {
  static const bool hold = SendsHoldBusy();
  if (!hold || bytes < kBusySendBytes) return;
  pending->busy_ = true;  // released in Pending::Finish; the Post (or Reply's thread) wakes us
  busy_.fetch_add(1);
}

void UcxWorker::Post(uint64_t endpoint, uint16_t id, std::shared_ptr<Pending> pending,
                     const void* data, size_t length, bool iov, bool want_reply) {
  in_flight_.fetch_add(1);  // until the send finishes (Pending::Finish)
  size_t bytes = length;
  if (iov) {
    bytes = 0;
    for (const ucp_dt_iov_t& piece : pending->iov_) bytes += piece.length;
  }
  HoldBusyWhileSending(pending.get(), bytes);
  Post([this, pending, endpoint, id, data, length, iov, want_reply] {
    auto it = endpoints_.find(endpoint);
    if (it == endpoints_.end())
      return pending->Finish(absl::UnavailableError("data plane endpoint closed"));
    Start(it->second->ep, id, pending, data, length, iov, want_reply);
  });
}

void UcxWorker::Start(ucp_ep_h ep, uint16_t id, std::shared_ptr<Pending> pending, const void* data,
                      size_t length, bool iov, bool want_reply) {
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  if (iov) {
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
    p.datatype = ucp_dt_make_iov();
  }
  if (want_reply) {
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_REPLY;
  }
  p.cb.send = [](void* request, ucs_status_t status, void* user_data) {
    auto* holder = static_cast<std::shared_ptr<Pending>*>(user_data);
    (*holder)->Finish(status == UCS_OK ? absl::OkStatus() : UcxError("data plane send", status));
    delete holder;
    ucp_request_free(request);
  };
  auto* holder = new std::shared_ptr<Pending>(pending);
  p.user_data = holder;
  ucs_status_ptr_t r =
      ucp_am_send_nbx(ep, id, pending->header_.data(), pending->header_.size(), data, length, &p);
  if (r == nullptr) {
    delete holder;
    pending->Finish(absl::OkStatus());
  } else if (UCS_PTR_IS_ERR(r)) {
    delete holder;
    pending->Finish(UcxError("data plane send", UCS_PTR_STATUS(r)));
  }
}

absl::StatusOr<ucp_mem_h> UcxWorker::Register(void* base, size_t length) {
  absl::StatusOr<ucp_mem_h> result = absl::InternalError("not run");
  Run([&] {
    ucp_mem_map_params_t p{};
    p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    p.address = base;
    p.length = length;
    ucp_mem_h memh = nullptr;
    if (ucs_status_t s = ucp_mem_map(context_, &p, &memh); s != UCS_OK) {
      result = UcxError("data plane registration", s);
    } else {
      registered_.insert(memh);
      result = memh;
    }
  });
  return result;
}

void UcxWorker::Unregister(ucp_mem_h memh) {
  Run([&] {
    if (registered_.erase(memh) != 0) (void)ucp_mem_unmap(context_, memh);
  });
}

void UcxWorker::Receive(void* descriptor, void* buffer, size_t length,
                        std::function<void(absl::Status)> done) {
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.recv_am = [](void* request, ucs_status_t status, size_t, void* user_data) {
    auto* fn = static_cast<std::function<void(absl::Status)>*>(user_data);
    (*fn)(status == UCS_OK ? absl::OkStatus() : UcxError("data plane receive", status));
    delete fn;
    ucp_request_free(request);
  };
  busy_.fetch_add(1);  // until the receive completes
  in_flight_.fetch_add(1);
  auto* fn = new std::function<void(absl::Status)>([this, done = std::move(done)](absl::Status s) {
    busy_.fetch_sub(1);
    in_flight_.fetch_sub(1);
    done(std::move(s));
  });
  p.user_data = fn;
  ucs_status_ptr_t r = ucp_am_recv_data_nbx(worker_, descriptor, buffer, length, &p);
  if (r == nullptr) {
    (*fn)(absl::OkStatus());
    delete fn;
  } else if (UCS_PTR_IS_ERR(r)) {
    (*fn)(UcxError("data plane receive", UCS_PTR_STATUS(r)));
    delete fn;
  }
}

}  // namespace attnd::transport
