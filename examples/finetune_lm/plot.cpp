#include "plot.h"

#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <stdexcept>
#include <system_error>
#include <thread>
#include <utility>

namespace finetune_lm {
namespace {

// ---------------------------------------------------------------------------
// 5x7 bitmap font for printable ASCII (0x20..0x7E). Each glyph is 7 rows, top
// to bottom; within a row bit 4 is the leftmost pixel and bit 0 the rightmost.
// ---------------------------------------------------------------------------
constexpr int kGlyphW = 5;
constexpr int kGlyphH = 7;
constexpr int kAdvance = kGlyphW + 1; // one blank column between glyphs

constexpr uint8_t kFont[95][kGlyphH] = {
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00}, // ' '
    {0x04, 0x04, 0x04, 0x04, 0x04, 0x00, 0x04}, // '!'
    {0x0A, 0x0A, 0x0A, 0x00, 0x00, 0x00, 0x00}, // '"'
    {0x0A, 0x0A, 0x1F, 0x0A, 0x1F, 0x0A, 0x0A}, // '#'
    {0x04, 0x0F, 0x14, 0x0E, 0x05, 0x1E, 0x04}, // '$'
    {0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03}, // '%'
    {0x0C, 0x12, 0x14, 0x08, 0x15, 0x12, 0x0D}, // '&'
    {0x04, 0x04, 0x08, 0x00, 0x00, 0x00, 0x00}, // '\''
    {0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02}, // '('
    {0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08}, // ')'
    {0x00, 0x04, 0x15, 0x0E, 0x15, 0x04, 0x00}, // '*'
    {0x00, 0x04, 0x04, 0x1F, 0x04, 0x04, 0x00}, // '+'
    {0x00, 0x00, 0x00, 0x00, 0x0C, 0x04, 0x08}, // ','
    {0x00, 0x00, 0x00, 0x1F, 0x00, 0x00, 0x00}, // '-'
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x0C, 0x0C}, // '.'
    {0x00, 0x01, 0x02, 0x04, 0x08, 0x10, 0x00}, // '/'
    {0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E}, // '0'
    {0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E}, // '1'
    {0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F}, // '2'
    {0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E}, // '3'
    {0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02}, // '4'
    {0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E}, // '5'
    {0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E}, // '6'
    {0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08}, // '7'
    {0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E}, // '8'
    {0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C}, // '9'
    {0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x0C, 0x00}, // ':'
    {0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x04, 0x08}, // ';'
    {0x02, 0x04, 0x08, 0x10, 0x08, 0x04, 0x02}, // '<'
    {0x00, 0x00, 0x1F, 0x00, 0x1F, 0x00, 0x00}, // '='
    {0x08, 0x04, 0x02, 0x01, 0x02, 0x04, 0x08}, // '>'
    {0x0E, 0x11, 0x01, 0x02, 0x04, 0x00, 0x04}, // '?'
    {0x0E, 0x11, 0x01, 0x0D, 0x15, 0x15, 0x0E}, // '@'
    {0x0E, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11}, // 'A'
    {0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E}, // 'B'
    {0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E}, // 'C'
    {0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C}, // 'D'
    {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F}, // 'E'
    {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10}, // 'F'
    {0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F}, // 'G'
    {0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11}, // 'H'
    {0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E}, // 'I'
    {0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C}, // 'J'
    {0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11}, // 'K'
    {0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F}, // 'L'
    {0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11}, // 'M'
    {0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11}, // 'N'
    {0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E}, // 'O'
    {0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10}, // 'P'
    {0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D}, // 'Q'
    {0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11}, // 'R'
    {0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E}, // 'S'
    {0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04}, // 'T'
    {0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E}, // 'U'
    {0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04}, // 'V'
    {0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A}, // 'W'
    {0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11}, // 'X'
    {0x11, 0x11, 0x0A, 0x04, 0x04, 0x04, 0x04}, // 'Y'
    {0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F}, // 'Z'
    {0x0E, 0x08, 0x08, 0x08, 0x08, 0x08, 0x0E}, // '['
    {0x00, 0x10, 0x08, 0x04, 0x02, 0x01, 0x00}, // '\\'
    {0x0E, 0x02, 0x02, 0x02, 0x02, 0x02, 0x0E}, // ']'
    {0x04, 0x0A, 0x11, 0x00, 0x00, 0x00, 0x00}, // '^'
    {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x1F}, // '_'
    {0x08, 0x04, 0x02, 0x00, 0x00, 0x00, 0x00}, // '`'
    {0x00, 0x00, 0x0E, 0x01, 0x0F, 0x11, 0x0F}, // 'a'
    {0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x1E}, // 'b'
    {0x00, 0x00, 0x0E, 0x10, 0x10, 0x11, 0x0E}, // 'c'
    {0x01, 0x01, 0x0D, 0x13, 0x11, 0x11, 0x0F}, // 'd'
    {0x00, 0x00, 0x0E, 0x11, 0x1F, 0x10, 0x0E}, // 'e'
    {0x06, 0x09, 0x08, 0x1C, 0x08, 0x08, 0x08}, // 'f'
    {0x00, 0x0F, 0x11, 0x11, 0x0F, 0x01, 0x0E}, // 'g'
    {0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x11}, // 'h'
    {0x04, 0x00, 0x0C, 0x04, 0x04, 0x04, 0x0E}, // 'i'
    {0x02, 0x00, 0x06, 0x02, 0x02, 0x12, 0x0C}, // 'j'
    {0x10, 0x10, 0x12, 0x14, 0x18, 0x14, 0x12}, // 'k'
    {0x0C, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E}, // 'l'
    {0x00, 0x00, 0x1A, 0x15, 0x15, 0x11, 0x11}, // 'm'
    {0x00, 0x00, 0x16, 0x19, 0x11, 0x11, 0x11}, // 'n'
    {0x00, 0x00, 0x0E, 0x11, 0x11, 0x11, 0x0E}, // 'o'
    {0x00, 0x00, 0x1E, 0x11, 0x1E, 0x10, 0x10}, // 'p'
    {0x00, 0x00, 0x0D, 0x13, 0x0F, 0x01, 0x01}, // 'q'
    {0x00, 0x00, 0x16, 0x19, 0x10, 0x10, 0x10}, // 'r'
    {0x00, 0x00, 0x0E, 0x10, 0x0E, 0x01, 0x1E}, // 's'
    {0x08, 0x08, 0x1C, 0x08, 0x08, 0x09, 0x06}, // 't'
    {0x00, 0x00, 0x11, 0x11, 0x11, 0x13, 0x0D}, // 'u'
    {0x00, 0x00, 0x11, 0x11, 0x11, 0x0A, 0x04}, // 'v'
    {0x00, 0x00, 0x11, 0x11, 0x15, 0x15, 0x0A}, // 'w'
    {0x00, 0x00, 0x11, 0x0A, 0x04, 0x0A, 0x11}, // 'x'
    {0x00, 0x00, 0x11, 0x11, 0x0F, 0x01, 0x0E}, // 'y'
    {0x00, 0x00, 0x1F, 0x02, 0x04, 0x08, 0x1F}, // 'z'
    {0x02, 0x04, 0x04, 0x08, 0x04, 0x04, 0x02}, // '{'
    {0x04, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04}, // '|'
    {0x08, 0x04, 0x04, 0x02, 0x04, 0x04, 0x08}, // '}'
    {0x00, 0x00, 0x08, 0x15, 0x02, 0x00, 0x00}, // '~'
};

