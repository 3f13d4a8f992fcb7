// A plain aligned text table for human-readable CLI output.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

namespace kdacp::cli {

class Table {
 public:
  explicit Table(std::vector<std::string> header) : rows_{std::move(header)} {}
  void add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  void print(std::FILE* out = stdout) const;

 private:
  std::vector<std::vector<std::string>> rows_;
};

std::string fmt(const char* format, double value);
std::string fmt_bytes(double bytes);

}  // namespace kdacp::cli
