#include "client/router.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <set>
#include <thread>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/sequence_import.h"
#include "common/status_macros.h"

namespace attnd::client {
namespace {

uint64_t Fnv1a(const std::string& s, uint64_t h) {
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

uint64_t Mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

std::vector<Replica> AddressesAsReplicas(std::vector<std::string> endpoints) {
  std::vector<Replica> out;
  for (std::string& e : endpoints) out.push_back({e, e});
  return out;
}

}  // namespace

uint64_t RendezvousWeight(const std::string& name, const std::string& sequence_id) {
  // A 0 byte between the two keeps ("ab", "c") and ("a", "bc") apart.
  uint64_t h = Fnv1a(name, 0xcbf29ce484222325ull);
  h ^= 0;
  h *= 0x100000001b3ull;
  return Mix(Fnv1a(sequence_id, h));
}

std::string Route(const std::vector<std::string>& names, const std::string& sequence_id) {
  std::string best;
  uint64_t best_w = 0;
  for (const std::string& e : names) {
    const uint64_t w = RendezvousWeight(e, sequence_id);
    if (best.empty() || w > best_w || (w == best_w && e < best)) {
      best = e;
      best_w = w;
    }
  }
  return best;
}

std::vector<std::string> Ranked(std::vector<std::string> names, const std::string& sequence_id) {
  std::vector<std::pair<uint64_t, std::string>> weighted;
  weighted.reserve(names.size());
  for (std::string& n : names)
    weighted.emplace_back(RendezvousWeight(n, sequence_id), std::move(n));
  std::sort(weighted.begin(), weighted.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  std::vector<std::string> out;
  out.reserve(weighted.size());
  for (auto& [w, n] : weighted) out.push_back(std::move(n));
  return out;
}

absl::StatusOr<std::vector<std::string>> ResolveEndpoints(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0)
    return absl::UnavailableError(absl::StrCat("resolve ", host, ": ", gai_strerror(rc)));
  std::set<std::string> out;
  for (addrinfo* a = res; a; a = a->ai_next) {
    char ip[INET6_ADDRSTRLEN] = {0};
    if (a->ai_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr, ip, sizeof(ip));
      out.insert(absl::StrCat(ip, ":", port));
    } else if (a->ai_family == AF_INET6) {
      inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr, ip, sizeof(ip));
      out.insert(absl::StrCat("[", ip, "]:", port));
    }
  }
  freeaddrinfo(res);
  if (out.empty()) return absl::UnavailableError(absl::StrCat("resolve ", host, ": no addresses"));
  return std::vector<std::string>(out.begin(), out.end());
}

std::vector<Replica> NameReplicas(const std::vector<std::string>& addresses,
                                  const ConnectOptions& options, std::vector<std::string>* errors) {
  std::vector<Replica> out;
  for (const std::string& address : addresses) {
    absl::StatusOr<v1::ServerInfoResponse> info = absl::UnavailableError("no client");
    if (auto c = Client::Connect(address, options); c.ok()) info = (*c)->Info();
    if (!info.ok()) {
      if (errors) errors->push_back(absl::StrCat(address, ": ", info.status().message()));
      continue;
    }
    out.push_back({info->replica_name().empty() ? address : info->replica_name(), address});
  }
  return out;
}

Router::Router(std::vector<std::string> endpoints) : Router(AddressesAsReplicas(endpoints), {}) {}

Router::Router(std::vector<Replica> replicas, ConnectOptions options)
    : options_(std::move(options)) {
  SetReplicas(std::move(replicas));
}

void Router::SetEndpoints(std::vector<std::string> endpoints) {
  SetReplicas(AddressesAsReplicas(std::move(endpoints)));
}

void Router::SetReplicas(std::vector<Replica> replicas) {
  std::lock_guard<std::mutex> lock(mu_);
  SetReplicasLocked(std::move(replicas));
}

void Router::SetReplicasLocked(std::vector<Replica> replicas) {
  std::map<std::string, std::string> next;
  for (Replica& r : replicas) next[r.name] = std::move(r.address);
  for (auto it = clients_.begin(); it != clients_.end();) {
    auto n = next.find(it->first);
    if ((n != next.end() && n->second == address_of_[it->first]) || leaving_.contains(it->first)) {
      ++it;
    } else {
      it = clients_.erase(it);  // the Client itself lives on in all_clients_
    }
  }
  address_of_ = std::move(next);
  names_.clear();
  for (const auto& [name, address] : address_of_) names_.push_back(name);
}

