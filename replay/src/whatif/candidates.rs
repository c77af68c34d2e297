//! The candidates `whatif` tries at an OOM: PyTorch's settings as recorded and as people change
//! them (`PytorchSettings`, read from a snapshot's `allocator_settings` or from
//! `PYTORCH_CUDA_ALLOC_CONF`), PyTorch's request rounding (`round_size`), and the list of
//! candidates built from them (`candidates`).

use cistern_trace::snapshot::AllocatorSettings;

use crate::pytorch::PytorchConfig;

/// Resolution of the headroom search: one 2 MiB page.
pub const RESOLUTION: u64 = 2 << 20;

/// At most this many operations before an OOM are kept for plots.
pub const PLOT_WINDOW: usize = 2000;

/// The `max_split_size_mb` values tried.
pub const MAX_SPLIT_SIZES_MB: [u64; 3] = [512, 256, 128];

/// The `roundup_power2_divisions` value tried.
pub const ROUNDUP_DIVISIONS: u64 = 4;

/// The `garbage_collection_threshold` value listed (not simulated).
pub const GC_THRESHOLD: f64 = 0.8;

/// PyTorch settings a candidate runs with: the keys of `PYTORCH_CUDA_ALLOC_CONF` that change
/// where memory goes.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PytorchSettings {
    /// `expandable_segments:True`.
    pub expandable_segments: bool,
    /// `max_split_size_mb`, in bytes; `None`: unlimited.
    pub max_split_size: Option<u64>,
    /// `roundup_power2_divisions`: `(interval start in MiB, divisions)`, ascending (see
    /// [`AllocatorSettings::roundup_power2_divisions`]); empty: off.
    pub roundup_power2_divisions: Vec<(u64, u64)>,
    /// `garbage_collection_threshold` (`None` or 0: off).
    pub garbage_collection_threshold: Option<f64>,
}

impl PytorchSettings {
    /// The settings a snapshot recorded; `None` when it has no `allocator_settings`.
    /// The typed keys are what PyTorch parsed; when none is there, the
    /// `PYTORCH_CUDA_ALLOC_CONF` string is read instead.
    pub fn recorded(settings: Option<&AllocatorSettings>) -> Option<Self> {
        let a = settings?;
        let typed = a.expandable_segments.is_some()
            || a.max_split_size.is_some()
            || !a.roundup_power2_divisions.is_empty()
            || a.garbage_collection_threshold.is_some();
        if !typed {
            if let Some(conf) = &a.conf {
                return Some(Self::parse_conf(conf).unwrap_or_default());
            }
        }
        Some(PytorchSettings {
            expandable_segments: a.expandable_segments.unwrap_or(false),
            max_split_size: a.max_split_size,
            roundup_power2_divisions: a
                .roundup_power2_divisions
                .iter()
                .copied()
                .filter(|&(_, d)| d > 1)
                .collect(),
            garbage_collection_threshold: a.garbage_collection_threshold.filter(|&g| g > 0.0),
        })
    }

