#include "kernels/device_factory.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/client_text.h"
#include "kernels/cpu/cpu_device.h"
#ifdef ATTND_HAVE_CUDA
#include "kernels/cuda/cuda_device.h"
#endif

namespace attnd {

absl::StatusOr<std::vector<std::unique_ptr<Device>>> CreateDevices(
    const std::vector<std::string>& names, const ModelSpec& spec, const CacheLayout& layout,
    const DeviceOptions& options) {
  std::vector<std::unique_ptr<Device>> out;
#ifdef ATTND_HAVE_CUDA
  std::vector<cuda::CudaDevice*> gpus;
#endif
  for (const std::string& name : names) {
    const bool gpu = name.rfind("cuda:", 0) == 0;
    int ordinal = -1;
    if ((!gpu && name.rfind("cpu:", 0) != 0) ||
        !absl::SimpleAtoi(name.substr(gpu ? 5 : 4), &ordinal) || ordinal < 0)
      return absl::InvalidArgumentError(
          absl::StrCat("device ", Quote(name), ": expected cpu:N or cuda:N"));
    if (!gpu) {
      auto d = CpuDevice::Create(name, spec, layout, options.pool, options.kernels);
      if (!d.ok()) return d.status();
      out.push_back(std::move(d).value());
      continue;
    }
#ifdef ATTND_HAVE_CUDA
    auto d = cuda::CudaDevice::Create(name, ordinal, spec, layout, options.gpu_scratch_bytes);
    if (!d.ok()) return d.status();
    gpus.push_back(d->get());
    out.push_back(std::move(d).value());
#else
    return absl::UnimplementedError(
        absl::StrCat("device ", Quote(name), ": this build has no CUDA backend (nvcc not found)"));
#endif
  }
#ifdef ATTND_HAVE_CUDA
  if (gpus.size() >= 2) cuda::ConnectPeers(gpus);
#endif
  return out;
}

bool CudaBackendBuilt() {
#ifdef ATTND_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

absl::StatusOr<std::vector<std::string>> GpuDeviceNames() {
  std::vector<std::string> out;
#ifdef ATTND_HAVE_CUDA
  auto n = cuda::ProbeDevices();
  if (!n.ok()) return n.status();
  for (int i = 0; i < *n; ++i) out.push_back(absl::StrCat("cuda:", i));
#endif
  return out;
}

absl::StatusOr<std::vector<std::string>> DefaultDeviceNames() {
  auto gpus = GpuDeviceNames();
  if (gpus.ok() && gpus->empty()) return std::vector<std::string>{"cpu:0"};
  return gpus;
}

}  // namespace attnd