std::vector<Replica> Router::replicas() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Replica> out;
  for (const auto& [name, address] : address_of_) out.push_back({name, address});
  return out;
}

std::vector<std::string> Router::endpoints() const {
  std::vector<std::string> out;
  for (Replica& r : replicas()) out.push_back(std::move(r.address));
  return out;
}

int64_t LeaseLeftMs(const absl::Status& status) {
  if (status.code() != absl::StatusCode::kUnavailable) return -1;
  constexpr absl::string_view kRuns = "lease on this standby copy runs ";
  const absl::string_view m = status.message();
  const size_t at = m.find(kRuns);
  if (at == absl::string_view::npos) return -1;
  const absl::string_view rest = m.substr(at + kRuns.size());
  int64_t ms = 0;
  if (!absl::SimpleAtoi(rest.substr(0, rest.find(' ')), &ms) || ms < 0) return -1;
  return ms;
}

bool RefusesConnections(const std::string& address, std::chrono::milliseconds timeout) {
  // One socket to a sockaddr: refused (true), accepted or silent (false).
  auto refused = [&](int family, const sockaddr* sa, socklen_t len) -> int {  // 1, 0, -1 error
    const int fd = socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    int result = 0;
    if (connect(fd, sa, len) != 0) {
      if (errno == ECONNREFUSED || errno == ENOENT) {
        result = 1;
      } else if (errno == EINPROGRESS) {
        pollfd p{fd, POLLOUT, 0};
        if (poll(&p, 1, static_cast<int>(timeout.count())) == 1) {
          int err = 0;
          socklen_t n = sizeof(err);
          getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &n);
          result = err == ECONNREFUSED ? 1 : 0;
        }
      }
    }
    close(fd);
    return result;
  };
  if (absl::StartsWith(address, "unix:")) {
    sockaddr_un sa{};
    sa.sun_family = AF_UNIX;
    const std::string path = address.substr(5);
    if (path.size() >= sizeof(sa.sun_path)) return false;
    std::memcpy(sa.sun_path, path.data(), path.size());
    return refused(AF_UNIX, reinterpret_cast<const sockaddr*>(&sa), sizeof(sa)) == 1;
  }
  std::string target = absl::StartsWith(address, "dns:") ? address.substr(4) : address;
  const size_t colon = target.rfind(':');
  if (colon == std::string::npos) return false;
  std::string host = target.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), target.substr(colon + 1).c_str(), &hints, &found) != 0)
    return false;
  bool all_refused = found != nullptr;
  for (addrinfo* a = found; a != nullptr && all_refused; a = a->ai_next)
    all_refused = refused(a->ai_family, a->ai_addr, a->ai_addrlen) == 1;
  freeaddrinfo(found);
  return all_refused;
}

std::string ChoosePrefixReplica(const std::vector<PrefixCandidate>& candidates,
                                const std::string& sequence_id, int64_t prompt_blocks,
                                const PrefixWeights& weights) {
  int64_t blocks = std::max<int64_t>(prompt_blocks, 1), busiest = 0;
  for (const PrefixCandidate& c : candidates) {
    blocks = std::max(blocks, c.cached_blocks);
    if (c.free_pages >= 0) busiest = std::max(busiest, c.busy);
  }
  const PrefixCandidate* best = nullptr;
  std::tuple<bool, double, uint64_t> best_key;
  for (const PrefixCandidate& c : candidates) {
    const bool up = c.free_pages >= 0;
    double score = weights.cache * (static_cast<double>(c.cached_blocks) / blocks);
    if (up && c.total_pages > 0)
      score += weights.free * (static_cast<double>(c.free_pages) / c.total_pages);
    if (up) score -= weights.load * (static_cast<double>(c.busy) / (busiest + 1));
    const std::tuple<bool, double, uint64_t> key{up, score, RendezvousWeight(c.name, sequence_id)};
    if (best == nullptr || key > best_key || (key == best_key && c.name < best->name)) {
      best = &c;
      best_key = key;
    }
  }
  return best == nullptr ? std::string() : best->name;
}

std::string Router::Pick(const std::string& sequence_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return PickLocked(sequence_id);
}

std::string Router::PickLocked(const std::string& sequence_id) const {
  auto chosen = chosen_.find(sequence_id);
  if (chosen != chosen_.end() &&
      (address_of_.contains(chosen->second) || leaving_.contains(chosen->second)))
    return chosen->second;
  return Route(names_, sequence_id);
}

