//! Trace replay of the Azure Functions invocation traces (the 2019 public dataset's
//! `invocations_per_function_md.anon.dNN.csv` format).
//!
//! One row per function: `HashOwner,HashApp,HashFunction,Trigger,1,2,...,1440`, the last columns
//! being invocation counts per minute of one day. kairos replays the busiest functions: each becomes
//! one source of [`Arrival::Windows`] feeding one stream (functions are dealt to the workload's
//! models round robin, busiest first), minutes are compressed to `window_ns` each, and all counts
//! are scaled by one factor so the whole replay offers the target rate. The shape over time (bursts,
//! idle minutes, the skew between functions) is the trace's; the level is the benchmark's.
//!
//! Rows may have fewer than 1440 minute columns (a trimmed sample); all rows must have the same.

use crate::workload::{Arrival, Source};

/// Functions kept from one trace at most.
pub const FUNCTIONS_MAX: usize = 4096;
/// Minute columns at most (one day).
pub const MINUTES_MAX: usize = 1440;
/// Rows read from one file at most.
pub const ROWS_MAX: usize = 2_000_000;

#[derive(Clone, Debug, PartialEq)]
pub struct AzureFunction {
    pub owner: String,
    pub app: String,
    pub function: String,
    pub trigger: String,
    /// Invocations per minute.
    pub counts: Vec<u32>,
}

