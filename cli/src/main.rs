//! `cistern`: the command-line tool.
//!
//! This crate owns argument parsing and presentation (tables, JSON, SVG plots, progress). The
//! work itself lives in the libraries: trace readers and workload generators in
//! `cistern-trace`, allocator models and the replay engine in `cistern-replay`.

mod convert;
mod doctor;
mod export;
mod gpu;
mod leaks;
mod plot;
mod ps;
mod registry_dirs;
mod replay;
mod table;
mod whatif;
mod xid;

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
    #[command(after_long_help = replay::COLUMNS)]
    Replay(ReplayArgs),
    /// Convert a trace (any format `replay` reads) to cistern's own format or to a RAPIDS RMM
    /// log (`logging_resource_adaptor` CSV), one output per device.
    Convert(ConvertArgs),
    /// Who holds GPU memory: per GPU and per process, NVML's numbers reconciled with the
    /// records of processes using cistern (live, cached, pending, overhead, top tags), including
    /// dead processes whose memory or record remains, processes in containers (by host pid) and
    /// on the simulated GPU; then the last OOM reports and the driver's recent Xid errors.
    Ps(PsArgs),
    /// A process's live blocks by tag and call site (with ages and growth since marks), from
    /// its newest record; works for dead processes.
    Leaks(LeaksArgs),
    /// Check for orphaned and zombie GPU contexts, processes holding /dev/nvidia* after their
    /// group leader died, killed processes' stale records, unsafe registry directories and the
    /// GPU driver's recent Xid errors. A clean exit is never "attention". Exit status 0 when
    /// healthy, 1 when something needs attention, 2 on error. Suggests actions; never kills.
    Doctor(DoctorArgs),
    /// For each OOM recorded in a PyTorch memory snapshot: the capacity the allocator had, and
    /// whether the request would have fitted with other PyTorch settings
    /// (PYTORCH_CUDA_ALLOC_CONF) or with cistern, and with how much to spare.
    Whatif(whatif::WhatifArgs),
    /// Serve Prometheus metrics (text format, or OpenMetrics on negotiation) of what `ps`
    /// shows: memory by process, tag and GPU, process states (dead ones holding memory
    /// included), unattributed memory per GPU, with labels that join dcgm-exporter's.
    Export(export::ExportArgs),
}

/// Arguments of `cistern ps`.
#[derive(clap::Args, Debug)]
pub struct PsArgs {
    /// Print JSON instead of tables (one document per line in watch mode).
    #[arg(long)]
    pub json: bool,
    /// Watch mode: redraw every SECONDS (0.01 to 86400).
    #[arg(long = "interval", short = 'i', value_name = "SECONDS")]
    pub interval: Option<f64>,
    /// Stop watch mode after N redraws (for tests).
    #[arg(long, hide = true)]
    pub iterations: Option<u64>,
    /// The registry directory (default: CISTERN_CONF's registry_dir, else the per-user one).
    #[arg(long, value_name = "DIR")]
    pub registry_dir: Option<PathBuf>,
    /// Read every user's registry directory this user may read (root: all), each checked
    /// against the uid in its name; unsafe ones are refused by name.
    #[arg(long)]
    pub all_users: bool,
}

/// Arguments of `cistern leaks`.
#[derive(clap::Args, Debug)]
pub struct LeaksArgs {
    /// The process id (the record of the process that has it now, else its newest record).
    pub pid: u32,
    /// Print JSON instead of tables.
    #[arg(long)]
    pub json: bool,
    /// The registry directory (default: CISTERN_CONF's registry_dir, else the per-user one).
    #[arg(long, value_name = "DIR")]
    pub registry_dir: Option<PathBuf>,
}

