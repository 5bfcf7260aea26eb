//! Runs a plan: builds in a lane of their own (at a lower CPU priority), test binaries and
//! try-install paths as soon as what they need is built, at most `jobs` slots of them at
//! once, one holder of each machine resource at a time; each in a process group of its
//! own with a deadline, its output in a log file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::child::{Child, Exit, Spawn};
use crate::libtest::{self, Counts};
use crate::machine::Machine;
use crate::plan::{Kind, Program, Step};

pub struct Options {
    pub root: PathBuf,
    pub log_dir: PathBuf,
    /// Test slots (each step takes its weight of them).
    pub jobs: u32,
    /// Builds at once.
    pub build_jobs: u32,
    /// Handed to every test binary after its own arguments.
    pub test_args: Vec<String>,
    /// The CPU priority builds run at (`nice`).
    pub build_nice: i32,
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case", tag = "state")]
pub enum State {
    Passed,
    Failed { code: i32 },
    TimedOut { after_s: u64 },
    Skipped { why: String },
    Interrupted,
}

/// What a step did.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Outcome {
    pub id: String,
    pub kind: Kind,
    pub version: Option<&'static str>,
    #[serde(flatten)]
    pub state: State,
    /// Seconds from the start of the run.
    pub started_s: f64,
    pub wall_s: f64,
    /// CPU seconds of the step's processes (and of every descendant they waited for).
    pub cpu_s: f64,
    /// How busy the machine's CPUs were while it ran (all steps together), 0–1.
    pub machine_busy: Option<f64>,
    pub max_rss_mib: f64,
    /// Builds: whether everything was already cached (nothing was built).
    pub cached: Option<bool>,
    pub tests: Option<Counts>,
    pub log: String,
}

/// Set by SIGINT/SIGTERM: stop everything and report.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

fn catch_signals() {
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
}

struct Running {
    index: usize,
    child: Child,
    ports: Option<usize>,
    deadline: Instant,
    stdout: PathBuf,
    log: PathBuf,
}

/// Port ranges handed to the test processes running at once (`CAPO_TESTENV_PORTS`), below
/// Linux's ephemeral range.
const PORT_BASE: u16 = 20_000;
const PORT_SPAN: u16 = 1_000;
const PORT_RANGES: usize = 12;

