#include "cluster/standby_ranking.h"

#include <algorithm>

#include "client/router.h"

namespace attnd {

int RankStandby(const std::vector<PeerCandidate>& peers, const std::string& self_name,
                const std::string& id, const std::string& avoid) {
  std::vector<std::string> names{self_name};
  for (const PeerCandidate& p : peers)
    if (p.usable && !p.name.empty() && p.name != avoid &&
        std::find(names.begin(), names.end(), p.name) == names.end())
      names.push_back(p.name);
  for (const std::string& n : client::Ranked(names, id)) {
    if (n == self_name) continue;
    for (size_t i = 0; i < peers.size(); ++i)
      if (peers[i].usable && peers[i].name == n) return static_cast<int>(i);
  }
  return -1;
}

}  // namespace attnd
