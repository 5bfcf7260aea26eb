//! How the leader tells people about new holds: an `IPHeld` Event on the Pod for each hold
//! while holds come at a human pace; during a burst (a drain, a failed node, a storm of
//! deletions), one `IPsHeld` Event on the policy per window that counts them and names a few.
//!
//! An Event is an API write. In a storm of 1,000 deletions one Event per hold was one of
//! the five extra requests each deletion cost the API server (docs/performance.md), and a
//! thousand Events name the same policy and say the same thing. Kubernetes' own Event
//! clients aggregate bursts of similar Events the same way.
//!
//! The announcements run as a loop of their own beside the leader's work queue
//! ([`Announcements`]): a hold's reconcile hands its record over and goes on; the Event is
//! written here, and a burst's summary goes out when its window ends, with no key of its
//! own in the queue.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use capo_api::ReservedIP;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;
use kube::runtime::events::EventType;
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::events::{Events, pod_ref, policy_ref};

/// Holds announced one by one per policy in any window.
pub const BURST: u32 = 10;
/// The window; a burst's summary is due at its end.
pub const WINDOW: Duration = Duration::from_secs(10);
/// Pods a summary names before it says "and N more".
const NAMED: usize = 5;

/// Whether a new hold gets an Event of its own.
#[derive(Debug, PartialEq, Eq)]
pub enum Announce {
    /// An `IPHeld` Event on the Pod.
    Each,
    /// Counted into the policy's summary, due at the given instant.
    Counted { due: Instant },
}

/// What a burst of holds in one policy came to.
#[derive(Debug, PartialEq, Eq)]
pub struct Summary {
    pub count: u32,
    /// The first few holds, as "namespace/pod ip".
    pub named: Vec<String>,
}

impl Summary {
    pub fn note(&self, policy: &str) -> String {
        let more = self.count as usize - self.named.len();
        let tail = if more > 0 { format!(" and {more} more") } else { String::new() };
        format!(
            "capo held {} more IPs of policy {policy} within {} s, beyond {BURST} announced one by one on their Pods: {}{tail} (kubectl get reservedips -l capo.io/policy={policy})",
            self.count,
            WINDOW.as_secs(),
            self.named.join(", "),
        )
    }
}

struct Window {
    start: Instant,
    each: u32,
    counted: u32,
    named: Vec<String>,
}

impl Window {
    fn new(start: Instant) -> Self {
        Self { start, each: 0, counted: 0, named: Vec::new() }
    }
}

/// Per policy: how many holds this window has announced, and what it has counted.
#[derive(Default)]
pub struct Announcer {
    windows: HashMap<String, Window>,
}

impl Announcer {
    /// A new hold of `policy` (`what`: "namespace/pod ip") seen at `now`.
    pub fn admit(&mut self, policy: &str, what: String, now: Instant) -> Announce {
        let w = self.windows.entry(policy.to_string()).or_insert_with(|| Window::new(now));
        // A window over and with nothing counted gives way to a new one; a window whose
        // summary is still waiting keeps counting until it is taken.
        if now.duration_since(w.start) >= WINDOW && w.counted == 0 {
            *w = Window::new(now);
        }
        if w.each < BURST && w.counted == 0 {
            w.each += 1;
            return Announce::Each;
        }
        w.counted += 1;
        if w.named.len() < NAMED {
            w.named.push(what);
        }
        Announce::Counted { due: w.start + WINDOW }
    }

    /// The summary of `policy`'s window, once the window is over and it counted any.
    /// The next window starts with the next hold.
    fn take(&mut self, policy: &str, now: Instant) -> Option<Summary> {
        let w = self.windows.get_mut(policy)?;
        if w.counted == 0 || now.duration_since(w.start) < WINDOW {
            return None;
        }
        let summary = Summary { count: w.counted, named: std::mem::take(&mut w.named) };
        self.windows.remove(policy);
        Some(summary)
    }

