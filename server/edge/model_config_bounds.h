#ifndef MEMRA_SERVER_MODEL_CONFIG_BOUNDS_H_
#define MEMRA_SERVER_MODEL_CONFIG_BOUNDS_H_

// What a client-supplied Hugging Face config.json (KvAdmin GetCost / GetFit / GetMaxContext /
// ImportModel) may cost the daemon before it is parsed: its size and its nesting depth, checked
// by one linear scan that allocates nothing. A JSON parser's memory and time grow with both
// (4 MB of "[" took seconds and hundreds of MiB), so they are bounded at the door; how many
// parses run at once is bounded by a ConcurrencyLimit of kMaxConcurrentModelConfigParses per
// socket (server/edge/admin_service.h). docs/security-model.md#resources lists the bounds.

#include <cstddef>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace memra {

// Real config.json files are a few KiB (the largest, with label tables or quantization module
// lists, a few hundred KiB).
inline constexpr size_t kMaxModelConfigBytes = size_t{1} << 20;
// Real ones nest 3 or 4 deep (text_config.rope_scaling...).
inline constexpr size_t kMaxModelConfigDepth = 32;
// Parses of client-supplied config.json running at once, per socket; past it RESOURCE_EXHAUSTED.
inline constexpr size_t kMaxConcurrentModelConfigParses = 2;

// OK, or RESOURCE_EXHAUSTED naming the size and kMaxModelConfigBytes, or INVALID_ARGUMENT naming
// the byte offset where nesting passed kMaxModelConfigDepth. Brackets inside strings do not count.
// Says nothing about whether the text is valid JSON: the parser decides that, afterwards.
absl::Status CheckModelConfigBounds(absl::string_view json_text);

}  // namespace memra

#endif  // MEMRA_SERVER_MODEL_CONFIG_BOUNDS_H_
