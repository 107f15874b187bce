// One UCX (ucp) worker and the thread that progresses it: the data plane's engine on both sides
// (transport/ucx_plane.h, transport/ucx_plane_client.h). Data moves only while the worker is
// progressed, and a ucp worker is single-threaded here, so every UCX call runs on that thread:
// other threads post work to it (Run, Send) and wait for the answer.
//
// Messages are active messages (ucp_am_send_nbx): a small header of the caller's and a payload
// UCX sends eagerly or by rendezvous as it sees fit; the receiving side's handler lands the
// payload in memory it registered once (ucp_mem_map). Active messages rather than RMA puts:
// on UCX 1.13's TCP transport a 15 MiB put moved 27-34 MB/s, an active message 932 MB/s
// (docs/data-plane.md).
//
// UCX's environment works as UCX users expect (UCX_TLS, UCX_NET_DEVICES, ...). Where the
// operator set nothing, each worker's context turns on the shared-memory transports' error
// handling (endpoints detect a dead peer, and shared memory stays among the transports with that
// on) and TCP's non-blocking connect; the process's environment is left as it was. UCX logs to
// stdout unless UCX_LOG_FILE says otherwise, or the process routed its lines (the server does:
// transport/ucx_log.h).
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace attnd::transport {

// "1.13.1": the UCX library this process runs on.
std::string UcxVersion();
// The transports UCX may choose from (UCX_TLS, "all" by default).
std::string UcxTransports();
// The network devices a worker made with `devices` uses: UCX_NET_DEVICES where the operator set
// it ("none" when empty: UCX reads that as no device), else `devices`, else "all".
std::string UcxNetDevices(const std::string& devices = "");
// This host's loopback interfaces, comma-separated (UCX_NET_DEVICES's form; "" if none): for a
// worker that should be reachable on loopback only (UCX's TCP transport listens on every
// interface otherwise).
std::string LoopbackDevices();

class UcxWorker {
 public:
  // An active message as its handler sees it, on the progress thread. `data` is the payload when
  // `rndv` is false (valid only during the call); a rendezvous descriptor for Receive otherwise.
  struct Message {
    const void* header;
    size_t header_length;
    void* data;
    size_t length;
    bool rndv;
    // The sender's endpoint as this worker sees it, when the sender asked for replies (valid
    // during the handler only: Reply on it from there).
    ucp_ep_h reply_ep;
    // The worker that received it (Receive and Reply go through it); null only where a test or
    // fuzz target calls a handler itself.
    UcxWorker* worker = nullptr;
  };
  // Returns nothing: a message the handler does not take (a refused one) is dropped.
  using Handler = std::function<void(const Message&)>;
  // An endpoint failed (its peer died or is unreachable): on the progress thread.
  using EndpointError = std::function<void(absl::Status)>;

  // A worker named `name` (in UCX's logs) with active-message handlers by id, its thread started.
  // `devices`: the network devices its context may use (UCX_NET_DEVICES's form) where the
  // operator's environment names none; "" leaves them to UCX.
  static absl::StatusOr<std::unique_ptr<UcxWorker>> Create(const std::string& name,
                                                           std::map<uint16_t, Handler> handlers,
                                                           const std::string& devices = "");
  // Stops the thread; endpoints are closed and registrations released first.
  ~UcxWorker();
  UcxWorker(const UcxWorker&) = delete;
  UcxWorker& operator=(const UcxWorker&) = delete;

  // The worker's address, for a peer's Connect (an opaque blob, exchanged over gRPC).
  const std::string& address() const { return address_; }

  // Runs fn on the progress thread and waits for it (fn must not block).
  void Run(const std::function<void()>& fn);

  // How long a Connect waits for its peer to answer.
  static constexpr absl::Duration kConnectLimit = absl::Seconds(5);
  // An endpoint to the worker at `address` (from a peer's address()), wired up before this
  // returns (UNAVAILABLE when the peer does not answer in kConnectLimit); `on_error` runs (progress
  // thread) when it fails. Ids are never reused. The server calls it with a client's address only
  // for a plane that pushes outputs (UcxPlane::Options::push); otherwise it answers clients on
  // their messages' reply endpoints.
  absl::StatusOr<uint64_t> Connect(const std::string& address, EndpointError on_error);
  // Connect without the wait: returns the endpoint's id once it is made, and `wired` runs once,
  // on the progress thread, with OK when it is wired up, or with the error that ended the try
  // (the endpoint is then closed, just after). To give up, Disconnect it (`wired` then runs with
  // an error). The worker polls until `wired` ran. No limit of its own: the caller keeps one.
  using Wired = std::function<void(uint64_t endpoint, absl::Status)>;
  absl::StatusOr<uint64_t> BeginConnect(const std::string& address, EndpointError on_error,
                                        Wired wired);
  // Closes the endpoint (pending sends on it fail). Unknown ids are ignored.
  void Disconnect(uint64_t endpoint);
  // Disconnect, posted to the progress thread without waiting (for a thread that must not
  // block on it, e.g. a deadline's).
  void DisconnectSoon(uint64_t endpoint);

  // A send in flight: Wait returns its outcome. The payload must stay valid until then.
  class Pending {
   public:
    // OK once UCX is done with the payload; DEADLINE_EXCEEDED (the send is cancelled, and the
    // payload no longer read) when `deadline` passes first; UNAVAILABLE when the endpoint failed.
    absl::Status Wait(absl::Time deadline);

   private:
    friend class UcxWorker;
    void Finish(absl::Status s);
    UcxWorker* worker_ = nullptr;
    uint64_t endpoint_ = 0;
    std::string header_;  // UCX reads the header until the send completes
    std::function<void(absl::Status)> done_fn_;
    std::shared_ptr<const void> keep_;
    std::vector<ucp_dt_iov_t> iov_;  // SendPieces: UCX reads the list until the send completes
    std::mutex mu_;
    std::condition_variable cv_;
    bool done_ = false;
    bool busy_ = false;  // holds the worker busy until finished (HoldBusyWhileSending)
    absl::Status status_;
  };
  // Sends active message `id` with `header` (copied) and `length` bytes at `data` on `endpoint`.
  // `done`, when given, runs with the outcome on the progress thread as the send completes;
  // `keep` is held until then (what owns the payload, for a caller that does not Wait).
  // `want_reply`: the receiver may answer on this endpoint (Message::reply_ep).
  std::shared_ptr<Pending> Send(uint64_t endpoint, uint16_t id, std::string header,
                                const void* data, size_t length,
                                std::function<void(absl::Status)> done = nullptr,
                                std::shared_ptr<const void> keep = nullptr,
                                bool want_reply = false);
  // Progress thread only, from a handler: sends on the message's reply endpoint (how a server
  // that does not push answers a client without an endpoint made from the client's address).
  // `keep` is held until the send completes; `done` then runs with its outcome.
  void Reply(ucp_ep_h reply_ep, uint16_t id, std::string header, const void* data, size_t length,
             std::shared_ptr<const void> keep, std::function<void(absl::Status)> done);
  // One message whose payload is the pieces in order (a scatter-gather send: one handshake for
  // them all); each piece must stay valid until Wait.
  struct Piece {
    const void* data;
    size_t length;
  };
  std::shared_ptr<Pending> SendPieces(uint64_t endpoint, uint16_t id, std::string header,
                                      std::vector<Piece> pieces);

  // While one is held (and while a receive, or a send of 64 KiB or more, is under way), the
  // progress thread polls without sleeping as long as something moved in the last 10 ms: a
  // thread waiting for bytes to land is answered without a wakeup's delay. Otherwise it sleeps
  // on the worker's event fd. A large send polls because the sender takes part in the copy:
  // over shared memory UCX 1.13 moves a rendezvous through the receiver's FIFO in fragments
  // (the sysv/posix `am_bw` lane: cma, the single-copy transport, is not chosen for endpoints
  // that detect dead peers), so a sender asleep stalls at every full FIFO until woken
  // (bench/results/transport.md measures it).
  // ATTND_UCX_SEND_BUSY=0 turns that off. Between transfers (a layer's compute) both sides sleep.
  class Busy {
   public:
    explicit Busy(UcxWorker* w) : w_(w) {
      w_->busy_.fetch_add(1);
      ucp_worker_signal(w_->worker_);
    }
    ~Busy() { w_->busy_.fetch_sub(1); }
    Busy(const Busy&) = delete;
    Busy& operator=(const Busy&) = delete;

   private:
    UcxWorker* w_;
  };

  // Runs fn on the progress thread every `period` (to within 100 ms) from now on, until the
  // worker stops (a client's keepalives: UcxPlaneClient::KeepAlive).
  void Every(absl::Duration period, std::function<void()> fn);

  // Whether the caller is this worker's progress thread.
  bool OnThread() const { return std::this_thread::get_id() == thread_.get_id(); }

  // Whether the worker is stalled: events have stayed pending that progress never takes, for
  // ten seconds or more (a peer that died mid-message in a shared-memory FIFO leaves it so for
  // good; the thread then naps between looks instead of spinning).
  bool stalled() const { return stalled_.load(std::memory_order_relaxed); }

  // Registers [base, base + length) with UCX once (rendezvous lands there without registering
  // per message); Unregister before freeing the memory.
  absl::StatusOr<ucp_mem_h> Register(void* base, size_t length);
  void Unregister(ucp_mem_h memh);

  // Progress thread only, from a handler: receives a rendezvous payload into `buffer`, then
  // calls done(status) on the progress thread (OK: every byte landed).
  void Receive(void* descriptor, void* buffer, size_t length,
               std::function<void(absl::Status)> done);

 private:
  UcxWorker() = default;
  void Loop();
  void Post(std::function<void()> fn);
  static ucs_status_t OnMessage(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param);
  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status);
  // Posts `pending`'s send of `length` bytes at `data` (or its iov_ when iov is true).
  void Post(uint64_t endpoint, uint16_t id, std::shared_ptr<Pending> pending, const void* data,
            size_t length, bool iov, bool want_reply = false);
  // A send of kBusySendBytes or more holds the worker busy until it finishes (Busy, above).
  void HoldBusyWhileSending(Pending* pending, size_t bytes);
  // Starts `pending`'s send on `ep` (progress thread).
  void Start(ucp_ep_h ep, uint16_t id, std::shared_ptr<Pending> pending, const void* data,
             size_t length, bool iov, bool want_reply);

  struct HandlerSlot {
    UcxWorker* worker;
    Handler fn;
  };
  struct Endpoint {
    ucp_ep_h ep = nullptr;
    EndpointError on_error;
    uint64_t id = 0;
    UcxWorker* worker = nullptr;
  };

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string address_;
  std::map<uint16_t, std::unique_ptr<HandlerSlot>> handlers_;
  // Progress-thread state.
  std::map<uint64_t, std::unique_ptr<Endpoint>> endpoints_;
  std::set<ucp_mem_h> registered_;  // Register'ed and not yet Unregister'ed
  struct Periodic {
    std::chrono::steady_clock::duration period;
    std::chrono::steady_clock::time_point next;
    std::function<void()> fn;
  };
  std::vector<Periodic> periodic_;  // Every's
  uint64_t next_endpoint_ = 1;
  // Work posted from other threads.
  std::atomic<int> busy_{0};       // Busy holders and receives in flight
  std::atomic<int> in_flight_{0};  // sends and receives in flight
  std::atomic<bool> stalled_{false};
  std::mutex mu_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace attnd::transport