    /// When `policy`'s summary is due, if one is waiting.
    #[cfg(test)]
    fn due(&self, policy: &str) -> Option<Instant> {
        let w = self.windows.get(policy)?;
        (w.counted > 0).then(|| w.start + WINDOW)
    }

    /// Forgets windows that are over and counted nothing.
    fn trim(&mut self, now: Instant) {
        self.windows.retain(|_, w| w.counted > 0 || now.duration_since(w.start) < WINDOW);
    }

    /// When the next summary of any policy is due.
    pub fn next_due(&self) -> Option<Instant> {
        self.windows.values().filter(|w| w.counted > 0).map(|w| w.start + WINDOW).min()
    }

    /// Every summary due at `now`, by policy.
    pub fn take_due(&mut self, now: Instant) -> Vec<(String, Summary)> {
        self.trim(now);
        let due: Vec<String> = self
            .windows
            .iter()
            .filter(|(_, w)| w.counted > 0 && now.duration_since(w.start) >= WINDOW)
            .map(|(p, _)| p.clone())
            .collect();
        due.into_iter().filter_map(|p| self.take(&p, now).map(|s| (p, s))).collect()
    }
}

enum Message {
    Held(Arc<ReservedIP>),
    Forget(String),
}

/// The leader's side of the announcements loop: a hold seen, a record gone. Sending never
/// waits; the loop ends with the last sender (the term).
#[derive(Clone)]
pub struct Announcements {
    tx: mpsc::UnboundedSender<Message>,
    /// Holds made before this (the term's start, less 10 s) were announced by an earlier
    /// leader, or are too old to be news.
    since: Timestamp,
}

impl Announcements {
    /// Starts the loop for a term that began at `started`.
    pub fn spawn(events: Events, started: Timestamp) -> (Self, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let since = started.checked_sub(SignedDuration::from_secs(10)).unwrap_or(started);
        (Self { tx, since }, tokio::spawn(run(rx, events)))
    }

    /// A record the leader looked at: announced once per record uid if it is new.
    pub fn held(&self, rec: &Arc<ReservedIP>) {
        if rec.spec.reserved_at.0 >= self.since && !rec.spec.pod.name.is_empty() {
            let _ = self.tx.send(Message::Held(rec.clone()));
        }
    }

    /// A record that is gone: a new hold under its name is news again.
    pub fn forget(&self, name: &str) {
        let _ = self.tx.send(Message::Forget(name.to_string()));
    }
}

