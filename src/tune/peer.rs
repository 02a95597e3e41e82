//! The vendor peer of a matmul row, the part that needs no GPU: which peer each epilogue gets
//! and its name ([`peer_name`]), why a peer has no time ([`PeerError`]), what `tune` records
//! ([`PeerRun`]), and the honesty check.
//!
//! The check: the peer runs once on the real (full-size) problem and its first rows are
//! compared with the f64 reference of a problem made of just those rows (the reference of the
//! full shape would cost minutes on the CPU). Rows of a matmul are independent, so the first
//! rows of the full output must equal the small problem's output; for the QKV split the rows
//! are those of the first sequence, gathered from the head-major layout.

use super::cublaslt::{LtCase, LtError};
use super::db::Entry;
use super::time::Timing;
use cudarc::cublas::sys::cublasStatus_t;

use crate::gpu::{GpuError, RunError};
use crate::ops::matmul::{qkv_index, Matmul};
use crate::ops::{relative_l2_error, Epilogue, HostData, OpContract, Problem, Role};
use crate::spec::Dtype;
use rand::SeedableRng;

/// The peer a matmul with `epilogue` is compared with, as tables and the database name it.
pub fn peer_name(epilogue: Epilogue) -> &'static str {
    match epilogue {
        Epilogue::None => "cuBLASLt",
        Epilogue::Bias => "cuBLASLt bias (fused)",
        Epilogue::BiasGelu => "cuBLASLt bias+gelu (fused)",
        Epilogue::BiasResidual => "cuBLASLt bias+residual (fused, C=residual)",
        Epilogue::Qkv => "cuBLAS + qkv split kernel (unfused)",
        Epilogue::LnBias => "standardize kernel + cuBLASLt bias (fused)",
        Epilogue::LnBiasGelu => "standardize kernel + cuBLASLt bias+gelu (fused)",
        Epilogue::LnQkv => "standardize kernel + cuBLAS + qkv split kernel (unfused)",
    }
}

/// What the peers are, in one paragraph for legends.
pub const PEER_LEGEND: &str = "peer: cuBLASLt with its own fused epilogue (bias; bias+GELU; bias+residual as beta = 1 with C = the residual), the fastest of up to 8 algorithms its heuristic offers (32 MiB workspace), in the row's dtype; the QKV split has no cuBLASLt epilogue, so its peer is cuBLAS + a separate split kernel (unfused); every peer is checked against the f64 reference, then timed in turns with the tuner's finalists (so both see the same clocks)";

/// Why the peer of a matmul row has no time. Every message names the problem (shape, dtype,
/// epilogue) and, where a library answered, its status.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error(transparent)]
    Lt(#[from] LtError),
    #[error("{0}")]
    LtMissing(String),
    #[error("{case}: {call} returned {status:?}")]
    Cublas {
        case: LtCase,
        call: &'static str,
        status: cublasStatus_t,
    },
    #[error("{case}: the peer ({peer}) is wrong: relative L2 error {error:.3e} against the f64 reference on its first {rows} rows, over the {dtype} bar {bar:.0e}")]
    Inaccurate {
        case: LtCase,
        peer: &'static str,
        error: f64,
        rows: usize,
        dtype: Dtype,
        bar: f64,
    },
    #[error("{case}: {message}")]
    Problem { case: LtCase, message: String },
    #[error("{case}: {source}")]
    Run { case: LtCase, source: Box<RunError> },
}

impl PeerError {
    /// A GPU error (fault, allocation, copy), as opposed to the peer declining or failing the
    /// check: the tuner stops on these instead of reporting the peer unavailable.
    pub fn is_fatal(&self) -> bool {
        match self {
            PeerError::Lt(e) => e.is_fatal(),
            PeerError::Run { .. } => true,
            _ => false,
        }
    }
}

pub(crate) fn gpu_err(case: LtCase, what: &str) -> impl FnOnce(cudarc::driver::DriverError) -> PeerError + '_ {
    move |e| PeerError::Run {
        case,
        source: Box::new(GpuError::cuda(what)(e).into()),
    }
}

/// The peer of one matmul row as `tune` records it.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerRun {
    pub peer: &'static str,
    /// Its time on the full shape, or why it has none (unavailable here, or wrong).
    pub outcome: Result<Timing, String>,
    /// Relative L2 error of its output against the f64 reference, when it ran.
    pub error: Option<f64>,
}

