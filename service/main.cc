// attnd: the attention-offload server. See `attnd --help`.
#include <cstdio>

#include "service/flags.h"
#include "service/logging.h"
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
  attnd::SetUpLogging(argv[0], flags->log_level, flags->log_format);
  return attnd::RunServer(*flags);
}
