#include "kernels/device_factory.h"

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/client_text.h"
#include "common/status_macros.h"
#include "kernels/cpu/cpu_device.h"
#include "kernels/cpu/host_memory.h"
#include "kernels/cuda/backend/kernel_choice.h"
#ifdef ATTND_HAVE_CUDA
#include "kernels/cuda/backend/cuda_device.h"
#endif

namespace attnd {
namespace {

struct DeviceName {
  bool gpu = false;
  int ordinal = -1;
};

absl::StatusOr<DeviceName> ParseDeviceName(const std::string& name) {
  DeviceName d;
  d.gpu = name.rfind("cuda:", 0) == 0;
  if ((!d.gpu && name.rfind("cpu:", 0) != 0) ||
      !absl::SimpleAtoi(name.substr(d.gpu ? 5 : 4), &d.ordinal) || d.ordinal < 0)
    return absl::InvalidArgumentError(
        absl::StrCat("device ", Quote(name), ": expected cpu:N or cuda:N"));
  return d;
}

std::string Gib(double bytes) { return absl::StrFormat("%.2f GiB", bytes / (1 << 30)); }

}  // namespace

absl::StatusOr<CacheBudget> CacheBytesForFraction(const std::vector<std::string>& names,
                                                  double fraction, size_t gpu_scratch_bytes) {
  if (!(fraction > 0 && fraction <= 1))
    return absl::InvalidArgumentError(
        absl::StrCat("--kv-cache-fraction=", fraction, ": expected a fraction in (0, 1]"));
  if (names.empty()) return absl::InvalidArgumentError("no devices");
  std::vector<DeviceName> parsed;
  int cpus = 0;
  for (const std::string& name : names) {
    ASSIGN_OR_RETURN(const DeviceName d, ParseDeviceName(name));
    parsed.push_back(d);
    cpus += d.gpu ? 0 : 1;
  }
  CacheBudget out;
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string& name = names[i];
    const DeviceName& d = parsed[i];
    double budget = 0;
    std::string why;
    if (!d.gpu) {
      ASSIGN_OR_RETURN(const cpu::HostMemory m, cpu::QueryHostMemory());
      budget = fraction * static_cast<double>(m.available) / cpus;
      why = absl::StrCat(fraction, " of ", Gib(m.available), " host memory available",
                         m.cgroup_limited ? " (cgroup limit)" : "",
                         cpus > 1 ? absl::StrCat(", shared by ", cpus, " CPU devices") : "");
    } else {
#ifdef ATTND_HAVE_CUDA
      ASSIGN_OR_RETURN(const cuda::GpuMemory m, cuda::QueryGpuMemory(d.ordinal));
      budget = fraction * static_cast<double>(m.free) - static_cast<double>(gpu_scratch_bytes);
      why = absl::StrCat(fraction, " of ", name, "'s ", Gib(m.free), " free, less ",
                         Gib(gpu_scratch_bytes), " of step scratch (--gpu-scratch-bytes)");
#else
      return absl::UnimplementedError(absl::StrCat(
          "device ", Quote(name), ": this build has no CUDA backend (nvcc not found)"));
#endif
    }
    if (budget < 1 << 20)
      return absl::ResourceExhaustedError(
          absl::StrCat("--kv-cache-fraction: ", why, " leaves no room for a KV cache"));
    const size_t bytes = static_cast<size_t>(budget);
    if (i == 0 || bytes < out.bytes) {
      out.bytes = bytes;
      out.explanation = absl::StrCat(Gib(bytes), " per device: ", why);
    }
  }
  return out;
}

absl::Status CheckHostCacheFits(int cpu_devices, size_t cache_bytes_per_device, uint64_t available,
                                bool cgroup_limited) {
  const double need = static_cast<double>(cache_bytes_per_device) * cpu_devices;
  if (need <= static_cast<double>(available)) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat("the cache needs ", Gib(need), " of host memory (", cpu_devices,
                   " CPU device(s) x ", Gib(static_cast<double>(cache_bytes_per_device)), ") but ",
                   Gib(static_cast<double>(available)), " are available",
                   cgroup_limited ? " (within the cgroup limit)" : " (MemAvailable)",
                   "; lower --kv-cache-bytes or --kv-pages, or use --kv-cache-fraction"));
}

