#include "service/logging.h"

#include <glog/logging.h>
#include <grpc/support/log.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace attnd {
namespace {

std::atomic<bool> json_lines{false};

// RFC 3339 in UTC with microseconds.
std::string Timestamp(std::time_t seconds, int usec) {
  std::tm t;
  gmtime_r(&seconds, &t);
  return absl::StrFormat("%04d-%02d-%02dT%02d:%02d:%02d.%06dZ", t.tm_year + 1900, t.tm_mon + 1,
                         t.tm_mday, t.tm_hour, t.tm_min, t.tm_sec, usec);
}

// One JSON object and a newline (bytes that are not UTF-8 become U+FFFD rather than an error).
std::string JsonLine(const char* level, const std::string& ts, const std::string& msg,
                     const std::string& file) {
  nlohmann::ordered_json line = {{"ts", ts}, {"level", level}, {"msg", msg}};
  if (!file.empty()) line["file"] = file;
  return line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

// glog's messages as JSON lines on stderr (glog's own stderr output is off in this mode).
class JsonSink : public google::LogSink {
 public:
  void send(google::LogSeverity severity, const char* /*full_filename*/, const char* base_filename,
            int line, const google::LogMessageTime& time, const char* message,
            size_t message_len) override {
    const std::string text =
        JsonLine(google::GetLogSeverityName(severity), Timestamp(time.timestamp(), time.usec()),
                 std::string(message, message_len), absl::StrCat(base_filename, ":", line));
    std::fwrite(text.data(), 1, text.size(), stderr);
  }
};

// gRPC core's own lines (gpr_log: its experiments at start, warnings, GRPC_VERBOSITY and
// GRPC_TRACE output) as JSON lines too, so a collector parsing stderr never meets plain text.
void GprToJson(gpr_log_func_args* args) {
  timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  const char* level = args->severity == GPR_LOG_SEVERITY_ERROR  ? "ERROR"
                      : args->severity == GPR_LOG_SEVERITY_INFO ? "INFO"
                                                                : "DEBUG";
  const char* file = args->file != nullptr ? args->file : "";
  if (const char* slash = std::strrchr(file, '/')) file = slash + 1;
  const std::string text =
      JsonLine(level, Timestamp(now.tv_sec, static_cast<int>(now.tv_nsec / 1000)),
               args->message != nullptr ? args->message : "", absl::StrCat(file, ":", args->line));
  std::fwrite(text.data(), 1, text.size(), stderr);
}

}  // namespace

void SetUpLogging(const char* argv0, const std::string& level, const std::string& format) {
  google::InitGoogleLogging(argv0);
  FLAGS_minloglevel = level == "error"     ? google::GLOG_ERROR
                      : level == "warning" ? google::GLOG_WARNING
                                           : google::GLOG_INFO;
  if (level == "debug") FLAGS_v = 1;  // VLOG(1) lines too
  if (format != "json") {
    FLAGS_logtostderr = true;  // containers log to stderr
    return;
  }
  json_lines = true;
  // No text on stderr and no log files: every message reaches the sink only.
  FLAGS_logtostderr = false;
  FLAGS_alsologtostderr = false;
  FLAGS_stderrthreshold = google::NUM_SEVERITIES;
  for (int s = 0; s < google::NUM_SEVERITIES; ++s) google::SetLogDestination(s, "");
  static JsonSink sink;  // lives as long as the process logs
  google::AddLogSink(&sink);
  gpr_set_log_function(GprToJson);  // before gRPC starts (it logs from its first init)
}

void Say(const std::string& line) {
  if (json_lines) {
    timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    const std::string text =
        JsonLine("INFO", Timestamp(now.tv_sec, static_cast<int>(now.tv_nsec / 1000)), line, "");
    std::fwrite(text.data(), 1, text.size(), stdout);
  } else {
    std::printf("attnd: %s\n", line.c_str());
  }
  std::fflush(stdout);
}

}  // namespace attnd
