// `kdacp protocols`: the protocol registry's rows (kdacp/protocol.hpp) as
// the table a user reads, or as the Markdown table README.md and
// docs/protocols.md carry (a test keeps them equal to this output).
#pragma once

namespace kdacp::report {

// Prints on stdout one row per registered protocol: method, class, knobs
// (w, c, parts), extra memory per rank and error bound against the FP64
// chain; with `markdown`, also when to use it, as a Markdown table.
void print_protocols(bool markdown);

}  // namespace kdacp::report
