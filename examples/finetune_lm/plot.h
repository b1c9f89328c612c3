#pragma once

// Minimal, dependency-light PNG line-plot writer (zlib only) used by the
// finetune_lm example to save loss curves. No anti-aliasing; text is drawn
// with an embedded 5x7 bitmap font covering printable ASCII.

#include <string>
#include <vector>

namespace finetune_lm {

/// One curve. `x` and `y` are paired element-wise. If `x` is empty, the
/// indices 0..y.size()-1 are used as x values. Points whose x or y is NaN or
/// infinite are skipped (the line is broken at them). Non-ASCII characters in
/// `name` are drawn as '?'.
struct Series {
  std::string name;
  std::vector<double> x, y;
};

/// Writes a PNG line plot (width x height pixels, white background, axes with
/// tick marks and numeric tick labels on both axes, a title, one colour per
/// series with a small legend) to `path`, through a temporary file renamed
/// into place. Throws std::runtime_error naming the path on failure.
///
/// Details:
///  - Tick values are "nice" (1, 2, 5 x 10^k); the axis range is widened to
///    whole ticks. A degenerate range (single point, all-equal values) is
///    padded; with no finite data at all the axes span [0, 1].
///  - Lines are 2 px thick; an isolated finite point is drawn as a small
///    square marker.
///  - Throws std::invalid_argument if width/height are outside [160, 8192] x
///    [120, 8192], or if a series has a non-empty `x` whose size differs from
///    `y`'s.
void write_line_plot(
    const std::string& path,
    const std::string& title,
    const std::string& x_label,
    const std::string& y_label,
    const std::vector<Series>& series,
    int width = 800,
    int height = 500);

} // namespace finetune_lm
