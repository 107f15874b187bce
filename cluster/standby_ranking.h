// Which peer holds a sequence's standby copy: the rendezvous hash over the replicas' names
// (client::Ranked, the router's too), so every replica and router agrees without asking.
#pragma once

#include <string>
#include <vector>

namespace attnd {

// One entry of the peer list as a standby choice sees it.
struct PeerCandidate {
  std::string name;     // "" until it answered ServerInfo
  bool usable = false;  // not this replica, and its last call did not fail
};
// The index of the peer that the rendezvous hash over `self_name` and every usable peer's name
// but `avoid` ranks first for `id` (after this replica), or -1. Where several entries share a
// name (a standby pod restarted at another address, its old entry down), the usable one.
int RankStandby(const std::vector<PeerCandidate>& peers, const std::string& self_name,
                const std::string& id, const std::string& avoid);

}  // namespace attnd
