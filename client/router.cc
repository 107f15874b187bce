#include "client/router.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <set>

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

}  // namespace

uint64_t RendezvousWeight(const std::string& endpoint, const std::string& sequence_id) {
  // A 0 byte between the two keeps ("ab", "c") and ("a", "bc") apart.
  uint64_t h = Fnv1a(endpoint, 0xcbf29ce484222325ull);
  h ^= 0;
  h *= 0x100000001b3ull;
  return Mix(Fnv1a(sequence_id, h));
}

std::string Route(const std::vector<std::string>& endpoints, const std::string& sequence_id) {
  std::string best;
  uint64_t best_w = 0;
  for (const std::string& e : endpoints) {
    const uint64_t w = RendezvousWeight(e, sequence_id);
    if (best.empty() || w > best_w || (w == best_w && e < best)) {
      best = e;
      best_w = w;
    }
  }
  return best;
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

Router::Router(std::vector<std::string> endpoints) { SetEndpoints(std::move(endpoints)); }

void Router::SetEndpoints(std::vector<std::string> endpoints) {
  std::sort(endpoints.begin(), endpoints.end());
  endpoints.erase(std::unique(endpoints.begin(), endpoints.end()), endpoints.end());
  std::lock_guard<std::mutex> lock(mu_);
  endpoints_ = std::move(endpoints);
  for (auto it = clients_.begin(); it != clients_.end();) {
    if (std::binary_search(endpoints_.begin(), endpoints_.end(), it->first)) {
      ++it;
    } else {
      it = clients_.erase(it);
    }
  }
}

std::vector<std::string> Router::endpoints() const {
  std::lock_guard<std::mutex> lock(mu_);
  return endpoints_;
}

std::string Router::Pick(const std::string& sequence_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return Route(endpoints_, sequence_id);
}

Client* Router::ClientFor(const std::string& sequence_id) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string e = Route(endpoints_, sequence_id);
  if (e.empty()) return nullptr;
  auto& c = clients_[e];
  if (!c) c = Client::Connect(e);
  return c.get();
}

}  // namespace attnd::client
