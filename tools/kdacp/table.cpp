#include "table.hpp"

#include <algorithm>

#include "kdacp/admission.hpp"

namespace kdacp::cli {

void Table::print(std::FILE* out) const {
  std::vector<std::size_t> width;
  for (const auto& row : rows_) {
    width.resize(std::max(width.size(), row.size()));
    for (std::size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  for (std::size_t r = 0; r < rows_.size(); ++r) {
    std::string line;
    for (std::size_t c = 0; c < rows_[r].size(); ++c) {
      const std::string& cell = rows_[r][c];
      // First column left-aligned, numbers right-aligned.
      if (c == 0) line += cell + std::string(width[c] - cell.size(), ' ');
      else line += "  " + std::string(width[c] - cell.size(), ' ') + cell;
    }
    std::fprintf(out, "%s\n", line.c_str());
    if (r == 0) {
      std::size_t total = 0;
      for (std::size_t c = 0; c < width.size(); ++c) total += width[c] + (c ? 2 : 0);
      std::fprintf(out, "%s\n", std::string(total, '-').c_str());
    }
  }
}

std::string fmt(const char* format, double value) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, value);
  return buf;
}

std::string fmt_bytes(double bytes) { return format_bytes(bytes); }

}  // namespace kdacp::cli
