//! RFC 3339 timestamps (protobuf `Timestamp` JSON, `/init`'s `timestamp`)
//! without a date library: days-from-civil and back (H. Hinnant's algorithms).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `secs.nanos` since the epoch as `YYYY-MM-DDTHH:MM:SS[.fffffffff]Z`.
pub fn format_rfc3339(secs: i64, nanos: u32) -> String {
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (y, mo, d) = civil_from_days(days);
    let (h, mi, s) = (rem / 3600, (rem / 60) % 60, rem % 60);
    if nanos == 0 {
        format!("{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}Z")
    } else {
        format!("{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}.{nanos:09}Z")
    }
}

pub fn format_system_time(t: SystemTime) -> String {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => format_rfc3339(d.as_secs() as i64, d.subsec_nanos()),
        Err(e) => {
            let d = e.duration();
            let (mut s, mut n) = (-(d.as_secs() as i64), d.subsec_nanos());
            if n > 0 {
                s -= 1;
                n = 1_000_000_000 - n;
            }
            format_rfc3339(s, n)
        }
    }
}

/// Parses RFC 3339 (`2024-01-02T03:04:05.123Z`, `...+02:00`) into a
/// duration since the epoch. Times before 1970 are refused.
pub fn parse_rfc3339(s: &str) -> Option<Duration> {
    let b = s.as_bytes();
    let num = |r: std::ops::Range<usize>| -> Option<u32> {
        let part = s.get(r)?;
        if part.bytes().all(|c| c.is_ascii_digit()) {
            part.parse().ok()
        } else {
            None
        }
    };
    if b.len() < 20
        || b[4] != b'-'
        || b[7] != b'-'
        || !matches!(b[10], b'T' | b't' | b' ')
        || b[13] != b':'
        || b[16] != b':'
    {
        return None;
    }
    let (y, mo, d, h, mi, sec) = (
        num(0..4)?,
        num(5..7)?,
        num(8..10)?,
        num(11..13)?,
        num(14..16)?,
        num(17..19)?,
    );
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || sec > 60 {
        return None;
    }
    let mut i = 19;
    let mut nanos = 0u32;
    if b.get(i) == Some(&b'.') {
        i += 1;
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        let frac = &s[start..i];
        if frac.is_empty() {
            return None;
        }
        let digits: String = frac.chars().chain(std::iter::repeat('0')).take(9).collect();
        nanos = digits.parse().ok()?;
    }
    let offset: i64 = match b.get(i)? {
        b'Z' | b'z' if i + 1 == b.len() => 0,
        sign @ (b'+' | b'-') if i + 6 == b.len() && b[i + 3] == b':' => {
            let oh = i64::from(num(i + 1..i + 3)?);
            let om = i64::from(num(i + 4..i + 6)?);
            let o = oh * 3600 + om * 60;
            if *sign == b'+' {
                o
            } else {
                -o
            }
        }
        _ => return None,
    };
    let secs = days_from_civil(i64::from(y), mo, d) * 86_400
        + i64::from(h) * 3600
        + i64::from(mi) * 60
        + i64::from(sec)
        - offset;
    u64::try_from(secs).ok().map(|s| Duration::new(s, nanos))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_known_instants() {
        assert_eq!(format_rfc3339(0, 0), "1970-01-01T00:00:00Z");
        assert_eq!(
            format_rfc3339(951_782_400, 5),
            "2000-02-29T00:00:00.000000005Z"
        );
        assert_eq!(format_rfc3339(1_700_000_000, 0), "2023-11-14T22:13:20Z");
    }

    #[test]
    fn parses_and_round_trips() {
        let d = parse_rfc3339("2023-11-14T22:13:20.5Z").unwrap();
        assert_eq!(d, Duration::new(1_700_000_000, 500_000_000));
        assert_eq!(
            parse_rfc3339("2023-11-15T00:13:20+02:00")
                .unwrap()
                .as_secs(),
            1_700_000_000
        );
        for secs in [0i64, 86_399, 951_782_400, 4_102_444_800] {
            let s = format_rfc3339(secs, 0);
            assert_eq!(parse_rfc3339(&s).unwrap().as_secs() as i64, secs);
        }
        for bad in [
            "",
            "2023-13-01T00:00:00Z",
            "2023-11-14 22:13:20",
            "2023-11-14T22:13:20.Z",
            "1969-12-31T23:59:59Z",
            "2023-11-14T22:13:20Zjunk",
        ] {
            assert!(parse_rfc3339(bad).is_none(), "{bad}");
        }
    }
}
