//! Durations as written in capo's API: Go-style strings such as `40m`, `1h30m`, `500ms`.
//!
//! The CRD schema restricts them to a pattern the API server's CEL `duration()`
//! understands too, so the same string is validated at `kubectl apply` time and here.

use std::fmt;
use std::str::FromStr;

/// The schema pattern of a duration string: one or more `<integer><unit>` groups.
pub const PATTERN: &str = r"^([0-9]+(ms|s|m|h))+$";

/// A non-negative span of time parsed from a Go-style duration string.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Duration(std::time::Duration);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("duration is empty")]
    Empty,
    #[error("duration {input:?} is not of the form 40m, 1h30m or 500ms: {reason}")]
    Malformed { input: String, reason: &'static str },
    #[error("duration {input:?} is too large")]
    Overflow { input: String },
}

impl Duration {
    pub const fn from_std(d: std::time::Duration) -> Self {
        Self(d)
    }
    pub const fn as_std(self) -> std::time::Duration {
        self.0
    }
}

impl FromStr for Duration {
    type Err = DurationError;

    fn from_str(input: &str) -> Result<Self, Self::Err> {
        if input.is_empty() {
            return Err(DurationError::Empty);
        }
        let malformed = |reason| DurationError::Malformed { input: input.to_string(), reason };
        let overflow = || DurationError::Overflow { input: input.to_string() };
        let mut total: u128 = 0;
        let mut rest = input;
        while !rest.is_empty() {
            let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
            if digits == 0 {
                return Err(malformed("expected a number"));
            }
            let value: u128 = rest[..digits].parse().map_err(|_| overflow())?;
            rest = &rest[digits..];
            let unit_len = rest.bytes().take_while(u8::is_ascii_alphabetic).count();
            let millis_per_unit: u128 = match &rest[..unit_len] {
                "ms" => 1,
                "s" => 1_000,
                "m" => 60_000,
                "h" => 3_600_000,
                "" => return Err(malformed("a number needs a unit (ms, s, m or h)")),
                _ => return Err(malformed("unknown unit; use ms, s, m or h")),
            };
            rest = &rest[unit_len..];
            total = value.checked_mul(millis_per_unit).and_then(|v| v.checked_add(total)).ok_or_else(overflow)?;
        }
        let millis = u64::try_from(total).map_err(|_| overflow())?;
        Ok(Self(std::time::Duration::from_millis(millis)))
    }
}

impl fmt::Display for Duration {
    /// Formats in the same syntax it parses, largest units first (`1h30m`, `500ms`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut ms = self.0.as_millis();
        if ms == 0 {
            return f.write_str("0s");
        }
        for (unit, size) in [("h", 3_600_000u128), ("m", 60_000), ("s", 1_000), ("ms", 1)] {
            if ms >= size {
                write!(f, "{}{unit}", ms / size)?;
                ms %= size;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: &str) -> u64 {
        s.parse::<Duration>().unwrap().as_std().as_secs()
    }

    #[test]
    fn parses_go_style_durations() {
        assert_eq!(secs("40m"), 2400);
        assert_eq!(secs("1h30m"), 5400);
        assert_eq!(secs("5s"), 5);
        assert_eq!("250ms".parse::<Duration>().unwrap().as_std().as_millis(), 250);
        assert_eq!(secs("1h1h"), 7200);
    }

    #[test]
    fn rejects_malformed_durations_with_a_reason() {
        for bad in ["", "40", "m", "4 0m", "1d", "-5s", "1.5h", "40m ", "99999999999999999999999h"] {
            let err = bad.parse::<Duration>().unwrap_err();
            // The message names the input (or says it is empty), so a user sees what to fix.
            let message = err.to_string();
            assert!(
                message.contains(&format!("{bad:?}")) || (bad.is_empty() && message == "duration is empty"),
                "{message}"
            );
        }
        assert!(matches!("1d".parse::<Duration>(), Err(DurationError::Malformed { .. })));
    }

    #[test]
    fn display_round_trips() {
        for s in ["40m", "1h30m", "500ms", "1h0m1s", "2h"] {
            let d: Duration = s.parse().unwrap();
            assert_eq!(d.to_string().parse::<Duration>().unwrap(), d);
        }
        assert_eq!("90m".parse::<Duration>().unwrap().to_string(), "1h30m");
    }

    #[test]
    fn pattern_agrees_with_parser_on_examples() {
        // The schema pattern is what the API server enforces; keep the two in step.
        let accept = ["40m", "1h30m", "500ms", "5s"];
        let reject = ["40", "1d", "1.5h", ""];
        for s in accept {
            assert!(s.parse::<Duration>().is_ok());
        }
        for s in reject {
            assert!(s.parse::<Duration>().is_err());
        }
    }
}
