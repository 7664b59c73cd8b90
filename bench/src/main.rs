//! `felix-bench`: see `felix-bench --help` and docs/benchmarking.md.

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;
use felix_bench::cli::{Cli, Command};

fn main() -> ExitCode {
    // The harness's clients allocate a frame per request: the same malloc
    // settings as the broker (see its docs), whatever broker they drive.
    felix_server::tune_allocator();
    let cli = Cli::parse();
    if let Command::Serve(args) = &cli.command {
        return ExitCode::from(felix_bench::embedded::serve(args) as u8);
    }
    let plan = match cli.validate() {
        Ok(Some(p)) => p,
        Ok(None) => unreachable!("serve handled above"),
        Err(e) => {
            eprintln!("felix-bench: {e}");
            return ExitCode::from(2);
        }
    };
    let report = match felix_bench::run::run(&plan) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("felix-bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    let json_to_stdout = plan.common().json.as_deref() == Some(std::path::Path::new("-"));
    {
        let mut human: Box<dyn Write> = if json_to_stdout {
            Box::new(std::io::stderr())
        } else {
            Box::new(std::io::stdout())
        };
        let _ = report.print(&mut human);
    }
    if let Some(path) = &plan.common().json {
        let text = serde_json::to_string_pretty(&report).expect("report serializes");
        let written = if json_to_stdout {
            writeln!(std::io::stdout(), "{text}")
        } else {
            std::fs::write(path, text + "\n")
        };
        if let Err(e) = written {
            eprintln!("felix-bench: cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    }
    if report.ok {
        ExitCode::SUCCESS
    } else {
        eprintln!("felix-bench: the run had errors or failed a check");
        ExitCode::FAILURE
    }
}
