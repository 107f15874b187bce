#include "engine/absorption_holder.h"

#include "absl/strings/str_cat.h"
#include "common/guarded.h"
#include "common/status_macros.h"

namespace attnd {
namespace {

absl::Status Prepare(const Absorption& a, const ModelSpec& s,
                     const std::vector<std::unique_ptr<Device>>& devices) {
  if (a.num_heads() != s.num_heads || a.latent_dim() != s.kv_lora_rank ||
      a.num_layers() != s.num_layers())
    return absl::InvalidArgumentError(
        absl::StrCat("absorption weights for ", a.num_layers(), " layers, ", a.num_heads(),
                     " heads, L ", a.latent_dim(), "; the model has ", s.num_layers(), " layers, ",
                     s.num_heads, " heads, L ", s.kv_lora_rank));
  if (!a.complete())
    return absl::InvalidArgumentError(
        absl::StrCat("absorption weights: layer ", a.missing_layer(), " is missing"));
  for (const auto& d : devices) {
    const absl::Status p = Guarded([&] { return d->PrepareAbsorption(a); });
    if (!p.ok())
      return absl::Status(p.code(), absl::StrCat(d->name(), ": absorption weights: ", p.message()));
  }
  return absl::OkStatus();
}

}  // namespace

std::shared_ptr<const Absorption> AbsorptionHolder::Get() const {
  std::lock_guard<std::mutex> lock(mu_);
  return weights_;
}

absl::Status AbsorptionHolder::Set(std::shared_ptr<const Absorption> weights, const ModelSpec& spec,
                                   const std::vector<std::unique_ptr<Device>>& devices) {
  if (weights == nullptr) return absl::InvalidArgumentError("no absorption weights");
  std::lock_guard<std::mutex> lock(set_mu_);
  if (const std::shared_ptr<const Absorption> current = Get()) {
    if (current->SameAs(*weights)) return absl::OkStatus();
    return absl::AlreadyExistsError(absl::StrCat(
        "absorption weights are already loaded (", current->source(),
        ") and differ from these; they are never replaced while the server runs (restart it)"));
  }
  RETURN_IF_ERROR(Prepare(*weights, spec, devices));
  std::lock_guard<std::mutex> set(mu_);
  weights_ = std::move(weights);
  return absl::OkStatus();
}

}  // namespace attnd
