//! Reading and writing NumPy .npy files (format versions 1-3, little-endian, C order), the
//! tensor exchange format of `kairos run`.

use crate::tensor::{DType, Tensor};
use std::path::{Path, PathBuf};

/// Why a .npy file could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum NpyError {
    #[error("cannot {action} {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Not a well-formed .npy file: the reason names what is wrong.
    #[error("{}{reason}", at(path))]
    Malformed { path: Option<PathBuf>, reason: String },
    /// A well-formed file kairos does not take (its format version, order or element type).
    #[error("{}{what}", at(path))]
    Unsupported { path: Option<PathBuf>, what: String },
}

fn at(path: &Option<PathBuf>) -> String {
    path.as_ref().map(|p| format!("{}: ", p.display())).unwrap_or_default()
}

impl NpyError {
    fn malformed(reason: impl Into<String>) -> NpyError {
        NpyError::Malformed { path: None, reason: reason.into() }
    }

    fn unsupported(what: impl Into<String>) -> NpyError {
        NpyError::Unsupported { path: None, what: what.into() }
    }

    /// The same error, naming the file it came from.
    fn in_file(self, file: &Path) -> NpyError {
        match self {
            NpyError::Malformed { reason, .. } => NpyError::Malformed { path: Some(file.to_path_buf()), reason },
            NpyError::Unsupported { what, .. } => NpyError::Unsupported { path: Some(file.to_path_buf()), what },
            e => e,
        }
    }
}

const MAGIC: &[u8] = b"\x93NUMPY";

/// Parses .npy bytes. Accepts float32, float16, float64 (converted to f32), int64 and int32
/// (converted to i64); big-endian and Fortran-order arrays are rejected with a clear error.
pub fn from_bytes(bytes: &[u8]) -> Result<Tensor, NpyError> {
    if bytes.len() < 10 || &bytes[..6] != MAGIC {
        return Err(NpyError::malformed("not a .npy file (bad magic)"));
    }
    let major = bytes[6];
    let (header_len, start) = match major {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 => {
            if bytes.len() < 12 {
                return Err(NpyError::malformed("truncated .npy header"));
            }
            (u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize, 12)
        }
        v => return Err(NpyError::unsupported(format!(".npy format version {v} is not supported"))),
    };
    let header = bytes.get(start..start + header_len).ok_or_else(|| NpyError::malformed("truncated .npy header"))?;
    let header = std::str::from_utf8(header).map_err(|_| NpyError::malformed("the .npy header is not text"))?;
    let field = |key: &str| -> Result<&str, NpyError> {
        let i = header.find(&format!("'{key}'")).ok_or_else(|| NpyError::malformed(format!("the .npy header has no '{key}'")))?;
        Ok(header[i + key.len() + 2..].trim_start().trim_start_matches(':').trim_start())
    };
    let descr = field("descr")?;
    let descr = descr.trim_start_matches('\'').split('\'').next().unwrap_or("");
    if field("fortran_order")?.starts_with("True") {
        return Err(NpyError::unsupported("Fortran-order arrays are not supported; save with np.ascontiguousarray"));
    }
    let shape_text = field("shape")?;
    let shape_text = shape_text.trim_start_matches('(').split(')').next().unwrap_or("");
    let shape: Vec<usize> = shape_text
        .split(',')
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<usize>().map_err(|_| NpyError::malformed(format!("bad dimension '{s}' in .npy shape"))))
        .collect::<Result<_, _>>()?;
    let data = &bytes[start + header_len..];
    // A shape's element count and byte size are checked before anything is allocated: a header
    // may claim any shape, and its product may overflow.
    let n = shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).ok_or_else(|| {
        NpyError::malformed(format!("the .npy shape {shape:?} has more elements than this machine can address"))
    })?;
    let need = |size: usize| match n.checked_mul(size) {
        Some(len_bytes) if len_bytes <= data.len() => Ok(()),
        Some(len_bytes) => {
            Err(NpyError::malformed(format!("the .npy data holds {} bytes, shape {shape:?} needs {len_bytes}", data.len())))
        }
        None => Err(NpyError::malformed(format!("the .npy shape {shape:?} needs more bytes than this machine can address"))),
    };
    match descr {
        "<f4" | "|f4" => {
            need(4)?;
            Tensor::from_bytes(DType::F32, shape, &data[..n * 4]).map_err(NpyError::malformed)
        }
        "<f2" | "|f2" => {
            need(2)?;
            Tensor::from_bytes(DType::F16, shape, &data[..n * 2]).map_err(NpyError::malformed)
        }
        "<f8" => {
            need(8)?;
            Ok(Tensor::f32(
                shape,
                data[..n * 8].chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap()) as f32).collect(),
            ))
        }
        "<i8" => {
            need(8)?;
            Tensor::from_bytes(DType::I64, shape, &data[..n * 8]).map_err(NpyError::malformed)
        }
        "<i4" => {
            need(4)?;
            Ok(Tensor::i64(
                shape,
                data[..n * 4].chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap()) as i64).collect(),
            ))
        }
        other => Err(NpyError::unsupported(format!(
            ".npy element type '{other}' is not supported (use float32, float16, int64 or int32, little-endian)"
        ))),
    }
}

