#include "cluster/drain.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/router.h"
#include "client/sequence_import.h"
#include "cluster/export_chunk.h"
#include "cluster/replication.h"
#include "common/status_macros.h"

namespace attnd {
namespace {

using Clock = std::chrono::steady_clock;

std::set<std::string> LocalAddresses() {
  std::set<std::string> out;
  ifaddrs* all = nullptr;
  if (getifaddrs(&all) != 0) return out;
  for (ifaddrs* a = all; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr) continue;
    char buf[INET6_ADDRSTRLEN] = "";
    if (a->ifa_addr->sa_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, buf, sizeof(buf));
    } else if (a->ifa_addr->sa_family == AF_INET6) {
      inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a->ifa_addr)->sin6_addr, buf,
                sizeof(buf));
    }
    if (buf[0] != '\0') out.insert(buf);
  }
  freeifaddrs(all);
  return out;
}

// Moves one sequence to `peer`; on failure the partial copy there is closed and it stays here.
absl::Status MoveOne(Engine& engine, const SequenceInfo& seq, const std::string& peer,
                     const DrainOptions& o) {
  client::ConnectOptions c = o.credentials;
  c.act_as_tenant = seq.tenant;  // "" (anonymous): no header
  ASSIGN_OR_RETURN(std::unique_ptr<client::Client> to, client::Client::Connect(peer, c));
  const SequenceKey key(seq.tenant, seq.id);
  // An fp8 cache's keys go as they are cached, and only another fp8 cache takes them.
  if (engine.options().cache_dtype == DType::kFP8E4M3) {
    ASSIGN_OR_RETURN(const v1::ServerInfoResponse info, to->Info());
    if (info.cache_datatype() != DTypeName(DType::kFP8E4M3))
      return absl::FailedPreconditionError(
          absl::StrCat("peer ", peer, " caches ", info.cache_datatype(),
                       ": this server's fp8 keys move only to an fp8 cache (--cache-dtype=fp8)"));
  }
  const int layers = engine.spec().num_layers();
  int64_t begin = 0;
  int layer = 0;
  auto next = [&](v1::ExportChunk* chunk) -> absl::StatusOr<bool> {
    if (begin >= seq.length) return false;
    const int64_t n = std::min(o.chunk_tokens, seq.length - begin);
    RETURN_IF_ERROR(ReadExportChunk(engine, key, layer, begin, n, seq.length, chunk));
    if (++layer == layers) {
      layer = 0;
      begin += n;
    }
    return true;
  };
  RETURN_IF_ERROR(client::ImportSequence(
      *to, {.id = seq.id, .length = seq.length, .generation = seq.generation}, next));
  return engine.CloseSequence(key);
}

// The peer named `peer_name` holds seq's standby copy: catch it up and promote it there.
absl::Status PromoteThere(Engine& engine, const SequenceInfo& seq, const std::string& peer,
                          const std::string& peer_name, const DrainOptions& o,
                          Clock::time_point deadline) {
  const SequenceKey key(seq.tenant, seq.id);
  if (o.replicator == nullptr || o.replicator->StandbyOf(key) != peer_name)
    return absl::NotFoundError("no standby copy there");
  RETURN_IF_ERROR(o.replicator->Flush(key, deadline));
  client::ConnectOptions c = o.credentials;
  c.act_as_tenant = seq.tenant;
  ASSIGN_OR_RETURN(std::unique_ptr<client::Client> to, client::Client::Connect(peer, c));
  ASSIGN_OR_RETURN(const v1::SequenceInfo there,
                   to->PromoteSequence(seq.id, seq.generation, seq.length, o.self_name,
                                       /*release_lease=*/true));
  if (there.length() != seq.length)
    return absl::InternalError(
        absl::StrCat("peer's promoted copy holds ", there.length(), " tokens, not ", seq.length));
  o.replicator->Forget(key);
  return engine.CloseSequence(key);
}

}  // namespace

