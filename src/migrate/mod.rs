//! Moving from the original capo: its configuration as CapoPolicies ([`config`], `capo
//! migrate`), and its held IPs taken over with their original reserve times ([`takeover`],
//! `capo take-over`).

pub mod config;
pub mod takeover;

pub use config::{MigrateError, migrate, render};
