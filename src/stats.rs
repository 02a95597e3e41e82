//! Small statistics that every layer takes the same way: the median of a set of timings (the
//! copy-bandwidth probe in `gpu`, the tuner's timings in `tune`, whole decode steps in `model`,
//! `bench`'s forward passes).

/// The middle value of `values` (the upper of the two middle ones for an even count), as
/// `tune::time::Timing::from_samples` takes it. Panics on an empty set: a median of nothing is a
/// caller's bug, not a time.
pub fn median(mut values: Vec<f64>) -> f64 {
    assert!(!values.is_empty(), "at least one value");
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn the_middle_or_the_upper_middle() {
        assert_eq!(median((1..=11).rev().map(|v| v as f64).collect()), 6.0);
        assert_eq!(
            median(vec![4.0, 1.0, 3.0, 2.0]),
            3.0,
            "the upper middle of an even count"
        );
        assert_eq!(median(vec![2.5]), 2.5);
    }
}
