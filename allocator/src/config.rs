//! Pool configuration: the typed [`Config`] and its text form, `CISTERN_CONF`.
//!
//! `CISTERN_CONF` uses PyTorch's `PYTORCH_CUDA_ALLOC_CONF` syntax: `key:value` pairs separated by
//! commas, e.g. `CISTERN_CONF="memory_fraction:0.5,release_threshold:8GiB"`. It is read once,
//! when a pool is created from the environment. Unknown keys, keys given twice and bad values are
//! errors that name the key and say what would be accepted: a typo must never be silently
//! ignored.
//!
//! Sizes accept a plain byte count or a unit: `KiB`, `MiB`, `GiB`, `TiB` (powers of 1024) or
//! `KB`, `MB`, `GB`, `TB` (powers of 1000), case-insensitive, e.g. `512MiB`, `1.5GiB`.
//!
//! Every key, its default and its meaning is listed in [`KEYS`] (and in the README).

use std::fmt;

/// The default of `registry_expire`: one hour.
pub const DEFAULT_REGISTRY_EXPIRE: std::time::Duration = std::time::Duration::from_secs(3600);

/// The name of the environment variable holding the configuration.
pub const ENV_VAR: &str = "CISTERN_CONF";

/// Every configuration key: `(key, default, meaning)`. The README's table is generated from the
/// same words; a test checks that every key here appears there.
pub const KEYS: &[(&str, &str, &str)] = &[
    (
        "vmm",
        "true",
        "Use the CUDA virtual memory API (reserve address space, map physical pages on demand, \
         stitch cached pages). Falls back to cuMemAlloc segments when the device lacks VMM.",
    ),
    (
        "memory_limit",
        "none",
        "Hard per-process limit on reserved memory per device, as a size (e.g. 40GiB).",
    ),
    (
        "memory_fraction",
        "1.0",
        "Per-process limit as a fraction of device memory, in [0, 1]. With memory_limit, the \
         lower of the two applies.",
    ),
    (
        "release_threshold",
        "none",
        "Cached (reserved but unallocated) memory above this size is returned to the driver \
         after each growth and on trim(). `none` keeps the cache until empty_cache().",
    ),
    (
        "stream_sync",
        "device",
        "How growth takes cached pages whose stream's queued work may still use them: `device` \
         (never block the host: map them at their new address, make the taking stream wait for \
         that work on the GPU with cuStreamWaitEvent, and unmap the old address once an event \
         query says the work is done; where the GPU cannot keep the order, during a graph \
         capture or for a stream that cannot be named, as `pressure`), `pressure` (leave them \
         and map new memory; block the host on their stream only when the request cannot be met \
         otherwise: the limit or the device is reached) or `always` (take cached pages first, \
         waiting for their stream, even where new handles would cost less than moving them).",
    ),
    (
        "chunk_size",
        "20MiB",
        "The largest physical handle large-heap growth creates: each run of missing pages is \
         backed by handles of up to this size (the small heap uses single granules). Fewer, \
         larger handles cost fewer cuMemCreate and cuMemMap calls, but a handle moves between \
         streams and is released only whole. Rounded down to the device's granularity; \
         `2MiB` with grow_whole_chunks:off gives one handle per granule. While memory is \
         plentiful, grow_whole_chunks:auto backs large requests with handles of up to 1/32 of \
         what the process holds when that is larger.",
    ),
    (
        "chunk_split",
        "4",
        "Large-heap growth backs a request with at least this many handles (each still at most \
         chunk_size, and at least one granule): with 4, a block spans four or more, so when it \
         is freed and smaller blocks reuse its range, at most a quarter of it stays pinned by a \
         partly used handle, and whole handles can move to other streams. `none` backs each \
         run of missing pages with handles of chunk_size whatever the request: fewer \
         cuMemCreate calls (with grow_whole_chunks:off, on the dev snapshots and built-in \
         workloads, median modelled driver time 1.8x pytorch-expandable's instead of 4.3x) for \
         more memory: up to 1.2% more peak reserved there, and 13-39% more on the small, \
         tightly packed packed-* workloads. Growth that maps whole chunks does not apply it, \
         and grow_whole_chunks:auto, while memory is plentiful, lets a handle reach an eighth \
         of what the process holds where that is more than the split allows.",
    ),
    (
        "grow_whole_chunks",
        "auto",
        "When large-heap growth ends in unmapped space, back its last run with whole chunks \
         (chunk_size; chunk_split does not apply there) and map whole chunks past the request, \
         as PyTorch's expandable segments grow by 20 MiB pages: the pages beyond it are cached \
         free memory for the requests that follow, so growth happens, and costs cuMemCreate \
         calls, less often. They share a handle with the request, which is released or moved \
         to another stream only whole, so they can strand memory that stitching cannot take \
         back. `on` does it while the limit and the device keep room for one chunk more. \
         `auto` does it only while the process then holds at most a quarter of what the limit \
         and the device allow it, in chunks of at most an eighth of what it holds (but at \
         least 6 MiB or a 64th of what it may hold, whichever is less), and then \
         also backs large requests with handles of up to 1/32 of what it holds (and up to an \
         eighth of it whatever chunk_split says); and while it \
         holds at most a third, with new handles rather than by moving cached chunks where \
         moving them costs more (two or more of them): cheap growth while memory is \
         plentiful, memory first as it runs short. `off` never does. On the \
         dev snapshots, median modelled driver time 0.86x pytorch-expandable's with `auto` \
         (1.03x with `on`, 4.9x with `off`), for at most 1.7% more peak reserved than \
         expandable on a device with room; the smallest device each dev snapshot and built-in \
         workload runs on is within 0.8% of `off`'s (`on`: up to 66% more on packed-*).",
    ),
    (
        "peer_access",
        "none",
        "Which other devices may read and write this device's memory: `all` grants access on \
         every mapping, present and future, to every device that cuDeviceCanAccessPeer allows \
         (VMM mappings need access per peer: cuCtxEnablePeerAccess does not cover them); `none` \
         grants it only to the devices given to enable_peer_access \
         (cistern_enable_peer_access, cistern_torch.enable_peer_access). Each peer adds a \
         descriptor to every cuMemSetAccess.",
    ),
    (
        "small_size",
        "1MiB",
        "Requests up to this size are served from the small heap (its own pages, so short-lived \
         small blocks do not pin pages of large ones). A multiple of 512 B, at most 64 MiB.",
    ),
    (
        "record",
        "none",
        "Record every allocation and free of this process to a cistern trace file at this path \
         (device N>0 writes PATH.devN), for `cistern replay`. `none` records nothing.",
    ),
    (
        "provenance",
        "tags",
        "What each live block records: `off` (nothing; the hot path skips it on one branch), \
         `tags` (tag, thread, stream, time; the ledger of live bytes per tag) or `stacks` (as \
         tags, plus a native call site sampled every stack_sample_rate allocations per thread).",
    ),
    (
        "stack_sample_rate",
        "1024",
        "With provenance:stacks, capture the call stack of one allocation in this many per \
         thread (the first one included). 1 captures every allocation; 0 never.",
    ),
    (
        "strict",
        "false",
        "Abort the process with a message on an invalid free (unknown pointer, double free) \
         instead of counting and ignoring it. For debugging.",
    ),
    (
        "registry",
        "on",
        "Publish this process's state (devices, reserved, live, cached, top tags, last OOM; a \
         leak summary at exit) in the per-user registry that `cistern ps`, `leaks` and `doctor` \
         read. `off` publishes nothing.",
    ),
    (
        "registry_dir",
        "/dev/shm/cistern-<uid>",
        "The registry directory: created with mode 0700; refused when it is a symlink, another \
         user's, or open to group or others. Without /dev/shm the default is \
         $XDG_RUNTIME_DIR/cistern, else /tmp/cistern-<uid>.",
    ),
    (
        "registry_expire",
        "1h",
        "How long the record of an exited process stays in the registry: after this time (since \
         its last write) `cistern ps` / `doctor` run by its owner remove it, and so does the \
         next process publishing in the directory (in the background, and only records of \
         clean exits: it has no NVML). Records of dead processes still holding memory (NVML \
         lists them, or a killed process's record with reserved bytes) or with leaks stay until \
         `cistern doctor --clean-stale`. A duration (`90s`, `30m`, `1h`, `7d`; a plain number \
         is seconds) or `never`.",
    ),
];