absl::StatusOr<std::string> Router::ChooseByPrefix(const std::string& sequence_id,
                                                   const v1::LookupPrefixRequest& request,
                                                   int64_t* cached_blocks) {
  std::vector<std::pair<std::string, Client*>> replicas;
  std::shared_ptr<const PrefixView> view;
  std::string tenant;
  PrefixWeights weights;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const std::string& n : names_) replicas.emplace_back(n, ClientLocked(n));
    view = view_;
    tenant = view_tenant_;
    weights = weights_;
  }
  if (replicas.empty()) return absl::UnavailableError("no replicas to route to");
  std::vector<PrefixCandidate> candidates;
  int64_t prompt_blocks = -1;     // from the first replica that says its page size
  std::vector<BlockHash> hashes;  // for the view: the request's, or its tokens' (page size known)
  bool hashed = false;
  int64_t lookups = 0;
  for (const auto& [name, client] : replicas) {
    PrefixCandidate c;
    c.name = name;
    c.free_pages = -1;
    if (client == nullptr) {
      candidates.push_back(c);
      continue;
    }
    auto info = client->Info();
    if (info.ok()) {
      c.free_pages = 0;
      for (const v1::DeviceInfo& d : info->devices()) {
        c.free_pages += d.pages_free();
        c.total_pages += d.pages_total();
      }
      c.busy = info->load().open_steps() + info->load().queue_depth();
      if (prompt_blocks < 0 && info->model().page_size() > 0)
        prompt_blocks = request.block_hashes_size() > 0
                            ? request.block_hashes_size()
                            : (request.token_ids_size() + info->model().page_size() - 1) /
                                  info->model().page_size();
      if (!hashed && view != nullptr) {
        hashed = true;
        if (request.block_hashes_size() > 0) {
          for (const std::string& h : request.block_hashes()) {
            if (h.size() != sizeof(BlockHash))
              return absl::InvalidArgumentError(
                  absl::StrCat("block_hashes: ", h.size(), " bytes; a block hash is 32"));
            BlockHash b;
            std::memcpy(b.data(), h.data(), b.size());
            hashes.push_back(b);
          }
        } else {
          std::vector<uint32_t> tokens(request.token_ids().begin(), request.token_ids().end());
          hashes = HashBlocks(tokens, info->model().page_size(), request.prefix_salt());
        }
      }
    }
    const std::optional<int64_t> known =
        view != nullptr && hashed ? view->CachedBlocks(name, tenant, hashes) : std::nullopt;
    if (known.has_value()) {
      c.cached_blocks = *known;
    } else if (auto found = client->LookupPrefix(request); found.ok()) {
      ++lookups;
      c.cached_blocks = found->cached_blocks();
    } else if (found.status().code() == absl::StatusCode::kInvalidArgument) {
      return found.status();  // the request itself is wrong: every replica would say so
    }
    candidates.push_back(c);
  }
  const std::string best = ChoosePrefixReplica(candidates, sequence_id, prompt_blocks, weights);
  if (cached_blocks != nullptr)
    for (const PrefixCandidate& c : candidates)
      if (c.name == best) *cached_blocks = c.cached_blocks;
  std::lock_guard<std::mutex> lock(mu_);
  chosen_[sequence_id] = best;
  prefix_lookups_ += lookups;
  return best;
}

void Router::SetPrefixWeights(const PrefixWeights& weights) {
  std::lock_guard<std::mutex> lock(mu_);
  weights_ = weights;
}

void Router::SetPrefixView(std::shared_ptr<const PrefixView> view, std::string tenant) {
  std::lock_guard<std::mutex> lock(mu_);
  view_ = std::move(view);
  view_tenant_ = std::move(tenant);
}

int64_t Router::prefix_lookups() const {
  std::lock_guard<std::mutex> lock(mu_);
  return prefix_lookups_;
}

void Router::Forget(const std::string& sequence_id) {
  std::lock_guard<std::mutex> lock(mu_);
  chosen_.erase(sequence_id);
  moving_.erase(sequence_id);
}

Client* Router::ClientLocked(const std::string& name) {
  auto known = clients_.find(name);
  if (known != clients_.end()) return known->second;
  auto address = address_of_.find(name);
  if (address == address_of_.end()) {
    address = leaving_.find(name);  // left, still holding sequences ChangeReplicas kept there
    if (address == leaving_.end()) return nullptr;
  }
  auto c = Client::Connect(address->second, options_);
  if (!c.ok()) return nullptr;
  all_clients_.push_back(*std::move(c));
  return clients_[name] = all_clients_.back().get();
}

Client* Router::ClientFor(const std::string& sequence_id) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string owner = PickLocked(sequence_id);
  return owner.empty() ? nullptr : ClientLocked(owner);
}

