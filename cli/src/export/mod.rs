//! `cistern export`: a long-running Prometheus exporter of what `cistern ps` shows, for the
//! people who read Prometheus and Grafana next to dcgm-exporter rather than a shell on the node.
//! This module owns the command (its arguments, the listening socket, the HTTP routes, content
//! negotiation and shutdown); [`collect`] builds a scrape's samples from the registry and NVML,
//! [`metrics`] names them and encodes them.
//!
//! # Crates, and why
//!
//! - **`prometheus-client`**, the Prometheus project's own Rust client, writes both formats:
//!   OpenMetrics 1.0.0 (`# UNIT`, counters' `_total`, `# EOF`) and, since 0.26, the Prometheus
//!   text format 0.0.4; since 0.25.2 it escapes label values (`\`, `"`, newlines), which
//!   commands and tags need. Its `Collector` fits an exporter that reads its numbers afresh on
//!   each scrape. (The `prometheus` crate writes only 0.0.4; the others are smaller projects.)
//! - **`tiny_http`**: a small, blocking HTTP/1.1 server with no async runtime. One scrape every
//!   few seconds needs no more, and tokio or axum would cost minutes of build on small machines
//!   for nothing the exporter uses.
//! - **`signal-hook`** (its `flag` module, no default features): SIGTERM and SIGINT set a flag
//!   that the serving loop polls, so the exporter stops cleanly, without `unsafe` here.
//!
//! # Negotiation
//!
//! `/metrics` answers OpenMetrics when the `Accept` header ranks
//! `application/openmetrics-text` (version 1.0.0, 0.0.1 or none) at least as high as the text
//! format (`text/plain`, `text/*`, `*/*`), as Prometheus asks by default; anything else,
//! including no header or types the exporter cannot write, gets the text format 0.0.4.

pub mod collect;
pub mod kube;
pub mod metrics;

use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::gpu::{self, GpuView};
use crate::registry_dirs::{registry_dirs, Dirs, SkippedDir};
use collect::Options;
use metrics::{Format, Value};

/// Arguments of `cistern export`.
#[derive(clap::Args, Debug)]
pub struct ExportArgs {
    /// The address to serve /metrics on, HOST:PORT (0.0.0.0:9400 for every interface; port 0
    /// picks a free one, printed at start).
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:9400")]
    pub listen: String,
    /// The registry directory (default: CISTERN_CONF's registry_dir, else the per-user one).
    #[arg(long, value_name = "DIR")]
    pub registry_dir: Option<PathBuf>,
    /// Export every user's registry directory that this user may read (root: all), each
    /// checked against the uid in its name, looked up again on every scrape (as `ps
    /// --all-users`); --registry-dir, when given, is read as well.
    #[arg(long)]
    pub all_users: bool,
    /// How many tags per process and GPU are labelled; the rest are summed as tag="other".
    #[arg(long, value_name = "N", default_value_t = 10)]
    pub top_tags: usize,
    /// The kubelet's container log folder, whose link names give the pod, namespace and
    /// container names of the container ids in records (`none` to read none).
    #[arg(long, value_name = "DIR", default_value = kube::DEFAULT_DIR)]
    pub kube_logs: PathBuf,
    /// Label processes with their whole command line (cut to 120 characters) instead of the
    /// program and script alone. Arguments can hold secrets (tokens, paths): the metrics are
    /// readable by whoever reaches the port.
    #[arg(long)]
    pub full_command: bool,
    /// Serve an answer again to requests within this many seconds of it (0 to 60; 0: every
    /// request scrapes afresh), so that a flood of requests costs one scrape per interval.
    #[arg(long, value_name = "SECONDS", default_value_t = 1.0)]
    pub fresh_for: f64,
    /// Print the metrics once (Prometheus text format 0.0.4) and exit, e.g. to check them with
    /// `promtool check metrics`.
    #[arg(long)]
    pub once: bool,
    /// List the metric names the exporter emits (name, type, labels, help) and exit.
    #[arg(long)]
    pub list_metrics: bool,
}

