//! A keyed work queue, as Kubernetes controllers use: a key waiting is queued once however
//! often it is added; a key being worked on is not handed to a second worker, and if it is
//! added meanwhile it runs again afterwards; a key can be added for later (the earliest
//! time wins); a key that failed comes back after an exponential backoff, reset when it
//! succeeds.
//!
//! Work that is due goes first: a key whose time came, or one added as urgent, is handed
//! out before every key that is merely ready, so a burst of new work (a storm of new holds,
//! each with its status write) never delays a countdown that has run out or a release slot.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::hash::Hash;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

struct Inner<K> {
    /// Due: their time came, or they were added as urgent; handed out first, in order.
    due: VecDeque<K>,
    /// Ready to run, in order.
    ready: VecDeque<K>,
    /// The keys waiting in `due` or `ready`. A key moved up to `due` may still stand in
    /// `ready`: a place whose key is no longer queued is skipped.
    queued: HashSet<K>,
    /// Being worked on.
    active: HashSet<K>,
    /// Added while active: run again when done (`true`: as urgent).
    again: HashMap<K, bool>,
    /// Waiting for a time: key → when, and the same ordered by time.
    /// (Removing by the exact timeline key keeps every change O(log n): the leader keeps
    /// one key per hold waiting for its due time.)
    later: HashMap<K, (Instant, u64)>,
    timeline: BTreeSet<(Instant, u64, K)>,
    seq: u64,
    failures: HashMap<K, u32>,
    closed: bool,
}

pub struct WorkQueue<K> {
    inner: Mutex<Inner<K>>,
    wake: Notify,
    base: Duration,
    max: Duration,
}

impl<K: Clone + Eq + Hash + Ord> WorkQueue<K> {
    /// A queue whose failed keys come back after `base`, doubling up to `max`.
    pub fn new(base: Duration, max: Duration) -> Self {
        Self {
            inner: Mutex::new(Inner {
                due: VecDeque::new(),
                ready: VecDeque::new(),
                queued: HashSet::new(),
                active: HashSet::new(),
                again: HashMap::new(),
                later: HashMap::new(),
                timeline: BTreeSet::new(),
                seq: 0,
                failures: HashMap::new(),
                closed: false,
            }),
            wake: Notify::new(),
            base,
            max,
        }
    }

    /// Queues `key`. A time it waits for stays set until it is handed out: a key queued
    /// behind a backlog of ready work still moves up when its time comes.
    fn push_ready(inner: &mut Inner<K>, key: K, urgent: bool) {
        if inner.active.contains(&key) {
            *inner.again.entry(key).or_default() |= urgent;
        } else if inner.queued.insert(key.clone()) {
            if urgent { inner.due.push_back(key) } else { inner.ready.push_back(key) }
        } else if urgent && !inner.due.contains(&key) {
            // Queued as merely ready: moved up (its place in `ready` is skipped later).
            inner.due.push_back(key);
        }
    }

    /// Runs `key` as soon as a worker is free.
    pub fn add(&self, key: K) {
        self.push(key, false);
    }

    /// Runs `key` as soon as a worker is free, before every key that is merely ready.
    pub fn add_urgent(&self, key: K) {
        self.push(key, true);
    }

    fn push(&self, key: K, urgent: bool) {
        let mut inner = self.inner.lock().expect("queue lock");
        Self::push_ready(&mut inner, key, urgent);
        drop(inner);
        self.wake.notify_one();
    }

    /// Runs `key` at `at` at the latest (an earlier time already set wins); if it is
    /// queued as merely ready by then, it moves up.
    pub fn add_at(&self, key: K, at: Instant) {
        if at <= Instant::now() {
            return self.add_urgent(key);
        }
        let mut inner = self.inner.lock().expect("queue lock");
        if inner.due.contains(&key) {
            return;
        }
        if let Some(&(prev, prev_seq)) = inner.later.get(&key) {
            if prev <= at {
                return;
            }
            inner.timeline.remove(&(prev, prev_seq, key.clone()));
        }
        inner.seq += 1;
        let seq = inner.seq;
        inner.later.insert(key.clone(), (at, seq));
        inner.timeline.insert((at, seq, key));
        drop(inner);
        self.wake.notify_one();
    }

