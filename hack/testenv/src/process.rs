//! Child processes of the control plane: each logs to a file in the state directory and
//! dies with the thread that started it (`PR_SET_PDEATHSIG`), so a crashed or panicking
//! test run leaves nothing behind.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::Error;

pub struct Component {
    pub name: &'static str,
    child: Child,
    launch: Launch,
}

/// What a component runs: the program, its flags, and environment variables added to
/// (or, with `None`, removed from) the test process's own.
#[derive(Clone, Debug, Default)]
pub struct Launch {
    pub program: std::path::PathBuf,
    pub args: Vec<String>,
    pub env: Vec<(String, Option<String>)>,
}

impl Component {
    /// Runs `launch`, logging to `<state_dir>/<name>.log`.
    pub fn launch(name: &'static str, launch: Launch, state_dir: &Path) -> Result<Self, Error> {
        let log_path = state_dir.join(format!("{name}.log"));
        let log = File::options()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|source| Error::Io { path: log_path.clone(), source })?;
        let log_err = log.try_clone().map_err(|source| Error::Io { path: log_path.clone(), source })?;
        let mut cmd = Command::new(&launch.program);
        cmd.args(&launch.args).stdin(Stdio::null()).stdout(log).stderr(log_err);
        for (key, value) in &launch.env {
            match value {
                Some(v) => cmd.env(key, v),
                None => cmd.env_remove(key),
            };
        }
        // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().map_err(|source| Error::Io { path: launch.program.clone(), source })?;
        Ok(Self { name, child, launch })
    }

    /// Stops the process (SIGTERM, then SIGKILL) and starts it again with the same flags.
    pub fn restart(&mut self, state_dir: &Path) -> Result<(), Error> {
        self.stop(Duration::from_secs(10));
        *self = Self::launch(self.name, self.launch.clone(), state_dir)?;
        Ok(())
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Fails if the process has already exited (it crashed on start, for example).
    pub fn ensure_running(&mut self, state_dir: &Path) -> Result<(), Error> {
        match self.child.try_wait() {
            Ok(Some(status)) => Err(Error::Exited {
                component: self.name,
                status: status.to_string(),
                log: state_dir.join(format!("{}.log", self.name)),
            }),
            _ => Ok(()),
        }
    }

    /// SIGTERM, then SIGKILL after `grace`.
    pub fn stop(&mut self, grace: Duration) {
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether a process with this pid is alive (signal 0).
pub fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks for existence.
    unsafe { libc::kill(pid, 0) == 0 }
}
