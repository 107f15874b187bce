// An enum's names in one table, read both ways: NameIn(table, value) and ValueNamed(table, name).
// Each enum that has a wire or flag spelling keeps its table beside its Name/Parse functions, so
// a new value is spelled once.
#pragma once

#include <cstddef>
#include <optional>

namespace attnd {

template <typename E>
struct NamedValue {
  E value;
  const char* name;
};

// The name of `value`, or `unknown` when the table lacks it.
template <typename E, size_t N>
constexpr const char* NameIn(const NamedValue<E> (&table)[N], E value, const char* unknown = "?") {
  for (const NamedValue<E>& entry : table)
    if (entry.value == value) return entry.name;
  return unknown;
}

// The value spelled exactly `name` (any string-view type), or nullopt.
template <typename E, size_t N, typename View>
constexpr std::optional<E> ValueNamed(const NamedValue<E> (&table)[N], View name) {
  for (const NamedValue<E>& entry : table)
    if (name == View(entry.name)) return entry.value;
  return std::nullopt;
}

}  // namespace attnd
