//! `cistern`: the command-line tool.
//!
//! This crate owns argument parsing and presentation (tables, JSON, SVG plots, progress). The
//! work itself lives in the libraries: trace readers and workload generators in
//! `cistern-trace`, allocator models and the replay engine in `cistern-replay`.

mod convert;
mod plot;
mod replay;
mod table;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// cistern: a CUDA memory allocator, and tools to see where GPU memory goes.
#[derive(Parser)]
#[command(name = "cistern", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Replay allocation traces against allocators on a simulated GPU and compare how much
    /// memory each one reserves (fragmentation, smallest device that runs the trace, driver
    /// calls, speed). With no trace and no workload, runs the built-in workloads.
    Replay(ReplayArgs),
    /// Convert a trace (any format `replay` reads) to cistern's own format or to a RAPIDS RMM
    /// log (`logging_resource_adaptor` CSV), one output per device.
    Convert(ConvertArgs),
}

/// Arguments of `cistern convert`.
#[derive(clap::Args, Debug)]
pub struct ConvertArgs {
    /// The trace to convert.
    pub input: PathBuf,
    /// Output format.
    #[arg(long, value_enum, default_value = "cistern")]
    pub to: convert::Target,
    /// Output file (default: standard output). With several devices, `.devN` is appended for
    /// device N > 0.
    #[arg(long, short = 'o')]
    pub output: Option<PathBuf>,
}

/// Arguments of `cistern replay`.
#[derive(clap::Args, Debug)]
pub struct ReplayArgs {
    /// Trace files: PyTorch memory snapshots (.pickle), PyTorch profiler traces (.json,
    /// .json.gz), RAPIDS RMM logs (.csv), MiniMalloc instances (.csv), cistern traces.
    pub files: Vec<PathBuf>,
    /// Built-in workloads to run (repeatable); `--workload list` lists them.
    #[arg(long = "workload", short = 'w')]
    pub workloads: Vec<String>,
    /// Allocators to compare, comma-separated; `--allocators list` lists them.
    #[arg(long, short = 'a', value_delimiter = ',')]
    pub allocators: Vec<String>,
    /// Capacity of the simulated device (e.g. 80GiB); by default large enough for each trace.
    #[arg(long, short = 'c')]
    pub capacity: Option<String>,
    /// Skip the search for the smallest device that runs each trace (faster).
    #[arg(long)]
    pub no_min_capacity: bool,
    /// Print one JSON document instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Write an SVG plot of reserved and live memory over time per allocator.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Replay(args) => replay::run(&args),
        Command::Convert(args) => convert::run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cistern: {e}");
            ExitCode::from(2)
        }
    }
}