/// What entries written before the peers were named were measured against.
pub const EARLIER_PEER: &str = "cuBLAS + epilogue kernel (earlier run)";

/// The peer `entry`'s `baseline_ms` belongs to, if it has one.
pub fn entry_peer(entry: &Entry) -> Option<&str> {
    match (&entry.baseline, entry.baseline_ms) {
        (Some(peer), _) => Some(peer),
        (None, Some(_)) => Some(EARLIER_PEER),
        (None, None) => None,
    }
}

/// The "peer ms" and "speed vs peer" cells of `entry`: the peer's time and the peer's time over
/// the winner's (above 1: the generated kernel is faster); `n/a` for a peer that was measured
/// but has no time (see `baseline_unavailable`), `-` when no peer was measured.
pub fn peer_cells(entry: &Entry) -> (String, String) {
    match entry.baseline_ms {
        Some(b) => (
            format!("{b:.4}"),
            if entry.median_ms > 0.0 {
                format!("{:.2}x", b / entry.median_ms)
            } else {
                "-".into()
            },
        ),
        None if entry.baseline_unavailable.is_some() => ("n/a".into(), "n/a".into()),
        None => ("-".into(), "-".into()),
    }
}

fn dim(problem: &Problem, name: &str) -> usize {
    problem.shape.get(name).copied().unwrap_or(0).max(0) as usize
}

/// How many leading rows a check of up to `rows` rows covers: at least 1, at most M, and for the
/// QKV split at most T (the first sequence).
pub fn head_rows(problem: &Problem, rows: usize) -> usize {
    let m = dim(problem, "M");
    let mut rows = rows.clamp(1, m.max(1));
    if problem.epilogue.after_product() == Epilogue::Qkv {
        rows = rows.min(dim(problem, "T").max(1));
    }
    rows
}

/// Output elements the first `rows` rows occupy at the start of the output (for the QKV split,
/// the whole output: its rows are spread over the head-major layout).
pub fn head_len(problem: &Problem, rows: usize) -> usize {
    if problem.epilogue.after_product() == Epilogue::Qkv {
        dim(problem, "M") * dim(problem, "N")
    } else {
        head_rows(problem, rows) * dim(problem, "N")
    }
}

/// The matmul problem made of the first [`head_rows`] rows of `problem`: the same weight, bias
/// and storage, the leading rows of the input (and of the residual).
pub fn head_problem(problem: &Problem, rows: usize) -> Result<Problem, String> {
    let rows = head_rows(problem, rows);
    let mut shape = problem.shape.clone();
    shape.insert("M".into(), rows as i64);
    shape.insert("T".into(), rows as i64);
    let mut head = Matmul
        .problem(
            &shape,
            problem.epilogue,
            problem.mask,
            &mut rand::rngs::StdRng::seed_from_u64(0),
        )
        .map_err(|e| format!("cannot build the {rows}-row check problem: {e}"))?;
    for t in head.tensors.iter_mut().filter(|t| t.role != Role::Output) {
        let Some(HostData::F32(full)) = problem.tensor(t.name).map(|f| &f.data) else {
            return Err(format!("the matmul problem has no f32 tensor `{}`", t.name));
        };
        let want = t.data.len();
        if full.len() < want {
            return Err(format!(
                "`{}` holds {} values, fewer than the {want} its first {rows} rows need",
                t.name,
                full.len()
            ));
        }
        // Row-major: the leading rows of `inp` and `residual` are a prefix; `weight`, `bias`
        // (and the 1-element residual dummy) are taken whole.
        t.data = HostData::F32(full[..want].to_vec());
    }
    head.storage = problem.storage;
    Ok(head)
}

/// The first [`head_rows`] rows of `out` (the full output, or at least its first
/// [`head_len`] elements), laid out as [`head_problem`]'s output.
pub fn gather_head<T: Copy + Default>(problem: &Problem, out: &[T], rows: usize) -> Vec<T> {
    let rows = head_rows(problem, rows);
    let (m, n) = (dim(problem, "M"), dim(problem, "N"));
    if problem.epilogue.after_product() != Epilogue::Qkv {
        return out[..(rows * n).min(out.len())].to_vec();
    }
    let (t, nh) = (dim(problem, "T"), dim(problem, "n_head"));
    let mut head = vec![T::default(); rows * n];
    for row in 0..rows {
        for col in 0..n {
            // Row `row` < T is (b = 0, t = row) in both layouts.
            head[qkv_index(row, col, rows, n, rows, nh)] = out[qkv_index(row, col, m, n, t, nh)];
        }
    }
    head
}

