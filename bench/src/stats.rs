//! Percentiles of latency samples.

use serde::Serialize;

/// p50 / p99 / max of a set of samples, in the unit the caller names.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Percentiles {
    pub samples: u64,
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
    pub unit: &'static str,
}

impl Percentiles {
    /// Nearest-rank percentiles; empty input gives zeros with `samples: 0`.
    pub fn of(mut samples: Vec<f64>, unit: &'static str) -> Percentiles {
        samples.sort_by(f64::total_cmp);
        let n = samples.len();
        if n == 0 {
            return Percentiles { unit, ..Default::default() };
        }
        let rank = |q: f64| samples[((q * n as f64).ceil() as usize).clamp(1, n) - 1];
        Percentiles {
            samples: n as u64,
            p50: rank(0.50),
            p99: rank(0.99),
            max: samples[n - 1],
            unit,
        }
    }

    pub fn render(&self) -> String {
        if self.samples == 0 {
            return "no samples".into();
        }
        format!(
            "p50 {} / p99 {} / max {} {}",
            fmt_num(self.p50),
            fmt_num(self.p99),
            fmt_num(self.max),
            self.unit
        )
    }
}

/// 3 significant digits, no exponent.
pub fn fmt_num(v: f64) -> String {
    let a = v.abs();
    if a >= 100.0 || a == 0.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let p = Percentiles::of((1..=100).rev().map(f64::from).collect(), "ms");
        assert_eq!((p.samples, p.p50, p.p99, p.max), (100, 50.0, 99.0, 100.0));
        let one = Percentiles::of(vec![7.0], "ms");
        assert_eq!((one.p50, one.p99, one.max), (7.0, 7.0, 7.0));
        assert_eq!(Percentiles::of(Vec::new(), "ms").samples, 0);
    }

    #[test]
    fn numbers_read_well() {
        assert_eq!(fmt_num(1234.5), "1234");
        assert_eq!(fmt_num(12.34), "12.3");
        assert_eq!(fmt_num(1.234), "1.23");
        assert_eq!(fmt_num(0.01234), "0.012");
    }
}
