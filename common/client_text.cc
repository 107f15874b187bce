#include "common/client_text.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace attnd {

std::string Quote(absl::string_view text) {
  if (text.size() <= kQuotedPrefixBytes) return absl::StrCat("'", absl::CHexEscape(text), "'");
  return absl::StrCat("'", absl::CHexEscape(text.substr(0, kQuotedPrefixBytes)), "'... (",
                      text.size(), " bytes)");
}

}  // namespace attnd
