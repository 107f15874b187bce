// CRC-32C (Castagnoli), the checksum the disk tier keeps per page (kv_store/disk_tier.h): SSE4.2's
// crc32 instruction where the CPU has it (chosen at run time; the default build stays baseline
// x86-64), a table otherwise; both give the same value.
#pragma once

#include <cstddef>
#include <cstdint>

namespace attnd {

// The CRC-32C of `n` bytes, continuing from `crc` (0 for a fresh one).
uint32_t Crc32c(const void* data, size_t n, uint32_t crc = 0);
// The table version, always (for tests: both must agree).
uint32_t Crc32cPortable(const void* data, size_t n, uint32_t crc = 0);

}  // namespace attnd