/// A media range of an `Accept` header: `type/subtype`, its `version` parameter and its `q`.
fn media_ranges(accept: &str) -> impl Iterator<Item = (String, Option<String>, f32)> + '_ {
    accept.split(',').filter_map(|range| {
        let mut parts = range.split(';');
        let ty = parts.next()?.trim().to_ascii_lowercase();
        if ty.is_empty() {
            return None;
        }
        let (mut version, mut q) = (None, 1.0f32);
        for p in parts {
            let Some((k, v)) = p.split_once('=') else {
                continue;
            };
            let v = v.trim().trim_matches('"');
            match k.trim().to_ascii_lowercase().as_str() {
                "version" => version = Some(v.to_string()),
                "q" => q = v.parse().ok().filter(|q: &f32| (0.0..=1.0).contains(q))?,
                _ => {}
            }
        }
        Some((ty, version, q))
    })
}

/// The format to answer a request with this `Accept` header (see the module docs).
pub fn negotiate(accept: Option<&str>) -> Format {
    let Some(accept) = accept else {
        return Format::Prometheus;
    };
    let (mut om, mut text) = (0.0f32, 0.0f32);
    for (ty, version, q) in media_ranges(accept) {
        match ty.as_str() {
            "application/openmetrics-text"
                if matches!(version.as_deref(), None | Some("1.0.0") | Some("0.0.1")) =>
            {
                om = om.max(q)
            }
            "text/plain" if matches!(version.as_deref(), None | Some("0.0.4")) => {
                text = text.max(q)
            }
            "text/*" | "*/*" => text = text.max(q),
            _ => {}
        }
    }
    if om > 0.0 && om >= text {
        Format::OpenMetrics
    } else {
        Format::Prometheus
    }
}

/// The `--listen` address, or an error that says what is expected.
fn listen_addr(arg: &str) -> Result<SocketAddr, String> {
    let bad = |why: String| {
        format!(
            "--listen {arg:?}: {why}; expected HOST:PORT, e.g. 127.0.0.1:9400 (this host only) \
             or 0.0.0.0:9400 (every interface)"
        )
    };
    let mut addrs = arg.to_socket_addrs().map_err(|e| bad(e.to_string()))?;
    addrs
        .next()
        .ok_or_else(|| bad("the host name has no address".into()))
}

/// Binds the listening socket, with errors that name the fix.
fn bind(arg: &str) -> Result<TcpListener, String> {
    let addr = listen_addr(arg)?;
    TcpListener::bind(addr).map_err(|e| match e.kind() {
        std::io::ErrorKind::AddrInUse => format!(
            "--listen {addr}: the port is in use (dcgm-exporter also serves on 9400 by \
             default): pick another port, e.g. --listen {}:9401, or stop what holds it \
             (`ss -ltnp 'sport = :{}'` names it)",
            addr.ip(),
            addr.port()
        ),
        std::io::ErrorKind::PermissionDenied => format!(
            "--listen {addr}: permission denied (ports below 1024 need root or \
             CAP_NET_BIND_SERVICE): use a port from 1024 up, e.g. --listen {}:9400",
            addr.ip()
        ),
        std::io::ErrorKind::AddrNotAvailable => format!(
            "--listen {addr}: no interface of this host has that address: use 127.0.0.1, \
             0.0.0.0, or one of `ip -brief address`"
        ),
        _ => format!("--listen {addr}: {e}"),
    })
}

/// The `Hostname` label of GPU metrics: `NODE_NAME` (set from the pod's `spec.nodeName` in the
/// DaemonSet, as dcgm-exporter does), else the kernel's host name.
fn hostname() -> String {
    std::env::var("NODE_NAME")
        .ok()
        .filter(|n| !n.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|h| h.trim().to_string())
        })
        .unwrap_or_default()
}

