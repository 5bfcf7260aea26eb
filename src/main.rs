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
    let client = kube::Client::try_default().await?;
    let app = capo::App::start(client, settings).await?;
    shutdown_signal().await;
    info!("shutting down");
    app.shutdown().await;
    Ok(())
}

/// `capo holds|release|extend|policies`: print the answer, or the error and its exit code.
async fn operator(command: Command) -> std::process::ExitCode {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = match kube::Client::try_default().await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("capo: no cluster to talk to (kubeconfig): {e}");
            return std::process::ExitCode::from(1);
        }
    };
    let result = match command {
        Command::Holds { output } => capo::ops::holds(client, output).await,
        Command::Policies { output } => capo::ops::policies(client, output).await,
        Command::Release { ips, wait } => capo::ops::release(client, &ips, wait.as_std()).await,
        Command::Extend { ip, for_, wait } => capo::ops::extend(client, ip, for_.as_std(), wait.as_std()).await,
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

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {},
        _ = tokio::signal::ctrl_c() => {},
    }
}
