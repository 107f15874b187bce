// Large copies whose destination will not be read soon (a tier move's pages): stores that bypass
// the cache (non-temporal), so the copy does not read every destination line first and does not
// evict what the steps are using. Plain SSE2 (every x86-64 has it); other CPUs use memcpy.
#pragma once

#include <cstddef>

namespace attnd {

// As memcpy(dst, src, n) (the ranges must not overlap); the bytes are in memory, ordered before
// anything the caller stores afterwards, when it returns.
void StreamCopy(void* dst, const void* src, size_t n);

}  // namespace attnd
