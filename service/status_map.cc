#include "service/status_map.h"

#include <string>

namespace attnd {

grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(static_cast<int>(s.code())),
                      std::string(s.message()));
}

}  // namespace attnd