/// When growth may block the host on a stream's queued work (the `stream_sync` key).
///
/// Taking a cached page from an arena means unmapping it, which CUDA allows only once the work
/// queued on that arena's stream no longer uses it. Growth first asks without waiting (an event
/// recorded on the stream and queried); this setting says what it does when the stream is busy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum StreamSync {
    /// Leave the busy stream's pages and map new memory while the limit and the device allow;
    /// wait only when the request would fail otherwise (memory pressure).
    Pressure,
    /// Take cached pages before mapping new memory, waiting for their stream if needed: the
    /// least memory, at the price of host waits.
    Always,
    /// The default. Take cached pages as `Pressure` does, but move a busy stream's pages with
    /// the order kept on the GPU instead of leaving them or waiting: map them at their new address (one handle may be mapped at two), make the
    /// taking stream wait for the donor's queued work (`cuStreamWaitEvent`), and unmap the old
    /// address later, once an event query says that work is done (Note [Moves ordered on the
    /// device] in `pool/pages.rs`). Where the GPU cannot order it (a graph capture underway, a
    /// stream that cannot be named), it falls back to `Pressure`.
    Device,
}

/// Which peer devices get access to a device's memory (the `peer_access` key).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PeerAccess {
    /// Only the devices given to `enable_peer_access`.
    None,
    /// Every device that `cuDeviceCanAccessPeer` allows, from the pool's creation.
    All,
}

