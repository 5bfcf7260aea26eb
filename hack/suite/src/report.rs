//! Where the time went: the table `make test` ends with (also written, with the run's
//! facts, to `target/suite/report.json` and `report.md`), and the section of
//! docs/testing.md and the line of the README that are written from a report.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::plan::Kind;
use crate::run::{Outcome, State};

#[derive(Serialize, Deserialize)]
pub struct Report {
    /// UTC, `YYYY-MM-DD HH:MM`.
    pub date: String,
    pub commit: String,
    /// Uncommitted changes when it ran.
    pub dirty: bool,
    pub cores: usize,
    pub mem_total_gib: f64,
    pub jobs: u32,
    /// `cold`: every build built; `warm`: every build cached; `mixed`.
    pub caches: String,
    /// The run's own command line.
    pub command: String,
    pub total_s: f64,
    pub machine_busy: Option<f64>,
    pub least_mem_available_gib: Option<f64>,
    pub steps: Vec<Row>,
}

#[derive(Serialize, Deserialize, Clone)]
pub struct Row {
    pub id: String,
    pub kind: String,
    pub version: Option<String>,
    pub result: String,
    pub started_s: f64,
    pub wall_s: f64,
    pub cpu_s: f64,
    pub machine_busy: Option<f64>,
    pub max_rss_mib: f64,
    pub cached: Option<bool>,
    pub passed: Option<u32>,
    pub failed: Option<u32>,
    pub ignored: Option<u32>,
}

pub fn rows(outcomes: &[Outcome]) -> Vec<Row> {
    let mut rows: Vec<Row> = outcomes
        .iter()
        .map(|o| Row {
            id: o.id.clone(),
            kind: match o.kind {
                Kind::Build => "build",
                Kind::Lint => "lint",
                Kind::Test => "test",
                Kind::Try => "try",
            }
            .into(),
            version: o.version.map(str::to_string),
            result: match &o.state {
                State::Passed => "ok".into(),
                State::Failed { code } => format!("FAILED ({code})"),
                State::TimedOut { after_s } => format!("TIMED OUT ({after_s}s)"),
                State::Skipped { why } => format!("skipped: {why}"),
                State::Interrupted => "interrupted".into(),
            },
            started_s: o.started_s,
            wall_s: o.wall_s,
            cpu_s: o.cpu_s,
            machine_busy: o.machine_busy,
            max_rss_mib: o.max_rss_mib,
            cached: o.cached,
            passed: o.tests.as_ref().map(|t| t.passed),
            failed: o.tests.as_ref().map(|t| t.failed),
            ignored: o.tests.as_ref().map(|t| t.ignored),
        })
        .collect();
    rows.sort_by(|a, b| a.started_s.total_cmp(&b.started_s));
    rows
}

/// `cold`, `warm` or `mixed`, from the builds of what the project pins (the Go builds
/// and `make tools`): cargo's build compiles capo after any change, and capo's image is
/// packed from each new binary, so neither says how warm the caches were.
pub fn caches(rows: &[Row]) -> String {
    let builds: Vec<bool> = rows
        .iter()
        .filter(|r| r.kind == "build" && r.id != "build cargo-tests" && r.id != "build image")
        .filter_map(|r| r.cached)
        .collect();
    if builds.is_empty() || builds.iter().all(|c| *c) {
        "warm".into()
    } else if builds.iter().all(|c| !*c) {
        "cold".into()
    } else {
        "mixed".into()
    }
}

pub fn mmss(s: f64) -> String {
    let s = s.round() as u64;
    if s >= 60 { format!("{}m{:02}s", s / 60, s % 60) } else { format!("{s}s") }
}

fn pct(x: Option<f64>) -> String {
    x.map(|x| format!("{:.0} %", x * 100.0)).unwrap_or_else(|| "–".into())
}

/// Tests that passed, per version ("1.35", "1.30", "unit").
pub fn passed_by_version(rows: &[Row]) -> Vec<(String, u32)> {
    let mut out: Vec<(String, u32)> = Vec::new();
    for r in rows.iter().filter(|r| r.kind == "test") {
        let key = r.version.clone().unwrap_or_else(|| "unit".into());
        let n = r.passed.unwrap_or(0);
        match out.iter_mut().find(|(k, _)| *k == key) {
            Some((_, sum)) => *sum += n,
            None => out.push((key, n)),
        }
    }
    out
}

/// The summary: total, the machine, tests per version, the five slowest steps.
pub fn summary(r: &Report) -> String {
    let mut s = String::new();
    let passed = passed_by_version(&r.steps);
    let all: u32 = passed.iter().map(|(_, n)| n).sum();
    let per: Vec<String> = passed.iter().map(|(v, n)| format!("{n} on {v}")).collect();
    let failed: Vec<&Row> = r.steps.iter().filter(|s| s.result != "ok").collect();
    let _ = writeln!(
        s,
        "total {} ({} caches; {} cores, {:.0} GiB, --jobs {}); machine busy {} of it; least memory available {}",
        mmss(r.total_s),
        r.caches,
        r.cores,
        r.mem_total_gib,
        r.jobs,
        pct(r.machine_busy),
        r.least_mem_available_gib.map(|g| format!("{g:.1} GiB")).unwrap_or_else(|| "–".into()),
    );
    let _ = writeln!(s, "tests passed: {all} ({})", per.join(", "));
    let test_wall: f64 = r.steps.iter().filter(|s| s.kind == "test" || s.kind == "try").map(|s| s.wall_s).sum();
    let build_wall: f64 = r.steps.iter().filter(|s| s.kind == "build" || s.kind == "lint").map(|s| s.wall_s).sum();
    let _ = writeln!(
        s,
        "one after another the steps would take {} (builds and lint {}, tests and try paths {})",
        mmss(test_wall + build_wall),
        mmss(build_wall),
        mmss(test_wall)
    );
    let mut slow: Vec<&Row> = r.steps.iter().collect();
    slow.sort_by(|a, b| b.wall_s.total_cmp(&a.wall_s));
    let five: Vec<String> = slow.iter().take(5).map(|r| format!("{} {}", r.id, mmss(r.wall_s))).collect();
    let _ = writeln!(s, "five slowest steps: {}", five.join(", "));
    if !failed.is_empty() {
        let names: Vec<String> = failed.iter().map(|r| format!("{} ({})", r.id, r.result)).collect();
        let _ = writeln!(s, "NOT OK: {}", names.join(", "));
    }
    s
}

