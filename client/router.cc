#include "client/router.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"

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
  std::map<std::string, std::string> next;
  for (Replica& r : replicas) next[r.name] = std::move(r.address);
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = clients_.begin(); it != clients_.end();) {
    auto n = next.find(it->first);
    if (n != next.end() && n->second == address_of_[it->first]) {
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

std::string ChoosePrefixReplica(const std::vector<PrefixCandidate>& candidates,
                                const std::string& sequence_id) {
  const PrefixCandidate* best = nullptr;
  for (const PrefixCandidate& c : candidates) {
    if (best == nullptr) {
      best = &c;
      continue;
    }
    const uint64_t wc = RendezvousWeight(c.name, sequence_id);
    const uint64_t wb = RendezvousWeight(best->name, sequence_id);
    if (std::tie(c.cached_blocks, c.room, wc) > std::tie(best->cached_blocks, best->room, wb) ||
        (c.cached_blocks == best->cached_blocks && c.room == best->room && wc == wb &&
         c.name < best->name))
      best = &c;
  }
  return best == nullptr ? std::string() : best->name;
}

std::string Router::Pick(const std::string& sequence_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto chosen = chosen_.find(sequence_id);
  if (chosen != chosen_.end() && address_of_.contains(chosen->second)) return chosen->second;
  return Route(names_, sequence_id);
}

absl::StatusOr<std::string> Router::ChooseByPrefix(const std::string& sequence_id,
                                                   const v1::LookupPrefixRequest& request,
                                                   int64_t* cached_blocks) {
  std::vector<std::pair<std::string, Client*>> replicas;
  std::shared_ptr<const PrefixView> view;
  std::string tenant;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const std::string& n : names_) replicas.emplace_back(n, ClientLocked(n));
    view = view_;
    tenant = view_tenant_;
  }
  if (replicas.empty()) return absl::UnavailableError("no replicas to route to");
  std::vector<PrefixCandidate> candidates;
  std::vector<BlockHash> hashes;  // for the view: the request's, or its tokens' (page size known)
  bool hashed = false;
  int64_t lookups = 0;
  for (const auto& [name, client] : replicas) {
    PrefixCandidate c{name, 0, -1};
    if (client == nullptr) {
      candidates.push_back(c);
      continue;
    }
    auto info = client->Info();
    if (info.ok()) {
      c.room = 0;
      for (const v1::DeviceInfo& d : info->devices()) c.room += d.pages_free() + d.pages_cached();
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
  const std::string best = ChoosePrefixReplica(candidates, sequence_id);
  if (cached_blocks != nullptr)
    for (const PrefixCandidate& c : candidates)
      if (c.name == best) *cached_blocks = c.cached_blocks;
  std::lock_guard<std::mutex> lock(mu_);
  chosen_[sequence_id] = best;
  prefix_lookups_ += lookups;
  return best;
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
}

Client* Router::ClientLocked(const std::string& name) {
  auto known = clients_.find(name);
  if (known != clients_.end()) return known->second;
  auto address = address_of_.find(name);
  if (address == address_of_.end()) return nullptr;
  auto c = Client::Connect(address->second, options_);
  if (!c.ok()) return nullptr;
  all_clients_.push_back(*std::move(c));
  return clients_[name] = all_clients_.back().get();
}

Client* Router::ClientFor(const std::string& sequence_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto chosen = chosen_.find(sequence_id);
  const std::string owner = chosen != chosen_.end() && address_of_.contains(chosen->second)
                                ? chosen->second
                                : Route(names_, sequence_id);
  return owner.empty() ? nullptr : ClientLocked(owner);
}

int64_t Router::pulls() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pulls_;
}

absl::StatusOr<Client*> Router::Locate(const std::string& sequence_id) {
  std::lock_guard<std::mutex> moving(move_mu_);
  std::vector<std::pair<std::string, Client*>> ranked;  // (name, client or nullptr)
  {
    std::lock_guard<std::mutex> lock(mu_);
    chosen_.erase(sequence_id);  // placed by prefix and missed there: the rendezvous rules now
    for (std::string& n : Ranked(names_, sequence_id)) {
      Client* c = ClientLocked(n);
      ranked.emplace_back(std::move(n), c);
    }
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
    absl::Status moved = HandOffSequence(*holder, *owner, sequence_id);
    if (moved.ok()) {
      auto copy = owner->DescribeSequence(sequence_id);
      if (!copy.ok() || copy->length() != there->length()) {
        (void)owner->CloseSequence(sequence_id);
        moved = absl::InternalError(absl::StrCat(ranked[0].first, " holds ",
                                                 copy.ok() ? copy->length() : -1, " tokens, not ",
                                                 there->length()));
      }
    }
    if (!moved.ok()) {
      // The copy failed (the owner may be full): the sequence stays, usable, where it is.
      return holder;
    }
    (void)holder->CloseSequence(sequence_id);
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
  std::string errors;
  for (auto& [name, c] : order) {
    auto info = c->PromoteSequence(sequence_id, generation, length, failed);
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