/// When large-heap growth backs a request with whole chunks and maps them past the request
/// (the `grow_whole_chunks` key; see `pool/vmm.rs`, Note [Chunks]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WholeChunks {
    /// Never: each request is backed with handles of at most a `chunk_split`-th of it.
    Off,
    /// While the limit and the device keep room for one chunk more.
    On,
    /// While the process would then hold at most a quarter of what the limit and the device
    /// allow it, in chunks of at most an eighth of what it holds (at least 6 MiB or a 64th of
    /// what it may hold, whichever is less); then large requests are also
    /// backed with handles of up to 1/32 of what it holds (an eighth whatever `chunk_split`
    /// says); and while it would hold at most
    /// a third, with new handles rather than by moving two or more cached chunks where moving
    /// costs more.
    Auto,
}

/// The pool's settings. `Config::default()` is what an empty `CISTERN_CONF` gives.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Config {
    /// Use virtual memory management when the device supports it.
    pub vmm: bool,
    /// Hard limit on reserved bytes per device.
    pub memory_limit: Option<u64>,
    /// Limit as a fraction of device memory, in `[0, 1]`.
    pub memory_fraction: f64,
    /// Cached bytes above this are released after growth and on `trim()`.
    pub release_threshold: Option<u64>,
    /// When growth may wait for a stream's work to take its cached pages.
    pub stream_sync: StreamSync,
    /// The size of the physical handles large-heap growth creates (see `chunk_size`).
    pub chunk_size: u64,
    /// The fewest handles large-heap growth backs a request with (`chunk_split`); `None`:
    /// handles of `chunk_size` whatever the request.
    pub chunk_split: Option<u32>,
    /// When large-heap growth maps whole chunks past the request (`grow_whole_chunks`).
    pub grow_whole_chunks: WholeChunks,
    /// Which peer devices are granted access to every mapping (`peer_access`).
    pub peer_access: PeerAccess,
    /// Requests up to this many bytes use the small heap.
    pub small_size: u64,
    /// Abort on invalid frees.
    pub strict: bool,
    /// Record a trace to this path.
    pub record: Option<std::path::PathBuf>,
    /// Publish a record in the cross-process registry.
    pub registry: bool,
    /// The registry directory; `None` is [`crate::registry::default_dir`].
    pub registry_dir: Option<std::path::PathBuf>,
    /// How long an exited process's record stays before it is removed; `None`: never.
    pub registry_expire: Option<std::time::Duration>,
    /// What each live block records.
    pub provenance: crate::provenance::Mode,
    /// With `provenance: Stacks`, one captured stack per this many allocations per thread.
    pub stack_sample_rate: u32,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            vmm: true,
            memory_limit: None,
            memory_fraction: 1.0,
            release_threshold: None,
            stream_sync: StreamSync::Device,
            chunk_size: 20 << 20,
            chunk_split: Some(4),
            grow_whole_chunks: WholeChunks::Auto,
            peer_access: PeerAccess::None,
            small_size: 1 << 20,
            strict: false,
            record: None,
            registry: true,
            registry_dir: None,
            registry_expire: Some(DEFAULT_REGISTRY_EXPIRE),
            provenance: crate::provenance::Mode::Tags,
            stack_sample_rate: 1024,
        }
    }
}

