// Quantities with units on the command line: "5us", "50GB/s", "2GiB".
// Decimal and binary prefixes mean what they say; a bare number is in the
// base unit (seconds, bytes per second, bytes). Bad text throws
// InvalidArgument naming the flag and the units it accepts.
#pragma once

#include <string>

namespace kdacp::cli {

double parse_seconds(const std::string& text, const char* what);
double parse_rate(const std::string& text, const char* what);   // bytes per second
double parse_bytes(const std::string& text, const char* what);

}  // namespace kdacp::cli
