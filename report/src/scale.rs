//! Colour scales. Differences span many orders of magnitude (one ulp of a
//! bf16 value to a whole changed token), so magnitudes are coloured on a
//! log scale by decade. The palette is viridis (sequential, perceptually
//! uniform, readable in grey and under the common colour-vision
//! deficiencies); identical cells are white and uncaptured cells a light
//! grey with a dashed outline, so those two never depend on hue.

use crate::svg::Svg;

/// Viridis at ten evenly spaced stops, darkest first.
pub const PALETTE: [&str; 10] = [
    "#440154", "#482878", "#3e4989", "#31688e", "#26828e", "#1f9e89", "#35b779", "#6ece58", "#b5de2b",
    "#fde725",
];

/// Fill of a cell whose records are identical.
pub const IDENTICAL: &str = "#ffffff";
/// Fill of a cell neither trace captured.
pub const NOT_CAPTURED: &str = "#e6e6e6";
/// Fill of a cell that differs by digest but whose values are not in the
/// traces (fingerprint-only capture): the darkest colour with no number.
pub const DIFFERS_UNKNOWN: &str = "#7f7f7f";

/// A log10 colour scale over whole decades `10^lo ..= 10^hi`: small values
/// dark, large values bright.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogScale {
    /// Lowest decade (values below clamp to it).
    pub lo: i32,
    /// Highest decade (values above clamp to it).
    pub hi: i32,
}

impl LogScale {
    /// The smallest whole-decade scale containing every positive finite
    /// value of `values` (at least one decade wide); `fallback` when there
    /// is none.
    pub fn covering(values: impl Iterator<Item = f64>, fallback: LogScale) -> LogScale {
        let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
        for v in values.filter(|v| v.is_finite() && *v > 0.0) {
            lo = lo.min(v);
            hi = hi.max(v);
        }
        if !lo.is_finite() {
            return fallback;
        }
        let (l, h) = (lo.log10().floor() as i32, hi.log10().ceil() as i32);
        LogScale {
            lo: l.max(-300),
            hi: h.max(l + 1).min(300),
        }
    }

    /// The colour of a positive value (non-positive values take the lowest).
    pub fn color(&self, v: f64) -> &'static str {
        if v.is_nan() || v <= 0.0 {
            return PALETTE[0];
        }
        let t = (v.log10() - self.lo as f64) / ((self.hi - self.lo) as f64);
        let i = (t.clamp(0.0, 1.0) * (PALETTE.len() - 1) as f64).round() as usize;
        PALETTE[i.min(PALETTE.len() - 1)]
    }

    /// Draws a horizontal legend at (`x`, `y`): the palette from `10^lo` to
    /// `10^hi` with `unit`, then the identical and not-captured swatches.
    pub fn legend(&self, svg: &mut Svg, x: f64, y: f64, unit: &str) {
        let w = 18.0;
        svg.text(x, y - 4.0, unit, "start", 11.0, "");
        for (i, c) in PALETTE.iter().enumerate() {
            svg.rect((x + i as f64 * w, y, w, 12.0), c, None, "");
        }
        svg.text(x, y + 24.0, &format!("1e{}", self.lo), "start", 10.0, "");
        let end = x + PALETTE.len() as f64 * w;
        svg.text(end, y + 24.0, &format!("1e{}", self.hi), "end", 10.0, "");
        let sx = end + 16.0;
        svg.rect((sx, y, 12.0, 12.0), IDENTICAL, Some(("#888", 1.0)), "");
        svg.text(sx + 16.0, y + 10.0, "identical", "start", 10.0, "");
        svg.rect((sx + 76.0, y, 12.0, 12.0), NOT_CAPTURED, Some(("#888", 1.0)), "");
        svg.text(sx + 92.0, y + 10.0, "not captured", "start", 10.0, "");
        svg.rect((sx + 170.0, y, 12.0, 12.0), DIFFERS_UNKNOWN, None, "");
        svg.text(sx + 186.0, y + 10.0, "differs (no values)", "start", 10.0, "");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn covering_rounds_out_to_decades() {
        let s = LogScale::covering([3e-3, 0.5].into_iter(), LogScale { lo: -6, hi: 0 });
        assert_eq!(s, LogScale { lo: -3, hi: 0 });
        let s = LogScale::covering([1.0].into_iter(), LogScale { lo: -6, hi: 0 });
        assert_eq!(s, LogScale { lo: 0, hi: 1 });
        let f = LogScale { lo: -6, hi: 0 };
        assert_eq!(LogScale::covering([0.0, f64::NAN].into_iter(), f), f);
    }

    #[test]
    fn colours_grow_with_the_value() {
        let s = LogScale { lo: -6, hi: 0 };
        assert_eq!(s.color(1e-9), PALETTE[0]);
        assert_eq!(s.color(1.0), PALETTE[9]);
        assert_eq!(s.color(0.0), PALETTE[0]);
        assert_ne!(s.color(1e-3), s.color(1e-1));
    }
}
