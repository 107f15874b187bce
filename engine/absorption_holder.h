// Server-side absorption's weights as the engine holds them (docs/numerics.md): set once, never
// replaced, so a running step's layers all see the same ones.
#pragma once

#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/status.h"
#include "common/absorption.h"
#include "common/model_spec.h"
#include "kernels/device.h"

namespace attnd {

// Thread safety: every method may be called from any thread. Set serialises uploads on a lock
// of its own, so a layer reading the weights (Get) never waits for an upload to the devices.
class AbsorptionHolder {
 public:
  // The weights set, or null.
  std::shared_ptr<const Absorption> Get() const;
  // Checks the weights against the model, prepares every device for them (a GPU copies them),
  // then sets them. The same weights again: OK, nothing changes; different ones once some are
  // set: ALREADY_EXISTS; INVALID_ARGUMENT for weights that do not fit the model.
  absl::Status Set(std::shared_ptr<const Absorption> weights, const ModelSpec& spec,
                   const std::vector<std::unique_ptr<Device>>& devices);

 private:
  std::mutex set_mu_;      // one upload at a time
  mutable std::mutex mu_;  // guards weights_
  std::shared_ptr<const Absorption> weights_;
};

}  // namespace attnd
