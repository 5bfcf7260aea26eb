use clap::Parser;
use tracing::{error, info};

use capo::cli::{Cli, Command};

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Some(command) => operator(command).await,
        None => {
            capo::telemetry::init(&cli.run.log_format);
            match run(cli.run).await {
                Ok(()) => std::process::ExitCode::SUCCESS,
                Err(e) => {
                    error!(error = %e, "capo stopped");
                    std::process::ExitCode::FAILURE
                }
            }
        }
    }
}

async fn run(args: capo::cli::Args) -> Result<(), Box<dyn std::error::Error>> {
    let settings = args.settings()?;
    let client = capo::client::infer(args.api_tcp_nodelay).await?;
    let app = capo::App::start(client, settings).await?;
    shutdown_signal().await;
    info!("shutting down");
    app.shutdown().await;
    Ok(())
}

/// `capo holds|release|extend|policies|migrate`: print the answer, or the error and its
/// exit code.
async fn operator(command: Command) -> std::process::ExitCode {
    if let Command::Migrate { file } = &command {
        return migrate(file);
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = match capo::client::infer(true).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("capo: no cluster to talk to (kubeconfig): {e}");
            return std::process::ExitCode::from(1);
        }
    };
    if let Command::TakeOver { .. } = &command {
        return take_over(client, command).await;
    }
    let result = match command {
        Command::Holds { output } => capo::ops::holds(client, output).await,
        Command::Policies { output } => capo::ops::policies(client, output).await,
        Command::Release { ips, wait } => capo::ops::release(client, &ips, wait.as_std()).await,
        Command::Extend { ip, for_, wait } => capo::ops::extend(client, ip, for_.as_std(), wait.as_std()).await,
        Command::Migrate { .. } | Command::TakeOver { .. } => unreachable!("handled above"),
    };
    match result {
        Ok(out) => {
            print!("{out}");
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("capo: {e}");
            std::process::ExitCode::from(e.exit_code())
        }
    }
}

/// `capo take-over`: the original's holds, taken over with their reserve times.
async fn take_over(client: kube::Client, command: Command) -> std::process::ExitCode {
    let Command::TakeOver { policy, namespace, reservation, config_map, original_utc_offset, calico_api, dry_run } =
        command
    else {
        unreachable!("called for take-over only")
    };
    let usage = |e: String| {
        eprintln!("capo: {e}");
        std::process::ExitCode::from(2)
    };
    let offset = match capo::migrate::takeover::parse_offset(&original_utc_offset) {
        Ok(o) => o,
        Err(e) => return usage(format!("--original-utc-offset: {e}")),
    };
    let calico_api = match calico_api.as_str() {
        "auto" | "" => None,
        other => match other.parse() {
            Ok(g) => Some(g),
            Err(e) => return usage(format!("--calico-api: {e}")),
        },
    };
    let settings = capo::migrate::takeover::TakeOverSettings {
        policy,
        namespace,
        reservation,
        config_map,
        offset,
        calico_api,
        dry_run,
    };
    match capo::migrate::takeover::take_over(client, &settings).await {
        Ok(report) => {
            print!("{}", report.render());
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("capo: {e}");
            std::process::ExitCode::from(e.exit_code())
        }
    }
}

/// Needs no cluster: reads the original's configuration and prints CapoPolicies.
fn migrate(file: &std::path::Path) -> std::process::ExitCode {
    use std::io::Read;
    let mut input = String::new();
    let read = if file.as_os_str() == "-" {
        std::io::stdin().read_to_string(&mut input).map(|_| ())
    } else {
        std::fs::read_to_string(file).map(|s| input = s)
    };
    if let Err(e) = read {
        eprintln!("capo: reading {}: {e}", file.display());
        return std::process::ExitCode::from(1);
    }
    match capo::migrate::migrate(&input) {
        Ok(policies) => {
            print!("{}", capo::migrate::render(&policies));
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("capo: {e}");
            std::process::ExitCode::from(1)
        }
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {},
        _ = tokio::signal::ctrl_c() => {},
    }
}
