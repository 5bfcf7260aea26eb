//! capo-suite: runs capo's whole test suite the way `make test` does and says where the
//! time went. See docs/testing.md, "How `make test` runs".

mod cargo;
mod child;
mod libtest;
mod machine;
mod plan;
mod report;
mod run;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "capo-suite",
    about = "Runs capo's test suite: builds, lint, every test binary on each Kubernetes version, the try-install paths"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the suite (or the areas of --only) and print where the time went.
    Run(RunArgs),
    /// Print the steps the suite would run, what each needs, its weight and resource.
    Plan(RunArgs),
    /// Rewrite docs/testing.md's timing section and the README's line from two reports.
    Docs {
        /// A report of a run with every cache cold (`CI=true bash .ci/run` on a new machine).
        #[arg(long, env = "CAPO_SUITE_COLD_REPORT", default_value = "target/suite/report-cold.json")]
        cold: PathBuf,
        /// A report of a warm `make test`.
        #[arg(long, env = "CAPO_SUITE_WARM_REPORT", default_value = "target/suite/report-warm.json")]
        warm: PathBuf,
    },
}

#[derive(clap::Args, Clone)]
struct RunArgs {
    /// Run only these areas (a test binary such as `holds`, `holds@1.30`, a group:
    /// admission, calico, install, policies, release, sticky, real-node; unit, lint, try,
    /// try-helm, ...), and the builds they need. Comma-separated or repeated.
    #[arg(long, env = "CAPO_SUITE_ONLY", value_delimiter = ',')]
    only: Vec<String>,
    /// Kubernetes versions to run the test binaries on.
    #[arg(long = "k8s", env = "CAPO_SUITE_K8S", value_delimiter = ',', default_values_t = vec![plan::LATEST.to_string(), plan::COMPAT.to_string()])]
    versions: Vec<String>,
    /// Test slots: how many test binaries run at once (a binary takes its weight of them).
    #[arg(long, env = "CAPO_SUITE_JOBS", default_value_t = 6)]
    jobs: u32,
    /// Builds at once (each Go or cargo build already uses every core).
    #[arg(long, env = "CAPO_SUITE_BUILD_JOBS", default_value_t = 1)]
    build_jobs: u32,
    /// The CPU priority (nice) of builds and lint, so that tests get the CPU first.
    #[arg(long, env = "CAPO_SUITE_BUILD_NICE", default_value_t = 10)]
    build_nice: i32,
    /// Leave out `cargo fmt --check` and clippy.
    #[arg(long, env = "CAPO_SUITE_NO_LINT")]
    no_lint: bool,
    /// A test binary that runs longer is stopped and fails.
    #[arg(long, env = "CAPO_SUITE_TEST_TIMEOUT_SECS", default_value_t = 20 * 60)]
    test_timeout_secs: u64,
    /// Where the logs and the report go.
    #[arg(long, env = "CAPO_SUITE_DIR", default_value = "target/suite")]
    dir: PathBuf,
    /// Handed to every test binary (a libtest filter, --exact, --test-threads ...).
    #[arg(last = true)]
    test_args: Vec<String>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let root = plan::repo_root();
    let result = match cli.command {
        Cmd::Run(args) => run(&root, args, false),
        Cmd::Plan(args) => run(&root, args, true),
        Cmd::Docs { cold, warm } => docs(&root, &cold, &warm),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("capo-suite: {e}");
            ExitCode::from(2)
        }
    }
}