/// Serializes a tensor as .npy (format 1.0).
pub fn to_bytes(t: &Tensor) -> Vec<u8> {
    let descr = match t.dtype() {
        DType::F32 => "<f4",
        DType::F16 => "<f2",
        DType::I64 => "<i8",
    };
    let shape = match t.shape.len() {
        0 => "()".to_string(),
        1 => format!("({},)", t.shape[0]),
        _ => format!("({})", t.shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")),
    };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    // Pad so the data starts on a 64-byte boundary, ending the header with a newline.
    let total = 10 + header.len() + 1;
    header.push_str(&" ".repeat(total.next_multiple_of(64) - total));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + t.size_bytes());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[1, 0]);
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&t.to_bytes());
    out
}

pub fn read(path: &Path) -> Result<Tensor, NpyError> {
    let bytes = std::fs::read(path).map_err(|source| NpyError::Io { action: "read", path: path.to_path_buf(), source })?;
    from_bytes(&bytes).map_err(|e| e.in_file(path))
}

pub fn write(path: &Path, t: &Tensor) -> Result<(), NpyError> {
    std::fs::write(path, to_bytes(t)).map_err(|source| NpyError::Io { action: "write", path: path.to_path_buf(), source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_every_dtype_and_rank() {
        for t in [
            Tensor::f32(vec![2, 3], vec![1.0, -2.0, 3.5, 0.0, 1e-3, 7.0]),
            Tensor::i64(vec![4], vec![1, -2, 3, 1 << 40]),
            Tensor::f16(vec![1, 1, 2], vec![half::f16::from_f32(0.5), half::f16::from_f32(-1.25)]),
            Tensor::f32(vec![], vec![42.0]),
        ] {
            let b = to_bytes(&t);
            assert_eq!((10 + u16::from_le_bytes([b[8], b[9]]) as usize) % 64, 0, "data aligned to 64 bytes");
            assert_eq!(from_bytes(&b).unwrap(), t);
        }
    }

    #[test]
    fn rejects_bad_files() {
        assert!(from_bytes(b"hello").is_err());
        let mut b = to_bytes(&Tensor::f32(vec![4], vec![1.0; 4]));
        b.truncate(b.len() - 3);
        assert!(from_bytes(&b).unwrap_err().to_string().contains("needs"));
        let fortran = to_bytes(&Tensor::f32(vec![2], vec![1.0; 2]));
        let text = String::from_utf8_lossy(&fortran).replace("False", "True ");
        assert!(from_bytes(text.as_bytes()).is_err());
    }

    /// Regression (fuzzing, issue 25): a header claiming a shape whose element count or byte size
    /// overflows usize panicked ("attempt to multiply with overflow") instead of failing.
    #[test]
    fn errors_say_what_and_which_file() {
        let dir = std::env::temp_dir().join(format!("kairos-npy-errors-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = dir.join("missing.npy");
        let e = read(&missing).unwrap_err();
        assert!(matches!(e, NpyError::Io { action: "read", .. }) && e.to_string().contains("missing.npy"), "{e}");
        let bad = dir.join("bad.npy");
        std::fs::write(&bad, b"hello world").unwrap();
        let e = read(&bad).unwrap_err();
        assert!(matches!(e, NpyError::Malformed { path: Some(_), .. }), "{e}");
        assert!(e.to_string().starts_with(&format!("{}: not a .npy file", bad.display())), "{e}");
        let mut f64_fortran = MAGIC.to_vec();
        let header = "{'descr': '<f4', 'fortran_order': True, 'shape': (2,), }\n";
        f64_fortran.extend_from_slice(&[1, 0]);
        f64_fortran.extend_from_slice(&(header.len() as u16).to_le_bytes());
        f64_fortran.extend_from_slice(header.as_bytes());
        assert!(matches!(from_bytes(&f64_fortran), Err(NpyError::Unsupported { path: None, .. })));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn huge_claimed_shapes_are_errors() {
        for (shape, want) in [
            ("(4294967296, 4294967296, 2)", "more elements"),
            ("(4611686018427387904,)", "more bytes"),
            ("(1000000000000,)", "needs 4000000000000"),
        ] {
            let header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}\n");
            let mut b = MAGIC.to_vec();
            b.extend_from_slice(&[1, 0]);
            b.extend_from_slice(&(header.len() as u16).to_le_bytes());
            b.extend_from_slice(header.as_bytes());
            b.extend_from_slice(&[0u8; 8]);
            let e = from_bytes(&b).unwrap_err();
            assert!(matches!(e, NpyError::Malformed { .. }) && e.to_string().contains(want), "{shape}: {e}");
        }
    }
}
