// Output files that appear only when the whole command succeeded. A writer
// puts its files into a staging folder inside the target folder; commit()
// renames them into place (a rename within one file system: a reader sees
// the old file or the new one, never a part) and removes the outputs of an
// earlier run that this run did not write, so a folder never mixes two runs.
// Without commit() (an error, a full disk) the staging folder is removed and
// the target is left as it was.
#pragma once

#include <string>
#include <vector>

namespace kdacp {

class StagedOutput {
 public:
  // `dir` is created if needed (and removed again if nothing is committed);
  // `outputs` are every file name a run of the command may write there.
  StagedOutput(std::string dir, std::vector<std::string> outputs);
  ~StagedOutput();
  StagedOutput(const StagedOutput&) = delete;
  StagedOutput& operator=(const StagedOutput&) = delete;

  // Where the writer puts its files, under the names of `outputs`.
  const std::string& staging_dir() const { return staging_; }
  std::string path(const std::string& name) const;

  // Moves every staged file into the target and removes the other `outputs`
  // from it. Every target name is checked (not a folder) before the first
  // rename; an error names the file and the system's reason (IoError).
  void commit();

 private:
  std::string dir_, staging_;
  std::vector<std::string> outputs_;
  bool created_dir_ = false, committed_ = false;
};

}  // namespace kdacp
