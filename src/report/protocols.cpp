#include "kdacp/report/protocols.hpp"

#include <cstdio>
#include <string>

#include "kdacp/protocol.hpp"
#include "kdacp/report/table.hpp"

namespace kdacp::report {

namespace {

std::string knobs(const ProtocolDescriptor& row) {
  std::string out;
  if (row.takes_group_size) out = "w";
  if (row.takes_segments) out += out.empty() ? "c" : ", c";
  if (row.takes_layouts) out += out.empty() ? "parts" : ", parts";
  return out.empty() ? "-" : out;
}

std::string bound_text(const ProtocolDescriptor& row) {
  if (row.chooser()) return "as chosen";
  if (row.exact()) return "0 (bitwise = chain)";
  return std::string(row.error_bound_text);
}

void print_markdown() {
  std::printf("| method | class | knobs | extra memory per rank | error vs FP64 chain | when to use it |\n");
  std::printf("|---|---|---|---|---|---|\n");
  for (const ProtocolDescriptor* row : protocol_registry())
    std::printf("| `%.*s` | %s | %s | %.*s | %s | %.*s |\n", int(row->name.size()), row->name.data(),
                to_string(row->kind).c_str(), knobs(*row).c_str(), int(row->memory.size()),
                row->memory.data(), bound_text(*row).c_str(), int(row->use_when.size()),
                row->use_when.data());
}

}  // namespace

void print_protocols(bool markdown) {
  if (markdown) return print_markdown();
  Table t({"method", "class", "knobs", "extra memory per rank", "error vs FP64 chain"});
  for (const ProtocolDescriptor* row : protocol_registry())
    t.add({std::string(row->name), to_string(row->kind), knobs(*row), std::string(row->memory), bound_text(*row)});
  t.print();
}

}  // namespace kdacp::report