int64_t Router::pulls() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pulls_;
}

absl::Status Router::Move(Client& from, Client& to, const std::string& sequence_id,
                          int64_t length) {
  RETURN_IF_ERROR(HandOffSequence(from, to, sequence_id));
  auto copy = to.DescribeSequence(sequence_id);
  if (!copy.ok() || copy->length() != length) {
    (void)to.CloseSequence(sequence_id);
    return absl::InternalError(
        absl::StrCat("the copy holds ", copy.ok() ? copy->length() : -1, " tokens, not ", length));
  }
  (void)from.CloseSequence(sequence_id);
  return absl::OkStatus();
}

std::vector<std::string> Router::ChangeReplicas(std::vector<Replica> replicas,
                                                const std::vector<std::string>& sequence_ids) {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<std::string, std::string> where;
  for (const std::string& id : sequence_ids) where[id] = PickLocked(id);
  const std::map<std::string, std::string> before = address_of_;
  SetReplicasLocked(std::move(replicas));
  std::vector<std::string> moving;
  for (const auto& [id, now] : where) {
    if (now.empty() || (chosen_.contains(id) && !moving_.contains(id)))
      continue;  // a pin of ChooseByPrefix or FailOver stays
    const std::string next = Route(names_, id);
    if (next == now) {  // (back where it is: nothing to move)
      moving_.erase(id);
      chosen_.erase(id);
      continue;
    }
    chosen_[id] = now;
    moving_[id] = next;
    if (!address_of_.contains(now)) {
      auto b = before.find(now);
      if (b != before.end()) leaving_[now] = b->second;
    }
    moving.push_back(id);
  }
  return moving;
}

int64_t Router::Rebalance(const std::vector<std::string>& sequence_ids) {
  std::lock_guard<std::mutex> one(move_mu_);
  std::vector<std::string> pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (sequence_ids.empty()) {
      for (const auto& [id, to] : moving_) pending.push_back(id);
    } else {
      for (const std::string& id : sequence_ids)
        if (moving_.contains(id)) pending.push_back(id);
    }
  }
  int64_t moved = 0;
  for (const std::string& id : pending) {
    std::string src;
    Client *from = nullptr, *to = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      src = chosen_[id];
      from = ClientLocked(src);
      to = ClientLocked(moving_[id]);
    }
    if (from == nullptr || to == nullptr) continue;
    auto there = from->DescribeSequence(id);
    if (there.ok() && (there->in_step() || there->importing())) continue;
    // Closed there meanwhile (NOT_FOUND): nothing to move, it routes to its new owner.
    if (there.ok() && !Move(*from, *to, id, there->length()).ok()) continue;
    if (!there.ok() && there.status().code() != absl::StatusCode::kNotFound) continue;
    std::lock_guard<std::mutex> lock(mu_);
    moving_.erase(id);
    if (chosen_[id] == src) chosen_.erase(id);
    ++moved;
    ++rebalanced_;
  }
  // A replica that left and holds nothing of this router's any more is forgotten.
  std::lock_guard<std::mutex> lock(mu_);
  std::erase_if(leaving_, [&](const auto& l) {
    return std::none_of(chosen_.begin(), chosen_.end(),
                        [&](const auto& c) { return c.second == l.first; });
  });
  return moved;
}

std::map<std::string, std::string> Router::moving() const {
  std::lock_guard<std::mutex> lock(mu_);
  return moving_;
}

int64_t Router::rebalanced() const {
  std::lock_guard<std::mutex> lock(mu_);
  return rebalanced_;
}