absl::StatusOr<std::vector<std::string>> DrainPeers(const std::vector<std::string>& peers) {
  std::vector<std::string> out;
  const std::set<std::string> local = LocalAddresses();
  for (const std::string& p : peers) {
    if (p.rfind("dns:", 0) != 0) {
      out.push_back(p);
      continue;
    }
    const std::string hp = p.substr(4);
    const size_t colon = hp.rfind(':');
    int port = 0;
    if (colon == std::string::npos || !absl::SimpleAtoi(hp.substr(colon + 1), &port))
      return absl::InvalidArgumentError(
          absl::StrCat("--drain-peers: '", p, "' is not dns:NAME:PORT"));
    ASSIGN_OR_RETURN(std::vector<std::string> resolved,
                     client::ResolveEndpoints(hp.substr(0, colon), port));
    for (const std::string& e : resolved) {
      std::string host = e.substr(0, e.rfind(':'));
      if (host.size() > 2 && host.front() == '[' && host.back() == ']')  // IPv6: "[::1]:50051"
        host = host.substr(1, host.size() - 2);
      if (!local.count(host)) out.push_back(e);
    }
  }
  return out;
}

int64_t AwaitOpenSteps(const Engine& engine, std::chrono::steady_clock::time_point deadline) {
  while (engine.num_open_steps() > 0 && Clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  return engine.num_open_steps();
}

DrainReport DrainSequences(Engine& engine, const DrainOptions& o) {
  DrainReport report;
  const auto deadline = Clock::now() + o.timeout;
  // Open steps may finish (their next layers are still served); new ones are refused.
  AwaitOpenSteps(engine, deadline);
  auto addresses = DrainPeers(o.peers);
  // The peers by the names the clients hash over; one that does not answer takes nothing.
  std::vector<std::string> unreachable;
  std::vector<client::Replica> replicas;
  if (addresses.ok()) {
    for (client::Replica& r : client::NameReplicas(*addresses, o.credentials, &unreachable))
      if (r.name != o.self_name) replicas.push_back(std::move(r));
  }
  if (replicas.empty()) {
    report.failed = static_cast<int>(engine.num_sequences());
    report.first_error = !addresses.ok()        ? std::string(addresses.status().message())
                         : !unreachable.empty() ? absl::StrCat("no peer answered: ", unreachable[0])
                                                : "no peer to drain to";
    return report;
  }
  std::map<std::string, std::string> address_of;
  std::vector<std::string> names;
  for (const client::Replica& r : replicas) {
    address_of[r.name] = r.address;
    names.push_back(r.name);
    report.peers.push_back(absl::StrCat(r.name, " (", r.address, ")"));
  }
  std::vector<SequenceInfo> all = engine.ListSequences(nullptr);
  // Standby copies stay: they are other replicas' sequences (which choose new standbys).
  all.erase(std::remove_if(all.begin(), all.end(), [](const SequenceInfo& s) { return s.standby; }),
            all.end());
  std::mutex mu;  // guards `next` and `report`
  size_t next = 0;
  auto worker = [&] {
    for (;;) {
      size_t i;
      {
        std::lock_guard<std::mutex> lock(mu);
        if (next == all.size()) return;
        i = next++;
      }
      const SequenceInfo& seq = all[i];
      absl::Status s = absl::DeadlineExceededError("drain timeout");
      std::string peer;
      if (Clock::now() < deadline) {
        const std::string name = client::Route(names, seq.id);
        peer = address_of.at(name);
        s = PromoteThere(engine, seq, peer, name, o, deadline);
        if (absl::IsNotFound(s)) {
          s = MoveOne(engine, seq, peer, o);
          if (s.ok() && o.replicator != nullptr)
            o.replicator->Closed(SequenceKey(seq.tenant, seq.id));
        }
      }
      std::lock_guard<std::mutex> lock(mu);
      if (s.ok()) {
        ++report.moved;
        continue;
      }
      ++report.failed;
      if (report.first_error.empty())
        report.first_error =
            peer.empty() ? std::string(s.message())
                         : absl::StrCat(seq.id.substr(0, 64), " -> ", peer, ": ", s.message());
    }
  };
  const size_t n = std::min<size_t>(std::max(1, o.parallel), std::max<size_t>(1, all.size()));
  std::vector<std::thread> threads;
  for (size_t t = 1; t < n; ++t) threads.emplace_back(worker);
  worker();
  for (std::thread& t : threads) t.join();
  return report;
}

}  // namespace attnd