const uint8_t* glyph(char c) {
  unsigned char u = static_cast<unsigned char>(c);
  if (u < 0x20 || u > 0x7E) {
    u = '?';
  }
  return kFont[u - 0x20];
}

struct Rgb {
  uint8_t r, g, b;
};

constexpr Rgb kWhite{255, 255, 255};
constexpr Rgb kBlack{0, 0, 0};
constexpr Rgb kGrid{225, 225, 225};
constexpr Rgb kLegendBorder{160, 160, 160};

// Colour-blind-friendly-ish categorical palette (matplotlib "tab10").
constexpr Rgb kPalette[] = {
    {31, 119, 180},
    {255, 127, 14},
    {44, 160, 44},
    {214, 39, 40},
    {148, 103, 189},
    {140, 86, 75},
    {227, 119, 194},
    {127, 127, 127},
    {188, 189, 34},
    {23, 190, 207},
};
constexpr size_t kPaletteSize = sizeof(kPalette) / sizeof(kPalette[0]);

struct Rect {
  int x0, y0, x1, y1; // inclusive
  bool contains(int x, int y) const {
    return x >= x0 && x <= x1 && y >= y0 && y <= y1;
  }
};

class Canvas {
 public:
  Canvas(int w, int h)
      : w_(w), h_(h), px_(static_cast<size_t>(w) * h * 3, 255) {}