absl::StatusOr<Client*> Router::Locate(const std::string& sequence_id) {
  std::lock_guard<std::mutex> moving(move_mu_);
  std::vector<std::pair<std::string, Client*>> ranked;  // (name, client or nullptr)
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Placed (by prefix, a failover, ChangeReplicas) and missed there: the rendezvous rules now.
    auto was = chosen_.find(sequence_id);
    const std::string pinned = was != chosen_.end() ? was->second : std::string();
    chosen_.erase(sequence_id);
    moving_.erase(sequence_id);
    for (std::string& n : Ranked(names_, sequence_id)) {
      Client* c = ClientLocked(n);
      ranked.emplace_back(std::move(n), c);
    }
    if (leaving_.contains(pinned))  // a replica that left may still hold it
      ranked.emplace_back(pinned, ClientLocked(pinned));
  }
  if (ranked.empty()) return absl::UnavailableError("no replicas to route to");
  Client* owner = ranked[0].second;
  bool owner_reachable = false;
  if (owner != nullptr) {
    auto here = owner->DescribeSequence(sequence_id);
    if (here.ok()) return owner;
    owner_reachable = here.status().code() == absl::StatusCode::kNotFound;
  }
  std::string errors;
  for (size_t i = 1; i < ranked.size(); ++i) {
    Client* holder = ranked[i].second;
    if (holder == nullptr) continue;
    auto there = holder->DescribeSequence(sequence_id);
    if (!there.ok()) {
      if (there.status().code() != absl::StatusCode::kNotFound)
        absl::StrAppend(&errors, "; ", ranked[i].first, ": ", there.status().message());
      continue;
    }
    if (there->standby()) continue;  // another's standby copy: FailOver promotes those
    if (!owner_reachable || there->in_step() || there->importing()) return holder;
    if (!Move(*holder, *owner, sequence_id, there->length()).ok()) {
      // The copy failed (the owner may be full): the sequence stays, usable, where it is.
      return holder;
    }
    std::lock_guard<std::mutex> lock(mu_);
    ++pulls_;
    return owner;
  }
  return absl::NotFoundError(absl::StrCat("sequence '", sequence_id.substr(0, 64),
                                          "' is on none of the ", ranked.size(), " replicas",
                                          errors));
}

absl::StatusOr<Router::FailedOver> Router::FailOver(const std::string& sequence_id,
                                                    uint64_t generation, int64_t length,
                                                    std::string failed,
                                                    const std::string& standby) {
  std::vector<std::pair<std::string, Client*>> order;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed.empty()) {
      auto chosen = chosen_.find(sequence_id);
      failed = chosen != chosen_.end() ? chosen->second : Route(names_, sequence_id);
    }
    std::vector<std::string> names = Ranked(names_, sequence_id);
    auto it = std::find(names.begin(), names.end(), standby);
    if (it != names.end()) std::rotate(names.begin(), it, it + 1);  // the known standby first
    for (std::string& n : names)
      if (n != failed) {
        Client* c = ClientLocked(n);
        if (c != nullptr) order.emplace_back(std::move(n), c);
      }
  }
  // The longest copy at the generation first: a copy left on a former standby may be behind the
  // one that caught up (the order above breaks ties).
  std::map<std::string, int64_t> held;
  for (auto& [name, c] : order) {
    auto there = c->DescribeSequence(sequence_id);
    if (there.ok() && there->standby() && there->generation() == generation)
      held[name] = there->length();
  }
  std::stable_sort(order.begin(), order.end(), [&](const auto& a, const auto& b) {
    auto length_of = [&](const std::string& n) {
      auto it = held.find(n);
      return it == held.end() ? int64_t{-1} : it->second;
    };
    return length_of(a.first) > length_of(b.first);
  });
  // A primary whose address refuses connections is gone: its lease ends with it. One that is
  // paused or cut off may still serve: its copy is promoted once its lease runs out.
  std::string failed_address;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = address_of_.find(failed); it != address_of_.end()) failed_address = it->second;
  }
  auto is_gone = [&] {
    return !failed_address.empty() &&
           RefusesConnections(failed_address, std::chrono::milliseconds(200));
  };
  bool gone = is_gone();
  std::string errors;
  for (auto& [name, c] : order) {
    absl::StatusOr<v1::SequenceInfo> info;
    // While the lease runs: wait it out, looking again every 100 ms whether the primary is gone
    // (a process killed a moment ago may still have held its port at the first look).
    for (int attempt = 0; attempt < 1000; ++attempt) {
      info = c->PromoteSequence(sequence_id, generation, length, failed, gone);
      const int64_t wait = info.ok() ? -1 : LeaseLeftMs(info.status());
      if (wait < 0) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(std::min<int64_t>(wait, 100) + 1));
      gone = gone || is_gone();
    }
    if (info.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      chosen_[sequence_id] = name;
      return FailedOver{c, name, *std::move(info)};
    }
    const absl::StatusCode code = info.status().code();
    if (code != absl::StatusCode::kNotFound && code != absl::StatusCode::kUnavailable &&
        code != absl::StatusCode::kDeadlineExceeded)
      return info.status();
    absl::StrAppend(&errors, "; ", name, ": ", info.status().message());
  }
  return absl::NotFoundError(absl::StrCat("no standby copy of '", sequence_id.substr(0, 64),
                                          "' at generation ", generation, " on the ", order.size(),
                                          " other replicas", errors));
}

}  // namespace attnd::client
