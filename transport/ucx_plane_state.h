// A UCX data plane's state (UcxPlane::State) and what its regions reach (UcxPlane::Link): shared
// by the plane's handlers and handshakes (ucx_plane.cc) and the regions calls resolve
// (ucx_plane_regions.cc). Internal to the transport library.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "transport/deadline_timer.h"
#include "transport/region.h"
#include "transport/ucx_plane.h"
#include "transport/ucx_worker.h"

namespace attnd::transport {

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
  absl::Duration keepalive;           // how often its client says it lives (0: it does not)
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
  // Why a region of this plane can no longer be used once its link was cut.
  absl::Status Closed() const {
    absl::Status l = Lost();
    return l.ok() ? absl::UnavailableError("data plane closed") : l;
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

// Region `name` of plane `s` as a call resolved it (bounds already checked): its input region
// (`input`) or its output region.
std::shared_ptr<const Region> PlaneRegion(std::shared_ptr<UcxPlane::State> s, std::string name,
                                          bool input);

}  // namespace attnd::transport
