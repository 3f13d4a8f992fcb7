// Charts of benchmark and model records drawn by gnuplot (`kdacp bench
// --plot`, `kdacp plan --plot`). Part of kdacp_report; gnuplot is a program
// found at run time, never a build dependency.
#pragma once

#include <cmath>
#include <string>
#include <utility>
#include <vector>

namespace kdacp::report {

struct PlotSeries {
  std::string title;
  std::vector<std::pair<double, double>> points;  // (x, y); a NaN y leaves a gap
  bool dashed = false;
};

struct PlotPanel {
  std::string title, xlabel, ylabel;
  bool log_x = false, log_y = false;
  bool y_from_zero = false;
  std::vector<PlotSeries> series;
  // A horizontal reference line at this y (none when NaN).
  double hline = NAN;
  std::string hline_title;
};

// Draws the panels side by side into `file`: SVG when it ends in .svg, PNG
// otherwise, `width` pixels per panel. With keep_script the gnuplot script,
// data included, is kept as `file`.gp. The files appear only when gnuplot
// succeeded; a missing or failing gnuplot throws IoError.
void draw_plot(const std::vector<PlotPanel>& panels, const std::string& file, int width, int height,
               bool keep_script = false);

}  // namespace kdacp::report
