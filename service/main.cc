// attnd: the attention-offload server. See `attnd --help`.
#include <glog/logging.h>

#include <cstdio>

#include "service/flags.h"
#include "service/server.h"

int main(int argc, char** argv) {
  auto flags = attnd::ParseServerFlags(argc, argv);
  if (!flags.ok()) {
    const bool help = flags.status().code() == absl::StatusCode::kCancelled;
    std::string text(flags.status().message());
    if (!text.empty() && text.back() != '\n') text += '\n';
    std::fprintf(help ? stdout : stderr, "%s", text.c_str());
    return help ? 0 : 2;
  }
  google::InitGoogleLogging(argv[0]);
  FLAGS_logtostderr = true;  // containers log to stderr
  FLAGS_minloglevel = flags->log_level == "error"     ? google::GLOG_ERROR
                      : flags->log_level == "warning" ? google::GLOG_WARNING
                                                      : google::GLOG_INFO;
  return attnd::RunServer(*flags);
}
