// A plain aligned text table: the human-readable form of the CLI's reports
// and of the benchmark drivers' records.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

namespace kdacp::report {

class Table {
 public:
  explicit Table(std::vector<std::string> header) : rows_{std::move(header)} {}
  void add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  // The header, a rule, then the rows; the first column left-aligned, the
  // others right-aligned.
  void print(std::FILE* out = stdout) const;

 private:
  std::vector<std::vector<std::string>> rows_;
};

}  // namespace kdacp::report