    /// Reads the keys this module knows from a `PYTORCH_CUDA_ALLOC_CONF` string (others are
    /// ignored); an error names a value that is not understood.
    pub fn parse_conf(conf: &str) -> Result<Self, String> {
        let mut s = PytorchSettings::default();
        for part in split_conf(conf) {
            let Some((k, v)) = part.split_once(':') else {
                continue;
            };
            let (k, v) = (k.trim(), v.trim());
            let bad = || format!("PYTORCH_CUDA_ALLOC_CONF: `{k}:{v}` is not understood");
            match k {
                "expandable_segments" => s.expandable_segments = v.eq_ignore_ascii_case("true"),
                "max_split_size_mb" => {
                    let mb: u64 = v.parse().map_err(|_| bad())?;
                    s.max_split_size = mb.checked_mul(1 << 20);
                }
                "garbage_collection_threshold" => {
                    s.garbage_collection_threshold = Some(v.parse().map_err(|_| bad())?)
                }
                "roundup_power2_divisions" => {
                    s.roundup_power2_divisions =
                        if let Some(list) = v.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                            let mut pairs = Vec::new();
                            for item in list.split(',') {
                                let (mb, d) = item.split_once(':').ok_or_else(bad)?;
                                let d: u64 = d.trim().parse().map_err(|_| bad())?;
                                let mb = match mb.trim() {
                                    ">" => u64::MAX,
                                    m => m.parse().map_err(|_| bad())?,
                                };
                                pairs.push((mb, d));
                            }
                            expand_intervals(&pairs)
                        } else {
                            vec![(1, v.parse().map_err(|_| bad())?)]
                        }
                        .into_iter()
                        .filter(|&(_, d)| d > 1)
                        .collect();
                }
                _ => {}
            }
        }
        Ok(s)
    }

    /// The settings as a `PYTORCH_CUDA_ALLOC_CONF` value (`""` for PyTorch's defaults).
    pub fn conf(&self) -> String {
        let mut parts = Vec::new();
        if self.expandable_segments {
            parts.push("expandable_segments:True".to_string());
        }
        if let Some(m) = self.max_split_size {
            parts.push(format!("max_split_size_mb:{}", m >> 20));
        }
        let divs: Vec<(u64, u64)> = self.roundup_power2_divisions.clone();
        if !divs.is_empty() {
            let first = divs[0].1;
            if divs.len() == 1 || divs.iter().all(|&(_, d)| d == first) && divs.len() == 16 {
                parts.push(format!("roundup_power2_divisions:{first}"));
            } else {
                let items: Vec<String> = divs.iter().map(|(mb, d)| format!("{mb}:{d}")).collect();
                parts.push(format!("roundup_power2_divisions:[{}]", items.join(",")));
            }
        }
        if let Some(g) = self.garbage_collection_threshold.filter(|&g| g > 0.0) {
            parts.push(format!("garbage_collection_threshold:{g}"));
        }
        parts.join(",")
    }

    /// The model's configuration (the settings it simulates).
    pub fn model_config(&self) -> PytorchConfig {
        PytorchConfig {
            max_split_size: self.max_split_size.unwrap_or(u64::MAX),
            expandable_segments: self.expandable_segments,
        }
    }

    /// `size` rounded as PyTorch's `round_size` does with these `roundup_power2_divisions`.
    pub fn round(&self, size: u64) -> u64 {
        round_size(size, self.divisions(size))
    }

    /// The divisions PyTorch uses for a request of `size` bytes: intervals are powers of two
    /// from 1 MiB (sizes below 2 MiB use the first, sizes above 32 GiB the last).
    fn divisions(&self, size: u64) -> u64 {
        if self.roundup_power2_divisions.is_empty() {
            return 0;
        }
        let log = 63 - u64::from(size.max(1).leading_zeros());
        let index = log.saturating_sub(20).min(15);
        let start_mb = 1u64 << index;
        self.roundup_power2_divisions
            .iter()
            .rev()
            .find(|&&(mb, _)| mb <= start_mb)
            .map_or(0, |&(_, d)| d)
    }
}

/// `a,b:[x:1,y:2],c` split at the commas outside brackets.
fn split_conf(conf: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in conf.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&conf[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&conf[start..]);
    out.into_iter().filter(|p| !p.trim().is_empty()).collect()
}

/// PyTorch's list form (`[256:1,512:2,>:4]`: each MiB key sets its interval, the first key also
/// those below it, `>` every interval after the last key) as one entry per interval from 1 MiB to 32 GiB.
fn expand_intervals(pairs: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut per = [0u64; 16];
    let mut last = None;
    for &(mb, d) in pairs {
        if mb == u64::MAX {
            let from = last.map_or(0, |l| l + 1);
            for slot in per.iter_mut().skip(from) {
                *slot = d;
            }
        } else {
            let i = (63 - u64::from(mb.max(1).leading_zeros())).min(15) as usize;
            // The first key also sets every interval below it.
            if last.is_none() {
                for slot in per.iter_mut().take(i) {
                    *slot = d;
                }
            }
            per[i] = d;
            last = Some(i);
        }
    }
    per.iter()
        .enumerate()
        .map(|(i, &d)| (1u64 << i, d))
        .collect()
}

/// PyTorch's `round_size`: at least 512 B; with `divisions` > 1 and a size above
/// `512 * divisions`, up to the next of `divisions` equal steps between two powers of two
/// (`roundup_power2_next_division`); else up to a multiple of 512 B.
pub fn round_size(size: u64, divisions: u64) -> u64 {
    const MIN: u64 = 512;
    if size < MIN {
        return MIN;
    }
    if divisions > 1 && size > MIN.saturating_mul(divisions) {
        if size.is_power_of_two() {
            return size;
        }
        let floor = 1u64 << (63 - size.leading_zeros());
        let step = floor >> (63 - divisions.leading_zeros());
        if step == 0 {
            return floor << 1;
        }
        let down = size & !(step - 1);
        return if down == size { size } else { down + step };
    }
    size.div_ceil(MIN).saturating_mul(MIN)
}