impl AzureFunction {
    pub fn total(&self) -> u64 {
        self.counts.iter().map(|&c| c as u64).sum()
    }
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct AzureTrace {
    pub functions: Vec<AzureFunction>,
}

impl AzureTrace {
    pub fn load(path: &std::path::Path) -> Result<AzureTrace, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read trace {}: {e}", path.display()))?;
        AzureTrace::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Parses the CSV text (the `csv` crate: quoted fields, CRLF; a header line starting with
    /// `HashOwner` is skipped, blank lines too).
    pub fn parse(text: &str) -> Result<AzureTrace, String> {
        let mut functions = Vec::new();
        let mut minutes: Option<usize> = None;
        let mut reader = csv::ReaderBuilder::new().has_headers(false).flexible(true).from_reader(text.as_bytes());
        for (i, record) in reader.records().enumerate() {
            let record = record.map_err(|e| format!("CSV: {e}"))?;
            // The record's line in the file (0-based; blank lines count), for the messages. The
            // reader's position may sit on the blank lines it skipped before the record.
            let n = record.position().map_or(i, |p| {
                let bytes = text.as_bytes();
                let mut at = p.byte() as usize;
                while at < bytes.len() && (bytes[at] == b'\n' || bytes[at] == b'\r') {
                    at += 1;
                }
                bytes[..at].iter().filter(|&&c| c == b'\n').count()
            });
            if record.iter().all(|f| f.trim().is_empty()) || (n == 0 && record.get(0).is_some_and(|f| f == "HashOwner")) {
                continue;
            }
            if n >= ROWS_MAX {
                return Err(format!("more than {ROWS_MAX} rows"));
            }
            let fields: Vec<&str> = record.iter().collect();
            if fields.len() < 5 {
                return Err(format!(
                    "line {}: {} fields, need HashOwner,HashApp,HashFunction,Trigger and minutes",
                    n + 1,
                    fields.len()
                ));
            }
            let m = fields.len() - 4;
            if m > MINUTES_MAX {
                return Err(format!("line {}: {m} minute columns, at most {MINUTES_MAX}", n + 1));
            }
            match minutes {
                None => minutes = Some(m),
                Some(k) if k != m => return Err(format!("line {}: {m} minute columns, earlier rows have {k}", n + 1)),
                _ => {}
            }
            let counts = fields[4..]
                .iter()
                .enumerate()
                .map(|(i, f)| {
                    f.trim().parse::<u32>().map_err(|_| format!("line {}, minute {}: '{f}' is not a count", n + 1, i + 1))
                })
                .collect::<Result<Vec<u32>, String>>()?;
            functions.push(AzureFunction {
                owner: fields[0].into(),
                app: fields[1].into(),
                function: fields[2].into(),
                trigger: fields[3].into(),
                counts,
            });
        }
        if functions.is_empty() {
            return Err("no function rows".into());
        }
        Ok(AzureTrace { functions })
    }

    pub fn minutes(&self) -> usize {
        self.functions.first().map_or(0, |f| f.counts.len())
    }

    /// One source per function for the `functions` busiest functions (ties: file order), over the
    /// minutes `[first_minute, first_minute + minutes)`, each minute lasting `window_ns`, all scaled
    /// so the total mean rate is `rate_per_s`. `stream_of(k)` gives the stream of the k-th busiest.
    pub fn sources(
        &self,
        functions: usize,
        first_minute: usize,
        minutes: usize,
        window_ns: u64,
        rate_per_s: f64,
        stream_of: impl Fn(usize) -> u32,
    ) -> Result<Vec<Source>, String> {
        if functions == 0 || functions > FUNCTIONS_MAX {
            return Err(format!("functions = {functions} must be in 1..={FUNCTIONS_MAX}"));
        }
        let end = first_minute + minutes;
        if minutes == 0 || end > self.minutes() {
            return Err(format!("minutes {first_minute}..{end} are not inside the trace's {} minutes", self.minutes()));
        }
        if !(rate_per_s.is_finite() && rate_per_s > 0.0) || window_ns == 0 {
            return Err("the replay needs a positive rate and window".into());
        }
        let mut order: Vec<usize> = (0..self.functions.len()).collect();
        let busy = |i: usize| self.functions[i].counts[first_minute..end].iter().map(|&c| c as u64).sum::<u64>();
        order.sort_by_key(|&i| std::cmp::Reverse(busy(i)));
        order.truncate(functions);
        let total: u64 = order.iter().map(|&i| busy(i)).sum();
        if total == 0 {
            return Err(format!("the {functions} busiest functions have no invocations in minutes {first_minute}..{end}"));
        }
        let wanted = rate_per_s * minutes as f64 * window_ns as f64 * 1e-9;
        let scale = wanted / total as f64;
        Ok(order
            .iter()
            .enumerate()
            .map(|(k, &i)| {
                let counts = self.functions[i].counts[first_minute..end].iter().map(|&c| c as f64 * scale).collect();
                Source::one(Arrival::Windows { window_ns, counts }, stream_of(k))
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "HashOwner,HashApp,HashFunction,Trigger,1,2,3\n\
        o1,a1,f1,http,10,0,30\n\
        o1,a1,f2,timer,1,1,1\n\
        o2,a2,f3,queue,0,100,0\n";

    #[test]
    fn parses_and_scales() {
        let t = AzureTrace::parse(SAMPLE).unwrap();
        assert_eq!((t.functions.len(), t.minutes()), (3, 3));
        assert_eq!(t.functions[2].trigger, "queue");
        let src = t.sources(2, 0, 3, 1_000_000_000, 10.0, |k| k as u32).unwrap();
        assert_eq!(src.len(), 2);
        // Busiest first: f3 (100) then f1 (40); 30 arrivals wanted over 3 s from 140 counted.
        let Arrival::Windows { counts, .. } = &src[0].arrival else { panic!() };
        assert!((counts[1] - 100.0 * 30.0 / 140.0).abs() < 1e-9);
        let rate: f64 = src.iter().map(|s| s.arrival.rate_per_s().unwrap()).sum();
        assert!((rate - 10.0).abs() < 1e-9);
        assert_eq!(src[1].streams, vec![(1, 1.0)]);
    }

    #[test]
    fn quoted_fields_crlf_and_blank_lines() {
        let t = AzureTrace::parse("HashOwner,HashApp,HashFunction,Trigger,1,2\r\n\r\n\"o,1\",a,f,http,3,4\r\n").unwrap();
        assert_eq!((t.functions.len(), t.functions[0].owner.as_str()), (1, "o,1"));
        assert_eq!(t.functions[0].counts, vec![3, 4]);
        let e = AzureTrace::parse("o,a,f,http,1\n\no,a,g,http,x\n").unwrap_err();
        assert!(e.starts_with("line 3, minute 1:"), "{e}");
    }

    #[test]
    fn rejects_malformed_rows() {
        assert!(AzureTrace::parse("a,b,c\n").is_err());
        assert!(AzureTrace::parse("o,a,f,http,1,x\n").is_err());
        assert!(AzureTrace::parse("o,a,f,http,1,2\no,a,g,http,1\n").is_err());
        assert!(AzureTrace::parse("HashOwner,HashApp,HashFunction,Trigger,1\n").is_err());
        let t = AzureTrace::parse(SAMPLE).unwrap();
        assert!(t.sources(1, 2, 2, 1, 1.0, |_| 0).is_err());
        assert!(t.sources(1, 1, 1, 1, 1.0, |_| 0).is_ok());
    }
}
