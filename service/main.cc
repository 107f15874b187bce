// attnd: the attention-offload server. See `attnd --help`.
#include <cstdio>

#include "service/flags.h"
#include "service/server.h"

int main(int argc, char** argv) {
  auto flags = attnd::ParseServerFlags(argc, argv);
  if (!flags.ok()) {
    const bool help = flags.status().code() == absl::StatusCode::kCancelled;
    std::fprintf(help ? stdout : stderr, "%s", std::string(flags.status().message()).c_str());
    return help ? 0 : 2;
  }
  return attnd::RunServer(*flags);
}