  int width() const {
    return w_;
  }
  int height() const {
    return h_;
  }
  const std::vector<uint8_t>& pixels() const {
    return px_;
  }

  void set(int x, int y, Rgb c) {
    if (x < 0 || y < 0 || x >= w_ || y >= h_) {
      return;
    }
    uint8_t* p = &px_[(static_cast<size_t>(y) * w_ + x) * 3];
    p[0] = c.r;
    p[1] = c.g;
    p[2] = c.b;
  }

  bool is_white(int x, int y) const {
    if (x < 0 || y < 0 || x >= w_ || y >= h_) {
      return true;
    }
    const uint8_t* p = &px_[(static_cast<size_t>(y) * w_ + x) * 3];
    return p[0] == 255 && p[1] == 255 && p[2] == 255;
  }

  void fill_rect(int x0, int y0, int x1, int y1, Rgb c) {
    for (int y = std::max(0, y0); y <= std::min(h_ - 1, y1); ++y) {
      for (int x = std::max(0, x0); x <= std::min(w_ - 1, x1); ++x) {
        set(x, y, c);
      }
    }
  }

  void hline(int x0, int x1, int y, Rgb c) {
    fill_rect(std::min(x0, x1), y, std::max(x0, x1), y, c);
  }
  void vline(int x, int y0, int y1, Rgb c) {
    fill_rect(x, std::min(y0, y1), x, std::max(y0, y1), c);
  }

  void rect_outline(const Rect& r, Rgb c) {
    hline(r.x0, r.x1, r.y0, c);
    hline(r.x0, r.x1, r.y1, c);
    vline(r.x0, r.y0, r.y1, c);
    vline(r.x1, r.y0, r.y1, c);
  }

  // Bresenham line with a 2x2 brush (2 px thick), clipped to `clip`. Every
  // pixel written is also recorded in `ink` (if given), a w*h mask.
  void thick_line(
      int x0,
      int y0,
      int x1,
      int y1,
      Rgb c,
      const Rect& clip,
      std::vector<uint8_t>* ink) {
    const int dx = std::abs(x1 - x0);
    const int dy = -std::abs(y1 - y0);
    const int sx = x0 < x1 ? 1 : -1;
    const int sy = y0 < y1 ? 1 : -1;
    int err = dx + dy;
    while (true) {
      brush(x0, y0, c, clip, ink);
      if (x0 == x1 && y0 == y1) {
        break;
      }
      const int e2 = 2 * err;
      if (e2 >= dy) {
        err += dy;
        x0 += sx;
      }
      if (e2 <= dx) {
        err += dx;
        y0 += sy;
      }
    }
  }

  // Square marker of side 2*r+1 centred on (x, y), clipped to `clip`.
  void marker(
      int x,
      int y,
      int r,
      Rgb c,
      const Rect& clip,
      std::vector<uint8_t>* ink) {
    for (int yy = y - r; yy <= y + r; ++yy) {
      for (int xx = x - r; xx <= x + r; ++xx) {
        plot_clipped(xx, yy, c, clip, ink);
      }
    }
  }

