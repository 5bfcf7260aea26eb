//! Logging: `tracing` with structured fields, as text or JSON, filtered by `--log-level`
//! (`RUST_LOG`, when set, wins: the usual Rust way).

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// The filter `--log-level` asks for: a level (`debug`) or `tracing` directives
/// (`info,capo::release=debug`).
pub fn filter(level: &str) -> Result<EnvFilter, LevelError> {
    // `tracing` reads a bare word as a target to log at every level: `verbose` would
    // silently log nothing of capo's. A bare word must be a level here.
    if let Some(word) = level
        .split(',')
        .map(str::trim)
        .find(|d| !d.contains(['=', '[', ':']) && !LEVELS.contains(&d.to_ascii_lowercase().as_str()))
    {
        return Err(LevelError::NotALevel(word.to_string()));
    }
    // kube's own lines stay at warn, unless named or the level asked for is quieter.
    let named_kube = level.split(',').any(|d| d.trim().starts_with("kube"));
    let quiet =
        level.split(',').map(|d| d.trim().to_ascii_lowercase()).any(|d| ["off", "error", "warn"].contains(&d.as_str()));
    let directives = if named_kube || quiet { level.to_string() } else { format!("{level},kube=warn") };
    EnvFilter::try_new(directives).map_err(LevelError::Directives)
}

const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];

#[derive(Debug, thiserror::Error)]
pub enum LevelError {
    #[error("{0:?} is not a level (off, error, warn, info, debug, trace)")]
    NotALevel(String),
    #[error("{0}")]
    Directives(tracing_subscriber::filter::ParseError),
}

pub fn init(format: &str, level: &str) {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| filter(level))
        .unwrap_or_else(|_| EnvFilter::new("info,kube=warn"));
    // Colours only on a terminal: a container's log (kubectl logs, a log shipper) gets
    // plain text, not escape sequences.
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_ansi(std::io::stdout().is_terminal());
    let _ = if format == "json" { builder.json().try_init() } else { builder.try_init() };
}

#[cfg(test)]
mod tests {
    #[test]
    fn log_levels_and_directives() {
        assert_eq!(super::filter("debug").unwrap().to_string(), "kube=warn,debug");
        assert!(super::filter("info,capo::release=debug").is_ok());
        assert!(super::filter("kube=info").unwrap().to_string().contains("kube=info"));
        assert!(super::filter("loud!").is_err(), "refused at start (capo run checks it)");
        assert!(super::filter("info,verbose").is_err(), "a bare word that is no level");
        assert!(super::filter("INFO").is_ok());
        assert!(super::filter("capo=debug,capo::release[hold]=trace").is_ok());
    }
}