/// Arguments of `cistern doctor`.
#[derive(clap::Args, Debug)]
pub struct DoctorArgs {
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// How long (seconds) the record of a process that died without exiting cleanly (killed,
    /// crashed) may stay before it needs attention; a clean exit never does.
    #[arg(long, value_name = "SECONDS", default_value_t = 60.0)]
    pub grace: f64,
    /// Remove stale records: only those of dead processes NVML does not list, last written
    /// more than the grace period ago. Nothing else is ever removed or killed.
    #[arg(long)]
    pub clean_stale: bool,
    /// The registry directory (default: CISTERN_CONF's registry_dir, else the per-user one).
    #[arg(long, value_name = "DIR")]
    pub registry_dir: Option<PathBuf>,
    /// Read every user's registry directory this user may read (root: all), each checked
    /// against the uid in its name; unsafe ones are refused by name (and need attention).
    #[arg(long)]
    pub all_users: bool,
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
    /// The most bytes taken from the input, read and decompressed (e.g. 16GiB; default 4 GiB
    /// read, and a gzipped input expanding to at most 100 times its size, at least 256 MiB).
    #[arg(long, value_name = "SIZE")]
    pub max_input: Option<String>,
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
    /// Capacity of the simulated device, with its unit (e.g. 80GiB, 512MB, 4096B); by default
    /// large enough for each trace.
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
    /// Price driver calls with this cost table (JSON, keyed by call kind; default: published
    /// A100 figures, as in replay/costs/a100-published.json).
    #[arg(long, value_name = "FILE.json")]
    pub costs: Option<PathBuf>,
    /// Replay cistern's models on a GPU that runs N kernels behind the host on each stream
    /// (each allocation launches one over its block): pages freed moments ago are still busy,
    /// as on a real GPU. Default 0: every kernel has finished before the next call. Per model:
    /// `--allocators cistern@lag=2`.
    #[arg(long, value_name = "N")]
    pub gpu_lag: Option<u32>,
    /// The most bytes taken from each input, read and decompressed (e.g. 16GiB; default 4 GiB
    /// read, and a gzipped input expanding to at most 100 times its size, at least 256 MiB).
    #[arg(long, value_name = "SIZE")]
    pub max_input: Option<String>,
    /// Start every PyTorch model, not only pytorch-as-recorded (which always does), from the
    /// allocator state a snapshot recorded when its window opened: its segments reserved and
    /// the blocks live then in place.
    #[arg(long)]
    pub seeded: bool,
    /// Seed of the built-in workloads' generators (default 42, so that every machine gets the
    /// same rows). Another seed draws another program of the same kind: a result that holds
    /// on one seed only is luck. A row drawn from another seed says it (`seed N`).
    #[arg(long, value_name = "N")]
    pub seed: Option<u64>,
}

/// Gives SIGPIPE back its default action, which Rust's runtime sets to "ignore": a command
/// whose reader has gone (`cistern replay ... | head -1`) then ends quietly, killed by SIGPIPE
/// as other Unix tools are (the shell reports status 141), instead of panicking on the failed
/// write to stdout.
fn restore_sigpipe() {
    // SAFETY: called first thing in `main`, before any other thread exists; `signal` with
    // `SIG_DFL` installs no handler (no code of ours runs in signal context).
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

fn main() -> ExitCode {
    restore_sigpipe();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Replay(args) => replay::run(&args).map(|()| ExitCode::SUCCESS),
        Command::Convert(args) => convert::run(&args).map(|()| ExitCode::SUCCESS),
        Command::Ps(args) => ps::run(&args).map(|()| ExitCode::SUCCESS),
        Command::Leaks(args) => leaks::run(&args).map(|()| ExitCode::SUCCESS),
        Command::Doctor(args) => doctor::run(&args),
        Command::Whatif(args) => whatif::run(&args).map(|()| ExitCode::SUCCESS),
        Command::Export(args) => export::run(&args).map(|()| ExitCode::SUCCESS),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            // Errors may quote a record or a trace: escaped as the tables are.
            eprintln!("cistern: {}", table::printable_lines(&e));
            ExitCode::from(2)
        }
    }
}
