#include "tools/text_format.h"

#include <algorithm>
#include <utility>

#include "absl/base/internal/raw_logging.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_format.h"

namespace memra::kvctl {

std::string FormatBytes(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) return absl::StrFormat("%d B", bytes);
  int unit = 0;
  long double scaled = static_cast<long double>(bytes) / 1024;
  // Move up while the value would print as 1024.00 or more (1023.996 KiB rounds to "1024.00").
  while (unit + 1 < static_cast<int>(std::size(kUnits)) && scaled >= 1023.995L) {
    scaled /= 1024;
    ++unit;
  }
  return absl::StrFormat("%.2Lf %s (%d B)", scaled, kUnits[unit], bytes);
}

std::string HexBytes(const std::string& bytes) { return absl::BytesToHexString(bytes); }

TextTable::TextTable(std::vector<Column> columns) : columns_(std::move(columns)) {}

void TextTable::AddRow(std::vector<std::string> cells) {
  ABSL_RAW_CHECK(cells.size() == columns_.size(), "a table row needs one cell per column");
  rows_.push_back(std::move(cells));
}

std::string TextTable::Render() const {
  const bool has_header = std::any_of(columns_.begin(), columns_.end(),
                                      [](const Column& column) { return !column.header.empty(); });
  std::vector<size_t> widths(columns_.size(), 0);
  for (size_t c = 0; c < columns_.size(); ++c) {
    if (has_header) widths[c] = columns_[c].header.size();
    for (const std::vector<std::string>& row : rows_)
      widths[c] = std::max(widths[c], row[c].size());
  }
  std::string out;
  auto render_row = [&](const std::vector<std::string>& cells) {
    std::string line;
    for (size_t c = 0; c < cells.size(); ++c) {
      if (c > 0) line += "  ";
      const std::string pad(widths[c] - cells[c].size(), ' ');
      line += columns_[c].align == Align::kRight ? pad + cells[c] : cells[c] + pad;
    }
    line.erase(line.find_last_not_of(' ') + 1);
    out += line + "\n";
  };
  if (has_header) {
    std::vector<std::string> headers;
    for (const Column& column : columns_) headers.push_back(column.header);
    render_row(headers);
  }
  for (const std::vector<std::string>& row : rows_) render_row(row);
  return out;
}

FieldList& FieldList::Add(std::string label, std::string value) {
  table_.AddRow({std::move(label), std::move(value)});
  return *this;
}

std::string FieldList::Render() const { return table_.Render(); }

}  // namespace memra::kvctl
