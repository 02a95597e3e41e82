//! Minimal NumPy `.npy` (format v1.0) writer and reader for little-endian float32 arrays, as the
//! `forward --logits-out` contract needs (`[T, vocab]` float32). Writes are atomic.

use std::io::Write;
use std::path::Path;

use super::error::{ModelError, Result};
use super::weights::atomic_write;

const MAGIC: &[u8] = b"\x93NUMPY";

/// The v1.0 header (magic, version, length, dict padded with spaces to a multiple of 64 bytes).
fn header(shape: &[usize]) -> Vec<u8> {
    let dims = match shape.len() {
        1 => format!("({},)", shape[0]),
        _ => format!(
            "({})",
            shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")
        ),
    };
    let mut dict = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {dims}, }}");
    let unpadded = MAGIC.len() + 2 + 2 + dict.len() + 1;
    dict.push_str(&" ".repeat(unpadded.next_multiple_of(64) - unpadded));
    dict.push('\n');
    let mut h = Vec::with_capacity(unpadded + 64);
    h.extend_from_slice(MAGIC);
    h.extend_from_slice(&[1, 0]);
    h.extend_from_slice(&(dict.len() as u16).to_le_bytes());
    h.extend_from_slice(dict.as_bytes());
    h
}

/// Write `data` with `shape` as a C-order `<f4` `.npy` file.
pub fn write_npy_f32(path: &Path, shape: &[usize], data: &[f32]) -> Result<()> {
    let n: usize = shape.iter().product();
    if n != data.len() {
        return Err(ModelError::Batch(format!(
            "npy {}: shape {shape:?} needs {n} values, got {}",
            path.display(),
            data.len()
        )));
    }
    atomic_write(path, |w| {
        w.write_all(&header(shape))?;
        for chunk in data.chunks(1 << 16) {
            let bytes: Vec<u8> = chunk.iter().flat_map(|x| x.to_le_bytes()).collect();
            w.write_all(&bytes)?;
        }
        Ok(())
    })
}

/// Read a C-order `<f4` `.npy` file (v1.0 or v2.0 header): `(shape, data)`.
pub fn read_npy_f32(path: &Path) -> Result<(Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).map_err(|e| ModelError::io(path, e))?;
    let bad = |m: &str| ModelError::NotAModel {
        path: path.to_path_buf(),
        message: format!("not a float32 .npy file: {m}"),
    };
    if bytes.len() < 10 || &bytes[..6] != MAGIC {
        return Err(bad("missing magic"));
    }
    let (hlen, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        ),
        _ => return Err(bad("unsupported version")),
    };
    let dict = std::str::from_utf8(bytes.get(start..start + hlen).ok_or_else(|| bad("short header"))?)
        .map_err(|_| bad("header is not UTF-8"))?;
    if !dict.contains("'<f4'") {
        return Err(bad("dtype is not '<f4'"));
    }
    if dict.contains("'fortran_order': True") {
        return Err(bad("Fortran order"));
    }
    let s = dict.find("'shape':").ok_or_else(|| bad("no shape"))?;
    let open = dict[s..].find('(').ok_or_else(|| bad("no shape"))? + s;
    let close = dict[open..].find(')').ok_or_else(|| bad("no shape"))? + open;
    let shape = dict[open + 1..close]
        .split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(|x| x.parse::<usize>().map_err(|_| bad("bad shape")))
        .collect::<Result<Vec<_>>>()?;
    let body = &bytes[start + hlen..];
    let n: usize = shape.iter().product();
    if body.len() != n * 4 {
        return Err(bad(&format!(
            "shape {shape:?} needs {} bytes of data, file has {}",
            n * 4,
            body.len()
        )));
    }
    let data = body
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    Ok((shape, data))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_alignment() {
        let dir = tempfile::tempdir().unwrap();
        for shape in [vec![3usize, 5], vec![7], vec![2, 3, 4]] {
            let n: usize = shape.iter().product();
            let data: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 1.0).collect();
            let p = dir.path().join("a.npy");
            write_npy_f32(&p, &shape, &data).unwrap();
            let raw = std::fs::read(&p).unwrap();
            let hlen = u16::from_le_bytes([raw[8], raw[9]]) as usize;
            assert_eq!((10 + hlen) % 64, 0);
            assert_eq!(read_npy_f32(&p).unwrap(), (shape, data));
        }
    }
}
