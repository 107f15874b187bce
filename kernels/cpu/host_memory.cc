#include "kernels/cpu/host_memory.h"

#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace attnd::cpu {
namespace {

std::optional<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::optional<uint64_t> ReadCgroupBytes(const std::string& path) {
  const auto text = ReadFile(path);
  return text ? ParseCgroupBytes(*text) : std::nullopt;
}

// A cgroup's usage less its inactive file pages (page cache the kernel reclaims before it
// OOM-kills anything): what the cgroup really holds.
std::optional<uint64_t> ReadCgroupUsage(const std::string& usage_file, const std::string& stat_file,
                                        const char* inactive_key) {
  auto usage = ReadCgroupBytes(usage_file);
  if (!usage) return usage;
  if (const auto stat = ReadFile(stat_file)) {
    const uint64_t inactive = ParseStatField(*stat, inactive_key);
    *usage = inactive < *usage ? *usage - inactive : 0;
  }
  return usage;
}

// This process's cgroup paths from /proc/self/cgroup: the v2 one ("0::/path") and the v1 memory
// controller's ("N:memory:/path"), each empty when absent.
void OwnCgroups(std::string* v2, std::string* v1_memory) {
  const auto text = ReadFile("/proc/self/cgroup");
  if (!text) return;
  for (absl::string_view line : absl::StrSplit(*text, '\n')) {
    const std::vector<absl::string_view> f = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (f.size() != 3) continue;
    if (f[0] == "0" && f[1].empty()) *v2 = std::string(f[2]);
    for (absl::string_view c : absl::StrSplit(f[1], ','))
      if (c == "memory") *v1_memory = std::string(f[2]);
  }
}

}  // namespace

absl::StatusOr<HostMemory> ParseMeminfo(const std::string& text) {
  HostMemory m;
  bool have_available = false, have_total = false;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    const std::vector<absl::string_view> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (f.size() < 2) continue;
    uint64_t kb = 0;
    if (!absl::SimpleAtoi(f[1], &kb) || kb > (uint64_t{1} << 50)) continue;
    if (f[0] == "MemAvailable:") {
      m.available = kb << 10;
      have_available = true;
    } else if (f[0] == "MemTotal:") {
      m.total = kb << 10;
      have_total = true;
    }
  }
  if (!have_available || !have_total)
    return absl::FailedPreconditionError("/proc/meminfo has no MemAvailable or MemTotal line");
  return m;
}

uint64_t ParseStatField(const std::string& text, const std::string& key) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    const std::vector<absl::string_view> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    uint64_t v = 0;
    if (f.size() == 2 && f[0] == key && absl::SimpleAtoi(f[1], &v)) return v;
  }
  return 0;
}

std::optional<uint64_t> ParseCgroupBytes(const std::string& text) {
  const absl::string_view v = absl::StripAsciiWhitespace(text);
  uint64_t n = 0;
  if (v == "max" || !absl::SimpleAtoi(v, &n) || n >= (uint64_t{1} << 62)) return std::nullopt;
  return n;
}

HostMemory ApplyCgroup(HostMemory m, std::optional<uint64_t> limit, std::optional<uint64_t> usage) {
  if (!limit) return m;
  uint64_t left = *limit;
  if (usage) left = *usage < *limit ? *limit - *usage : 0;
  if (*limit < m.total) m.total = *limit;
  if (left < m.available) {
    m.available = left;
    m.cgroup_limited = true;
  }
  return m;
}

absl::StatusOr<HostMemory> QueryHostMemory() {
  const auto meminfo = ReadFile("/proc/meminfo");
  if (!meminfo) return absl::FailedPreconditionError("cannot read /proc/meminfo");
  auto m = ParseMeminfo(*meminfo);
  if (!m.ok()) return m.status();
  std::string v2, v1;
  OwnCgroups(&v2, &v1);
  // Inside a container the process's own cgroup is usually mounted at the root; on a host it is
  // at its path below it. The first limit file found wins.
  const std::string root = "/sys/fs/cgroup";
  for (const std::string& dir : {root, root + v2}) {
    if (auto limit = ReadCgroupBytes(dir + "/memory.max"))
      return ApplyCgroup(
          *m, limit,
          ReadCgroupUsage(dir + "/memory.current", dir + "/memory.stat", "inactive_file"));
  }
  for (const std::string& dir : {root + "/memory", root + "/memory" + v1}) {
    if (auto limit = ReadCgroupBytes(dir + "/memory.limit_in_bytes"))
      return ApplyCgroup(*m, limit,
                         ReadCgroupUsage(dir + "/memory.usage_in_bytes", dir + "/memory.stat",
                                         "total_inactive_file"));
  }
  return m;
}

}  // namespace attnd::cpu
