// The one conversion between ModelSpec and its wire form (v1::ModelSpec): the server fills
// ServerInfo with it and clients (attnctl, the soak, the tests) read the model back with it.
#pragma once

#include "absl/status/statusor.h"
#include "attnd/v1/attention.pb.h"
#include "common/model_spec.h"

namespace attnd {

void ModelSpecToProto(const ModelSpec& spec, v1::ModelSpec* out);

// INVALID_ARGUMENT when a name is unknown or the spec fails ValidateModelSpec.
absl::StatusOr<ModelSpec> ModelSpecFromProto(const v1::ModelSpec& m);

}  // namespace attnd
