#include "kdacp/report/plot.hpp"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>

#include <fmt/format.h>

#include "kdacp/error.hpp"
#include "kdacp/output.hpp"

namespace kdacp::report {
namespace {

// A gnuplot single-quoted string: a quote is doubled.
std::string quoted(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("''") : std::string(1, c);
  return out + "'";
}

std::string number(double x) {
  if (std::isnan(x)) return "NaN";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", x);
  return buf;
}

std::string script_of(const std::vector<PlotPanel>& panels, const std::string& image, bool svg, int width,
                      int height) {
  const int total_width = width * int(std::max<std::size_t>(panels.size(), 1));
  std::string s = fmt::format("set terminal {} size {},{} noenhanced\nset output {}\nset grid\nset key top left\n",
                              svg ? "svg" : "pngcairo", total_width, height, quoted(image));
  s += fmt::format("set multiplot layout 1,{}\n", panels.size());
  for (std::size_t p = 0; p < panels.size(); ++p) {
    const PlotPanel& panel = panels[p];
    std::string plots;
    for (std::size_t i = 0; i < panel.series.size(); ++i) {
      const PlotSeries& ser = panel.series[i];
      const std::string block = fmt::format("$d{}_{}", p, i);
      s += block + " << EOD\n";
      for (const auto& [x, y] : ser.points) s += number(x) + " " + number(y) + "\n";
      s += "EOD\n";
      plots += (plots.empty() ? "" : ", ") + block + " using 1:2 with linespoints " +
               (ser.dashed ? "dt 2" : "lw 2") + " title " + quoted(ser.title);
    }
    if (!std::isnan(panel.hline))
      plots += (plots.empty() ? "" : ", ") + number(panel.hline) + " with lines lw 2 dt 2 lc rgb 'black' title " +
               quoted(panel.hline_title);
    s += std::string(panel.log_x ? "set logscale x\n" : "unset logscale x\n") +
         (panel.log_y ? "set logscale y\n" : "unset logscale y\n") +
         (panel.y_from_zero ? "set yrange [0:*]\n" : "set autoscale y\n") + "set xlabel " + quoted(panel.xlabel) +
         "\nset ylabel " + quoted(panel.ylabel) + "\nset title " + quoted(panel.title) + "\n";
    s += plots.empty() ? "plot NaN notitle\n" : "plot " + plots + "\n";
  }
  return s + "unset multiplot\n";
}

}  // namespace

void draw_plot(const std::vector<PlotPanel>& panels, const std::string& file, int width, int height,
               bool keep_script) {
  namespace fs = std::filesystem;
  const fs::path target(file);
  const std::string name = target.filename().string();
  const bool svg = target.extension() == ".svg";
  StagedOutput out(target.parent_path().string(), {name, name + ".gp"});
  const std::string script = script_of(panels, out.path(name), svg, width, height);
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> gp(popen("gnuplot", "w"), pclose);
  if (!gp) throw IoError("cannot start gnuplot to draw " + file + " (install gnuplot-nox)");
  std::fputs(script.c_str(), gp.get());
  if (pclose(gp.release()) != 0 || !fs::exists(out.path(name)))
    throw IoError("gnuplot failed to draw " + file + " (is gnuplot installed?)");
  if (keep_script) {
    std::ofstream gp_file(out.path(name + ".gp"));
    gp_file << script_of(panels, file, svg, width, height);
    if (!gp_file.flush()) throw IoError("cannot write " + file + ".gp");
  }
  out.commit();
}

}  // namespace kdacp::report
