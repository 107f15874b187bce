// The server's UCX data plane (docs/data-plane.md): a client that connected over gRPC
// (ConnectDataPlane) gets a plane of two regions, an input region in server memory its worker
// writes tensors into (active message kToServer, each landing announced by the transfer id the
// layer call then names) and an output region in its own memory: the server builds each output
// in a registered mirror of it and sends it there (kToClient) as soon as it is built, on an
// endpoint of the plane's worker to the client's (whose address the handshake gave); a client
// that gave none pulls it (kPull) once the reply named it, answered on the pull's endpoint.
// Thread safe. Each plane has its
// own UCX worker and progress thread (transport/ucx_worker.h), its address given in the
// handshake: a client that dies mid-message can leave a shared-memory FIFO stalled for good
// (UCX's FIFO slots are claimed, then filled; a claimed slot never filled blocks every later
// message), and then only its own plane stalls. Closing a plane stops its worker.
//
// Trust (docs/trust.md): a plane belongs to the tenant that connected it, and its regions resolve
// only for that tenant; every message must carry the plane's 128-bit secret, given only in the
// (authenticated) handshake reply; a message that names another plane, the wrong secret or bytes
// outside the region is dropped, and a transfer that overruns its region is answered to the call
// that waits for it. The server never maps client memory (clients write into buffers the server
// allocated; it sends into the client's region only outputs of that client's calls). A client's
// worker address is bounded in size and otherwise handed to UCX as it is: UCX does not validate
// one (a damaged address crashed ucp_ep_create in a probe), nor the address in every peer's
// wireup message, which it parses the same way (ucp_address_unpack) before any check of ours
// can run (docs/trust.md: UCX trusts its peers). A plane idle for `idle_timeout` (its client gone
// without closing it), silent past its keepalives, or whose worker stalled (UcxWorker::stalled: its
// client died mid-message) is closed by CloseIdle: at the next handshake and by the server's
// housekeeping.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transport/deadline_timer.h"
#include "transport/region.h"
#include "transport/ucx_worker.h"

namespace attnd::transport {

class UcxPlane {
 public:
  struct Options {
    int max_planes = 64;                                 // connected clients at once, all tenants
    int64_t max_region_bytes = int64_t{256} << 20;       // each region of a plane
    absl::Duration transfer_timeout = absl::Seconds(2);  // an input's landing, an output's send
    int max_landed = 256;  // transfers landed and not yet superseded, per plane (oldest dropped)
    // Calls waiting for their transfers to land, per plane; beyond, a call runs at once (and
    // fails if its bytes are not there).
    int max_waiting_calls = 1024;
    // Transfers under way on one plane at once (receives of its client's inputs, outputs and
    // answers sent to it); beyond, an input is refused to the call that names it (nothing
    // written) and a pull that names no output goes unanswered. Each holds UCX memory until its
    // peer completes it, which a client that stalls never does.
    int max_transfers_under_way = 1024;
    absl::Duration idle_timeout = absl::Minutes(10);
    // The network devices the planes' workers use where UCX_NET_DEVICES names none ("": UCX's
    // choice, every interface; LoopbackDevices() for a server reachable on loopback only).
    std::string devices;
    // Outputs go to clients that gave their worker address as soon as they are built
    // (--data-plane-push); false: every client pulls them (and no client address is parsed).
    bool push = false;
    // Clients that offer keepalives are told to send one this often, and a plane of such a
    // client silent three times as long (its process died) is closed by CloseIdle
    // (--data-plane-keepalive-ms). Zero: none asked; planes close when idle_timeout passes.
    absl::Duration keepalive = absl::Seconds(5);
  };
  // The largest client worker address taken (UCX's are a few hundred bytes to a few KiB).
  static constexpr size_t kMaxClientAddressBytes = 65536;
  static absl::StatusOr<std::unique_ptr<UcxPlane>> Create(const Options& options);
  ~UcxPlane();

