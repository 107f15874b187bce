# CUTLASS and CuTe headers from the nvidia-cutlass wheel, at the version scripts/fetch-gpu-libs.sh
# pins (BSD-3-Clause). Defines Cutlass::Cutlass (an interface target: include directory only),
# Cutlass_FOUND, Cutlass_VERSION and Cutlass_INCLUDE_DIR.
include(${CMAKE_CURRENT_LIST_DIR}/GpuLibsPins.cmake)
set(_dir "${ATTND_GPU_LIBS_DIR}/nvidia-cutlass-${ATTND_PIN_nvidia-cutlass}")
find_path(Cutlass_INCLUDE_DIR NAMES cute/tensor.hpp cutlass/cutlass.h
          HINTS "${_dir}/include" NO_DEFAULT_PATH)
if(Cutlass_INCLUDE_DIR AND EXISTS "${_dir}/VERSION")
  file(STRINGS "${_dir}/VERSION" Cutlass_VERSION LIMIT_COUNT 1)
endif()
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(Cutlass REQUIRED_VARS Cutlass_INCLUDE_DIR VERSION_VAR Cutlass_VERSION
  FAIL_MESSAGE "CUTLASS ${ATTND_PIN_nvidia-cutlass} headers not found under ${_dir}: run ./scripts/fetch-gpu-libs.sh (./scripts/install-deps.sh runs it where nvcc is)")
if(Cutlass_FOUND AND NOT TARGET Cutlass::Cutlass)
  add_library(Cutlass::Cutlass INTERFACE IMPORTED)
  # SYSTEM: their headers' warnings are not attnd's.
  set_target_properties(Cutlass::Cutlass PROPERTIES INTERFACE_SYSTEM_INCLUDE_DIRECTORIES "${Cutlass_INCLUDE_DIR}"
    INTERFACE_INCLUDE_DIRECTORIES "${Cutlass_INCLUDE_DIR}")
endif()
