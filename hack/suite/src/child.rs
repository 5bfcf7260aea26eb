//! A step's process: in a process group of its own (so a timeout or an interrupt stops
//! everything it started), reaped with `wait4` for its CPU time and that of every
//! descendant it waited for.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub struct Child {
    pub pid: libc::pid_t,
    pub started: Instant,
    /// When the group was sent SIGTERM (a timeout or an interrupt).
    pub terminating: Option<Instant>,
}

/// How a process ended.
#[derive(Clone, Copy, Debug)]
pub struct Exit {
    pub success: bool,
    /// The exit code, or 128 + the signal.
    pub code: i32,
    /// User + system CPU time of the process and the descendants it waited for.
    pub cpu: Duration,
    /// Peak resident set size of the largest of them, in KiB.
    pub max_rss_kib: u64,
}

pub struct Spawn<'a> {
    pub program: &'a str,
    pub args: &'a [String],
    pub env: &'a [(String, String)],
    pub cwd: &'a Path,
    /// stdout, and stderr if `stderr` is `None`.
    pub stdout: &'a Path,
    pub stderr: Option<&'a Path>,
    /// Run at a lower priority (`nice`), so tests take the CPU before builds.
    pub nice: i32,
}

#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error("creating {path}: {source}")]
    Log { path: PathBuf, source: std::io::Error },
    #[error("starting {program}: {source}")]
    Start { program: String, source: std::io::Error },
}

impl Child {
    pub fn spawn(s: Spawn<'_>) -> Result<Child, SpawnError> {
        let create = |p: &Path| File::create(p).map_err(|source| SpawnError::Log { path: p.to_path_buf(), source });
        let out = create(s.stdout)?;
        let err = match s.stderr {
            Some(p) => create(p)?,
            None => out.try_clone().map_err(|source| SpawnError::Log { path: s.stdout.to_path_buf(), source })?,
        };
        let mut cmd = Command::new(s.program);
        cmd.args(s.args).current_dir(s.cwd).stdin(Stdio::null()).stdout(out).stderr(err);
        for (k, v) in s.env {
            cmd.env(k, v);
        }
        let nice = s.nice;
        // SAFETY: setpgid and setpriority are async-signal-safe; nothing else runs
        // between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setpgid(0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if nice != 0 {
                    libc::setpriority(libc::PRIO_PROCESS, 0, nice);
                }
                Ok(())
            });
        }
        let child = cmd.spawn().map_err(|source| SpawnError::Start { program: s.program.to_string(), source })?;
        Ok(Child { pid: child.id() as libc::pid_t, started: Instant::now(), terminating: None })
    }

    /// The exit, if the process has ended (never blocks).
    pub fn try_reap(&self) -> Option<Exit> {
        let mut status = 0;
        // SAFETY: an all-zero rusage is a valid value for wait4 to overwrite.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: wait4 on our own child, with valid pointers.
        let r = unsafe { libc::wait4(self.pid, &mut status, libc::WNOHANG, &mut usage) };
        if r != self.pid {
            return None;
        }
        let tv = |t: libc::timeval| Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64);
        let code = if libc::WIFEXITED(status) { libc::WEXITSTATUS(status) } else { 128 + libc::WTERMSIG(status) };
        Some(Exit {
            success: libc::WIFEXITED(status) && code == 0,
            code,
            cpu: tv(usage.ru_utime) + tv(usage.ru_stime),
            max_rss_kib: usage.ru_maxrss as u64,
        })
    }

    /// SIGTERM to the whole group now, SIGKILL once `grace` has passed since.
    pub fn terminate(&mut self, grace: Duration) {
        match self.terminating {
            None => {
                signal_group(self.pid, libc::SIGTERM);
                self.terminating = Some(Instant::now());
            }
            Some(at) if at.elapsed() >= grace => signal_group(self.pid, libc::SIGKILL),
            Some(_) => {}
        }
    }

    /// Whatever of the group is left once the leader is reaped (a daemon it started).
    pub fn kill_leftovers(&self) {
        signal_group(self.pid, libc::SIGKILL);
    }
}

fn signal_group(pgid: libc::pid_t, signal: libc::c_int) {
    // SAFETY: kill(2) on a process group this runner created.
    unsafe {
        libc::kill(-pgid, signal);
    }
}