/// A configuration error: which key, and what is wrong with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    /// The offending key (or the whole entry when it has no key).
    pub key: String,
    /// What is wrong, and what would be accepted.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{ENV_VAR}: `{}`: {}", self.key, self.message)
    }
}

impl std::error::Error for ConfigError {}

fn err(key: &str, message: impl Into<String>) -> ConfigError {
    ConfigError {
        key: key.to_string(),
        message: message.into(),
    }
}

/// Parses a size such as `4096`, `512MiB`, `1.5GiB` or `2GB` into bytes.
///
/// A plain byte count is read exactly (all 64 bits); a value with a unit or a fraction is
/// rounded to the nearest byte. The error says what is wrong: a negative value, one that is not
/// a number (`nan`, `inf`, `MiB` alone), scientific notation, an unknown unit, or a size above
/// 2^64 - 1 bytes.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let example = "expected a number of bytes with an optional unit, e.g. 4096 or 512MiB";
    if t.starts_with('-') {
        return Err(format!("`{text}` is negative: {example}"));
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit = unit.trim().to_ascii_lowercase();
    if num.is_empty() {
        let what = match unit.trim_start_matches('+') {
            "nan" | "inf" | "infinity" => "is not a number",
            _ => "is not a size",
        };
        return Err(format!("`{text}` {what}: {example}"));
    }
    if let Some(exp) = unit.strip_prefix('e') {
        if exp
            .trim_start_matches(['+', '-'])
            .starts_with(|c: char| c.is_ascii_digit())
        {
            return Err(format!(
                "`{text}` is in scientific notation, which sizes do not take: write the number \
                 out or use a unit, e.g. 1000000 or 1MB"
            ));
        }
    }
    let too_large = || format!("`{text}` is too large: a size is at most 2^64 - 1 bytes (16 EiB)");
    if (unit.is_empty() || unit == "b") && !num.contains('.') {
        return num.parse::<u64>().map_err(|_| too_large());
    }
    let mult: f64 = match unit.as_str() {
        "" | "b" => 1.0,
        "kib" | "k" => 1024.0,
        "mib" | "m" => 1024.0 * 1024.0,
        "gib" | "g" => 1024.0 * 1024.0 * 1024.0,
        "tib" | "t" => 1024.0f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => {
            return Err(format!(
                "unknown unit `{unit}` in `{text}`: use bytes or KiB, MiB, GiB, TiB (1024-based) \
                 or KB, MB, GB, TB (1000-based)"
            ))
        }
    };
    let value: f64 = num.parse().map_err(|_| {
        format!("`{text}` is not a size: expected a number with an optional unit, e.g. 512MiB")
    })?;
    let bytes = value * mult;
    // 2^64 itself rounds to u64::MAX as f64 would accept it: refuse at 2^64 and above.
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(too_large());
    }
    Ok(bytes.round() as u64)
}

/// Parses a duration such as `90s`, `30m`, `1.5h`, `7d`, `500ms` or `120` (seconds).
pub fn parse_duration(text: &str) -> Result<std::time::Duration, String> {
    let t = text.trim();
    let example = "expected a duration with a unit, e.g. 90s, 30m, 1h or 7d (a plain number is \
                   seconds)";
    if t.starts_with('-') {
        return Err(format!("`{text}` is negative: {example}"));
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let secs_per: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "ms" => 1e-3,
        "" | "s" | "sec" | "secs" => 1.0,
        "m" | "min" | "mins" => 60.0,
        "h" | "hour" | "hours" => 3600.0,
        "d" | "day" | "days" => 86400.0,
        other => {
            return Err(format!(
                "unknown unit `{other}` in `{text}`: use ms, s, m (minutes), h or d"
            ))
        }
    };
    let value: f64 = num
        .parse()
        .map_err(|_| format!("`{text}` is not a duration: {example}"))?;
    let secs = value * secs_per;
    // At most 100 years: more is surely a typo, and Duration::from_secs_f64 must not panic.
    if !secs.is_finite() || secs > 100.0 * 365.0 * 86400.0 {
        return Err(format!(
            "`{text}` is too long: at most 100 years (use `never` to keep records for ever)"
        ));
    }
    Ok(std::time::Duration::from_secs_f64(secs))
}