absl::StatusOr<std::string> ResolveCpuIsa(absl::string_view cpu_isa) {
  if (cpu_isa == "auto") return std::string(cpu::IsaName(cpu::BestIsa()));
  if (cpu_isa != "avx512" && cpu_isa != "avx2" && cpu_isa != "generic")
    return absl::InvalidArgumentError(
        absl::StrCat("cpu isa '", cpu_isa, "' is not auto, avx512, avx2 or generic"));
  if (!cpu::SupportedIsaNamed(cpu_isa))
    return absl::FailedPreconditionError(
        absl::StrCat("--cpu-isa=", cpu_isa, ": this CPU lacks ",
                     cpu_isa == "avx512" ? "AVX-512 (F, BW, VL, DQ)" : "AVX2/FMA/F16C"));
  return std::string(cpu_isa);
}

HostAllocator HostTierAllocator(const std::vector<std::unique_ptr<Device>>& devices) {
#ifdef ATTND_HAVE_CUDA
  for (const auto& d : devices)
    if (d->backend() == "cuda") return cuda::PinnedHostMemory();
#endif
  return AnonymousHostMemory();
}

absl::StatusOr<std::vector<std::unique_ptr<Device>>> CreateDevices(
    const std::vector<std::string>& names, const ModelSpec& spec, const CacheLayout& layout,
    const DeviceOptions& options) {
  ASSIGN_OR_RETURN(const std::string isa, ResolveCpuIsa(options.settings.cpu_isa));
  std::vector<DeviceName> parsed;
  int cpus = 0;
  for (size_t i = 0; i < names.size(); ++i) {
    ASSIGN_OR_RETURN(const DeviceName d, ParseDeviceName(names[i]));
    if (std::find(names.begin(), names.begin() + i, names[i]) != names.begin() + i)
      return absl::InvalidArgumentError(
          absl::StrCat("device ", Quote(names[i]), " is named twice (one cache per device)"));
    parsed.push_back(d);
    cpus += d.gpu ? 0 : 1;
  }
  if (cpus > 0) {
    // A host whose memory cannot be read (no /proc) is not refused: its allocations still fail
    // cleanly where they do not fit.
    if (const auto m = cpu::QueryHostMemory(); m.ok())
      RETURN_IF_ERROR(
          CheckHostCacheFits(cpus, layout.TotalBytes(), m->available, m->cgroup_limited));
  }
  const cpu::Kernels* kernels = &cpu::GetKernels(*cpu::SupportedIsaNamed(isa));
  std::vector<std::unique_ptr<Device>> out;
  cuda::CudaKernelChoice choice;
  if (!cuda::ParseCudaMla(options.settings.cuda_mla, &choice) ||
      !cuda::ParseCudaIndexer(options.settings.cuda_indexer, &choice) ||
      !cuda::ParseCudaTopK(options.settings.cuda_topk, &choice))
    return absl::InvalidArgumentError(absl::StrCat(
        "CUDA kernels: --cuda-mla=", Quote(options.settings.cuda_mla),
        " --cuda-indexer=", Quote(options.settings.cuda_indexer),
        " --cuda-topk=", Quote(options.settings.cuda_topk), ": not all are kernel names"));
  cuda::SetFlagKernelChoice(choice);
#ifdef ATTND_HAVE_CUDA
  std::vector<cuda::CudaDevice*> gpus;
#endif
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string& name = names[i];
    if (!parsed[i].gpu) {
      auto d = CpuDevice::Create(name, spec, layout, options.pool, kernels);
      if (!d.ok()) return d.status();
      out.push_back(std::move(d).value());
      continue;
    }
#ifdef ATTND_HAVE_CUDA
    auto d = cuda::CudaDevice::Create(name, parsed[i].ordinal, spec, layout,
                                      options.settings.gpu_scratch_bytes);
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