  // Horizontal text; (x, y) is the top-left corner; `s` is the pixel scale.
  void text(int x, int y, const std::string& str, int s, Rgb c) {
    for (size_t i = 0; i < str.size(); ++i) {
      const uint8_t* g = glyph(str[i]);
      const int ox = x + static_cast<int>(i) * kAdvance * s;
      for (int gy = 0; gy < kGlyphH; ++gy) {
        for (int gx = 0; gx < kGlyphW; ++gx) {
          if (g[gy] & (0x10 >> gx)) {
            fill_rect(
                ox + gx * s,
                y + gy * s,
                ox + gx * s + s - 1,
                y + gy * s + s - 1,
                c);
          }
        }
      }
    }
  }

  // Text rotated 90 degrees counter-clockwise (reads bottom to top). (x, y) is
  // the bottom-left corner of the rotated text block; glyph tops face left.
  void text_up(int x, int y, const std::string& str, int s, Rgb c) {
    for (size_t i = 0; i < str.size(); ++i) {
      const uint8_t* g = glyph(str[i]);
      const int oy = y - static_cast<int>(i) * kAdvance * s;
      for (int gy = 0; gy < kGlyphH; ++gy) {
        for (int gx = 0; gx < kGlyphW; ++gx) {
          if (g[gy] & (0x10 >> gx)) {
            const int px = x + gy * s;
            const int py = oy - gx * s;
            fill_rect(px, py - s + 1, px + s - 1, py, c);
          }
        }
      }
    }
  }

 private:
  void plot_clipped(
      int x,
      int y,
      Rgb c,
      const Rect& clip,
      std::vector<uint8_t>* ink) {
    if (!clip.contains(x, y)) {
      return;
    }
    set(x, y, c);
    if (ink != nullptr && x >= 0 && y >= 0 && x < w_ && y < h_) {
      (*ink)[static_cast<size_t>(y) * w_ + x] = 1;
    }
  }

  void brush(int x, int y, Rgb c, const Rect& clip, std::vector<uint8_t>* ink) {
    plot_clipped(x, y, c, clip, ink);
    plot_clipped(x + 1, y, c, clip, ink);
    plot_clipped(x, y + 1, c, clip, ink);
    plot_clipped(x + 1, y + 1, c, clip, ink);
  }

  int w_, h_;
  std::vector<uint8_t> px_;
};

int text_width(const std::string& s, int scale) {
  return s.empty() ? 0 : (static_cast<int>(s.size()) * kAdvance - 1) * scale;
}

int text_height(int scale) {
  return kGlyphH * scale;
}

