//! How long the webhook may spend: the API server passes its own deadline in the
//! `timeout` query parameter; capo answers comfortably inside it.

use std::time::Duration;

/// Time kept back from the API server's deadline for the answer to travel.
const MARGIN: Duration = Duration::from_millis(500);

/// The time capo may spend writing a hold, given the `timeout` query parameter (a Go
/// duration such as `10s`) and capo's own ceiling.
pub fn budget(timeout_param: Option<&str>, ceiling: Duration) -> Duration {
    let server = timeout_param.and_then(|t| t.parse::<capo_api::Duration>().ok()).map(|d| d.as_std());
    let limit = server.map_or(ceiling, |s| s.min(ceiling));
    // Keep the margin, or a quarter of a short deadline: always some time to answer.
    limit.saturating_sub(MARGIN.min(limit / 4))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_inside_the_api_servers_deadline() {
        let ceiling = Duration::from_secs(10);
        assert_eq!(budget(Some("5s"), ceiling), Duration::from_millis(4500));
        assert_eq!(budget(Some("30s"), ceiling), Duration::from_millis(9500));
        assert_eq!(budget(None, ceiling), Duration::from_millis(9500));
        assert_eq!(budget(Some("1s"), ceiling), Duration::from_millis(750));
        assert_eq!(budget(Some("garbage"), ceiling), Duration::from_millis(9500));
        // A short deadline still leaves a quarter of it for the answer.
        assert_eq!(budget(Some("100ms"), ceiling), Duration::from_millis(75));
        assert_eq!(budget(Some("1ms"), ceiling), Duration::from_micros(750));
    }
}
