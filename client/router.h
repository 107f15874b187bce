// Client-side routing of sequences to attnd replicas by rendezvous (highest random weight)
// hashing (DESIGN §5): every sequence goes to the replica with the highest hash of
// (endpoint, sequence id), so all of its steps meet its KV cache, and when a replica joins or
// leaves only the sequences that hash to it move. The hash is fixed (FNV-1a 64 + a splitmix64
// finaliser) so C++ and Python clients agree (`attnd.route` in the Python client).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/attnd_client.h"

namespace attnd::client {

// The rendezvous weight of `sequence_id` on `endpoint`.
uint64_t RendezvousWeight(const std::string& endpoint, const std::string& sequence_id);

// The endpoint `sequence_id` belongs to (ties to the lexicographically smaller endpoint);
// empty when there are no endpoints.
std::string Route(const std::vector<std::string>& endpoints, const std::string& sequence_id);

// Every address `host` resolves to, as "ip:port" (a Kubernetes headless Service name gives one
// per ready pod). UNAVAILABLE when it resolves to nothing.
absl::StatusOr<std::vector<std::string>> ResolveEndpoints(const std::string& host, int port);

// A Client per endpoint, and the routing between them. Thread safe.
class Router {
 public:
  explicit Router(std::vector<std::string> endpoints);
  // Replaces the endpoint set (e.g. after re-resolving the Service); clients of endpoints that
  // stay are kept.
  void SetEndpoints(std::vector<std::string> endpoints);
  std::vector<std::string> endpoints() const;
  std::string Pick(const std::string& sequence_id) const;
  // The client of the replica that owns `sequence_id`; nullptr without endpoints.
  Client* ClientFor(const std::string& sequence_id);

 private:
  mutable std::mutex mu_;
  std::vector<std::string> endpoints_;
  std::map<std::string, std::unique_ptr<Client>> clients_;
};

}  // namespace attnd::client
