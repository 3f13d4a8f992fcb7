#include "units.hpp"

#include <algorithm>
#include <map>
#include <sstream>

#include "kdacp/error.hpp"

namespace kdacp::cli {
namespace {

double parse_with_unit(const std::string& text, const std::map<std::string, double>& units,
                       const char* what) {
  std::size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    throw InvalidArgument(std::string(what) + " is '" + text + "', expected a number with a unit");
  }
  std::string unit = text.substr(used);
  unit.erase(std::remove(unit.begin(), unit.end(), ' '), unit.end());
  const auto it = units.find(unit);
  if (it == units.end() || !(value > 0)) {
    std::ostringstream os;
    os << what << " is '" << text << "', expected a positive number with a unit among: ";
    bool first = true;
    for (const auto& entry : units) {
      os << (first ? "" : ", ") << (entry.first.empty() ? "none" : entry.first);
      first = false;
    }
    throw InvalidArgument(os.str());
  }
  return value * it->second;
}

}  // namespace

double parse_seconds(const std::string& t, const char* what) {
  return parse_with_unit(t, {{"", 1}, {"s", 1}, {"ms", 1e-3}, {"us", 1e-6}, {"µs", 1e-6}, {"ns", 1e-9}},
                         what);
}

double parse_rate(const std::string& t, const char* what) {
  return parse_with_unit(t, {{"", 1}, {"B/s", 1}, {"KB/s", 1e3}, {"MB/s", 1e6}, {"GB/s", 1e9},
                             {"TB/s", 1e12}, {"KiB/s", 1024.0}, {"MiB/s", 1048576.0},
                             {"GiB/s", 1073741824.0}, {"Gb/s", 1e9 / 8}},
                         what);
}

double parse_bytes(const std::string& t, const char* what) {
  return parse_with_unit(t, {{"", 1}, {"B", 1}, {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12},
                             {"KiB", 1024.0}, {"MiB", 1048576.0}, {"GiB", 1073741824.0}},
                         what);
}

}  // namespace kdacp::cli
