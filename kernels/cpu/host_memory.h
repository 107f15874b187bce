// How much host memory this process may still take: what a CPU device's cache can be sized from
// (--kv-cache-fraction). Linux: /proc/meminfo's MemAvailable, lowered to what the process's memory
// cgroup (v2 memory.max, v1 memory.limit_in_bytes) leaves — its usage less its inactive file
// pages, which the kernel reclaims first — so a pod's limit counts, not the node's.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"

namespace attnd::cpu {

struct HostMemory {
  uint64_t available = 0;  // bytes this process may still allocate
  uint64_t total = 0;      // MemTotal, or the cgroup limit where that is lower
  bool cgroup_limited = false;
};

// Reads the files below (FAILED_PRECONDITION when /proc/meminfo cannot be read or parsed).
absl::StatusOr<HostMemory> QueryHostMemory();

// The parts, for tests. MemAvailable and MemTotal of a /proc/meminfo text (kB lines).
absl::StatusOr<HostMemory> ParseMeminfo(const std::string& text);
// A cgroup limit file's value in bytes: nullopt for "max" (v2) or a v1 "no limit" sentinel (at or
// above 2^62), or for text that is not a number.
std::optional<uint64_t> ParseCgroupBytes(const std::string& text);
// A "key value" line's value in a cgroup memory.stat text (0 when absent).
uint64_t ParseStatField(const std::string& text, const std::string& key);
// Lowers `m` to a cgroup's limit and current usage (either may be absent).
HostMemory ApplyCgroup(HostMemory m, std::optional<uint64_t> limit, std::optional<uint64_t> usage);

}  // namespace attnd::cpu