// ---------------------------------------------------------------------------
// Axis ranges and "nice" ticks.
// ---------------------------------------------------------------------------
struct Range {
  double lo = std::numeric_limits<double>::infinity();
  double hi = -std::numeric_limits<double>::infinity();
  void add(double v) {
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  bool empty() const {
    return !(lo <= hi);
  }
};

// Keep axis limits well inside double range so that hi - lo stays finite.
constexpr double kMaxAbs = 1e300;

Range padded(Range r) {
  if (r.empty()) {
    return Range{0.0, 1.0};
  }
  r.lo = std::max(r.lo, -kMaxAbs);
  r.hi = std::min(r.hi, kMaxAbs);
  const double mag = std::max(std::abs(r.lo), std::abs(r.hi));
  if (r.hi - r.lo <= mag * 1e-12) {
    // Single value (or all equal): pad by 5% of its magnitude, or 1 at zero.
    const double mid = 0.5 * (r.lo + r.hi);
    const double pad = mid != 0.0 ? std::abs(mid) * 0.05 : 1.0;
    r.lo = mid - pad;
    r.hi = mid + pad;
  }
  return r;
}

double nice_step(double raw) {
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double n = raw / mag;
  double m = 10.0;
  if (n < 1.5) {
    m = 1.0;
  } else if (n < 3.0) {
    m = 2.0;
  } else if (n < 7.0) {
    m = 5.0;
  }
  return m * mag;
}

struct Ticks {
  double lo = 0.0, hi = 1.0, step = 1.0;
  std::vector<double> values;
  std::vector<std::string> labels;
  int max_label_width(int scale) const {
    int w = 0;
    for (const auto& l : labels) {
      w = std::max(w, text_width(l, scale));
    }
    return w;
  }
};

Ticks make_ticks(Range r, int target) {
  Ticks t;
  target = std::max(2, target);
  t.step = nice_step((r.hi - r.lo) / target);
  t.lo = std::floor(r.lo / t.step + 1e-9) * t.step;
  t.hi = std::ceil(r.hi / t.step - 1e-9) * t.step;
  if (!(t.hi > t.lo)) {
    t.hi = t.lo + t.step;
  }
  const int n = static_cast<int>(std::llround((t.hi - t.lo) / t.step));
  for (int k = 0; k <= n; ++k) {
    double v = t.lo + k * t.step;
    if (std::abs(v) < t.step * 1e-9) {
      v = 0.0; // avoid "-0.00"
    }
    t.values.push_back(v);
  }
  // Label format: fixed-point with as many decimals as the step needs, or
  // scientific for very large / very small magnitudes.
  const double mag = std::max(std::abs(t.lo), std::abs(t.hi));
  const int step_exp = static_cast<int>(std::floor(std::log10(t.step) + 1e-9));
  const bool sci = mag >= 1e6 || t.step < 1e-4;
  char buf[64];
  for (double v : t.values) {
    if (sci && v != 0.0) {
      const int mag_exp = static_cast<int>(std::floor(std::log10(mag) + 1e-9));
      const int prec = std::min(6, std::max(0, mag_exp - step_exp));
      std::snprintf(buf, sizeof(buf), "%.*e", prec, v);
    } else if (sci) {
      std::snprintf(buf, sizeof(buf), "0");
    } else {
      const int decimals = std::max(0, -step_exp);
      std::snprintf(buf, sizeof(buf), "%.*f", decimals, v);
    }
    t.labels.emplace_back(buf);
  }
  return t;
}

// Picks a tick count for an axis of `length` px so that labels of the given
// orientation do not collide.
Ticks fit_ticks(
    Range r,
    int length,
    int min_spacing,
    bool horizontal_labels,
    int scale) {
  int target = std::max(2, length / min_spacing);
  Ticks t = make_ticks(r, target);
  while (target > 2) {
    const int n = static_cast<int>(t.values.size());
    const int need = horizontal_labels ? t.max_label_width(scale) + 4 * scale
                                       : text_height(scale) + 4 * scale;
    if (n <= 1 || need * (n - 1) <= length) {
      break;
    }
    t = make_ticks(r, --target);
  }
  return t;
}

// ---------------------------------------------------------------------------
// PNG encoding.
// ---------------------------------------------------------------------------
void put_u32(std::string& out, uint32_t v) {
  out.push_back(static_cast<char>((v >> 24) & 0xFF));
  out.push_back(static_cast<char>((v >> 16) & 0xFF));
  out.push_back(static_cast<char>((v >> 8) & 0xFF));
  out.push_back(static_cast<char>(v & 0xFF));
}

void put_chunk(std::string& out, const char type[4], const std::string& data) {
  put_u32(out, static_cast<uint32_t>(data.size()));
  const size_t type_pos = out.size();
  out.append(type, 4);
  out.append(data);
  uLong crc = crc32(0L, Z_NULL, 0);
  crc = crc32(
      crc,
      reinterpret_cast<const Bytef*>(out.data() + type_pos),
      static_cast<uInt>(4 + data.size()));
  put_u32(out, static_cast<uint32_t>(crc));
}

std::string encode_png(const Canvas& c, const std::string& path) {
  const int w = c.width();
  const int h = c.height();
  const size_t row = static_cast<size_t>(w) * 3;
  std::vector<uint8_t> raw((row + 1) * h);
  for (int y = 0; y < h; ++y) {
    uint8_t* dst = &raw[(row + 1) * y];
    dst[0] = 0; // filter type: None
    std::copy_n(&c.pixels()[row * y], row, dst + 1);
  }
  uLongf zlen = compressBound(static_cast<uLong>(raw.size()));
  std::string z(zlen, '\0');
  const int rc = compress2(
      reinterpret_cast<Bytef*>(&z[0]),
      &zlen,
      raw.data(),
      static_cast<uLong>(raw.size()),
      6);
  if (rc != Z_OK) {
    throw std::runtime_error(
        "write_line_plot: zlib compress2 failed (code " + std::to_string(rc) +
        ") for '" + path + "'");
  }
  z.resize(zlen);

  std::string ihdr;
  put_u32(ihdr, static_cast<uint32_t>(w));
  put_u32(ihdr, static_cast<uint32_t>(h));
  ihdr.push_back(8); // bit depth
  ihdr.push_back(2); // colour type: truecolour RGB
  ihdr.push_back(0); // compression: deflate
  ihdr.push_back(0); // filter method
  ihdr.push_back(0); // interlace: none

  std::string png("\x89PNG\r\n\x1a\n", 8);
  put_chunk(png, "IHDR", ihdr);
  put_chunk(png, "IDAT", z);
  put_chunk(png, "IEND", std::string());
  return png;
}

void write_file_atomically(const std::string& path, const std::string& bytes) {
  static std::atomic<unsigned> counter{0};
  const auto stamp = static_cast<unsigned long long>(
      std::chrono::steady_clock::now().time_since_epoch().count());
  const std::string tmp = path + ".tmp." +
      std::to_string(std::hash<std::thread::id>{}(std::this_thread::get_id()) %
                     1000000) +
      "." + std::to_string(stamp % 1000000007ULL) + "." +
      std::to_string(counter.fetch_add(1));
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) {
      throw std::runtime_error(
          "write_line_plot: cannot open temporary file '" + tmp + "' for '" +
          path + "'");
    }
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    f.flush();
    f.close();
    if (!f) {
      std::error_code ignored;
      std::filesystem::remove(tmp, ignored);
      throw std::runtime_error(
          "write_line_plot: failed writing temporary file '" + tmp + "' for '" +
          path + "'");
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    throw std::runtime_error(
        "write_line_plot: cannot rename '" + tmp + "' to '" + path +
        "': " + ec.message());
  }
}

