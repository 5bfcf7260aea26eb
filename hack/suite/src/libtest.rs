//! What a test binary's output says: how many tests passed, failed and were ignored, and
//! which failed.

#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counts {
    pub passed: u32,
    pub failed: u32,
    pub ignored: u32,
    /// Names of the tests that failed.
    pub failures: Vec<String>,
}

/// Sums every `test result:` line of `output` (a binary prints one; a doc-test run one per
/// crate) and collects the `test <name> ... FAILED` lines.
pub fn counts(output: &str) -> Counts {
    let mut c = Counts::default();
    for line in output.lines() {
        let line = line.trim_end();
        if let Some(rest) = line.strip_prefix("test result: ") {
            for part in rest.split(';') {
                let mut words = part.split_whitespace().rev();
                let (Some(label), Some(n)) = (words.next(), words.next()) else { continue };
                let Ok(n) = n.parse::<u32>() else { continue };
                match label {
                    "passed" => c.passed += n,
                    "failed" => c.failed += n,
                    "ignored" => c.ignored += n,
                    _ => {}
                }
            }
        } else if let Some(name) = line.strip_prefix("test ").and_then(|l| l.strip_suffix(" ... FAILED")) {
            c.failures.push(name.to_string());
        }
    }
    c
}

/// The part of a failed binary's output worth printing: from libtest's `failures:` list
/// on (each failure's own output), or else the last `tail` lines.
pub fn failure_excerpt(output: &str, tail: usize) -> String {
    let lines: Vec<&str> = output.lines().collect();
    let from = lines.iter().position(|l| *l == "failures:").unwrap_or(lines.len().saturating_sub(tail));
    let excerpt = &lines[from..];
    let excerpt = if excerpt.len() > 4 * tail { &excerpt[excerpt.len() - 4 * tail..] } else { excerpt };
    excerpt.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_binarys_result_lines_are_summed_and_its_failures_named() {
        let out = "running 3 tests\ntest a ... ok\ntest b::c ... FAILED\ntest d ... ignored\n\nfailures:\n\n---- b::c stdout ----\npanic\n\ntest result: FAILED. 1 passed; 1 failed; 1 ignored; 0 measured; 0 filtered out; finished in 1.00s\n\ntest result: ok. 4 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s\n";
        let c = counts(out);
        assert_eq!((c.passed, c.failed, c.ignored), (5, 1, 1));
        assert_eq!(c.failures, ["b::c"]);
        assert!(failure_excerpt(out, 10).starts_with("failures:"));
    }

    #[test]
    fn output_without_a_failures_list_gives_its_tail() {
        let out: String = (0..100).map(|i| format!("line {i}\n")).collect();
        assert_eq!(failure_excerpt(&out, 3), "line 97\nline 98\nline 99");
    }
}
