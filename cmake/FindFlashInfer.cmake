# FlashInfer's header-only kernels from the flashinfer-python wheel, at the version
# scripts/fetch-gpu-libs.sh pins (Apache-2.0). They include CUTLASS/CuTe: FlashInfer::FlashInfer
# (an interface target) brings Cutlass::Cutlass along. Defines FlashInfer_FOUND,
# FlashInfer_VERSION and FlashInfer_INCLUDE_DIR.
include(${CMAKE_CURRENT_LIST_DIR}/GpuLibsPins.cmake)
set(_dir "${ATTND_GPU_LIBS_DIR}/flashinfer-python-${ATTND_PIN_flashinfer-python}")
find_path(FlashInfer_INCLUDE_DIR NAMES flashinfer/attention/mla_hopper.cuh
          HINTS "${_dir}/include" NO_DEFAULT_PATH)
if(FlashInfer_INCLUDE_DIR AND EXISTS "${_dir}/VERSION")
  file(STRINGS "${_dir}/VERSION" FlashInfer_VERSION LIMIT_COUNT 1)
endif()
find_package(Cutlass QUIET)
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(FlashInfer REQUIRED_VARS FlashInfer_INCLUDE_DIR Cutlass_FOUND
  VERSION_VAR FlashInfer_VERSION
  FAIL_MESSAGE "FlashInfer ${ATTND_PIN_flashinfer-python} (and CUTLASS ${ATTND_PIN_nvidia-cutlass}) headers not found under ${ATTND_GPU_LIBS_DIR}: run ./scripts/fetch-gpu-libs.sh (./scripts/install-deps.sh runs it where nvcc is)")
if(FlashInfer_FOUND AND NOT TARGET FlashInfer::FlashInfer)
  add_library(FlashInfer::FlashInfer INTERFACE IMPORTED)
  set_target_properties(FlashInfer::FlashInfer PROPERTIES
    INTERFACE_SYSTEM_INCLUDE_DIRECTORIES "${FlashInfer_INCLUDE_DIR}"
    INTERFACE_INCLUDE_DIRECTORIES "${FlashInfer_INCLUDE_DIR}"
    INTERFACE_LINK_LIBRARIES Cutlass::Cutlass)
endif()
