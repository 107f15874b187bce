// Client-supplied text inside status messages and logs: at most a short, escaped prefix, so a
// 16 MB sequence id or a 100 KB datatype string can never turn the real status into a
// metadata-size error (docs/trust.md).
#pragma once

#include <cstddef>
#include <string>

#include "absl/strings/string_view.h"

namespace attnd {

// Bytes of client text quoted before it is cut.
inline constexpr size_t kQuotedPrefixBytes = 64;

// 'text' with C escapes for non-printable bytes; a longer text is cut to its first
// kQuotedPrefixBytes bytes and followed by its full length: 'abc...'... (100000 bytes).
std::string Quote(absl::string_view text);

}  // namespace attnd