std::string sanitize(const std::string& s) {
  std::string out = s;
  for (char& ch : out) {
    const unsigned char u = static_cast<unsigned char>(ch);
    if (u < 0x20 || u > 0x7E) {
      ch = '?';
    }
  }
  return out;
}

std::string truncate_to(const std::string& s, size_t max_chars) {
  if (s.size() <= max_chars) {
    return s;
  }
  if (max_chars <= 2) {
    return s.substr(0, max_chars);
  }
  return s.substr(0, max_chars - 2) + "..";
}

} // namespace

void write_line_plot(
    const std::string& path,
    const std::string& title_in,
    const std::string& x_label_in,
    const std::string& y_label_in,
    const std::vector<Series>& series,
    int width,
    int height) {
  if (width < 160 || height < 120 || width > 8192 || height > 8192) {
    throw std::invalid_argument(
        "write_line_plot: size " + std::to_string(width) + "x" +
        std::to_string(height) + " out of range for '" + path + "'");
  }
  for (const auto& s : series) {
    if (!s.x.empty() && s.x.size() != s.y.size()) {
      throw std::invalid_argument(
          "write_line_plot: series '" + s.name + "' has " +
          std::to_string(s.x.size()) + " x values but " +
          std::to_string(s.y.size()) + " y values (plot '" + path + "')");
    }
  }
  const std::string title = sanitize(title_in);
  const std::string x_label = sanitize(x_label_in);
  const std::string y_label = sanitize(y_label_in);

  auto x_at = [](const Series& s, size_t i) {
    return s.x.empty() ? static_cast<double>(i) : s.x[i];
  };
  auto finite_at = [&](const Series& s, size_t i) {
    return std::isfinite(x_at(s, i)) && std::isfinite(s.y[i]);
  };

  // Data ranges over finite points only.
  Range xr, yr;
  for (const auto& s : series) {
    for (size_t i = 0; i < s.y.size(); ++i) {
      if (finite_at(s, i)) {
        xr.add(x_at(s, i));
        yr.add(s.y[i]);
      }
    }
  }
  xr = padded(xr);
  yr = padded(yr);

  // Text scales: tick labels / axis labels / legend, and a bigger title.
  const int ts = std::min(width, height) >= 400 ? 2 : 1;
  const int title_s = ts + 1;
  const int pad = 4 * ts;
  const int tick_len = 3 * ts;

  // Vertical layout (does not depend on tick labels).
  const int top = pad + (title.empty() ? 0 : text_height(title_s) + pad) + pad;
  const int bottom = tick_len + pad + text_height(ts) +
      (x_label.empty() ? 0 : pad + text_height(ts)) + pad;
  const int plot_h = std::max(10, height - top - bottom);

  const Ticks yt =
      fit_ticks(yr, plot_h, 40 * ts, /*horizontal_labels=*/false, ts);

  const int left = pad + (y_label.empty() ? 0 : text_height(ts) + pad) +
      yt.max_label_width(ts) + pad + tick_len;
  // Leave room for the rightmost x tick label, which is centred on the right
  // edge of the plot: lay out once with a guess, then with the real label.
  int right = 2 * pad;
  int plot_w = 0;
  Ticks xt;
  for (int pass = 0; pass < 2; ++pass) {
    plot_w = std::max(10, width - left - right);
    xt = fit_ticks(xr, plot_w, 60 * ts, /*horizontal_labels=*/true, ts);
    right = std::max(2 * pad, text_width(xt.labels.back(), ts) / 2 + pad);
  }
  plot_w = std::max(10, width - left - right);

  const Rect area{left, top, left + plot_w - 1, top + plot_h - 1};
  auto to_px = [&](double v) {
    double f = (v - xt.lo) / (xt.hi - xt.lo);
    f = std::min(1.0, std::max(0.0, f));
    return area.x0 + static_cast<int>(std::lround(f * (plot_w - 1)));
  };
  auto to_py = [&](double v) {
    double f = (v - yt.lo) / (yt.hi - yt.lo);
    f = std::min(1.0, std::max(0.0, f));
    return area.y1 - static_cast<int>(std::lround(f * (plot_h - 1)));
  };

  Canvas canvas(width, height);

  // Grid lines.
  for (double v : xt.values) {
    canvas.vline(to_px(v), area.y0, area.y1, kGrid);
  }
  for (double v : yt.values) {
    canvas.hline(area.x0, area.x1, to_py(v), kGrid);
  }

  // Series (clipped to the plot area, leaving the frame line alone).
  std::vector<uint8_t> ink(static_cast<size_t>(width) * height, 0);
  const Rect inner{area.x0 + 1, area.y0 + 1, area.x1 - 1, area.y1 - 1};
  for (size_t si = 0; si < series.size(); ++si) {
    const Series& s = series[si];
    const Rgb c = kPalette[si % kPaletteSize];
    const size_t n = s.y.size();
    bool have_prev = false;
    int px = 0, py = 0;
    for (size_t i = 0; i < n; ++i) {
      if (!finite_at(s, i)) {
        have_prev = false;
        continue;
      }
      const int x = to_px(x_at(s, i));
      const int y = to_py(s.y[i]);
      if (have_prev) {
        canvas.thick_line(px, py, x, y, c, inner, &ink);
      } else {
        const bool next_finite = i + 1 < n && finite_at(s, i + 1);
        if (!next_finite) {
          canvas.marker(x, y, ts + 1, c, inner, &ink); // isolated point
        }
      }
      px = x;
      py = y;
      have_prev = true;
    }
  }

  // Frame, tick marks and tick labels.
  canvas.rect_outline(area, kBlack);
  for (size_t i = 0; i < xt.values.size(); ++i) {
    const int x = to_px(xt.values[i]);
    canvas.vline(x, area.y1 + 1, area.y1 + tick_len, kBlack);
    const std::string& l = xt.labels[i];
    canvas.text(
        x - text_width(l, ts) / 2, area.y1 + tick_len + pad, l, ts, kBlack);
  }
  for (size_t i = 0; i < yt.values.size(); ++i) {
    const int y = to_py(yt.values[i]);
    canvas.hline(area.x0 - tick_len, area.x0 - 1, y, kBlack);
    const std::string& l = yt.labels[i];
    canvas.text(
        area.x0 - tick_len - pad - text_width(l, ts),
        y - text_height(ts) / 2,
        l,
        ts,
        kBlack);
  }

  // Title and axis labels.
  if (!title.empty()) {
    canvas.text(
        (width - text_width(title, title_s)) / 2,
        2 * pad,
        title,
        title_s,
        kBlack);
  }
  if (!x_label.empty()) {
    canvas.text(
        area.x0 + (plot_w - text_width(x_label, ts)) / 2,
        area.y1 + tick_len + pad + text_height(ts) + pad,
        x_label,
        ts,
        kBlack);
  }
  if (!y_label.empty()) {
    canvas.text_up(
        pad,
        area.y0 + (plot_h + text_width(y_label, ts)) / 2,
        y_label,
        ts,
        kBlack);
  }

  // Legend, placed in whichever plot corner hides the fewest series pixels.
  if (!series.empty()) {
    const int swatch = 10 * ts;
    const int row_h = text_height(ts) + 3 * ts;
    const int max_chars =
        std::max(4, (plot_w / 2 - swatch - 4 * pad) / (kAdvance * ts));
    std::vector<std::string> names;
    int name_w = 0;
    for (size_t si = 0; si < series.size(); ++si) {
      std::string nm = sanitize(series[si].name);
      if (nm.empty()) {
        nm = "series " + std::to_string(si + 1);
      }
      nm = truncate_to(nm, static_cast<size_t>(max_chars));
      name_w = std::max(name_w, text_width(nm, ts));
      names.push_back(std::move(nm));
    }
    const int lw = pad + swatch + pad + name_w + pad;
    const int lh = pad + static_cast<int>(names.size()) * row_h - 3 * ts + pad;
    const int m = pad; // margin from the frame
    const std::pair<int, int> corners[] = {
        {area.x1 - m - lw + 1, area.y0 + m},          // top-right
        {area.x0 + m, area.y0 + m},                   // top-left
        {area.x1 - m - lw + 1, area.y1 - m - lh + 1}, // bottom-right
        {area.x0 + m, area.y1 - m - lh + 1},          // bottom-left
    };
    int best = 0;
    size_t best_cover = std::numeric_limits<size_t>::max();
    for (int k = 0; k < 4; ++k) {
      size_t cover = 0;
      const int x0 = corners[k].first, y0 = corners[k].second;
      for (int y = std::max(0, y0); y < std::min(height, y0 + lh); ++y) {
        for (int x = std::max(0, x0); x < std::min(width, x0 + lw); ++x) {
          cover += ink[static_cast<size_t>(y) * width + x];
        }
      }
      if (cover < best_cover) {
        best_cover = cover;
        best = k;
      }
    }
    const int lx = corners[best].first, ly = corners[best].second;
    const Rect box{lx, ly, lx + lw - 1, ly + lh - 1};
    canvas.fill_rect(box.x0, box.y0, box.x1, box.y1, kWhite);
    canvas.rect_outline(box, kLegendBorder);
    for (size_t si = 0; si < names.size(); ++si) {
      const Rgb c = kPalette[si % kPaletteSize];
      const int ry = ly + pad + static_cast<int>(si) * row_h;
      const int cy = ry + text_height(ts) / 2;
      canvas.fill_rect(lx + pad, cy - 1, lx + pad + swatch - 1, cy, c);
      canvas.text(lx + pad + swatch + pad, ry, names[si], ts, kBlack);
    }
  }

  write_file_atomically(path, encode_png(canvas, path));
}

} // namespace finetune_lm