/// The exporter: what it reads, and how many scrapes it served.
pub struct Exporter {
    view: Box<dyn GpuView>,
    /// `--registry-dir`, when given.
    registry_dir: Option<PathBuf>,
    /// `--all-users`: every user's directory, looked up afresh on each scrape (a user whose
    /// first process starts after the exporter is seen on the next scrape).
    all_users: bool,
    opts: Options,
    warnings: collect::Warnings,
    scrapes: AtomicU64,
    /// How long an answer is served again (`--fresh-for`, default [`FRESH_FOR`]).
    fresh_for: Duration,
    /// The last answer in each format, and when it was made.
    cache: Mutex<Vec<(Format, Instant, Arc<String>)>>,
    /// Answers being written by their threads ([`MAX_IN_FLIGHT`]).
    in_flight: Arc<AtomicUsize>,
}

/// By default, an answer is served again to scrapes within this time of it: a flood of
/// requests (many clients, or one pipelining GETs) costs one scrape a second, not one each.
pub const FRESH_FOR: Duration = Duration::from_secs(1);
/// At most this many answers are written at once, each on a thread of its own; beyond it, a
/// request is answered 503 at once (a client that never reads must not make the exporter
/// hold one thread and one answer per request).
pub const MAX_IN_FLIGHT: usize = 16;