/// The table, in Markdown: one row per step, in the order they started.
pub fn table(r: &Report) -> String {
    let mut s = String::from(
        "| step | start | wall | CPU | CPU / wall | machine busy | result |\n| --- | ---: | ---: | ---: | ---: | ---: | --- |\n",
    );
    for row in &r.steps {
        let result = match (row.kind.as_str(), row.cached, row.passed) {
            ("build", Some(true), _) => format!("{} (cached)", row.result),
            ("build", Some(false), _) => format!("{} (built)", row.result),
            (_, _, Some(p)) if row.result == "ok" => format!("{p} passed"),
            _ => row.result.clone(),
        };
        let ratio = if row.wall_s > 0.0 { format!("{:.0} %", 100.0 * row.cpu_s / row.wall_s) } else { "–".into() };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {ratio} | {} | {result} |",
            row.id,
            mmss(row.started_s),
            mmss(row.wall_s),
            mmss(row.cpu_s),
            pct(row.machine_busy)
        );
    }
    s
}

pub const DOCS_BEGIN: &str = "<!-- suite-report:begin (written by `make test-report`; do not edit) -->";
pub const DOCS_END: &str = "<!-- suite-report:end -->";
pub const README_BEGIN: &str = "<!-- suite-total:begin -->";
pub const README_END: &str = "<!-- suite-total:end -->";

/// docs/testing.md's timing section for a cold and a warm report.
pub fn docs_section(cold: &Report, warm: &Report) -> String {
    let mut s = String::new();
    for (what, r) in [("Cold", cold), ("Warm", warm)] {
        let _ = writeln!(
            s,
            "### {what}: `{}`, {} UTC, commit {}{}\n",
            r.command,
            r.date,
            r.commit,
            if r.dirty { " with uncommitted changes" } else { "" }
        );
        for line in summary(r).lines() {
            let _ = writeln!(s, "- {line}");
        }
        s.push('\n');
        s.push_str(&table(r));
        s.push('\n');
    }
    s
}

/// The README's sentence on what the suite costs.
pub fn readme_line(cold: &Report, warm: &Report) -> String {
    let passed: u32 = passed_by_version(&warm.steps).iter().map(|(_, n)| n).sum();
    format!(
        "On this project's 2-core machine (measured {} at {}) the whole suite, {passed} tests, took {} with every cache cold (`CI=true bash .ci/run` on a new machine) and {} warm (`make test`); [docs/testing.md](docs/testing.md#where-the-time-goes) has the table.",
        warm.date.split(' ').next().unwrap_or(&warm.date),
        warm.commit,
        mmss(cold.total_s),
        mmss(warm.total_s),
    )
}

/// `text` with what lies between `begin` and `end` replaced by `inner`.
pub fn replace_between(text: &str, begin: &str, end: &str, inner: &str) -> Option<String> {
    let b = text.find(begin)? + begin.len();
    let e = b + text[b..].find(end)?;
    Some(format!("{}\n{}{}", &text[..b], inner, &text[e..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: &str, kind: &str, version: Option<&str>, wall: f64, cached: Option<bool>, passed: Option<u32>) -> Row {
        Row {
            id: id.into(),
            kind: kind.into(),
            version: version.map(str::to_string),
            result: "ok".into(),
            started_s: 0.0,
            wall_s: wall,
            cpu_s: wall / 2.0,
            machine_busy: Some(0.5),
            max_rss_mib: 1.0,
            cached,
            passed,
            failed: passed.map(|_| 0),
            ignored: passed.map(|_| 0),
        }
    }

    #[test]
    fn tests_are_counted_per_version_and_the_caches_named() {
        let rows = vec![
            row("build a", "build", None, 10.0, Some(true), None),
            row("holds@1.35", "test", Some("1.35"), 20.0, None, Some(20)),
            row("holds@1.30", "test", Some("1.30"), 20.0, None, Some(19)),
            row("unit capo", "test", None, 5.0, None, Some(135)),
        ];
        assert_eq!(
            passed_by_version(&rows),
            [("1.35".to_string(), 20), ("1.30".to_string(), 19), ("unit".to_string(), 135)]
        );
        assert_eq!(caches(&rows), "warm");
        let mut cold = rows.clone();
        cold[0].cached = Some(false);
        assert_eq!(caches(&cold), "cold");
    }

    #[test]
    fn a_marked_section_is_replaced_and_the_rest_kept() {
        let text = "a\n<!-- b -->\nold\n<!-- e -->\nz\n";
        assert_eq!(
            replace_between(text, "<!-- b -->", "<!-- e -->", "new\n").unwrap(),
            "a\n<!-- b -->\nnew\n<!-- e -->\nz\n"
        );
        assert_eq!(replace_between("no markers", "<!-- b -->", "<!-- e -->", "x"), None);
    }

    #[test]
    fn durations_read_as_minutes_and_seconds() {
        assert_eq!(mmss(59.4), "59s");
        assert_eq!(mmss(61.0), "1m01s");
        assert_eq!(mmss(3600.0), "60m00s");
    }
}
