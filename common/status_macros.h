// Small look-alikes of the status macros that Debian's Abseil (20220623) lacks.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define ATTND_CONCAT_INNER_(a, b) a##b
#define ATTND_CONCAT_(a, b) ATTND_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define RETURN_IF_ERROR(expr)                      \
  do {                                             \
    ::absl::Status attnd_status_ = (expr);         \
    if (!attnd_status_.ok()) return attnd_status_; \
  } while (0)

// `ASSIGN_OR_RETURN(auto x, MakeX())`: assigns the value of an absl::StatusOr or returns its error.
#define ASSIGN_OR_RETURN(lhs, expr) \
  ASSIGN_OR_RETURN_IMPL_(ATTND_CONCAT_(attnd_statusor_, __LINE__), lhs, expr)
#define ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                           \
  if (!tmp.ok()) return tmp.status();          \
  lhs = std::move(tmp).value()