impl Exporter {
    /// An exporter of the directories `registry_dirs(registry_dir, all_users)` names; fails as
    /// that does (an invalid `CISTERN_CONF`), so that a bad setting stops it at start.
    pub fn new(
        view: Box<dyn GpuView>,
        registry_dir: Option<PathBuf>,
        all_users: bool,
        opts: Options,
    ) -> Result<Exporter, String> {
        registry_dirs(registry_dir.as_deref(), all_users)?;
        Ok(Exporter {
            view,
            registry_dir,
            all_users,
            opts,
            warnings: collect::Warnings::default(),
            scrapes: AtomicU64::new(0),
            fresh_for: FRESH_FOR,
            cache: Mutex::new(Vec::new()),
            in_flight: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// How long an answer is served again (0: every request scrapes).
    pub fn fresh_for(mut self, d: Duration) -> Exporter {
        self.fresh_for = d;
        self
    }

    /// The answer to a scrape now: the last one in this format when it is younger than
    /// `fresh_for`, else a new scrape.
    pub fn answer(&self, format: Format) -> Arc<String> {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, at, text)) = cache.iter().find(|(f, _, _)| *f == format) {
            if at.elapsed() < self.fresh_for {
                return Arc::clone(text);
            }
        }
        let text = Arc::new(self.scrape(format));
        cache.retain(|(f, _, _)| *f != format);
        cache.push((format, Instant::now(), Arc::clone(&text)));
        text
    }

    /// The directories to read now.
    fn dirs(&self) -> Dirs {
        registry_dirs(self.registry_dir.as_deref(), self.all_users).unwrap_or_else(|e| {
            // CISTERN_CONF cannot change under a running process: only a race with a
            // directory disappearing gets here. Report it as a directory that is down.
            let path = self.registry_dir.clone().unwrap_or_default();
            Dirs {
                refused: vec![SkippedDir {
                    path,
                    uid: None,
                    reason: e,
                }],
                ..Dirs::default()
            }
        })
    }

    /// One scrape, encoded.
    pub fn scrape(&self, format: Format) -> String {
        let n = self.scrapes.fetch_add(1, Ordering::Relaxed) + 1;
        let dirs = self.dirs();
        let mut x = collect::collect(self.view.as_ref(), &dirs, &self.opts, &self.warnings);
        x.add("cistern_exporter_scrapes_total", vec![], Value::Count(n));
        metrics::encode(&x, format)
    }
}

const INDEX: &str = "<!DOCTYPE html>
<html><head><meta charset=\"utf-8\"><title>cistern exporter</title></head>
<body><h1>cistern exporter</h1>
<p>GPU memory by process, tag and device, from cistern's registry and NVML:
<a href=\"/metrics\">/metrics</a>.</p>
<p>Registry directories read: DIRS</p>
</body></html>
";

fn html_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn header(name: &str, value: &str) -> tiny_http::Header {
    tiny_http::Header::from_bytes(name.as_bytes(), value.as_bytes())
        .expect("static header names and values are valid")
}

fn respond(exporter: &Exporter, req: tiny_http::Request) {
    use tiny_http::{Method, Response};
    let path = req.url().split('?').next().unwrap_or("").to_string();
    let get = matches!(req.method(), Method::Get | Method::Head);
    let resp = match (get, path.as_str()) {
        (true, "/metrics") => {
            let accept = req
                .headers()
                .iter()
                .find(|h| h.field.equiv("Accept"))
                .map(|h| h.value.as_str().to_string());
            let format = negotiate(accept.as_deref());
            Response::from_string(exporter.answer(format).as_str())
                .with_header(header("Content-Type", format.content_type()))
        }
        (true, "/") => {
            let dirs = exporter
                .dirs()
                .paths()
                .iter()
                .map(|d| format!("<code>{}</code>", html_escape(&d.display().to_string())))
                .collect::<Vec<_>>()
                .join(", ");
            Response::from_string(INDEX.replace("DIRS", &dirs))
                .with_header(header("Content-Type", "text/html; charset=utf-8"))
        }
        (true, _) => Response::from_string("not found: the metrics are at /metrics\n")
            .with_status_code(404)
            .with_header(header("Content-Type", "text/plain; charset=utf-8")),
        (false, _) => Response::from_string("only GET and HEAD are served\n")
            .with_status_code(405)
            .with_header(header("Allow", "GET, HEAD"))
            .with_header(header("Content-Type", "text/plain; charset=utf-8")),
    };
    // The answer is written on a thread of its own, so that a client that reads slowly (or
    // not at all) cannot hold up the next scrape; one that hung up needs nothing more. Past
    // MAX_IN_FLIGHT such threads the request gets a short 503 here instead.
    let in_flight = Arc::clone(&exporter.in_flight);
    if in_flight.fetch_add(1, Ordering::SeqCst) >= MAX_IN_FLIGHT {
        in_flight.fetch_sub(1, Ordering::SeqCst);
        let _ = req.respond(busy());
        return;
    }
    let slot = Arc::clone(&in_flight);
    let spawned = std::thread::Builder::new()
        .name("cistern-export-answer".into())
        .spawn(move || {
            let _ = req.respond(resp);
            slot.fetch_sub(1, Ordering::SeqCst);
        });
    if spawned.is_err() {
        // No thread could be made (a pids limit): the request is dropped with its
        // connection, and the exporter goes on.
        in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The answer when too many are being written already.
fn busy() -> tiny_http::Response<std::io::Cursor<Vec<u8>>> {
    tiny_http::Response::from_string("busy: too many answers are being written; retry\n")
        .with_status_code(503)
        .with_header(header("Retry-After", "1"))
        .with_header(header("Content-Type", "text/plain; charset=utf-8"))
}

fn print_metric_list() {
    for d in metrics::METRICS {
        let kind = match d.kind {
            metrics::Kind::Gauge => "gauge",
            metrics::Kind::Counter => "counter",
        };
        println!("{}\t{kind}\t{}\t{}", d.name, d.labels, d.help);
    }
}

pub fn run(args: &ExportArgs) -> Result<(), String> {
    if args.list_metrics {
        print_metric_list();
        return Ok(());
    }
    let opts = Options {
        top_tags: args.top_tags,
        full_command: args.full_command,
        hostname: hostname(),
        kube_logs: Some(args.kube_logs.clone()).filter(|p| p.as_os_str() != "none"),
    };
    if !(0.0..=60.0).contains(&args.fresh_for) {
        return Err(format!(
            "--fresh-for {}: expected a number of seconds from 0 to 60 (default 1)",
            args.fresh_for
        ));
    }
    let exporter = Exporter::new(
        gpu::from_env()?,
        args.registry_dir.clone(),
        args.all_users,
        opts,
    )?
    .fresh_for(Duration::from_secs_f64(args.fresh_for));
    if args.once {
        print!("{}", exporter.scrape(Format::Prometheus));
        return Ok(());
    }

    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, Arc::clone(&stop))
            .map_err(|e| format!("installing the handler of signal {sig}: {e}"))?;
    }
    let listener = bind(&args.listen)?;
    let local = listener
        .local_addr()
        .map_err(|e| format!("--listen {}: {e}", args.listen))?;
    let server = tiny_http::Server::from_listener(listener, None)
        .map_err(|e| format!("--listen {local}: {e}"))?;
    eprintln!(
        "cistern export: serving http://{local}/metrics (registry: {})",
        exporter
            .dirs()
            .paths()
            .iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    while !stop.load(Ordering::SeqCst) {
        match server.recv_timeout(Duration::from_millis(200)) {
            Ok(Some(req)) => respond(&exporter, req),
            Ok(None) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("serving on {local}: {e}")),
        }
    }
    eprintln!("cistern export: stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negotiation() {
        // What Prometheus sends by default (2.x): OpenMetrics first.
        let prom = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;\
                    version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert_eq!(negotiate(Some(prom)), Format::OpenMetrics);
        // Prometheus told to prefer the text format.
        assert_eq!(
            negotiate(Some(
                "text/plain;version=0.0.4,application/openmetrics-text;q=0.5"
            )),
            Format::Prometheus
        );
        // curl, browsers, nothing: the text format.
        assert_eq!(negotiate(Some("*/*")), Format::Prometheus);
        assert_eq!(
            negotiate(Some("text/html,application/xhtml+xml,*/*;q=0.8")),
            Format::Prometheus
        );
        assert_eq!(negotiate(None), Format::Prometheus);
        // Case and spaces do not matter; a version the exporter cannot write is not chosen.
        assert_eq!(
            negotiate(Some(" Application/OpenMetrics-Text ; Version=1.0.0 ")),
            Format::OpenMetrics
        );
        assert_eq!(
            negotiate(Some("application/openmetrics-text;version=2.0.0")),
            Format::Prometheus
        );
        // q=0 means "not this one"; a bad q drops the range.
        assert_eq!(
            negotiate(Some("application/openmetrics-text;q=0,*/*")),
            Format::Prometheus
        );
        assert_eq!(
            negotiate(Some("application/openmetrics-text;q=zz")),
            Format::Prometheus
        );
        assert_eq!(
            Format::OpenMetrics.content_type(),
            "application/openmetrics-text; version=1.0.0; charset=utf-8"
        );
        assert_eq!(
            Format::Prometheus.content_type(),
            "text/plain; version=0.0.4; charset=utf-8"
        );
    }

    #[test]
    fn listen_errors_name_the_fix() {
        let e = listen_addr("9400").unwrap_err();
        assert!(e.contains("expected HOST:PORT, e.g. 127.0.0.1:9400"), "{e}");
        assert!(listen_addr("127.0.0.1:notaport").is_err());
        let held = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = held.local_addr().unwrap().port();
        let e = bind(&format!("127.0.0.1:{port}")).unwrap_err();
        assert!(
            e.contains("the port is in use") && e.contains("--listen 127.0.0.1:9401"),
            "{e}"
        );
    }

    #[test]
    fn html_is_escaped() {
        assert_eq!(html_escape("<a&\"b\">"), "&lt;a&amp;&quot;b&quot;&gt;");
    }
}
