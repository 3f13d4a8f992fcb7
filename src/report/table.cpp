#include "kdacp/report/table.hpp"

#include <algorithm>

#include <fmt/format.h>

namespace kdacp::report {

void Table::print(std::FILE* out) const {
  std::vector<std::size_t> width;
  for (const auto& row : rows_) {
    width.resize(std::max(width.size(), row.size()));
    for (std::size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  for (std::size_t r = 0; r < rows_.size(); ++r) {
    std::string line;
    for (std::size_t c = 0; c < rows_[r].size(); ++c) {
      // Padded by bytes, as the widths are counted ("B·H" is 4 wide).
      const std::string& cell = rows_[r][c];
      const std::string pad(width[c] - cell.size(), ' ');
      line += c == 0 ? cell + pad : "  " + pad + cell;
    }
    fmt::print(out, "{}\n", line);
    if (r == 0) {
      std::size_t total = 0;
      for (std::size_t c = 0; c < width.size(); ++c) total += width[c] + (c ? 2 : 0);
      fmt::print(out, "{}\n", std::string(total, '-'));
    }
  }
}

}  // namespace kdacp::report
