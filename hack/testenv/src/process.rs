//! Child processes of the control plane: each logs to a file in the state directory and
//! dies with the thread that started it (`PR_SET_PDEATHSIG`), so a crashed or panicking
//! test run leaves nothing behind.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::Error;

pub struct Component {
    pub name: &'static str,
    child: Child,
    program: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
}

impl Component {
    /// Starts `program` as the component `name` (its log is `<name>.log` in `state_dir`).
    pub fn spawn(
        name: &'static str,
        program: &Path,
        args: &[String],
        env: &[(String, String)],
        state_dir: &Path,
    ) -> Result<Self, Error> {
        let log_path = state_dir.join(format!("{name}.log"));
        let log = File::options()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|source| Error::Io { path: log_path.clone(), source })?;
        let log_err = log.try_clone().map_err(|source| Error::Io { path: log_path.clone(), source })?;
        let mut cmd = Command::new(program);
        cmd.args(args).envs(env.iter().cloned()).stdin(Stdio::null()).stdout(log).stderr(log_err);
        // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().map_err(|source| Error::Io { path: program.to_path_buf(), source })?;
        Ok(Self { name, child, program: program.to_path_buf(), args: args.to_vec(), env: env.to_vec() })
    }

    /// Stops the process (SIGTERM, then SIGKILL) and starts it again with the same flags.
    pub fn restart(&mut self, state_dir: &Path) -> Result<(), Error> {
        self.stop(Duration::from_secs(10));
        *self = Self::spawn(self.name, &self.program.clone(), &self.args.clone(), &self.env.clone(), state_dir)?;
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
