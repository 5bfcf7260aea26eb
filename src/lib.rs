//! capo: holds the IPs of deleted or evicted stateful Pods in capo-owned Calico
//! `IPReservation`s so Calico IPAM cannot hand them to another Pod.

pub mod admission;
pub mod app;
pub mod calico;
pub mod caller_auth;
pub mod certs;
pub mod cli;
pub mod client;
pub mod events;
pub mod explain;
pub mod health;
pub mod hold;
pub mod leader;
pub mod metrics;
pub mod migrate;
pub mod ops;
pub mod pod;
pub mod policy;
pub mod release;
pub mod server;
pub mod store;
pub mod telemetry;
pub mod webhook_config;

pub use app::{App, Settings, WebhookLimits};
