#ifndef MEMRA_TOOLS_TEXT_FORMAT_H_
#define MEMRA_TOOLS_TEXT_FORMAT_H_

// Human-readable text for memra-kvctl: byte counts and aligned tables. Pure functions over
// values; nothing here knows the protocol.

#include <cstdint>
#include <string>
#include <vector>

namespace memra::kvctl {

// "512 B" below 1 KiB; above, two decimals of the largest binary unit and the exact count:
// "1.50 GiB (1610612736 B)". The exact count is always there so scripts scraping the human
// output (and operators comparing with logs) never lose precision.
std::string FormatBytes(uint64_t bytes);

// Lowercase hex of raw bytes (fingerprints): the form --model accepts.
std::string HexBytes(const std::string& bytes);

// A table of text cells, columns separated by two spaces, no trailing spaces. Numbers are
// right-aligned so their digits line up; text is left-aligned.
//
// Thread-safety: a value; not synchronized.
class TextTable {
 public:
  enum class Align { kLeft, kRight };
  struct Column {
    std::string header;  // every header empty: no header line (a label/value list)
    Align align = Align::kLeft;
  };

  explicit TextTable(std::vector<Column> columns);

  // REQUIRES: cells.size() == number of columns.
  void AddRow(std::vector<std::string> cells);
  bool empty() const { return rows_.empty(); }

  // Every line ends in '\n'.
  std::string Render() const;

 private:
  std::vector<Column> columns_;
  std::vector<std::vector<std::string>> rows_;
};

// A two-column, headerless label/value list: "label  value" with the values aligned.
class FieldList {
 public:
  FieldList& Add(std::string label, std::string value);
  std::string Render() const;

 private:
  TextTable table_{{{""}, {""}}};
};

}  // namespace memra::kvctl

#endif  // MEMRA_TOOLS_TEXT_FORMAT_H_
