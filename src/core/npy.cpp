#include "kdacp/npy.hpp"

#include <sys/stat.h>

#include <cerrno>
#include <algorithm>
#include <bit>
#include <iterator>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/copy_bytes.hpp"
#include "kdacp/error.hpp"

namespace kdacp {

static_assert(std::endian::native == std::endian::little, "kdacp's .npy I/O assumes little-endian");

namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr std::size_t kMaxElements = std::size_t{1} << 40;

[[noreturn]] void bad(const std::string& path, const std::string& what) {
  throw IoError(path + ": " + what);
}

// Value of `key` in the header dict, as raw text up to the next top-level ','.
std::string dict_value(const std::string& path, const std::string& header, const std::string& key) {
  const std::string quoted = "'" + key + "'";
  auto pos = header.find(quoted);
  if (pos == std::string::npos) bad(path, "header lacks the key " + quoted + ": " + header);
  pos = header.find(':', pos + quoted.size());
  if (pos == std::string::npos) bad(path, "header has no value for " + quoted);
  ++pos;
  while (pos < header.size() && header[pos] == ' ') ++pos;
  std::size_t end = pos;
  int depth = 0;
  while (end < header.size()) {
    const char c = header[end];
    if (c == '(') ++depth;
    if (c == ')') --depth;
    if ((c == ',' || c == '}') && depth == 0) break;
    ++end;
  }
  return header.substr(pos, end - pos);
}

}  // namespace

std::size_t NpyArray::elements() const {
  std::size_t n = 1;
  for (std::size_t d : shape) n *= d;
  return n;
}

std::string NpyArray::file_dtype() const { return half ? half_name(*half) : to_string(dtype); }

std::vector<float> NpyArray::to_f32(bool allow_f64) const {
  if (dtype == DType::f32) return detail::copy_bytes_as<float>(data.data(), elements());
  std::vector<float> out(elements());
  if (dtype == DType::f64 && allow_f64) {
    for (std::size_t i = 0; i < out.size(); ++i) {
      double d;
      std::memcpy(&d, data.data() + i * sizeof(double), sizeof(double));
      out[i] = static_cast<float>(d);
    }
  } else {
    throw IoError("array dtype is " + to_string(dtype) + ", expected float32");
  }
  return out;
}

namespace {

// Reads the header from `in` (positioned at the start) and returns the array
// with its dtype and shape but no data, and the data's byte count.
NpyArray read_header(const std::string& path, std::istream& in, std::size_t& data_bytes) {
  char magic[6];
  if (!in.read(magic, 6) || std::memcmp(magic, kMagic, 6) != 0)
    bad(path, "not a .npy file (bad magic string)");
  unsigned char ver[2];
  if (!in.read(reinterpret_cast<char*>(ver), 2)) bad(path, "truncated before the version");
  std::size_t header_len = 0;
  if (ver[0] == 1) {
    unsigned char b[2];
    if (!in.read(reinterpret_cast<char*>(b), 2)) bad(path, "truncated header length");
    header_len = b[0] | (std::size_t{b[1]} << 8);
  } else if (ver[0] == 2 || ver[0] == 3) {
    unsigned char b[4];
    if (!in.read(reinterpret_cast<char*>(b), 4)) bad(path, "truncated header length");
    header_len = b[0] | (std::size_t{b[1]} << 8) | (std::size_t{b[2]} << 16) |
                 (std::size_t{b[3]} << 24);
  } else {
    bad(path, fmt::format("format version {}.{}, expected 1.0, 2.0 or 3.0", ver[0], ver[1]));
  }
  if (header_len > (1u << 20)) bad(path, fmt::format("header of {} bytes is implausible", header_len));
  std::string header(header_len, '\0');
  if (!in.read(header.data(), static_cast<std::streamsize>(header_len))) bad(path, "truncated header");

  NpyArray arr;
  std::string descr = dict_value(path, header, "descr");
  if (descr == "'<f4'" || descr == "'=f4'") arr.dtype = DType::f32;
  else if (descr == "'<f8'" || descr == "'=f8'") arr.dtype = DType::f64;
  else if (descr == "'<f2'" || descr == "'=f2'") arr.half = Half::f16;  // widened to float32 as it is read
  else bad(path, "dtype " + descr + ", expected '<f2' (float16), '<f4' (float32) or '<f8' (float64)");
  const std::string fortran = dict_value(path, header, "fortran_order");
  if (fortran != "False") bad(path, "fortran_order is " + fortran + ", expected False (C order)");
  std::string shape = dict_value(path, header, "shape");
  if (shape.size() < 2 || shape.front() != '(' || shape.back() != ')')
    bad(path, "shape " + shape + " is not a tuple");
  std::stringstream ss(shape.substr(1, shape.size() - 2));
  std::string item;
  std::size_t total = 1;
  while (std::getline(ss, item, ',')) {
    const auto first = item.find_first_not_of(' ');
    if (first == std::string::npos) continue;
    item = item.substr(first, item.find_last_not_of(' ') - first + 1);
    if (item.empty() || item.find_first_not_of("0123456789") != std::string::npos || item.size() > 19)
      bad(path, "shape entry '" + item + "' is not a non-negative integer");
    const unsigned long long d = std::stoull(item);
    if (d != 0 && total > kMaxElements / d) bad(path, "shape " + shape + " is too large");
    total *= d;
    arr.shape.push_back(static_cast<std::size_t>(d));
  }
  data_bytes = total * (arr.half ? sizeof(std::uint16_t) : dtype_size(arr.dtype));
  return arr;
}

// Reads exactly `bytes` of data, which the caller checked against what the
// source holds, and insists that nothing follows.
void read_data(const std::string& path, std::istream& in, std::size_t bytes,
               std::size_t available, const std::string& shape_text, NpyArray& arr) {
  if (available < bytes)
    bad(path, fmt::format("data truncated: the header's shape {} needs {} bytes, the file holds {}", shape_text,
                          bytes, available));
  if (available > bytes)
    bad(path, fmt::format("{} bytes after the data of shape {}, expected none", available - bytes, shape_text));
  if (!arr.half) {
    // Appended a block at a time, never zero-filled first: resize() would
    // write (and fault in) every page once more before the read does.
    arr.data.clear();
    arr.data.reserve(bytes);
    detail::advise_huge_pages(arr.data.data(), bytes);
    char block[64 << 10];
    while (arr.data.size() < bytes) {
      const std::size_t m = std::min(sizeof block, bytes - arr.data.size());
      if (!in.read(block, static_cast<std::streamsize>(m)))
        bad(path, fmt::format("read failed after {} of {} data bytes", arr.data.size() + in.gcount(), bytes));
      const auto* b = reinterpret_cast<const std::byte*>(block);
      arr.data.insert(arr.data.end(), b, b + m);
    }
    return;
  }
  // 16-bit values, widened once to float32 (exact), a block at a time.
  const std::size_t n = bytes / sizeof(std::uint16_t);
  std::vector<std::uint16_t> bits(n);
  if (bytes > 0 && !in.read(reinterpret_cast<char*>(bits.data()), static_cast<std::streamsize>(bytes)))
    bad(path, fmt::format("read failed after {} of {} data bytes", in.gcount(), bytes));
  arr.data.clear();
  arr.data.reserve(n * sizeof(float));
  float block[1024];
  for (std::size_t at = 0; at < n; at += std::size(block)) {
    const std::size_t m = std::min(std::size(block), n - at);
    widen(*arr.half, bits.data() + at, m, block);
    const auto* b = reinterpret_cast<const std::byte*>(block);
    arr.data.insert(arr.data.end(), b, b + m * sizeof(float));
  }
}

std::string shape_text(const std::vector<std::size_t>& shape) {
  return fmt::format("({}{})", fmt::join(shape, ", "), shape.size() == 1 ? "," : "");
}

}  // namespace