#[derive(Debug, thiserror::Error)]
enum Error {
    #[error(transparent)]
    Cargo(#[from] cargo::CargoError),
    #[error(transparent)]
    Plan(#[from] plan::PlanError),
    #[error("--k8s {0:?}: the suite runs on {latest} and {compat}", latest = plan::LATEST, compat = plan::COMPAT)]
    Version(String),
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
}

fn version(v: &str) -> Result<&'static str, Error> {
    [plan::LATEST, plan::COMPAT].into_iter().find(|k| *k == v).ok_or_else(|| Error::Version(v.into()))
}

fn run(root: &Path, args: RunArgs, dry: bool) -> Result<ExitCode, Error> {
    let targets = cargo::test_targets(root)?;
    let sel = plan::Selection {
        only: args.only.clone(),
        versions: args.versions.iter().map(|v| version(v)).collect::<Result<_, _>>()?,
        lint: !args.no_lint,
        test_timeout: Duration::from_secs(args.test_timeout_secs),
    };
    let steps = plan::plan(&targets, &sel)?;
    if dry {
        for s in &steps {
            let hold = s.hold.map(|h| format!(", holds {h}")).unwrap_or_default();
            println!("{:<28} weight {}{hold}; needs {}", s.id, s.weight, s.needs.join(", "));
        }
        return Ok(ExitCode::SUCCESS);
    }
    let dir = if args.dir.is_absolute() { args.dir.clone() } else { root.join(&args.dir) };
    let log_dir = dir.join("logs");
    let _ = std::fs::remove_dir_all(&log_dir);
    let opts = run::Options {
        root: root.to_path_buf(),
        log_dir: log_dir.clone(),
        jobs: args.jobs.max(1),
        build_jobs: args.build_jobs.max(1),
        test_args: args.test_args.clone(),
        build_nice: args.build_nice,
    };
    let machine = machine::Machine::start();
    println!(
        "[suite] {} steps, {} test slots, logs in {}",
        steps.len(),
        opts.jobs,
        log_dir.strip_prefix(root).unwrap_or(&log_dir).display()
    );
    let started = Instant::now();
    let outcomes = run::run(&steps, &opts, &machine);
    let total = started.elapsed();

    let rows = report::rows(&outcomes);
    let (commit, dirty) = git_commit(root);
    let report = report::Report {
        date: utc_now(),
        commit,
        dirty,
        cores: machine::cores(),
        mem_total_gib: machine::mem_total_kib() as f64 / 1024.0 / 1024.0,
        jobs: opts.jobs,
        caches: report::caches(&rows),
        command: std::env::var("CAPO_SUITE_COMMAND").unwrap_or_else(|_| "make test".into()),
        total_s: total.as_secs_f64(),
        machine_busy: machine.busy(started, Instant::now()),
        least_mem_available_gib: machine.least_available_kib().map(|k| k as f64 / 1024.0 / 1024.0),
        steps: rows,
    };
    println!("\n{}", report::table(&report));
    print!("{}", report::summary(&report));
    let json = serde_json::to_string_pretty(&report).expect("a report serializes");
    let _ = std::fs::write(dir.join("report.json"), &json);
    // A whole run (nothing left out) is kept by its caches, for `capo-suite docs`.
    if args.only.is_empty() && sel.versions.len() == 2 && report.caches != "mixed" {
        let _ = std::fs::write(dir.join(format!("report-{}.json", report.caches)), &json);
    }
    let _ = std::fs::write(dir.join("report.md"), format!("{}\n{}", report::summary(&report), report::table(&report)));
    let ok = outcomes.iter().all(|o| o.state == run::State::Passed);
    Ok(if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

fn git_commit(root: &Path) -> (String, bool) {
    let out = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(root)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let commit = out(&["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "unknown".into());
    let dirty = out(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    (commit, dirty)
}

fn utc_now() -> String {
    Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

fn read_report(path: &Path) -> Result<report::Report, Error> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::File { path: path.into(), message: e.to_string() })?;
    serde_json::from_str(&text).map_err(|e| Error::File { path: path.into(), message: e.to_string() })
}

fn docs(root: &Path, cold: &Path, warm: &Path) -> Result<ExitCode, Error> {
    let rewrite = |file: &str, begin: &str, end: &str, inner: &str| -> Result<(), Error> {
        let path = root.join(file);
        let text =
            std::fs::read_to_string(&path).map_err(|e| Error::File { path: path.clone(), message: e.to_string() })?;
        let new = report::replace_between(&text, begin, end, inner)
            .ok_or_else(|| Error::File { path: path.clone(), message: format!("no {begin} … {end} markers") })?;
        std::fs::write(&path, new).map_err(|e| Error::File { path, message: e.to_string() })
    };
    rewrite("docs/testing.md", PLAN_BEGIN, PLAN_END, &plan::latest_only_table())?;
    let (cold_path, warm_path) = (root.join(cold), root.join(warm));
    if !cold_path.exists() || !warm_path.exists() {
        println!(
            "wrote the plan's table into docs/testing.md; the timings need both reports ({} and {}): a whole `make test` keeps each as report-cold.json or report-warm.json",
            cold_path.display(),
            warm_path.display()
        );
        return Ok(ExitCode::SUCCESS);
    }
    let (cold, warm) = (read_report(&cold_path)?, read_report(&warm_path)?);
    rewrite("docs/testing.md", report::DOCS_BEGIN, report::DOCS_END, &report::docs_section(&cold, &warm))?;
    rewrite(
        "README.md",
        report::README_BEGIN,
        report::README_END,
        &format!("{}\n", report::readme_line(&cold, &warm)),
    )?;
    println!("wrote docs/testing.md and README.md from the {} and {} reports", cold.caches, warm.caches);
    Ok(ExitCode::SUCCESS)
}

const PLAN_BEGIN: &str = "<!-- suite-plan:begin (written by `make test-report` from hack/suite/src/plan.rs) -->";
const PLAN_END: &str = "<!-- suite-plan:end -->";

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/testing.md lists what runs on one version only as the plan has it.
    #[test]
    fn the_docs_list_of_what_runs_once_is_the_plans() {
        let root = plan::repo_root();
        let text = std::fs::read_to_string(root.join("docs/testing.md")).unwrap();
        let want = report::replace_between(&text, PLAN_BEGIN, PLAN_END, &plan::latest_only_table())
            .expect("docs/testing.md has the suite-plan markers");
        assert!(text == want, "docs/testing.md's list of what runs on one version is stale: run `make test-report`");
    }
}
