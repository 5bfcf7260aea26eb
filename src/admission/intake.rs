//! How much of the webhook's memory reviews in flight may take, and load shedding past it.
//!
//! Every review reserves the bytes of its body before it is read. Two lanes share the
//! budget half and half: reviews up to [`LARGE_REVIEW_BYTES`] (the API server's usual
//! few KiB) and larger ones, or ones of unknown length (which reserve the largest review
//! capo reads). A flood of 4 MiB bodies therefore fills only the large lane, and the
//! API server's ordinary reviews are still answered. A review that finds its lane full is
//! answered at once (429) rather than queued past the API server's deadline.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::handler::MAX_REVIEW_BYTES;

/// Reviews larger than this take the large lane.
pub const LARGE_REVIEW_BYTES: usize = 256 << 10;

/// What reviews in flight may cost.
#[derive(Clone, Debug)]
pub struct ReviewLimits {
    /// The bytes of review bodies held at once, both lanes together.
    pub bytes_in_flight: usize,
}

impl Default for ReviewLimits {
    fn default() -> Self {
        Self { bytes_in_flight: 64 << 20 }
    }
}

/// Reservations are counted in KiB (a semaphore's permits are `u32`).
const UNIT: usize = 1 << 10;

pub struct Intake {
    small: Arc<Semaphore>,
    large: Arc<Semaphore>,
    /// Each lane's size, in units.
    lane: usize,
}

/// The room a review holds while it is read and answered.
#[must_use]
pub struct Admitted(#[allow(dead_code)] OwnedSemaphorePermit);

/// A review shed for want of room.
#[derive(Debug, thiserror::Error)]
#[error(
    "capo is busy: the {lane} lane holds {in_flight} KiB of reviews in flight, no room for {wanted} KiB more; \
     try again"
)]
pub struct Busy {
    pub lane: &'static str,
    pub in_flight: usize,
    pub wanted: usize,
}

impl Intake {
    pub fn new(limits: &ReviewLimits) -> Self {
        let lane = (limits.bytes_in_flight / 2 / UNIT).max(1);
        Self { small: Arc::new(Semaphore::new(lane)), large: Arc::new(Semaphore::new(lane)), lane }
    }

    /// Reserves room for a body of `length` bytes (`None`: not announced, so as much as
    /// the largest review capo reads).
    pub fn admit(&self, length: Option<usize>) -> Result<Admitted, Busy> {
        let bytes = length.unwrap_or(MAX_REVIEW_BYTES).min(MAX_REVIEW_BYTES);
        let (name, lane) = match length {
            Some(n) if n <= LARGE_REVIEW_BYTES => ("small", &self.small),
            _ => ("large", &self.large),
        };
        // The body, plus a unit for what reading and answering it costs; never more than
        // a whole lane, so one review always fits when nothing else is in flight.
        let wanted = (bytes.div_ceil(UNIT) + 1).min(self.lane);
        match lane.clone().try_acquire_many_owned(wanted as u32) {
            Ok(permit) => Ok(Admitted(permit)),
            Err(_) => Err(Busy { lane: name, in_flight: self.lane - lane.available_permits(), wanted }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn intake(bytes_in_flight: usize) -> Intake {
        Intake::new(&ReviewLimits { bytes_in_flight })
    }

    #[test]
    fn large_reviews_cannot_take_the_room_of_small_ones() {
        let intake = intake(64 << 20);
        // 32 MiB for large reviews: seven 4 MiB bodies (each with its unit of overhead).
        let large: Vec<_> = (0..7).map(|_| intake.admit(Some(4 << 20)).expect("room")).collect();
        let busy = intake.admit(Some(4 << 20)).err().expect("the large lane is full");
        assert_eq!(busy.lane, "large");
        // A body of unknown length counts as the largest.
        assert!(intake.admit(None).is_err());
        // The API server's usual reviews still get in, thousands of them.
        let small: Vec<_> = (0..3000).map(|_| intake.admit(Some(8 << 10)).expect("room for a small review")).collect();
        drop(large);
        assert!(intake.admit(Some(4 << 20)).is_ok(), "room again once the large reviews are done");
        drop(small);
    }

    #[test]
    fn one_review_always_fits_an_empty_lane() {
        let intake = intake(1 << 20);
        let only = intake.admit(Some(4 << 20)).expect("one fits");
        assert!(intake.admit(Some(300 << 10)).is_err());
        drop(only);
        assert!(intake.admit(Some(300 << 10)).is_ok());
    }
}