void require_regular_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw IoError(path + ": cannot open for reading: " + std::strerror(errno));
  if (S_ISREG(st.st_mode)) return;
  const char* kind = S_ISFIFO(st.st_mode)  ? "a FIFO (named pipe)"
                     : S_ISDIR(st.st_mode) ? "a directory"
                     : S_ISCHR(st.st_mode) ? "a character device"
                     : S_ISBLK(st.st_mode) ? "a block device"
                     : S_ISSOCK(st.st_mode) ? "a socket"
                                            : "not a regular file";
  throw IoError(path + ": is " + kind + ", expected a regular file");
}

NpyArray read_npy(const std::string& path) {
  require_regular_file(path);
  std::ifstream in(path, std::ios::binary);
  if (!in) bad(path, "cannot open for reading");
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  in.seekg(0, std::ios::beg);
  if (size < 0 || !in) bad(path, "cannot determine the file size");
  std::size_t bytes = 0;
  NpyArray arr = read_header(path, in, bytes);
  const std::streamoff at = in.tellg();
  if (at < 0) bad(path, "cannot determine the header size");
  // The file's size bounds what is allocated: a header claiming more data
  // than the file holds is an error before any allocation.
  read_data(path, in, bytes, static_cast<std::size_t>(size - at), shape_text(arr.shape), arr);
  return arr;
}

NpyArray parse_npy(std::span<const std::byte> bytes, const std::string& name) {
  std::istringstream in(std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()),
                        std::ios::binary);
  std::size_t data_bytes = 0;
  NpyArray arr = read_header(name, in, data_bytes);
  const std::streamoff at = in.tellg();
  if (at < 0) bad(name, "cannot determine the header size");
  read_data(name, in, data_bytes, bytes.size() - static_cast<std::size_t>(at), shape_text(arr.shape), arr);
  return arr;
}

namespace {

void write_impl(const std::string& path, const void* data, std::size_t elem_size,
                const char* descr, const std::vector<std::size_t>& shape) {
  std::size_t n = 1;
  for (std::size_t d : shape) n *= d;
  // A 1-tuple keeps its trailing comma: (5,).
  std::string header = fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': ({}{}), }}", descr,
                                   fmt::join(shape, ","), shape.size() == 1 ? "," : "");
  // Pad so that the data starts on a 64-byte boundary, ending with '\n'.
  const std::size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header.push_back('\n');
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw IoError(path + ": cannot open for writing");
  out.write(kMagic, 6);
  const char ver[2] = {1, 0};
  out.write(ver, 2);
  const std::size_t len = header.size();
  if (len > std::numeric_limits<std::uint16_t>::max()) throw IoError(path + ": header too long");
  const char lb[2] = {static_cast<char>(len & 0xff), static_cast<char>(len >> 8)};
  out.write(lb, 2);
  out.write(header.data(), static_cast<std::streamsize>(len));
  if (n > 0) out.write(static_cast<const char*>(data), static_cast<std::streamsize>(n * elem_size));
  if (!out) throw IoError(path + ": write failed");
}

}  // namespace

void write_npy(const std::string& path, const float* data, const std::vector<std::size_t>& shape) {
  write_impl(path, data, sizeof(float), "<f4", shape);
}

void write_npy(const std::string& path, const double* data, const std::vector<std::size_t>& shape) {
  write_impl(path, data, sizeof(double), "<f8", shape);
}

void write_npy_f16(const std::string& path, const std::uint16_t* bits, const std::vector<std::size_t>& shape) {
  write_impl(path, bits, sizeof(std::uint16_t), "<f2", shape);
}

}  // namespace kdacp
