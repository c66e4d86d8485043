//! The caller's deadline, as gRPC sends it (the `grpc-timeout` header), so
//! a server that holds a call (backpressure) can answer before the caller
//! gives up instead of doing work nobody will read.

use std::time::Duration;

use tonic::metadata::MetadataMap;

/// How long the caller said it would wait, if it said; a malformed header
/// reads as none (the server's own bound applies).
pub fn grpc_timeout(meta: &MetadataMap) -> Option<Duration> {
    parse(meta.get("grpc-timeout")?.to_str().ok()?)
}

/// `TimeoutValue TimeoutUnit`: at most 8 ASCII digits and one of
/// `H M S m u n` (the gRPC over HTTP/2 spec).
fn parse(s: &str) -> Option<Duration> {
    let unit = s.chars().last()?;
    let digits = &s[..s.len() - unit.len_utf8()];
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        'H' => Duration::from_secs(n * 3600),
        'M' => Duration::from_secs(n * 60),
        'S' => Duration::from_secs(n),
        'm' => Duration::from_millis(n),
        'u' => Duration::from_micros(n),
        'n' => Duration::from_nanos(n),
        _ => return None,
    })
}

/// How long to hold a call: `own` at most, and within `caller`'s deadline
/// less a tenth of it (at most a second), so the answer is on its way back
/// before the caller's deadline passes.
pub fn hold_within(own: Duration, caller: Option<Duration>) -> Duration {
    match caller {
        Some(c) => own.min(c.saturating_sub((c / 10).min(Duration::from_secs(1)))),
        None => own,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_unit_and_no_malformed_value() {
        assert_eq!(parse("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(parse("3M"), Some(Duration::from_secs(180)));
        assert_eq!(parse("10S"), Some(Duration::from_secs(10)));
        assert_eq!(parse("250m"), Some(Duration::from_millis(250)));
        assert_eq!(parse("7u"), Some(Duration::from_micros(7)));
        assert_eq!(parse("99999999n"), Some(Duration::from_nanos(99_999_999)));
        for bad in ["", "S", "123456789S", "10s", "-1S", "1.5S", "10", "é"] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_hold_ends_before_the_callers_deadline() {
        let own = Duration::from_secs(10);
        assert_eq!(hold_within(own, None), own);
        assert_eq!(
            hold_within(own, Some(Duration::from_secs(5))),
            Duration::from_millis(4500)
        );
        assert_eq!(
            hold_within(own, Some(Duration::from_secs(60))),
            own,
            "the server's own bound when the caller waits longer"
        );
        assert_eq!(
            hold_within(own, Some(Duration::from_secs(30))),
            own.min(Duration::from_secs(29))
        );
        assert_eq!(hold_within(own, Some(Duration::ZERO)), Duration::ZERO);
    }

    #[test]
    fn the_header_is_read_from_metadata() {
        let mut m = MetadataMap::new();
        assert_eq!(grpc_timeout(&m), None);
        m.insert("grpc-timeout", "1500m".parse().unwrap());
        assert_eq!(grpc_timeout(&m), Some(Duration::from_millis(1500)));
    }
}
