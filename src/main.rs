use tracing::{error, info};

use capo::cli::{Cli, Command};

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse_args();
    let target = cli.kube.target();
    match cli.command {
        Command::Run(args) => {
            capo::telemetry::init(&args.log_format, &args.log_level);
            match run(&target, *args).await {
                Ok(()) => std::process::ExitCode::SUCCESS,
                Err(e) => {
                    error!(error = %e, "capo stopped");
                    std::process::ExitCode::FAILURE
                }
            }
        }
        command => operator(&target, command).await,
    }
}

async fn run(target: &capo::client::Target, args: capo::cli::Args) -> Result<(), Box<dyn std::error::Error>> {
    let settings = args.settings()?;
    let (client, leader_client) = capo::client::infer_pair(target, args.api_tcp_nodelay, &args.identity()).await?;
    let app = capo::App::start_with_leader_client(client, leader_client, settings).await?;
    shutdown_signal().await;
    info!("shutting down");
    app.shutdown().await;
    Ok(())
}

/// `capo holds|release|extend|policies|migrate`: print the answer, or the error and its
/// exit code.
async fn operator(target: &capo::client::Target, command: Command) -> std::process::ExitCode {
    if let Command::Migrate { file } = &command {
        return migrate(file);
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = match capo::client::infer(target, true).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("capo: {e}");
            return std::process::ExitCode::from(1);
        }
    };
    let result = match command {
        Command::Holds { scope, output, capo_namespace } => {
            capo::ops::holds(client, output, scope.namespace.as_deref(), &capo_namespace).await
        }
        Command::Policies { output } => capo::ops::policies(client, output).await,
        Command::Explain { pod, namespace, output, capo_namespace } => {
            let (namespace, name) = capo::cli::explain_target(&pod, &namespace);
            capo::explain::explain(client, &namespace, &name, &capo_namespace, output).await
        }
        Command::Release { ips, wait } => capo::ops::release(client, &ips, wait.as_std()).await,
        Command::Extend { ip, for_, wait } => capo::ops::extend(client, ip, for_.as_std(), wait.as_std()).await,
        Command::TakeOver(args) => return take_over(client, &args).await,
        Command::Migrate { .. } | Command::Run(_) => unreachable!("handled without a cluster"),
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
async fn take_over(client: kube::Client, args: &capo::cli::TakeOverArgs) -> std::process::ExitCode {
    let settings = match args.settings() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("capo: {e}");
            return std::process::ExitCode::from(2);
        }
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
