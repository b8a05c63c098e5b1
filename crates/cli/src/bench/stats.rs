//! Percentiles of a set of samples (nearest rank, no interpolation: every
//! figure printed is one that was measured).

use serde::Serialize;

#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Summary {
    pub n: usize,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
    pub mean: f64,
}

impl Summary {
    /// `None` for no samples.
    pub fn of(samples: &[f64]) -> Option<Self> {
        if samples.is_empty() {
            return None;
        }
        let mut s = samples.to_vec();
        s.sort_by(|a, b| a.total_cmp(b));
        let rank = |q: f64| s[((q * s.len() as f64).ceil() as usize).clamp(1, s.len()) - 1];
        Some(Self {
            n: s.len(),
            p50: rank(0.50),
            p90: rank(0.90),
            p99: rank(0.99),
            max: s[s.len() - 1],
            mean: s.iter().sum::<f64>() / s.len() as f64,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        assert_eq!(Summary::of(&[]), None);
        let one = Summary::of(&[7.0]).unwrap();
        assert_eq!((one.p50, one.p99, one.max), (7.0, 7.0, 7.0));
        let s: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        let sum = Summary::of(&s).unwrap();
        assert_eq!(
            (sum.n, sum.p50, sum.p90, sum.p99, sum.max),
            (100, 50.0, 90.0, 99.0, 100.0)
        );
        assert_eq!(sum.mean, 50.5);
        let odd = Summary::of(&[3.0, 1.0, 2.0]).unwrap();
        assert_eq!(odd.p50, 2.0);
    }
}