    pub fn add_after(&self, key: K, after: Duration) {
        self.add_at(key, Instant::now() + after);
    }

    /// `key` failed: it runs again after its backoff; returns that backoff.
    pub fn retry(&self, key: K) -> Duration {
        let delay = {
            let mut inner = self.inner.lock().expect("queue lock");
            let n = inner.failures.entry(key.clone()).or_insert(0);
            *n += 1;
            self.base.saturating_mul(1 << (*n - 1).min(16)).min(self.max)
        };
        self.add_after(key, delay);
        delay
    }

    /// `key` succeeded: its backoff starts over.
    pub fn forget(&self, key: &K) {
        self.inner.lock().expect("queue lock").failures.remove(key);
    }

    /// The next key to work on; `None` once closed. Call [`WorkQueue::done`] after.
    pub async fn next(&self) -> Option<K> {
        loop {
            let sleep_until = {
                let mut inner = self.inner.lock().expect("queue lock");
                if inner.closed {
                    return None;
                }
                let now = Instant::now();
                while let Some((at, _, _)) = inner.timeline.first() {
                    if *at > now {
                        break;
                    }
                    let (_, _, key) = inner.timeline.pop_first().expect("first exists");
                    inner.later.remove(&key);
                    Self::push_ready(&mut inner, key, true);
                }
                while let Some(key) = inner.due.pop_front().or_else(|| inner.ready.pop_front()) {
                    if inner.queued.remove(&key) {
                        // Handed out: the worker says when it wants it again.
                        if let Some((at, seq)) = inner.later.remove(&key) {
                            inner.timeline.remove(&(at, seq, key.clone()));
                        }
                        inner.active.insert(key.clone());
                        return Some(key);
                    }
                }
                inner.timeline.first().map(|(at, _, _)| *at)
            };
            match sleep_until {
                Some(at) => {
                    tokio::select! {
                        _ = self.wake.notified() => {}
                        _ = tokio::time::sleep_until(at) => {}
                    }
                }
                None => self.wake.notified().await,
            }
        }
    }

    /// The work on `key` is over.
    pub fn done(&self, key: &K) {
        let mut inner = self.inner.lock().expect("queue lock");
        inner.active.remove(key);
        if let Some(urgent) = inner.again.remove(key) {
            Self::push_ready(&mut inner, key.clone(), urgent);
            drop(inner);
            self.wake.notify_one();
        }
    }

    /// Keys waiting (ready or for a time).
    pub fn len(&self) -> usize {
        let inner = self.inner.lock().expect("queue lock");
        inner.queued.len() + inner.later.keys().filter(|k| !inner.queued.contains(*k)).count()
    }