  struct Connection {
    std::string name;  // "ucx-<id>"
    uint64_t id = 0;
    std::string token;                        // kTokenBytes: every message to the server carries it
    std::string server_address;               // the server worker's address
    std::string input_region, output_region;  // "<name>.in", "<name>.out"
    bool pushes = false;       // outputs are sent unasked (the client's worker was connected)
    absl::Duration keepalive;  // how often the client is to say it lives (0: never)
  };
  // A plane for `tenant`'s client: an input region of input_bytes in server memory, an output
  // region of output_bytes in the client's (0: outputs come back in the reply). INVALID_ARGUMENT
  // (sizes), RESOURCE_EXHAUSTED (the server's max_planes, or `tenant_limit` planes of this tenant
  // when > 0). `client_address`: the client's worker, which the plane's worker connects to
  // (pushing outputs) when options().push and there are outputs; a client whose worker cannot
  // be reached gets a plane it pulls from. INVALID_ARGUMENT beyond kMaxClientAddressBytes.
  // `keepalives`: the client offers them (Options::keepalive).
  absl::StatusOr<Connection> Connect(const std::string& tenant, int64_t input_bytes,
                                     int64_t output_bytes, int tenant_limit,
                                     const std::string& client_address = "",
                                     bool keepalives = false);
  // The same without waiting for the client's worker: `done` runs once with the outcome, on the
  // calling thread unless the plane connects to the client's worker, then on the plane's
  // progress thread (wired up or failed) or the plane's timer (not wired up within
  // `wire_limit`, at most UcxWorker::kConnectLimit: a plane the client pulls from). It must not
  // block. Handshakes under way hold this object's destruction until they end.
  using Connected = std::function<void(absl::StatusOr<Connection>)>;
  void Connect(const std::string& tenant, int64_t input_bytes, int64_t output_bytes,
               int tenant_limit, const std::string& client_address, bool keepalives, Connected done,
               absl::Duration wire_limit = UcxWorker::kConnectLimit);
  // NOT_FOUND unless `tenant` holds plane `name`. Calls using it finish first (they hold it).
  absl::Status Close(const std::string& tenant, const std::string& name);
  // Closes every plane (the server is stopping).
  void CloseAll();
  // Closes the planes whose client is gone: idle beyond options().idle_timeout (or, of a client
  // that sends keepalives, silent three of them), whose worker stalled or whose endpoint to their
  // client failed. Returns how many. Each handshake runs it, and the server's housekeeping every
  // second, so that a dead client's memory and place go without waiting for another client.
  int CloseIdle();

  // Whether `region` is a name this plane gives out ("ucx-" ...).
  static bool Names(const std::string& region);
  // `tenant`'s region `name`, after checking [offset, offset + size) lies inside it. NOT_FOUND
  // for a region of no plane of this tenant (another tenant's reads as absent).
  absl::StatusOr<std::shared_ptr<const Region>> Resolve(const std::string& tenant,
                                                        const std::string& what,
                                                        const std::string& name, int64_t offset,
                                                        int64_t size) const;

  int num_planes() const;
  int planes_of(const std::string& tenant) const;
  // Messages dropped: unknown plane, wrong secret, malformed header.
  int64_t refused_messages() const { return refused_.load(); }
  // Planes closed, by why: their client closed them (or gave up on the handshake), they stood
  // idle, their client stopped its keepalives, their worker stalled, their endpoint to the
  // client failed.
  struct ClosedCounts {
    int64_t closed = 0, idle = 0, silent = 0, stalled = 0, lost = 0;
  };
  ClosedCounts closed_counts() const;
  // Bytes landed in input regions, and sent from outputs to their clients.
  int64_t bytes_in() const { return bytes_in_->load(); }
  int64_t bytes_out() const { return bytes_out_->load(); }
  const Options& options() const { return options_; }
  // Deadlines of waits for a landing not yet passed nor cancelled (tests).
  size_t pending_deadlines() const { return timer_->pending(); }

  struct State;  // one plane (ucx_plane.cc)
  struct Link;   // what planes reach of worker_ (ucx_plane.cc)

  // The handlers of the messages clients send, on the progress thread of plane `arrived_on`'s
  // worker: a message naming another plane is refused (public for the fuzz target, which feeds
  // them any bytes).
  void OnToServer(const UcxWorker::Message& m, uint64_t arrived_on);
  void OnPull(const UcxWorker::Message& m, uint64_t arrived_on);

 private:
  explicit UcxPlane(const Options& options) : options_(options) {}
  // Takes out the planes CloseIdle closes (mu_ held); returns them, each with why, to shut
  // outside.
  std::vector<std::pair<std::shared_ptr<State>, const char*>> TakeIdle();
  struct Reservation;  // a handshake's place against the limits (ucx_plane.cc)
  // A handshake's plane, checked against the limits (the place it takes in *reserved), its
  // worker made and its regions registered; not yet published.
  absl::StatusOr<std::shared_ptr<State>> Prepare(const std::string& tenant, int64_t input_bytes,
                                                 int64_t output_bytes, int tenant_limit,
                                                 const std::string& client_address, bool keepalives,
                                                 std::shared_ptr<Reservation>* reserved);
  // Publishes a prepared plane (its place becomes the plane's) and returns what its client needs.
  Connection Publish(const std::shared_ptr<State>& s, Reservation& reserved);

  const Options options_;
  std::unique_ptr<DeadlineTimer> timer_;  // where waits for a landing end (InputRegion)
  mutable std::mutex mu_;
  std::map<uint64_t, std::shared_ptr<State>> planes_;
  // Connects between their checks and their insert, by tenant.
  std::map<std::string, int> connecting_of_;
  std::condition_variable connects_done_;      // a connect published its plane or gave up
  std::vector<std::weak_ptr<State>> closing_;  // closed planes, until no receive of theirs is on
  uint64_t next_id_ = 1;
  std::atomic<int64_t> refused_{0};
  ClosedCounts closed_;  // mu_
  // Shared with the planes' receives and pushes, which count what they moved (a plane may
  // outlive this).
  std::shared_ptr<std::atomic<int64_t>> bytes_in_ = std::make_shared<std::atomic<int64_t>>(0);
  std::shared_ptr<std::atomic<int64_t>> bytes_out_ = std::make_shared<std::atomic<int64_t>>(0);
};

}  // namespace attnd::transport
