// Typed reads of a JSON object's fields (nlohmann::json) with errors that name the document and
// the field: what the model spec and Hugging Face config readers share.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace attnd::json {

// Parses `text` as one JSON object; INVALID_ARGUMENT "<what>: ..." with the parser's position
// otherwise (nlohmann bounds nesting by its own recursion; the files are operators', not
// clients').
inline absl::StatusOr<nlohmann::json> Parse(absl::string_view text, absl::string_view what) {
  nlohmann::json doc = nlohmann::json::parse(text.begin(), text.end(), nullptr,
                                             /*allow_exceptions=*/false);
  if (doc.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(what, ": not valid JSON"));
  if (!doc.is_object()) return absl::InvalidArgumentError(absl::StrCat(what, ": not an object"));
  return doc;
}

class Fields {
 public:
  Fields(const nlohmann::json& obj, absl::string_view what) : obj_(obj), what_(what) {}

  bool Has(absl::string_view key) const { return obj_.contains(std::string(key)); }
  const nlohmann::json& At(absl::string_view key) const { return obj_.at(std::string(key)); }
  absl::Status Bad(absl::string_view key, absl::string_view why) const {
    return absl::InvalidArgumentError(absl::StrCat(what_, ": '", key, "' ", why));
  }

  // An integer that fits T (a JSON number with no fraction).
  template <typename T>
  absl::Status Int(absl::string_view key, T* out) const {
    const nlohmann::json& v = At(key);
    if (!v.is_number()) return Bad(key, "has the wrong type (expected an integer)");
    const double d = v.get<double>();
    // [min, 2^digits): the bound is exact in double (T's max need not be: 2^63 - 1 is not).
    const double hi = std::ldexp(1.0, std::numeric_limits<T>::digits);
    if (d != std::floor(d) || d < static_cast<double>(std::numeric_limits<T>::min()) || d >= hi)
      return Bad(key, "must be an integer in range");
    *out = static_cast<T>(d);
    return absl::OkStatus();
  }
  absl::Status Number(absl::string_view key, double* out) const {
    const nlohmann::json& v = At(key);
    if (!v.is_number()) return Bad(key, "has the wrong type (expected a number)");
    *out = v.get<double>();
    return absl::OkStatus();
  }
  absl::Status String(absl::string_view key, std::string* out) const {
    const nlohmann::json& v = At(key);
    if (!v.is_string()) return Bad(key, "has the wrong type (expected a string)");
    *out = v.get<std::string>();
    return absl::OkStatus();
  }
  // The same, leaving *out as it is when the key is absent or null.
  template <typename T>
  absl::Status OptionalInt(absl::string_view key, T* out) const {
    return Has(key) && !At(key).is_null() ? Int(key, out) : absl::OkStatus();
  }

 private:
  const nlohmann::json& obj_;
  std::string what_;
};

}  // namespace attnd::json
