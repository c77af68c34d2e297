//! The answer in words: byte amounts for people, headroom phrases, and the first line of
//! `cistern whatif`'s reply (`OomReport::answer`).

use super::*;

/// Bytes in GiB with one decimal (`0.4 GiB`), or in MiB below 1 GiB when that reads better.
pub fn gib(bytes: u64) -> String {
    const G: f64 = (1u64 << 30) as f64;
    const M: f64 = (1u64 << 20) as f64;
    let b = bytes as f64;
    if bytes >= 1 << 30 {
        format!("{:.1} GiB", b / G)
    } else if bytes >= 1 << 20 {
        format!("{:.0} MiB", b / M)
    } else {
        cistern::format_bytes(bytes)
    }
}

/// A headroom in words: `0.4 GiB to spare` or `0.2 GiB short`.
pub fn headroom_words(h: i64) -> String {
    if h >= 0 {
        format!("{} to spare", gib(h.unsigned_abs()))
    } else {
        format!("{} short", gib(h.unsigned_abs()))
    }
}

impl OomReport {
    /// The answer for a failure recorded by another allocator: which allocators fit it on the
    /// given capacity.
    fn answer_foreign(&self) -> String {
        let fits: Vec<String> = self
            .results
            .iter()
            .filter(|v| v.fits == Some(true))
            .map(|v| match v.headroom {
                Some(h) if h > 0 => format!("{} ({} to spare)", v.label(), gib(h.unsigned_abs())),
                _ => v.label(),
            })
            .collect();
        let need = self.live.saturating_add(self.size);
        if !fits.is_empty() {
            format!(
                "On {} the failed {} request fits with: {}.",
                gib(self.capacity),
                gib(self.size),
                fits.join(", ")
            )
        } else if need > self.capacity {
            format!(
                "On {} no allocator can fit the failed {} request: the live bytes plus the \
                 request ({}) exceed the capacity.",
                gib(self.capacity),
                gib(self.size),
                gib(need)
            )
        } else {
            format!(
                "On {} no allocator tried fits the failed {} request (live plus request: {}).",
                gib(self.capacity),
                gib(self.size),
                gib(need)
            )
        }
    }

    /// The first line of the answer: whether the recorded settings reproduce the OOM (if not,
    /// how far the model is from the recording, and no advice), then the smallest change that
    /// fits and cistern's verdict.
    pub fn answer(&self) -> String {
        let Some(rec) = self.results.iter().find(|v| v.recorded) else {
            return self.answer_foreign();
        };
        let conf_words = |c: &str| {
            if c.is_empty() {
                "PyTorch's default settings".to_string()
            } else {
                format!("PYTORCH_CUDA_ALLOC_CONF={c}")
            }
        };
        let cistern = self.results.iter().find(|v| v.allocator == "cistern");
        let cistern_words = |lead: &str| -> String {
            match cistern {
                Some(c) if c.fits == Some(true) => match c.headroom {
                    Some(h) if h > 0 => format!("{lead}with cistern, {}", gib(h.unsigned_abs())),
                    Some(_) => format!("{lead}with cistern, nothing to spare"),
                    None => format!("{lead}with cistern it fits"),
                },
                Some(c) if c.fits == Some(false) => match c.headroom {
                    Some(h) => format!("{lead}cistern does not fit either ({})", headroom_words(h)),
                    None => format!("{lead}cistern does not fit either"),
                },
                _ => String::new(),
            }
        };
        match self.reproduced {
            Some(true) => {
                let short = rec
                    .headroom
                    .map(|h| format!(" ({})", headroom_words(h)))
                    .unwrap_or_default();
                let lead = format!(
                    "The recorded settings ({}) reproduce the OOM{short}",
                    conf_words(&rec.conf)
                );
                let best = self
                    .results
                    .iter()
                    .find(|v| v.allocator == "pytorch" && !v.recorded && v.fits == Some(true));
                match best {
                    Some(b) => {
                        let spare = match b.headroom {
                            Some(h) if h > 0 => format!(" with {} to spare", gib(h.unsigned_abs())),
                            Some(_) => ", with nothing to spare".into(),
                            None => String::new(),
                        };
                        format!(
                            "{lead}; with PYTORCH_CUDA_ALLOC_CONF={} it fits{spare}{}.",
                            b.conf,
                            cistern_words("; ")
                        )
                    }
                    None if cistern.is_some_and(|c| c.fits == Some(true)) => format!(
                        "{lead}; no PyTorch setting tried fits it{}.",
                        cistern_words("; ")
                    ),
                    None => {
                        let need = self.live.saturating_add(self.size);
                        if need > self.capacity {
                            format!(
                                "{lead}, and no allocator can fit it: the live bytes plus the \
                                 request ({}) exceed the capacity ({}); the program must hold \
                                 less (smaller batch, activation checkpointing, offloading).",
                                gib(need),
                                gib(self.capacity)
                            )
                        } else {
                            format!(
                                "{lead}, and no allocator tried fits it (live plus request: {} \
                                 of {}).",
                                gib(need),
                                gib(self.capacity)
                            )
                        }
                    }
                }
            }
            Some(false) => {
                let how = match (rec.earlier_oom, rec.headroom) {
                    (Some(e), _) => format!(
                        "it runs out earlier, at operation {} of the {} before the OOM",
                        e.op_index, self.ops_before
                    ),
                    (None, Some(h)) => format!("the request fits with {}", headroom_words(h)),
                    (None, None) => "the request fits".into(),
                };
                format!(
                    "The model disagrees with the recording: with the recorded settings ({}) {how} \
                     (model reserved {}, PyTorch reserved {}), so it gives no advice for this OOM.",
                    conf_words(&rec.conf),
                    gib(rec.reserved.unwrap_or(0)),
                    gib(self.recorded_reserved)
                )
            }
            None => "The recorded settings could not be replayed.".into(),
        }
    }
}
