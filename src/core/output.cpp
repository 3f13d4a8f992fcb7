#include "kdacp/output.hpp"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <system_error>

#include <fmt/format.h>

#include "kdacp/error.hpp"

namespace kdacp {
namespace {

namespace fs = std::filesystem;

[[noreturn]] void fail(const std::string& what, const fs::path& path, const std::error_code& ec) {
  throw IoError("cannot " + what + " " + path.string() + ": " + ec.message());
}

}  // namespace

StagedOutput::StagedOutput(std::string dir, std::vector<std::string> outputs)
    : dir_(dir.empty() ? "." : std::move(dir)), outputs_(std::move(outputs)) {
  std::error_code ec;
  if (!fs::exists(dir_, ec)) {
    created_dir_ = fs::create_directories(dir_, ec);
    if (ec) fail("create directory", dir_, ec);
  } else if (!fs::is_directory(dir_, ec)) {
    throw IoError("cannot write into " + dir_ + ": not a directory");
  }
  // The process id keeps two commands writing into one folder apart.
  staging_ = (fs::path(dir_) / fmt::format(".kdacp-staging-{}", ::getpid())).string();
  fs::remove_all(staging_, ec);
  fs::create_directory(staging_, ec);
  if (ec) fail("create directory", staging_, ec);
}

StagedOutput::~StagedOutput() {
  std::error_code ec;
  fs::remove_all(staging_, ec);
  if (!committed_ && created_dir_) fs::remove(dir_, ec);  // only if still empty
}

std::string StagedOutput::path(const std::string& name) const { return (fs::path(staging_) / name).string(); }

void StagedOutput::commit() {
  std::error_code ec;
  std::vector<std::string> staged;
  for (const auto& entry : fs::directory_iterator(staging_, ec)) staged.push_back(entry.path().filename().string());
  if (ec) fail("list", staging_, ec);
  for (const std::string& name : staged) {
    const fs::path target = fs::path(dir_) / name;
    if (fs::exists(target, ec) && !fs::is_regular_file(target, ec))
      throw IoError("cannot write " + target.string() + ": it exists and is not a regular file");
  }
  for (const std::string& name : staged) {
    fs::rename(fs::path(staging_) / name, fs::path(dir_) / name, ec);
    if (ec) fail("write", fs::path(dir_) / name, ec);
  }
  for (const std::string& name : outputs_) {
    if (std::find(staged.begin(), staged.end(), name) != staged.end()) continue;
    const fs::path stale = fs::path(dir_) / name;
    if (fs::is_regular_file(stale, ec) && !fs::remove(stale, ec) && ec) fail("remove", stale, ec);
  }
  committed_ = true;
}

}  // namespace kdacp
