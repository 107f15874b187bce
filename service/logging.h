// Where attnd's words go. Lifecycle lines (serving, draining, drained, stopped) go to stdout
// whatever --log-level says, since tools read the serving line's port there; everything else
// goes through glog to stderr. --log-format=json makes both one JSON object per line (ts,
// level, msg, and file for glog's), as log collectors (Loki, Elasticsearch, Cloud Logging) parse.
#pragma once

#include <string>

namespace attnd {

// Before anything logs: glog to stderr at `level` (debug, info, warning, error) in `format` (text,
// json). Call once.
void SetUpLogging(const char* argv0, const std::string& level, const std::string& format);

// A lifecycle line on stdout ("attnd: LINE", or a JSON object), flushed.
void Say(const std::string& line);

}  // namespace attnd
