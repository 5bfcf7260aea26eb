use clap::Parser;
use tracing::{error, info};

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = capo::cli::Args::parse();
    capo::telemetry::init(&args.log_format);
    match run(args).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            error!(error = %e, "capo stopped");
            std::process::ExitCode::FAILURE
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

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {},
        _ = tokio::signal::ctrl_c() => {},
    }
}
