//! Shapes: parsing `--shape` against an op's dims, and the checks the op files share (a dim
//! present and positive, every count within a 32-bit index).

use super::{OpContract, OpError, Shape};

fn shape_usage(op: &dyn OpContract) -> String {
    let dims = op.dims().join(",");
    let mut s = format!(
        "expected {} comma-separated values ({dims}) or NAME=VALUE pairs",
        op.dims().len()
    );
    if !op.optional_vars().is_empty() {
        s += &format!(" (optional: {})", op.optional_vars().join(", "));
    }
    s
}

/// Parse `--shape`: `"37,100,72"` positional by [`OpContract::dims`], or
/// `"M=37,N=100,K=72,T=37,n_head=2"` named (positional values may precede named ones).
/// Dims must be positive; optional variables non-negative. The result is not completed.
pub fn parse_shape(op: &dyn OpContract, text: &str) -> Result<Shape, OpError> {
    let err = |msg: String| OpError::Parse {
        op: op.name(),
        text: text.to_string(),
        msg,
    };
    let dims = op.dims();
    let mut shape = Shape::new();
    let mut positional = 0usize;
    let mut seen_named = false;
    for (i, item) in text.split(',').enumerate() {
        let item = item.trim();
        if item.is_empty() {
            return Err(err(format!("empty item #{}; {}", i + 1, shape_usage(op))));
        }
        let (name, value) = match item.split_once('=') {
            Some((n, v)) => {
                seen_named = true;
                let n = n.trim();
                let known = dims.iter().chain(op.optional_vars()).find(|d| **d == n);
                match known {
                    Some(d) => (*d, v.trim()),
                    None => return Err(err(format!("unknown variable `{n}`; {}", shape_usage(op)))),
                }
            }
            None => {
                if seen_named {
                    return Err(err(format!(
                        "positional value `{item}` after named ones; {}",
                        shape_usage(op)
                    )));
                }
                if positional >= dims.len() {
                    return Err(err(format!("too many values; {}", shape_usage(op))));
                }
                positional += 1;
                (dims[positional - 1], item)
            }
        };
        let v: i64 = value
            .parse()
            .map_err(|_| err(format!("{name}=`{value}` is not an integer; {}", shape_usage(op))))?;
        let is_dim = dims.contains(&name);
        if is_dim && v <= 0 {
            return Err(err(format!("{name} must be positive (got {v})")));
        }
        if v < 0 {
            return Err(err(format!("{name} must not be negative (got {v})")));
        }
        if v > i32::MAX as i64 {
            return Err(err(format!("{name}={v} does not fit a 32-bit int")));
        }
        if shape.insert(name.to_string(), v).is_some() {
            return Err(err(format!("{name} given twice")));
        }
    }
    let missing: Vec<&str> = dims.iter().copied().filter(|d| !shape.contains_key(*d)).collect();
    if !missing.is_empty() {
        return Err(err(format!("missing {}; {}", missing.join(", "), shape_usage(op))));
    }
    Ok(shape)
}

/// A positive dim of the shape, or an error naming it.
pub(crate) fn get_dim(op: &dyn OpContract, shape: &Shape, name: &str) -> Result<i64, OpError> {
    match shape.get(name) {
        None => Err(OpError::MissingVar {
            op: op.name(),
            var: name.to_string(),
            hint: format!("give all of {} in --shape", op.dims().join(",")),
        }),
        Some(&v) if v <= 0 => Err(OpError::Shape {
            op: op.name(),
            msg: format!("{name} must be positive (got {v})"),
        }),
        Some(&v) => Ok(v),
    }
}

/// Check that every value and the given element counts fit a 32-bit int (kernels index with `int`).
pub(crate) fn check_i32(op: &dyn OpContract, shape: &Shape, counts: &[(&str, i64)]) -> Result<(), OpError> {
    for (k, &v) in shape {
        if !(0..=i32::MAX as i64).contains(&v) {
            return Err(OpError::Shape {
                op: op.name(),
                msg: format!("{k}={v} must be in 0..=2^31-1"),
            });
        }
    }
    for &(what, n) in counts {
        if n > i32::MAX as i64 {
            return Err(OpError::Shape {
                op: op.name(),
                msg: format!("{what} has {n} elements, more than a 32-bit index reaches; use smaller dims"),
            });
        }
    }
    Ok(())
}

/// Build a shape from pairs.
pub(crate) fn shape_of(pairs: &[(&str, i64)]) -> Shape {
    pairs.iter().map(|&(k, v)| (k.to_string(), v)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::op_by_name;

    #[test]
    fn parse_shape_good() {
        let mm = op_by_name("matmul").unwrap();
        let s = parse_shape(mm, "37,100,72").unwrap();
        assert_eq!(s, shape_of(&[("M", 37), ("N", 100), ("K", 72)]));
        let s = parse_shape(mm, " M=37, N = 100,K=72,T=37,n_head=2 ").unwrap();
        assert_eq!(
            s,
            shape_of(&[("M", 37), ("N", 100), ("K", 72), ("T", 37), ("n_head", 2)])
        );
        let s = parse_shape(mm, "K=72,M=37,N=100").unwrap();
        assert_eq!(s["K"], 72);
        let s = parse_shape(mm, "10,48,40,T=5,n_head=2").unwrap();
        assert_eq!((s["M"], s["T"]), (10, 5));
        let enc = op_by_name("encoder").unwrap();
        let s = parse_shape(enc, "4,64,768,pos_offset=0").unwrap();
        assert_eq!(s["pos_offset"], 0);
        let gelu = op_by_name("gelu").unwrap();
        assert_eq!(parse_shape(gelu, "1001").unwrap()["N"], 1001);
    }

    #[test]
    fn parse_shape_bad() {
        let mm = op_by_name("matmul").unwrap();
        let bad = [
            ("37,100", "missing K"),
            ("37,100,72,5", "too many"),
            ("M=37,N=100,X=1", "unknown variable `X`"),
            ("M=37,N=100", "missing K"),
            ("37,0,72", "N must be positive"),
            ("37,-1,72", "N must be positive"),
            ("37,abc,72", "not an integer"),
            ("37,,72", "empty"),
            ("M=3,M=4,N=1,K=1", "twice"),
            ("37,N=100,72", "after named"),
            ("37,100,72,T=-1", "must not be negative"),
            ("37,100,99999999999", "32-bit"),
            ("", "empty"),
        ];
        for (text, want) in bad {
            let e = parse_shape(mm, text).unwrap_err().to_string();
            assert!(e.starts_with("matmul: cannot parse shape"), "{e}");
            assert!(e.contains(want), "{text}: {e}");
        }
        // The usage names the dims.
        let e = parse_shape(mm, "1,2").unwrap_err().to_string();
        assert!(e.contains("(M,N,K)") && e.contains("T, n_head"), "{e}");
        let att = op_by_name("attention").unwrap();
        let e = parse_shape(att, "1,2,3").unwrap_err().to_string();
        assert!(e.contains("B,NH,T,HS"), "{e}");
    }
}
