//! `felix`: run a broker, and administer and use one over the wire protocol.

mod args;
mod commands;
mod output;
mod serve;

use std::process::ExitCode;

use clap::Parser;

use args::{Cli, Command};
use felix_client::ClientError;

/// Why a command failed, and how to say so.
#[derive(Debug)]
pub enum CliError {
    /// A call to the broker failed.
    Client(ClientError),
    /// A call failed after the command had done part of its work (stored
    /// or printed records, and said how many): never run again whole.
    Partial(ClientError),
    /// The arguments were fine for clap but make no sense together.
    Usage(String),
    /// Reading stdin or writing stdout failed.
    Io(std::io::Error),
    /// `felix serve` failed.
    Serve(String),
}

impl From<ClientError> for CliError {
    fn from(e: ClientError) -> CliError {
        CliError::Client(e)
    }
}

impl From<std::io::Error> for CliError {
    fn from(e: std::io::Error) -> CliError {
        CliError::Io(e)
    }
}

impl CliError {
    /// `error: <code>: <message>` on stderr; the exit code (2 for usage).
    fn report(&self) -> ExitCode {
        let (code, message, exit) = match self {
            // An argument the client refused (before sending anything) is
            // a usage error too.
            CliError::Client(e @ ClientError::InvalidArgument(_)) => (e.kind(), e.message(), 2),
            CliError::Client(e) | CliError::Partial(e) => (e.kind(), e.message(), 1),
            CliError::Usage(m) => ("usage", m.clone(), 2),
            CliError::Io(e) => ("io", e.to_string(), 1),
            CliError::Serve(m) => ("serve", m.clone(), 1),
        };
        eprintln!("error: {code}: {message}");
        ExitCode::from(exit)
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        // The broker runs its own executors and logging; no tokio runtime.
        Command::Serve(args) => serve::run(args),
        command => {
            init_logging();
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build();
            match runtime {
                Ok(rt) => rt.block_on(commands::run(&cli.global, command)),
                Err(e) => Err(CliError::Io(e)),
            }
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // `felix read ... | head` closing the pipe is not a failure.
        Err(CliError::Io(e)) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => e.report(),
    }
}

/// Client-side logs go to stderr, filtered by `FELIX_LOG` (default: warn).
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("FELIX_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    use std::io::IsTerminal;
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}
