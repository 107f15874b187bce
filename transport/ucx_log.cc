#include "transport/ucx_log.h"

#include <ucs/debug/log_def.h>

#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "absl/strings/str_cat.h"

namespace attnd::transport {
namespace {

struct Route {
  std::mutex mu;
  UcxLogSink sink;
  int per_second = 20;
  std::chrono::steady_clock::time_point window;  // the current second's start
  int in_window = 0;                             // lines let through in it
  int64_t held = 0;                              // held back since the last line let through
  int64_t held_total = 0;
  bool pushed = false;  // the handler is installed (once per process)
};

Route& TheRoute() {
  static Route* r = new Route;  // never destroyed: UCX may log from its threads at exit
  return *r;
}

ucs_log_func_rc_t Handle(const char* file, unsigned line, const char* /*function*/,
                         ucs_log_level_t level, const ucs_log_component_config_t* /*comp*/,
                         const char* message, va_list ap) {
  char text[2048];
  va_list copy;
  va_copy(copy, ap);
  std::vsnprintf(text, sizeof(text), message, copy);
  va_end(copy);
  size_t n = std::strlen(text);
  while (n > 0 && (text[n - 1] == '\n' || text[n - 1] == '\r')) text[--n] = '\0';
  const char* base = std::strrchr(file, '/');
  base = base != nullptr ? base + 1 : file;
  const UcxLogLevel l = level <= UCS_LOG_LEVEL_ERROR  ? UcxLogLevel::kError
                        : level == UCS_LOG_LEVEL_WARN ? UcxLogLevel::kWarning
                                                      : UcxLogLevel::kInfo;
  Route& r = TheRoute();
  std::lock_guard<std::mutex> lock(r.mu);
  if (!r.sink) return UCS_LOG_FUNC_RC_CONTINUE;  // UCX's printer, as before any route
  const auto now = std::chrono::steady_clock::now();
  if (now - r.window >= std::chrono::seconds(1)) {
    r.window = now;
    r.in_window = 0;
  }
  if (r.in_window >= r.per_second) {
    ++r.held;
    ++r.held_total;
    return UCS_LOG_FUNC_RC_STOP;
  }
  ++r.in_window;
  if (r.held > 0) {
    r.sink(UcxLogLevel::kWarning, absl::StrCat("UCX: ", r.held, " lines held back (more than ",
                                               r.per_second, " a second)"));
    r.held = 0;
  }
  r.sink(l, absl::StrCat("UCX ", base, ":", line, " ", text));
  return UCS_LOG_FUNC_RC_STOP;  // not printed again by UCX
}

}  // namespace

bool RouteUcxLogs(UcxLogSink sink, int per_second) {
  const char* file = std::getenv("UCX_LOG_FILE");
  if (file != nullptr && file[0] != '\0') return false;
  Route& r = TheRoute();
  std::lock_guard<std::mutex> lock(r.mu);
  r.sink = std::move(sink);
  r.per_second = per_second > 0 ? per_second : 1;
  if (!r.pushed) {
    ucs_log_push_handler(&Handle);
    r.pushed = true;
  }
  return true;
}

int64_t UcxLogLinesSuppressed() {
  Route& r = TheRoute();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.held_total;
}

}  // namespace attnd::transport