fn parse_bool(key: &str, v: &str) -> Result<bool, ConfigError> {
    match v.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        other => Err(err(
            key,
            format!("`{other}` is not a boolean: use true or false"),
        )),
    }
}

fn parse_opt_size(key: &str, v: &str) -> Result<Option<u64>, ConfigError> {
    if v.trim().eq_ignore_ascii_case("none") {
        return Ok(None);
    }
    parse_size(v).map(Some).map_err(|m| err(key, m))
}

impl Config {
    /// Parses `key:value,key:value` text. Empty text gives the defaults.
    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let mut c = Config::default();
        let mut seen: Vec<&str> = Vec::new();
        for entry in text.split(',') {
            let entry = entry.trim();
            if entry.is_empty() {
                continue;
            }
            let Some((key, value)) = entry.split_once(':') else {
                return Err(err(entry, "expected `key:value`"));
            };
            let key = key.trim();
            if seen.contains(&key) {
                return Err(err(
                    key,
                    "is given more than once: give each key once (which one was meant?)",
                ));
            }
            seen.push(key);
            c.set(key, value.trim())?;
        }
        c.validate()?;
        Ok(c)
    }

    /// Reads [`ENV_VAR`]; unset or empty gives the defaults.
    pub fn from_env() -> Result<Config, ConfigError> {
        match std::env::var(ENV_VAR) {
            Ok(text) => Config::parse(&text),
            Err(std::env::VarError::NotPresent) => Ok(Config::default()),
            Err(std::env::VarError::NotUnicode(_)) => Err(err(ENV_VAR, "is not valid UTF-8")),
        }
    }

    /// Sets one key from its text value (without validating the whole config).
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), ConfigError> {
        match key {
            "vmm" => self.vmm = parse_bool(key, value)?,
            "memory_limit" => {
                self.memory_limit = parse_opt_size(key, value)?;
                if self.memory_limit == Some(0) {
                    return Err(err(key, "must be greater than 0 (or `none`)"));
                }
            }
            "memory_fraction" => {
                let f: f64 = value.parse().map_err(|_| {
                    err(
                        key,
                        format!("`{value}` is not a number: use a fraction in [0, 1]"),
                    )
                })?;
                if f.is_nan() {
                    return Err(err(
                        key,
                        format!("`{value}` is not a number: use a fraction in [0, 1]"),
                    ));
                }
                self.memory_fraction = f;
            }
            "release_threshold" => self.release_threshold = parse_opt_size(key, value)?,
            "stream_sync" => {
                self.stream_sync = match value.trim().to_ascii_lowercase().as_str() {
                    "pressure" => StreamSync::Pressure,
                    "always" => StreamSync::Always,
                    "device" => StreamSync::Device,
                    other => {
                        return Err(err(
                            key,
                            format!(
                                "`{other}` is not a stream_sync mode: use pressure, always or \
                                 device"
                            ),
                        ))
                    }
                };
            }
            "chunk_size" => {
                self.chunk_size = parse_size(value).map_err(|m| err(key, m))?;
                if self.chunk_size == 0 {
                    return Err(err(key, "must be at least one granule (e.g. 2MiB)"));
                }
            }
            "chunk_split" => {
                let v = value.trim();
                self.chunk_split = if v.eq_ignore_ascii_case("none") {
                    None
                } else {
                    match v.parse::<u32>() {
                        Ok(n @ 1..=1024) => Some(n),
                        _ => {
                            return Err(err(
                                key,
                                format!(
                                    "`{v}` is not a number of handles: use 1 to 1024, or none \
                                     (handles of chunk_size whatever the request)"
                                ),
                            ))
                        }
                    }
                };
            }
            "grow_whole_chunks" => {
                self.grow_whole_chunks = if value.trim().eq_ignore_ascii_case("auto") {
                    WholeChunks::Auto
                } else {
                    match parse_bool(key, value) {
                        Ok(true) => WholeChunks::On,
                        Ok(false) => WholeChunks::Off,
                        Err(_) => {
                            return Err(err(
                                key,
                                format!(
                                    "`{}` is not a growth mode: use auto, on or off",
                                    value.trim()
                                ),
                            ))
                        }
                    }
                };
            }
            "peer_access" => {
                self.peer_access = match value.trim().to_ascii_lowercase().as_str() {
                    "none" => PeerAccess::None,
                    "all" => PeerAccess::All,
                    other => {
                        return Err(err(
                            key,
                            format!("`{other}` is not a peer_access mode: use all or none"),
                        ))
                    }
                };
            }
            "small_size" => {
                self.small_size = parse_size(value).map_err(|m| err(key, m))?;
            }
            "strict" => self.strict = parse_bool(key, value)?,
            "provenance" => {
                use crate::provenance::Mode;
                self.provenance = match value.trim().to_ascii_lowercase().as_str() {
                    "off" => Mode::Off,
                    "tags" => Mode::Tags,
                    "stacks" => Mode::Stacks,
                    other => {
                        return Err(err(
                            key,
                            format!("`{other}` is not a provenance level: use off, tags or stacks"),
                        ))
                    }
                };
            }
            "stack_sample_rate" => {
                let v = value.trim();
                self.stack_sample_rate = v.parse().map_err(|_| {
                    let what = if v.starts_with('-') {
                        "is negative".to_string()
                    } else if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) {
                        format!("is too large (at most {})", u32::MAX)
                    } else {
                        "is not a count".to_string()
                    };
                    err(
                        key,
                        format!("`{value}` {what}: use a whole number (0: never)"),
                    )
                })?;
            }
            "record" => {
                let v = value.trim();
                self.record = if v.eq_ignore_ascii_case("none") {
                    None
                } else if v.is_empty() {
                    return Err(err(key, "expected a file path (or `none`)"));
                } else {
                    Some(v.into())
                };
            }
            "registry" => self.registry = parse_bool(key, value)?,
            "registry_dir" => {
                let v = value.trim();
                if v.is_empty() {
                    return Err(err(key, "expected a directory path"));
                }
                self.registry_dir = Some(v.into());
            }
            "registry_expire" => {
                let v = value.trim();
                self.registry_expire = if v.eq_ignore_ascii_case("never") {
                    None
                } else {
                    Some(parse_duration(v).map_err(|m| err(key, format!("{m}, or `never`")))?)
                };
            }
            _ => {
                let valid: Vec<&str> = KEYS.iter().map(|k| k.0).collect();
                return Err(err(
                    key,
                    format!("unknown key; valid keys are: {}", valid.join(", ")),
                ));
            }
        }
        Ok(())
    }

    /// Checks ranges and combinations.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(0.0..=1.0).contains(&self.memory_fraction) || self.memory_fraction.is_nan() {
            return Err(err(
                "memory_fraction",
                format!("{} is outside [0, 1]", self.memory_fraction),
            ));
        }
        if self.small_size < 512
            || !self.small_size.is_multiple_of(512)
            || self.small_size > 64 << 20
        {
            return Err(err(
                "small_size",
                format!(
                    "{} must be a multiple of 512 B between 512 B and 64 MiB",
                    self.small_size
                ),
            ));
        }
        if self.memory_limit == Some(0) {
            return Err(err("memory_limit", "must be greater than 0 (or `none`)"));
        }
        if let Some(n) = self.chunk_split.filter(|n| !(1..=1024).contains(n)) {
            return Err(err(
                "chunk_split",
                format!("{n} must be between 1 and 1024 (or `none`)"),
            ));
        }
        Ok(())
    }

    /// The effective limit on reserved bytes for a device of `total` bytes.
    pub fn limit_for(&self, total: u64) -> u64 {
        let frac = (total as f64 * self.memory_fraction).floor() as u64;
        match self.memory_limit {
            Some(l) => l.min(frac),
            None => frac,
        }
    }
}

#[cfg(test)]
mod tests;
