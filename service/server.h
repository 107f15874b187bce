// Builds the engine, the gRPC server, health, reflection and metrics from flags, serves until
// SIGTERM/SIGINT, then drains and shuts down cleanly.
#pragma once

#include "service/flags.h"

namespace attnd {

// Returns the process exit code: 0 after a clean shutdown, 1 when startup fails.
int RunServer(const ServerFlags& flags);

}  // namespace attnd
