//! The `facegate` binary: parse flags, then serve or bench.

use clap::Parser;
use facegate::cli::{Cli, Command};

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("FACEGATE_LOG").unwrap_or_else(|_| "info,wasmtime=warn,ort=warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let mut cli = Cli::parse();
    // Before the async runtime starts: its threads inherit the handlers' cores.
    let engine = match &mut cli.command {
        Command::Serve(config) => Some(&mut config.engine),
        Command::Bench(config) => Some(&mut config.serve.engine),
        _ => None,
    };
    if let Some(engine) = engine {
        facegate::cores::reserve(engine)?;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    match cli.command {
        Command::Serve(config) => runtime.block_on(facegate::run(config)),
        Command::Bench(config) => runtime.block_on(facegate::bench::run(config)),
        client => {
            let code = runtime.block_on(facegate::cli::run(client))?;
            std::process::exit(code)
        }
    }
}
