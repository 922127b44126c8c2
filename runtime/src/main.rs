//! The `facegate` binary: parse flags, then serve, run an admin command,
//! or hand `bench` to the `facegate-bench` binary beside it.

use anyhow::Context;
use clap::Parser;
use facegate::cli::{Cli, Command};

fn main() -> anyhow::Result<()> {
    facegate::cli::init_logging();
    let mut cli = Cli::parse();
    if let Command::Bench { args } = &mut cli.command {
        std::process::exit(bench(std::mem::take(args))?);
    }
    // Before the async runtime starts: its threads inherit the handlers' cores.
    let engine = match &mut cli.command {
        Command::Serve(config) => Some(&mut config.engine),
        _ => None,
    };
    if let Some(engine) = engine {
        facegate::serve::cores::reserve(engine)?;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    match cli.command {
        Command::Serve(config) => runtime.block_on(facegate::run(config)),
        client => {
            let code = runtime.block_on(facegate::cli::run(client))?;
            std::process::exit(code)
        }
    }
}

/// Runs `facegate-bench` (a binary of its own, so that the gateway links
/// none of the suites' dependencies) from this binary's directory with
/// `args`; its exit code.
fn bench(args: Vec<std::ffi::OsString>) -> anyhow::Result<i32> {
    let exe = std::env::current_exe()?.with_file_name("facegate-bench");
    let status = std::process::Command::new(&exe)
        .args(args)
        .status()
        .with_context(|| format!("cannot run {} (build it: cargo build --release -p facegate-bench)", exe.display()))?;
    Ok(status.code().unwrap_or(1))
}