/// Relative L2 error of the first rows of `out` against the f64 reference of those rows.
pub fn head_error(problem: &Problem, out: &[f32], rows: usize) -> Result<f64, String> {
    if out.len() < head_len(problem, rows) {
        return Err(format!(
            "the peer's output holds {} values, fewer than the {} checked",
            out.len(),
            head_len(problem, rows)
        ));
    }
    let head = head_problem(problem, rows)?;
    let want = &Matmul.reference(&head)[0].1;
    Ok(relative_l2_error(&gather_head(problem, out, rows), want))
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;
    use crate::ops::{shape_of, Mask, Storage};

    fn problem(epilogue: Epilogue, dims: &[(&str, i64)]) -> Problem {
        Matmul
            .problem(
                &shape_of(dims),
                epilogue,
                Mask::None,
                &mut rand::rngs::StdRng::seed_from_u64(11),
            )
            .unwrap()
    }

    /// The reference of the head problem is the head of the full reference, for every epilogue
    /// (QKV gathered out of the head-major layout).
    #[test]
    fn the_head_problem_is_the_head_of_the_full_one() {
        let plain = [("M", 37), ("N", 100), ("K", 72)];
        let qkv = [("M", 12), ("N", 48), ("K", 8), ("T", 6), ("n_head", 2)];
        for (e, dims) in [
            (Epilogue::None, &plain[..]),
            (Epilogue::Bias, &plain[..]),
            (Epilogue::BiasGelu, &plain[..]),
            (Epilogue::BiasResidual, &plain[..]),
            (Epilogue::Qkv, &qkv[..]),
            (Epilogue::LnBias, &plain[..]),
            (Epilogue::LnBiasGelu, &plain[..]),
            (Epilogue::LnQkv, &qkv[..]),
        ] {
            let p = problem(e, dims);
            let full = Matmul.reference(&p)[0].1.clone();
            for rows in [1, 5, 6, 37, 100] {
                let head = head_problem(&p, rows).unwrap();
                let r = head_rows(&p, rows);
                assert_eq!(head.shape["M"], r as i64);
                let want = &Matmul.reference(&head)[0].1;
                assert_eq!(&gather_head(&p, &full, rows), want, "{e} rows {rows}");
                let got: Vec<f32> = full.iter().map(|&x| x as f32).collect();
                assert!(head_error(&p, &got, rows).unwrap() < 1e-6, "{e} rows {rows}");
            }
        }
    }

    #[test]
    fn every_epilogue_has_a_named_peer() {
        assert_eq!(peer_name(Epilogue::None), "cuBLASLt");
        assert_eq!(peer_name(Epilogue::Bias), "cuBLASLt bias (fused)");
        assert_eq!(peer_name(Epilogue::BiasGelu), "cuBLASLt bias+gelu (fused)");
        assert_eq!(
            peer_name(Epilogue::BiasResidual),
            "cuBLASLt bias+residual (fused, C=residual)"
        );
        assert_eq!(peer_name(Epilogue::Qkv), "cuBLAS + qkv split kernel (unfused)");
        // The fused names are exactly the epilogues cuBLASLt fuses.
        for e in [
            Epilogue::None,
            Epilogue::Bias,
            Epilogue::BiasGelu,
            Epilogue::BiasResidual,
            Epilogue::Qkv,
        ] {
            assert_eq!(
                peer_name(e).starts_with("cuBLASLt"),
                super::super::cublaslt::fused(e).is_some(),
                "{e}"
            );
        }
        // The ln_ epilogues' peer standardizes the rows first, then runs the plain one's peer.
        for e in [Epilogue::LnBias, Epilogue::LnBiasGelu, Epilogue::LnQkv] {
            assert_eq!(
                peer_name(e),
                format!("standardize kernel + {}", peer_name(e.after_product()))
            );
            assert_eq!(
                super::super::cublaslt::fused(e),
                super::super::cublaslt::fused(e.after_product()),
                "{e}"
            );
        }
        assert!(PEER_LEGEND.contains("beta = 1") && PEER_LEGEND.contains("unfused"));
    }

    #[test]
    fn entries_show_their_peer_or_why_not() {
        let mut e: Entry = serde_json::from_str(
            r#"{"family":"matmul_simt","params":{},"shape":{"M":8,"N":8,"K":8},"median_ms":0.5,
                "spread_ms":0.01,"baseline_ms":0.6,"variants_tried":3,"tuned_at":1}"#,
        )
        .unwrap();
        assert_eq!(
            entry_peer(&e),
            Some(EARLIER_PEER),
            "a file from before peers were named"
        );
        assert_eq!(peer_cells(&e), ("0.6000".to_string(), "1.20x".to_string()));
        e.baseline = Some(peer_name(Epilogue::BiasGelu).into());
        assert_eq!(entry_peer(&e), Some("cuBLASLt bias+gelu (fused)"));
        e.baseline_ms = None;
        e.baseline_unavailable = Some("wrong".into());
        assert_eq!(peer_cells(&e), ("n/a".to_string(), "n/a".to_string()));
        e.baseline = None;
        e.baseline_unavailable = None;
        assert_eq!(entry_peer(&e), None);
        assert_eq!(peer_cells(&e), ("-".to_string(), "-".to_string()));
        // Absent fields are not written.
        let text = serde_json::to_string(&e).unwrap();
        assert!(
            !text.contains("baseline\"") && !text.contains("baseline_unavailable"),
            "{text}"
        );
    }

    #[test]
    fn peer_errors_name_the_problem_and_say_which_are_fatal() {
        let case = LtCase {
            m: 130,
            n: 3072,
            k: 768,
            dtype: Dtype::F16,
            epilogue: Epilogue::BiasGelu,
        };
        let e = PeerError::Inaccurate {
            case,
            peer: peer_name(case.epilogue),
            error: 0.031,
            rows: 130,
            dtype: case.dtype,
            bar: 1e-2,
        };
        assert_eq!(
            e.to_string(),
            "matmul f16 bias_gelu M=130 N=3072 K=768: the peer (cuBLASLt bias+gelu (fused)) is wrong: relative L2 error 3.100e-2 against the f64 reference on its first 130 rows, over the f16 bar 1e-2"
        );
        assert!(!e.is_fatal());
        let e = PeerError::Cublas {
            case: LtCase {
                epilogue: Epilogue::Qkv,
                ..case
            },
            call: "cublasGemmEx",
            status: cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED,
        };
        assert_eq!(
            e.to_string(),
            "matmul f16 qkv M=130 N=3072 K=768: cublasGemmEx returned CUBLAS_STATUS_NOT_SUPPORTED"
        );
        assert!(!e.is_fatal());
        // (A driver error's text needs the driver: built from a launch error instead.)
        let e = PeerError::Run {
            case,
            source: Box::new(RunError::Launch {
                kernel: "peer".into(),
                message: "an illegal address".into(),
            }),
        };
        assert!(e.is_fatal());
        assert_eq!(
            e.to_string(),
            "matmul f16 bias_gelu M=130 N=3072 K=768: peer: an illegal address"
        );
    }

    #[test]
    fn rows_are_clamped_to_the_shape_and_qkv_to_one_sequence() {
        let p = problem(Epilogue::Bias, &[("M", 37), ("N", 10), ("K", 4)]);
        assert_eq!((head_rows(&p, 0), head_rows(&p, 16), head_rows(&p, 512)), (1, 16, 37));
        assert_eq!(head_len(&p, 16), 160);
        let q = problem(
            Epilogue::Qkv,
            &[("M", 12), ("N", 48), ("K", 8), ("T", 6), ("n_head", 2)],
        );
        assert_eq!(head_rows(&q, 512), 6);
        assert_eq!(head_len(&q, 3), 12 * 48, "qkv rows are spread over the whole output");
    }

    #[test]
    fn a_wrong_or_short_output_fails() {
        let p = problem(Epilogue::BiasGelu, &[("M", 9), ("N", 20), ("K", 16)]).stored_as(Storage::Bf16);
        let head = head_problem(&p, 4).unwrap();
        assert_eq!(head.storage, Storage::Bf16);
        let mut out: Vec<f32> = Matmul.reference(&p)[0].1.iter().map(|&x| x as f32).collect();
        assert!(head_error(&p, &out, 4).unwrap() < 1e-6);
        out[3] = f32::NAN;
        assert_eq!(head_error(&p, &out, 4).unwrap(), f64::INFINITY, "NaN never passes");
        let e = head_error(&p, &out[..10], 4).unwrap_err();
        assert!(e.contains("fewer than the 80 checked"), "{e}");
    }
}