async fn run(mut rx: mpsc::UnboundedReceiver<Message>, events: Events) {
    // Record name → the uid announced.
    let mut announced: HashMap<String, String> = HashMap::new();
    let mut announcer = Announcer::default();
    loop {
        let next = announcer.next_due();
        let summary_due = async {
            match next {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            m = rx.recv() => match m {
                Some(Message::Held(rec)) => {
                    let uid = rec.uid().unwrap_or_default();
                    if announced.insert(rec.name_any(), uid.clone()).as_deref() == Some(uid.as_str()) {
                        continue;
                    }
                    let s = &rec.spec;
                    let what = format!("{}/{} {}", s.pod.namespace, s.pod.name, s.ip);
                    if announcer.admit(&s.policy, what, Instant::now()) == Announce::Each {
                        let note = format!(
                            "capo holds {} in IPReservation {} (policy {}, trigger {:?}) for {} after the Pod is gone",
                            s.ip, s.reservation, s.policy, s.trigger, s.reserve_for
                        );
                        let pod = pod_ref(&s.pod.namespace, &s.pod.name, &s.pod.uid);
                        events.publish(&pod, EventType::Normal, "IPHeld", "Hold", note).await;
                    }
                }
                Some(Message::Forget(name)) => {
                    announced.remove(&name);
                }
                None => return,
            },
            _ = summary_due => {
                for (policy, summary) in announcer.take_due(Instant::now()) {
                    let note = summary.note(&policy);
                    events.publish(&policy_ref(&policy), EventType::Normal, "IPsHeld", "Hold", note).await;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hold(i: u32) -> String {
        format!("ns/redis-{i} 10.0.0.{i}")
    }

    #[test]
    fn holds_at_a_human_pace_are_announced_one_by_one() {
        let mut a = Announcer::default();
        let t0 = Instant::now();
        for i in 0..30 {
            let at = t0 + Duration::from_secs(2 * i as u64);
            assert_eq!(a.admit("p", hold(i), at), Announce::Each, "hold {i}");
            assert_eq!(a.take("p", at + WINDOW), None, "nothing counted");
        }
    }

    #[test]
    fn a_burst_is_announced_up_to_the_burst_then_summed_up_once_per_window() {
        let mut a = Announcer::default();
        let t0 = Instant::now();
        let mut each = 0;
        let mut dues = Vec::new();
        for i in 0..100 {
            match a.admit("p", hold(i), t0 + Duration::from_millis(10 * i as u64)) {
                Announce::Each => each += 1,
                Announce::Counted { due } => dues.push(due),
            }
        }
        assert_eq!(each, BURST);
        assert_eq!(dues.len(), 90);
        assert!(dues.iter().all(|d| *d == t0 + WINDOW), "one summary, due at the window's end");
        assert_eq!(a.due("p"), Some(t0 + WINDOW));
        assert_eq!(a.take("p", t0 + WINDOW - Duration::from_millis(1)), None, "not before its time");
        // Holds that come while the summary waits are in it, even past the window's end.
        assert!(matches!(a.admit("p", hold(100), t0 + WINDOW), Announce::Counted { .. }));
        let s = a.take("p", t0 + WINDOW).expect("due");
        assert_eq!(s.count, 91);
        assert_eq!(s.named, (10..15).map(hold).collect::<Vec<_>>(), "the first counted, by name");
        assert!(
            s.note("p").contains("91 more IPs of policy p") && s.note("p").contains("and 86 more"),
            "{}",
            s.note("p")
        );
        assert_eq!(a.take("p", t0 + WINDOW * 2), None, "taken once");
        assert_eq!(a.due("p"), None);
        // After the summary, the next hold starts a window of its own.
        assert_eq!(a.admit("p", hold(101), t0 + WINDOW * 2), Announce::Each);
    }

    #[test]
    fn policies_have_windows_of_their_own() {
        let mut a = Announcer::default();
        let t0 = Instant::now();
        for i in 0..BURST {
            assert_eq!(a.admit("busy", hold(i), t0), Announce::Each);
        }
        assert!(matches!(a.admit("busy", hold(99), t0), Announce::Counted { .. }));
        assert_eq!(a.admit("quiet", hold(1), t0), Announce::Each);
        assert_eq!(a.due("quiet"), None);
        a.trim(t0 + WINDOW);
        assert!(a.due("busy").is_some(), "a waiting summary is kept");
        assert!(!a.windows.contains_key("quiet"), "a window over and counting nothing is forgotten");
    }

    /// The loop sleeps until the earliest summary of any policy, and takes all that are due.
    #[test]
    fn the_earliest_summary_of_any_policy_is_due_first() {
        let mut a = Announcer::default();
        let t0 = Instant::now();
        assert_eq!(a.next_due(), None, "nothing counted, nothing due");
        for i in 0..=BURST {
            a.admit("early", hold(i), t0);
            a.admit("late", hold(i), t0 + Duration::from_secs(3));
        }
        a.admit("quiet", hold(1), t0);
        assert_eq!(a.next_due(), Some(t0 + WINDOW));
        assert!(a.take_due(t0 + WINDOW - Duration::from_millis(1)).is_empty());
        let due = a.take_due(t0 + WINDOW);
        assert_eq!(due.iter().map(|(p, s)| (p.as_str(), s.count)).collect::<Vec<_>>(), [("early", 1)]);
        assert_eq!(a.next_due(), Some(t0 + Duration::from_secs(3) + WINDOW));
        assert_eq!(a.take_due(t0 + WINDOW * 2).len(), 1);
        assert_eq!(a.next_due(), None);
    }
}
