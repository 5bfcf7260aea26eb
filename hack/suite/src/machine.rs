//! The machine while the suite runs: how busy its CPUs were over any window (from
//! `/proc/stat`, sampled once a second) and the least memory it had available.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug)]
struct Sample {
    at: Instant,
    /// Jiffies: all, and idle (idle + iowait).
    total: u64,
    idle: u64,
    mem_available_kib: u64,
}

#[derive(Clone, Default)]
pub struct Machine {
    samples: Arc<Mutex<Vec<Sample>>>,
}

pub fn cores() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

pub fn mem_total_kib() -> u64 {
    meminfo("MemTotal:").unwrap_or(0)
}

fn meminfo(key: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    text.lines().find(|l| l.starts_with(key))?.split_whitespace().nth(1)?.parse().ok()
}

fn read() -> Option<Sample> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    let (total, idle) = parse_cpu_line(text.lines().next()?)?;
    Some(Sample { at: Instant::now(), total, idle, mem_available_kib: meminfo("MemAvailable:").unwrap_or(0) })
}

/// `cpu  user nice system idle iowait irq softirq steal guest guest_nice` → (all, idle).
/// guest time is already in user, so it is left out of the sum.
fn parse_cpu_line(line: &str) -> Option<(u64, u64)> {
    let mut fields = line.split_whitespace();
    if fields.next()? != "cpu" {
        return None;
    }
    let v: Vec<u64> = fields.take(8).map(|f| f.parse().unwrap_or(0)).collect();
    if v.len() < 5 {
        return None;
    }
    Some((v.iter().sum(), v[3] + v[4]))
}

impl Machine {
    /// Starts sampling, once a second, for the life of the process.
    pub fn start() -> Machine {
        let m = Machine::default();
        let samples = m.samples.clone();
        std::thread::spawn(move || {
            loop {
                if let Some(s) = read() {
                    samples.lock().unwrap_or_else(|e| e.into_inner()).push(s);
                }
                std::thread::sleep(Duration::from_secs(1));
            }
        });
        m
    }

    /// The share of the machine's CPU time that was busy between `from` and `to`
    /// (samples at or inside the window); `None` for a window under two samples.
    pub fn busy(&self, from: Instant, to: Instant) -> Option<f64> {
        let samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        let inside: Vec<&Sample> =
            samples.iter().filter(|s| s.at + Duration::from_millis(500) >= from && s.at <= to).collect();
        let (first, last) = (inside.first()?, inside.last()?);
        let total = last.total.checked_sub(first.total)?;
        let idle = last.idle.checked_sub(first.idle)?;
        (total > 0).then(|| 1.0 - idle as f64 / total as f64)
    }

    /// The least memory available (`MemAvailable`) seen, in KiB.
    pub fn least_available_kib(&self) -> Option<u64> {
        let samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        samples.iter().map(|s| s.mem_available_kib).filter(|&m| m > 0).min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_line_gives_all_and_idle_jiffies() {
        assert_eq!(parse_cpu_line("cpu  10 2 3 100 5 1 1 0 7 0"), Some((122, 105)));
        assert_eq!(parse_cpu_line("cpu0 10 2 3 100 5 1 1 0"), None);
        assert_eq!(parse_cpu_line("intr 1 2"), None);
    }
}
