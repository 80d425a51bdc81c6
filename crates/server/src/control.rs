//! Who may use the model-control API (REST `/v2/repository/...`, gRPC `RepositoryIndex`,
//! `RepositoryModelLoad`, `RepositoryModelUnload`): everyone (`on`, the default), no one (`off`),
//! or clients that present a key in the `x-kairos-control-key` header (REST) or metadata entry
//! (gRPC). Keys are compared in constant time; a refusal is 403 / PERMISSION_DENIED.

use std::str::FromStr;

/// The REST header and gRPC metadata key that carries the control key.
pub const CONTROL_KEY_HEADER: &str = kairos_client::CONTROL_KEY_HEADER;
/// The shortest key accepted: a short key is guessable.
pub const CONTROL_KEY_BYTES_MIN: usize = 16;
/// The longest key accepted (it travels in a header).
pub const CONTROL_KEY_BYTES_MAX: usize = 256;

/// The model-control API's access mode.
#[derive(Clone, PartialEq, Eq, Default)]
pub enum ControlAccess {
    /// Everyone may index, load and unload (today's behaviour).
    #[default]
    On,
    /// No one may: every control call is refused.
    Off,
    /// Only requests carrying this key.
    Key(String),
}

impl std::fmt::Debug for ControlAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the key itself (configurations end up in logs).
        match self {
            ControlAccess::On => f.write_str("On"),
            ControlAccess::Off => f.write_str("Off"),
            ControlAccess::Key(k) => write!(f, "Key(<{} bytes>)", k.len()),
        }
    }
}

impl FromStr for ControlAccess {
    type Err = String;

    /// `on`, `off`, or a key: printable ASCII without spaces, `CONTROL_KEY_BYTES_MIN..=CONTROL_KEY_BYTES_MAX` bytes.
    fn from_str(s: &str) -> Result<ControlAccess, String> {
        match s {
            "on" => return Ok(ControlAccess::On),
            "off" => return Ok(ControlAccess::Off),
            _ => {}
        }
        if !(CONTROL_KEY_BYTES_MIN..=CONTROL_KEY_BYTES_MAX).contains(&s.len()) {
            return Err(format!(
                "the control API setting must be 'on', 'off' or a key of {CONTROL_KEY_BYTES_MIN} to {CONTROL_KEY_BYTES_MAX} \
                 characters (got {} characters)",
                s.len()
            ));
        }
        if !s.bytes().all(|b| b.is_ascii_graphic()) {
            return Err("a control key must be printable ASCII without spaces (it travels in a header)".into());
        }
        Ok(ControlAccess::Key(s.to_string()))
    }
}

impl ControlAccess {
    /// Whether a request presenting `key` (the header's bytes, if it has one) may use the control
    /// API; the error says why not.
    pub fn check(&self, key: Option<&[u8]>) -> Result<(), String> {
        match self {
            ControlAccess::On => Ok(()),
            ControlAccess::Off => Err("the model-control API is disabled on this server (--control-api off)".into()),
            ControlAccess::Key(want) => match key {
                None => Err(format!("the model-control API needs a key: send it in the {CONTROL_KEY_HEADER} header")),
                Some(got) if constant_time_eq(got, want.as_bytes()) => Ok(()),
                Some(_) => Err(format!("the {CONTROL_KEY_HEADER} header does not hold this server's control key")),
            },
        }
    }
}

/// Compares `got` with `want` in time that depends only on `want`'s length (not on where they
/// first differ, nor on `got`'s length).
pub fn constant_time_eq(got: &[u8], want: &[u8]) -> bool {
    let mut diff = (got.len() != want.len()) as u8;
    for (i, &w) in want.iter().enumerate() {
        let g = got.get(i).copied().unwrap_or(!w);
        diff |= std::hint::black_box(g ^ w);
    }
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_modes_and_keys() {
        assert_eq!("on".parse::<ControlAccess>().unwrap(), ControlAccess::On);
        assert_eq!("off".parse::<ControlAccess>().unwrap(), ControlAccess::Off);
        let k = "0123456789abcdef";
        assert_eq!(k.parse::<ControlAccess>().unwrap(), ControlAccess::Key(k.into()));
        assert!("short".parse::<ControlAccess>().unwrap_err().contains("'on', 'off' or a key"));
        assert!("0123456789 abcdef".parse::<ControlAccess>().unwrap_err().contains("printable"));
        assert!("x".repeat(CONTROL_KEY_BYTES_MAX + 1).parse::<ControlAccess>().is_err());
        assert!(!format!("{:?}", ControlAccess::Key(k.into())).contains(k), "the key is never printed");
    }

    #[test]
    fn checks_keys() {
        let key = "0123456789abcdef";
        let c = ControlAccess::Key(key.into());
        assert!(c.check(Some(key.as_bytes())).is_ok());
        assert!(c.check(None).unwrap_err().contains(CONTROL_KEY_HEADER));
        for bad in ["", "0123456789abcdeF", "0123456789abcde", "0123456789abcdef0", "\u{0}"] {
            assert!(c.check(Some(bad.as_bytes())).is_err(), "{bad:?}");
        }
        assert!(ControlAccess::Off.check(Some(key.as_bytes())).unwrap_err().contains("disabled"));
        assert!(ControlAccess::On.check(None).is_ok());
    }

    #[test]
    fn constant_time_eq_is_equality() {
        let cases: [(&[u8], &[u8]); 6] =
            [(b"", b""), (b"a", b""), (b"", b"a"), (b"abc", b"abc"), (b"abd", b"abc"), (b"ab\xff", b"ab")];
        for (a, b) in cases {
            assert_eq!(constant_time_eq(a, b), a == b, "{a:?} {b:?}");
        }
    }
}
