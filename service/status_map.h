// The one place where engine errors become gRPC statuses (docs/wire-protocol.md).
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace attnd {

// Same code, same message. absl and gRPC share the canonical code numbering.
grpc::Status ToGrpcStatus(const absl::Status& s);

}  // namespace attnd
