// Guarded(f): runs `f` (returning absl::Status or StatusOr) and turns any exception into a status,
// so none escapes a request handler or a device operation: std::bad_alloc is RESOURCE_EXHAUSTED,
// anything else INTERNAL.
#pragma once

#include <exception>
#include <new>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace attnd {

template <typename F>
auto Guarded(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("out of memory while serving the request");
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("internal error: ", e.what()));
  } catch (...) {
    return absl::InternalError("internal error: unknown exception");
  }
}

}  // namespace attnd