/// What the build steps handed on, and the test executables.
#[derive(Default)]
struct Built {
    provided: BTreeMap<String, (&'static str, String)>,
    executables: BTreeMap<(String, String, String), String>,
}

fn file_name(id: &str) -> String {
    id.chars().map(|c| if c.is_ascii_alphanumeric() || c == '.' || c == '-' { c } else { '_' }).collect()
}

/// Prints a progress line: minutes and seconds since the start, and what happened.
fn say(start: Instant, what: &str) {
    let t = start.elapsed().as_secs();
    println!("[suite {:>2}:{:02}] {what}", t / 60, t % 60);
}

pub fn run(steps: &[Step], opts: &Options, machine: &Machine) -> Vec<Outcome> {
    catch_signals();
    let _ = std::fs::create_dir_all(&opts.log_dir);
    let start = Instant::now();
    let mut outcomes: Vec<Option<Outcome>> = vec![None; steps.len()];
    let mut running: Vec<Running> = Vec::new();
    let mut built = Built::default();
    let mut ports_in_use = [false; PORT_RANGES];

    loop {
        // Reap what ended.
        let mut i = 0;
        while i < running.len() {
            let Some(exit) = running[i].child.try_reap() else {
                i += 1;
                continue;
            };
            let r = running.swap_remove(i);
            r.child.kill_leftovers();
            if let Some(p) = r.ports {
                ports_in_use[p] = false;
            }
            let step = &steps[r.index];
            let outcome = finish(step, &r, exit, start, machine, &mut built, opts);
            report_line(start, &outcome, &r.log);
            outcomes[r.index] = Some(outcome);
        }

        // Deadlines and interrupts.
        let interrupted = INTERRUPTED.load(Ordering::SeqCst);
        for r in running.iter_mut() {
            if interrupted || Instant::now() >= r.deadline {
                r.child.terminate(Duration::from_secs(10));
            }
        }

        // Skip what can no longer run.
        for (i, step) in steps.iter().enumerate() {
            if outcomes[i].is_some() || running.iter().any(|r| r.index == i) {
                continue;
            }
            let why = if interrupted {
                Some("interrupted".to_string())
            } else {
                step.needs.iter().find_map(|n| match steps.iter().position(|s| &s.id == n) {
                    None => Some(format!("{n} is not in this run")),
                    Some(j) => match &outcomes[j] {
                        Some(o) if o.state != State::Passed => Some(format!("{n} did not pass")),
                        _ => None,
                    },
                })
            };
            if let Some(why) = why {
                let o = skipped(step, why, start);
                say(start, &format!("skipped {}: {}", step.id, skip_reason(&o)));
                outcomes[i] = Some(o);
            }
        }

        if running.is_empty() && outcomes.iter().all(Option::is_some) {
            break;
        }

        // Start what is ready: builds in their lane, the rest by slots.
        if !interrupted {
            let ready = |i: usize| {
                outcomes[i].is_none()
                    && !running.iter().any(|r| r.index == i)
                    && steps[i].needs.iter().all(|n| {
                        steps
                            .iter()
                            .position(|s| &s.id == n)
                            .and_then(|j| outcomes[j].as_ref())
                            .is_some_and(|o| o.state == State::Passed)
                    })
            };
            let mut to_start = Vec::new();
            let mut builds = running.iter().filter(|r| is_build_lane(&steps[r.index])).count() as u32;
            let mut used: u32 =
                running.iter().filter(|r| !is_build_lane(&steps[r.index])).map(|r| weight(&steps[r.index], opts)).sum();
            let mut held: Vec<&str> = running.iter().filter_map(|r| steps[r.index].hold).collect();
            let mut reserved = 0u32;
            let mut head_reserved = false;
            let mut free_ranges = ports_in_use.iter().filter(|u| !**u).count();
            for (i, step) in steps.iter().enumerate() {
                if !ready(i) {
                    // A test that only waits for builds running now keeps its slots: the
                    // real node's binary, first in the plan, waiting for capo's image,
                    // is not to find every slot taken by the heavy binaries after it.
                    let soon = !is_build_lane(step)
                        && outcomes[i].is_none()
                        && !running.iter().any(|r| r.index == i)
                        && step.needs.iter().all(|n| {
                            let j = steps.iter().position(|s| &s.id == n);
                            j.is_some_and(|j| {
                                outcomes[j].as_ref().is_some_and(|o| o.state == State::Passed)
                                    || running.iter().any(|r| r.index == j)
                            })
                        });
                    if soon && !step.hold.is_some_and(|h| held.contains(&h)) {
                        reserved += weight(step, opts);
                    }
                    continue;
                }
                if is_build_lane(step) {
                    if builds < opts.build_jobs {
                        builds += 1;
                        to_start.push(i);
                    }
                    continue;
                }
                if step.hold.is_some_and(|h| held.contains(&h)) {
                    continue;
                }
                let w = weight(step, opts);
                if used + reserved + w <= opts.jobs && free_ranges > 0 {
                    used += w;
                    free_ranges -= 1;
                    held.extend(step.hold);
                    to_start.push(i);
                } else if !head_reserved {
                    // The first step that does not fit keeps its slots: later, smaller
                    // steps may only use what is left beside it.
                    reserved += w;
                    head_reserved = true;
                }
            }
            for i in to_start {
                let ports = if is_build_lane(&steps[i]) {
                    None
                } else {
                    let p = ports_in_use.iter().position(|u| !*u).expect("counted free above");
                    ports_in_use[p] = true;
                    Some(p)
                };
                match start_step(&steps[i], i, ports, opts, &built) {
                    Ok(r) => {
                        say(start, &format!("start {}", steps[i].id));
                        running.push(r);
                    }
                    Err(e) => {
                        if let Some(p) = ports {
                            ports_in_use[p] = false;
                        }
                        let mut o = skipped(&steps[i], String::new(), start);
                        o.state = State::Failed { code: -1 };
                        say(start, &format!("FAILED {}: {e}", steps[i].id));
                        outcomes[i] = Some(o);
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    outcomes.into_iter().map(|o| o.expect("every step has an outcome")).collect()
}

fn is_build_lane(step: &Step) -> bool {
    matches!(step.kind, Kind::Build | Kind::Lint)
}

fn weight(step: &Step, opts: &Options) -> u32 {
    step.weight.clamp(1, opts.jobs.max(1))
}

fn skip_reason(o: &Outcome) -> &str {
    match &o.state {
        State::Skipped { why } => why,
        _ => "",
    }
}

fn skipped(step: &Step, why: String, start: Instant) -> Outcome {
    Outcome {
        id: step.id.clone(),
        kind: step.kind,
        version: step.version,
        state: if why == "interrupted" { State::Interrupted } else { State::Skipped { why } },
        started_s: start.elapsed().as_secs_f64(),
        wall_s: 0.0,
        cpu_s: 0.0,
        machine_busy: None,
        max_rss_mib: 0.0,
        cached: None,
        tests: None,
        log: String::new(),
    }
}

#[derive(Debug, thiserror::Error)]
enum StartError {
    #[error("the cargo-tests build made no executable for {0}")]
    NoExecutable(String),
    #[error(transparent)]
    Spawn(#[from] crate::child::SpawnError),
}

fn start_step(
    step: &Step,
    index: usize,
    ports: Option<usize>,
    opts: &Options,
    built: &Built,
) -> Result<Running, StartError> {
    let (program, mut args) = match &step.program {
        Program::Command { program, args } => (program.clone(), args.clone()),
        Program::TestBinary { package, target, kind } => {
            let exe = built
                .executables
                .get(&(package.clone(), target.clone(), kind.clone()))
                .ok_or_else(|| StartError::NoExecutable(format!("{package} {kind} {target}")))?;
            (exe.clone(), Vec::new())
        }
    };
    if matches!(step.program, Program::TestBinary { .. }) {
        args.extend(opts.test_args.iter().cloned());
    }
    let mut env = step.env.clone();
    for need in &step.needs {
        if let Some((var, value)) = built.provided.get(need) {
            env.push((var.to_string(), value.clone()));
        }
    }
    if let Some(p) = ports {
        let first = PORT_BASE + p as u16 * PORT_SPAN;
        env.push(("CAPO_TESTENV_PORTS".into(), format!("{first}-{}", first + PORT_SPAN - 3)));
        env.push(("CAPO_TRY_PORT".into(), (first + PORT_SPAN - 2).to_string()));
        env.push(("CAPO_TRY_PROBE_PORT".into(), (first + PORT_SPAN - 1).to_string()));
    }
    let name = file_name(&step.id);
    let log = opts.log_dir.join(format!("{name}.log"));
    let stdout = opts.log_dir.join(format!("{name}.stdout"));
    let separate_stdout = step.kind == Kind::Build;
    let cwd = step.cwd.as_deref().map(Path::new).unwrap_or(&opts.root);
    let child = Child::spawn(Spawn {
        program: &program,
        args: &args,
        env: &env,
        cwd,
        stdout: if separate_stdout { &stdout } else { &log },
        stderr: separate_stdout.then_some(log.as_path()),
        nice: if is_build_lane(step) { opts.build_nice } else { 0 },
    })?;
    Ok(Running { index, child, ports, deadline: Instant::now() + step.timeout, stdout, log })
}

fn finish(
    step: &Step,
    r: &Running,
    exit: Exit,
    start: Instant,
    machine: &Machine,
    built: &mut Built,
    _opts: &Options,
) -> Outcome {
    let ended = Instant::now();
    let log_text = std::fs::read_to_string(&r.log).unwrap_or_default();
    let mut state = match (exit.success, r.child.terminating) {
        (true, _) => State::Passed,
        (false, Some(_)) if INTERRUPTED.load(Ordering::SeqCst) => State::Interrupted,
        (false, Some(_)) => State::TimedOut { after_s: step.timeout.as_secs() },
        (false, None) => State::Failed { code: exit.code },
    };
    let mut cached = None;
    if step.kind == Kind::Build {
        cached = Some(build_was_cached(&log_text));
        if state == State::Passed {
            if step.id == "build cargo-tests" {
                match crate::cargo::executables(&r.stdout) {
                    Ok(exes) if !exes.is_empty() => built.executables = exes,
                    _ => state = State::Failed { code: -2 },
                }
            } else if let Some(var) = step.provides {
                let out = std::fs::read_to_string(&r.stdout).unwrap_or_default();
                match out.lines().rev().map(str::trim).find(|l| !l.is_empty()) {
                    Some(path) if Path::new(path).exists() => {
                        built.provided.insert(step.id.clone(), (var, path.to_string()));
                    }
                    _ => state = State::Failed { code: -3 },
                }
            }
        }
    }
    let tests = matches!(step.kind, Kind::Test).then(|| libtest::counts(&log_text));
    if let Some(t) = &tests
        && state == State::Passed
        && t.failed > 0
    {
        state = State::Failed { code: 101 };
    }
    Outcome {
        id: step.id.clone(),
        kind: step.kind,
        version: step.version,
        state,
        started_s: r.child.started.duration_since(start).as_secs_f64(),
        wall_s: ended.duration_since(r.child.started).as_secs_f64(),
        cpu_s: exit.cpu.as_secs_f64(),
        machine_busy: machine.busy(r.child.started, ended),
        max_rss_mib: exit.max_rss_kib as f64 / 1024.0,
        cached,
        tests,
        log: r.log.display().to_string(),
    }
}

/// A build script that built something says so ("building …", cargo's "Compiling");
/// one whose every part was cached does not.
fn build_was_cached(log: &str) -> bool {
    !log.lines().any(|l| {
        let l = l.trim_start();
        l.starts_with("Compiling ")
            || l.contains("] building ")
            || l.contains("] fetching ")
            || l.contains("] installing ")
    })
}

fn report_line(start: Instant, o: &Outcome, log: &Path) {
    let cpu = format!("cpu {:.0}s", o.cpu_s);
    let tests = o.tests.as_ref().map(|t| format!(", {} passed", t.passed)).unwrap_or_default();
    match &o.state {
        State::Passed => say(start, &format!("ok {} ({:.0}s, {cpu}{tests})", o.id, o.wall_s)),
        state => {
            let what = match state {
                State::Failed { code } => format!("FAILED (exit {code})"),
                State::TimedOut { after_s } => format!("TIMED OUT after {after_s}s"),
                _ => "INTERRUPTED".into(),
            };
            say(start, &format!("{what} {} ({:.0}s); its log: {}", o.id, o.wall_s, log.display()));
            let text = std::fs::read_to_string(log).unwrap_or_default();
            let excerpt = libtest::failure_excerpt(&text, 60);
            for line in excerpt.lines() {
                println!("    | {line}");
            }
            if let Some(t) = &o.tests
                && !t.failures.is_empty()
            {
                println!("    failed: {}", t.failures.join(", "));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_build_that_built_nothing_is_cached() {
        assert!(build_was_cached("[build-controlplane] cached: /x/bin\n"));
        assert!(!build_was_cached("[build-controlplane] building etcd ...\n"));
        assert!(!build_was_cached("   Compiling capo v0.1.0 (/r)\n    Finished `test` profile\n"));
        assert!(build_was_cached("    Finished `test` profile [unoptimized] target(s) in 0.2s\n"));
    }

    #[test]
    fn file_names_keep_only_plain_characters() {
        assert_eq!(file_name("build controlplane@1.30"), "build_controlplane_1.30");
    }
}