    /// Keys to run now (not those waiting for a time).
    pub fn busy(&self) -> usize {
        let inner = self.inner.lock().expect("queue lock");
        inner.queued.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every worker's `next` returns `None` from now on.
    pub fn close(&self) {
        self.inner.lock().expect("queue lock").closed = true;
        self.wake.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue() -> WorkQueue<u32> {
        WorkQueue::new(Duration::from_millis(100), Duration::from_secs(1))
    }

    #[tokio::test(start_paused = true)]
    async fn a_key_is_queued_once_and_not_handed_out_twice() {
        let q = queue();
        q.add(1);
        q.add(1);
        q.add(2);
        assert_eq!(q.next().await, Some(1));
        q.add(1); // while active: again afterwards, not now
        assert_eq!(q.next().await, Some(2));
        assert!(tokio::time::timeout(Duration::from_millis(10), q.next()).await.is_err());
        q.done(&1);
        assert_eq!(q.next().await, Some(1));
    }

    #[tokio::test(start_paused = true)]
    async fn later_keys_come_at_their_time_and_the_earliest_wins() {
        let q = queue();
        let t0 = Instant::now();
        q.add_after(1, Duration::from_secs(5));
        q.add_after(1, Duration::from_secs(2));
        q.add_after(1, Duration::from_secs(9));
        q.add_after(2, Duration::from_secs(3));
        assert_eq!(q.next().await, Some(1));
        assert_eq!(t0.elapsed(), Duration::from_secs(2));
        assert_eq!(q.next().await, Some(2));
        assert_eq!(t0.elapsed(), Duration::from_secs(3));
        // An add now overrides a later time.
        q.add_after(3, Duration::from_secs(60));
        q.add(3);
        assert_eq!(q.next().await, Some(3));
        assert_eq!(t0.elapsed(), Duration::from_secs(3));
        assert!(q.is_empty());
        // The times each key had before are gone with it: nothing comes at 5 s or 9 s.
        for k in [1, 2, 3] {
            q.done(&k);
        }
        assert!(tokio::time::timeout(Duration::from_secs(10), q.next()).await.is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn what_is_due_goes_before_a_backlog_of_ready_work() {
        let q = queue();
        let t0 = Instant::now();
        q.add_after(100, Duration::from_secs(1));
        for k in 0..50 {
            q.add(k);
        }
        tokio::time::advance(Duration::from_secs(2)).await;
        // The countdown that ran out comes before the 50 keys that were ready first.
        assert_eq!(q.next().await, Some(100));
        assert!(t0.elapsed() >= Duration::from_secs(1));
        // An urgent key jumps the backlog too, and a ready key moved up runs once.
        q.add_urgent(200);
        q.add_urgent(30);
        assert_eq!(q.next().await, Some(200));
        assert_eq!(q.next().await, Some(30));
        let rest: Vec<u32> = futures::future::join_all((0..49).map(|_| q.next())).await.into_iter().flatten().collect();
        assert_eq!(rest, (0..50).filter(|k| *k != 30).collect::<Vec<_>>());
        assert!(q.is_empty(), "the place 30 had in the backlog is skipped, not handed out again");
        assert!(tokio::time::timeout(Duration::from_millis(10), q.next()).await.is_err());
        // Urgent while active: it runs again afterwards, ahead of the ready keys.
        q.add(300);
        q.add_urgent(100);
        q.done(&100);
        assert_eq!(q.next().await, Some(100));
    }

    /// A key in the backlog (a hold's record changed again, by the leader's own status
    /// write) keeps its time: when its countdown runs out it moves up, instead of waiting
    /// for the backlog ahead of it.
    #[tokio::test(start_paused = true)]
    async fn a_key_in_the_backlog_still_moves_up_when_its_time_comes() {
        let q = queue();
        q.add_after(100, Duration::from_secs(1));
        q.add(101);
        q.add_after(101, Duration::from_secs(1));
        for k in 0..50 {
            q.add(k);
        }
        q.add(100); // an event on 100 queues it behind the backlog...
        tokio::time::advance(Duration::from_secs(2)).await;
        // ...and its time still comes first, as does the time set while 101 was queued.
        let first: Vec<u32> = vec![q.next().await.unwrap(), q.next().await.unwrap()];
        assert_eq!(first, vec![100, 101]);
        let rest: Vec<u32> = futures::future::join_all((0..50).map(|_| q.next())).await.into_iter().flatten().collect();
        assert_eq!(rest, (0..50).collect::<Vec<_>>(), "each handed out once");
        assert!(q.is_empty());
        // Handed out, a key's time is spent: it does not come again by itself.
        for k in (0..50).chain([100, 101]) {
            q.done(&k);
        }
        assert!(tokio::time::timeout(Duration::from_secs(10), q.next()).await.is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn failures_back_off_exponentially_until_forgotten() {
        let q = queue();
        assert_eq!(q.retry(7), Duration::from_millis(100));
        assert_eq!(q.retry(7), Duration::from_millis(200));
        assert_eq!(q.retry(7), Duration::from_millis(400));
        for _ in 0..10 {
            q.retry(7);
        }
        assert_eq!(q.retry(7), Duration::from_secs(1), "capped");
        q.forget(&7);
        assert_eq!(q.retry(7), Duration::from_millis(100));
    }

    #[tokio::test(start_paused = true)]
    async fn closing_stops_the_workers() {
        let q = std::sync::Arc::new(queue());
        let w = {
            let q = q.clone();
            tokio::spawn(async move { q.next().await })
        };
        tokio::task::yield_now().await;
        q.close();
        assert_eq!(w.await.unwrap(), None);
    }
}
