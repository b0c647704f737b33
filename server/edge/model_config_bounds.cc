#include "server/edge/model_config_bounds.h"

#include "absl/strings/str_cat.h"

namespace memra {

absl::Status CheckModelConfigBounds(absl::string_view json_text) {
  if (json_text.size() > kMaxModelConfigBytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("config.json is ", json_text.size(), " bytes and the limit is ",
                     kMaxModelConfigBytes, " (kMaxModelConfigBytes)"));
  }
  size_t depth = 0;
  bool in_string = false;
  bool escaped = false;
  for (size_t offset = 0; offset < json_text.size(); ++offset) {
    const char c = json_text[offset];
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    switch (c) {
      case '"':
        in_string = true;
        break;
      case '[':
      case '{':
        if (++depth > kMaxModelConfigDepth) {
          return absl::InvalidArgumentError(absl::StrCat(
              "config.json nests ", depth, " deep at byte ", offset, " and the limit is ",
              kMaxModelConfigDepth, " (kMaxModelConfigDepth)"));
        }
        break;
      case ']':
      case '}':
        // Unbalanced closers are the parser's to refuse; never wrap below zero.
        if (depth > 0) --depth;
        break;
      default:
        break;
    }
  }
  return absl::OkStatus();
}

}  // namespace memra
