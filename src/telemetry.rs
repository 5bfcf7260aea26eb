//! Logging: `tracing` with structured fields, as text or JSON, filtered by `RUST_LOG`.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

pub fn init(format: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,kube=warn"));
    // Colours only on a terminal: a container's log (kubectl logs, a log shipper) gets
    // plain text, not escape sequences.
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_ansi(std::io::stdout().is_terminal());
    let _ = if format == "json" { builder.json().try_init() } else { builder.try_init() };
}