/// How a candidate is built.
#[derive(Debug, Clone, PartialEq)]
pub enum Spec {
    /// The replay catalog's model of this name (`cistern`, `cistern:KEY:VALUE`, ...).
    Catalog(String),
    /// PyTorch's caching allocator with these settings.
    Pytorch(PytorchSettings),
    /// A setting the models do not simulate: the reason.
    NotSimulated(String),
}

/// One allocator configuration to try.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// `pytorch` or `cistern`.
    pub allocator: String,
    /// Its configuration: a `PYTORCH_CUDA_ALLOC_CONF` value for PyTorch (`""`: defaults), a
    /// `CISTERN_CONF` value for cistern.
    pub conf: String,
    /// The setting changed from the recorded ones (`None` for the recorded settings and for
    /// other allocators).
    pub change: Option<String>,
    /// Whether these are the settings the snapshot recorded.
    pub recorded: bool,
    /// How to build it.
    pub spec: Spec,
}

impl Candidate {
    /// A short label: `pytorch (recorded)`, `pytorch expandable_segments:True`, `cistern`.
    pub fn label(&self) -> String {
        match (&self.change, self.recorded) {
            (_, true) => format!("{} (recorded)", self.allocator),
            (Some(c), _) => format!("{} {c}", self.allocator),
            (None, _) if self.conf.is_empty() => self.allocator.clone(),
            (None, _) => format!("{}:{}", self.allocator, self.conf),
        }
    }
}

/// The candidates for a snapshot whose recorded settings are `recorded` (PyTorch's defaults
/// when `None`), in the order of preference of [`OomReport::answer`](super::OomReport::answer): the recorded settings,
/// then one change at a time (expandable segments, `max_split_size_mb` from large to small,
/// `roundup_power2_divisions`, `garbage_collection_threshold`), then cistern.
pub fn candidates(recorded: &PytorchSettings) -> Vec<Candidate> {
    let mut out = vec![Candidate {
        allocator: "pytorch".into(),
        conf: recorded.conf(),
        change: None,
        recorded: true,
        spec: Spec::Pytorch(recorded.clone()),
    }];
    let mut push = |change: String, s: PytorchSettings| {
        out.push(Candidate {
            allocator: "pytorch".into(),
            conf: s.conf(),
            change: Some(change),
            recorded: false,
            spec: Spec::Pytorch(s),
        });
    };
    if !recorded.expandable_segments {
        push(
            "expandable_segments:True".into(),
            PytorchSettings {
                expandable_segments: true,
                ..recorded.clone()
            },
        );
    }
    for mb in MAX_SPLIT_SIZES_MB {
        if recorded.max_split_size != Some(mb << 20) {
            push(
                format!("max_split_size_mb:{mb}"),
                PytorchSettings {
                    max_split_size: Some(mb << 20),
                    ..recorded.clone()
                },
            );
        }
    }
    if recorded.roundup_power2_divisions != vec![(1, ROUNDUP_DIVISIONS)] {
        push(
            format!("roundup_power2_divisions:{ROUNDUP_DIVISIONS}"),
            PytorchSettings {
                roundup_power2_divisions: vec![(1, ROUNDUP_DIVISIONS)],
                ..recorded.clone()
            },
        );
    }
    let gc = PytorchSettings {
        garbage_collection_threshold: Some(GC_THRESHOLD),
        ..recorded.clone()
    };
    out.push(Candidate {
        allocator: "pytorch".into(),
        conf: gc.conf(),
        change: Some(format!("garbage_collection_threshold:{GC_THRESHOLD}")),
        recorded: false,
        spec: Spec::NotSimulated(
            "not simulated: acts only under set_per_process_memory_fraction, and an OOM \
             already frees every unsplit cached block"
                .into(),
        ),
    });
    out.push(Candidate {
        allocator: "cistern".into(),
        conf: String::new(),
        change: None,
        recorded: false,
        spec: Spec::Catalog("cistern".into()),
    });
    out
}
