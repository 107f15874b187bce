// UCX's own log lines (its warnings about peers and transports, its errors) sent to the process's
// log instead of UCX's printer, which writes plain text to stdout (where attnd's lifecycle lines,
// JSON ones under --log-format=json, are read), and bounded: a peer can make UCX warn, with a
// backtrace, for every message it sends (an active message of an id no handler serves, say), so
// at most `per_second` lines a second go through and the rest are counted, their number reported
// with the next line let through. Where the operator set UCX_LOG_FILE, UCX keeps its own
// printer (RouteUcxLogs returns false).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace attnd::transport {

enum class UcxLogLevel { kError, kWarning, kInfo };
using UcxLogSink = std::function<void(UcxLogLevel, const std::string&)>;

// From now on UCX's lines at or above UCX_LOG_LEVEL (UCX's, default warn) go to `sink` (one
// line each, "UCX <file>:<line> <message>", any thread), not to stdout. A later call replaces
// the sink; an empty one gives the lines back to UCX's printer. False (nothing changed) when
// UCX_LOG_FILE is set.
bool RouteUcxLogs(UcxLogSink sink, int per_second = 20);

// Lines UCX logged that the bound held back, since the process began.
int64_t UcxLogLinesSuppressed();

}  // namespace attnd::transport
