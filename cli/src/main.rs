//! `felix`: run a broker, and administer and use one over the wire protocol.

mod args;
mod commands;
mod output;
mod serve;

use std::process::ExitCode;

use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches};

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
        eprintln!("error: {code}: {message}{}", hint(code, &message));
        ExitCode::from(exit)
    }
}

/// What to do about the commonest failures, where the message alone does
/// not say.
fn hint(code: &str, message: &str) -> &'static str {
    if code == "unauthorized" && message.contains("requires a token") {
        " (pass --token or set FELIX_TOKEN)"
    } else if code == "io" && message.contains("Connection refused") {
        " (is `felix serve` running there? --broker or FELIX_BROKER names the broker, \
         127.0.0.1:7400 by default)"
    } else {
        ""
    }
}

fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let mut cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    cli.global.shard_left_out = shard_left_out(&matches);
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

/// The stream of a one-shard command run without `--shard` (so on shard
/// 0), to point out the other shards if it has them.
fn shard_left_out(matches: &ArgMatches) -> Option<felix_client::StreamRef> {
    let mut m = matches;
    while let Some((_, sub)) = m.subcommand() {
        m = sub;
    }
    let defaulted = matches!(m.try_get_raw("shard"), Ok(Some(_)))
        && m.value_source("shard") == Some(ValueSource::DefaultValue);
    let every_shard = matches!(m.try_get_one::<bool>("all_shards"), Ok(Some(true)));
    if !defaulted || every_shard {
        return None;
    }
    m.try_get_one::<felix_client::StreamRef>("stream")
        .ok()
        .flatten()
        .cloned()
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
