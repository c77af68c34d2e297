//! Synthetic workloads for what real traces lack, each deterministic given a seed: transformer
//! training with activation recomputation and varying sequence lengths, LLM serving with
//! contiguous per-request KV caches that grow per decoded token, RMM's `random_allocations`
//! benchmark, and MiniMalloc's static-lifetime instances scaled by 64.
//!
//! Every generator returns a [`Trace`] with a valid [`AllocSequence`] of a few thousand to a few
//! tens of thousands of ops (fast to replay). The random numbers come from a fixed SplitMix64 /
//! xoshiro256** generator written here, so a seed gives the same trace on every platform and
//! with every dependency version.

use std::path::{Path, PathBuf};

use crate::load::Trace;
use crate::sequence::{AllocSequence, Op};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// The workload names [`generate`] accepts.
pub fn names() -> &'static [&'static str] {
    &[
        "training",
        "llm-serving",
        "llm-serving-mooncake",
        "rmm-random",
        "rmm-random-normal",
        "minimalloc-A",
        "minimalloc-B",
        "minimalloc-C",
        "minimalloc-D",
        "minimalloc-E",
        "minimalloc-F",
        "minimalloc-G",
        "minimalloc-H",
        "minimalloc-I",
        "minimalloc-J",
        "minimalloc-K",
    ]
}

/// The names whose data is present: every name except the `minimalloc-*` instances whose CSV
/// is missing from the traces folder (the LLM-serving workloads fall back to built-in lengths).
pub fn available() -> Vec<&'static str> {
    let dir = traces_dir();
    names()
        .iter()
        .copied()
        .filter(|n| match n.strip_prefix("minimalloc-") {
            Some(inst) => minimalloc_path(&dir, inst).is_file(),
            None => true,
        })
        .collect()
}

/// The development traces folder: `$CISTERN_TRACES_DIR`, else `../shared/traces` next to the
/// workspace this crate was built in.
pub fn traces_dir() -> PathBuf {
    match std::env::var_os("CISTERN_TRACES_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces"),
    }
}

fn minimalloc_path(dir: &Path, instance: &str) -> PathBuf {
    dir.join("static_lifetimes/minimalloc_challenging")
        .join(format!("{instance}.1048576.csv"))
}

/// Iterations (optimizer steps) of the `training` workload unless `iters=N` says otherwise.
pub const TRAINING_ITERS: usize = 10;

/// The parameters of the `training` workload: `training:iters=N,seq=L`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrainingParams {
    /// Training steps; each repeats the same allocation pattern (for its sequence length).
    pub iters: usize,
    /// A fixed sequence length, or `None` to draw one per step from {128, 256, 512, 1024}.
    pub seq: Option<u64>,
}

impl Default for TrainingParams {
    fn default() -> Self {
        TrainingParams {
            iters: TRAINING_ITERS,
            seq: None,
        }
    }
}

impl TrainingParams {
    /// Parses `iters=N,seq=L` (either, both, or empty).
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut p = TrainingParams::default();
        for kv in text.split(',').filter(|s| !s.is_empty()) {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            let n: Option<u64> = v.trim().parse().ok().filter(|&n| n > 0);
            match (k.trim(), n) {
                ("iters", Some(n)) if n <= 10_000 => p.iters = n as usize,
                ("seq", Some(n)) if n <= 1024 => p.seq = Some(n),
                ("iters", _) => {
                    return Err(format!(
                        "training: `{kv}`: iters takes a whole number from 1 to 10000"
                    ))
                }
                ("seq", _) => {
                    return Err(format!(
                        "training: `{kv}`: seq takes a sequence length from 1 to 1024"
                    ))
                }
                _ => {
                    return Err(format!(
                        "training: unknown parameter `{kv}`; expected iters=N and/or seq=L \
                         (e.g. training:iters=3,seq=512)"
                    ))
                }
            }
        }
        Ok(p)
    }
}

/// Generate the workload `name` with `seed`, reading characterizations from [`traces_dir`].
///
/// `training` takes parameters after a colon: `training:iters=N` (default
/// [`TRAINING_ITERS`]) and `seq=L` (a fixed sequence length, so that every step repeats the
/// same allocations).
pub fn generate(name: &str, seed: u64) -> Result<Trace, String> {
    generate_from(name, seed, &traces_dir())
}

/// [`generate`] with an explicit traces folder.
pub fn generate_from(name: &str, seed: u64, dir: &Path) -> Result<Trace, String> {
    let mut rng = Rng::new(seed);
    let (base, params) = match name.split_once(':') {
        Some((b, p)) => (b, Some(p)),
        None => (name, None),
    };
    if base != "training" && params.is_some() && names().contains(&base) {
        return Err(format!(
            "workload `{base}` takes no parameters (only training does: training:iters=N,seq=L)"
        ));
    }
    let (label, seq) = match base {
        "training" => {
            let p = TrainingParams::parse(params.unwrap_or(""))?;
            let seqs = match p.seq {
                Some(s) => format!("seq {s}"),
                None => "seq 128-1024".to_string(),
            };
            (
                format!(
                    "training (GPT-medium, recompute, {seqs}, {} iters)",
                    p.iters
                ),
                training(&mut rng, p),
            )
        }
        "llm-serving" => llm_serving(&mut rng, dir, LengthSource::Azure)?,
        "llm-serving-mooncake" => llm_serving(&mut rng, dir, LengthSource::Mooncake)?,
        "rmm-random" => (
            "rmm-random (uniform 1 B-64 MiB, 1000 allocs)".to_string(),
            rmm_random(&mut rng, false),
        ),
        "rmm-random-normal" => (
            "rmm-random-normal (normal 32±16 MiB, 1000 allocs)".to_string(),
            rmm_random(&mut rng, true),
        ),
        other => match other.strip_prefix("minimalloc-") {
            Some(inst) if names().contains(&other) => {
                let path = minimalloc_path(dir, inst);
                let seq = crate::minimalloc::read_csv(&path, 64)
                    .map_err(|e| format!("{}: {e}", path.display()))?;
                (format!("minimalloc-{inst} (x64, optimum 64 MiB)"), Ok(seq))
            }
            _ => {
                return Err(format!(
                    "unknown workload {other:?}; expected one of {}",
                    names().join(", ")
                ))
            }
        },
    };
    let sequence = seq.map_err(|e| format!("{name}: generated an invalid sequence: {e}"))?;
    Ok(Trace {
        name: label,
        device: 0,
        sequence,
        recorded_reserved: None,
        recorded_peak_reserved: None,
    })
}

type Built = Result<AllocSequence, crate::SequenceError>;

/// xoshiro256** seeded by SplitMix64.
struct Rng([u64; 4]);

impl Rng {
    fn new(seed: u64) -> Self {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        Rng([next(), next(), next(), next()])
    }

    fn next_u64(&mut self) -> u64 {
        let s = &mut self.0;
        let out = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        out
    }

    /// Uniform in `[0, n)` (`n > 0`); the modulo bias is below 2^-40 for the n used here.
    fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// Uniform in `[0, 1)`.
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box-Muller).
    fn normal(&mut self) -> f64 {
        let u1 = self.unit().max(f64::MIN_POSITIVE);
        let u2 = self.unit();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

/// Builds a sequence with fresh ids.
#[derive(Default)]
struct Builder {
    ops: Vec<Op>,
    next_id: u64,
}

impl Builder {
    fn alloc(&mut self, size: u64) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.ops.push(Op::Alloc {
            id,
            size: size.max(1),
            stream: 0,
        });
        id
    }

    fn free(&mut self, id: u64) {
        self.ops.push(Op::Free { id });
    }

    fn finish(self) -> Built {
        AllocSequence::new(self.ops, 0)
    }
}

/// GPT-medium training with per-2-layer activation checkpointing, bf16 activations, fp32
/// parameters, gradients and Adam state, batch 8, `p.iters` steps (default 10), sequence length
/// drawn per step from {128, 256, 512, 1024} unless `p.seq` fixes it (then every step after the
/// first, which also allocates Adam's state, makes the same allocations and frees).
///
/// Per step: input ids and targets; the forward pass keeps only each 2-layer segment's input
/// (the checkpoint) and frees everything else as soon as it is consumed; logits in bf16, upcast
/// to fp32 for the loss. The backward pass, segment by segment from the last: recompute the
/// segment's forward keeping its activations, then walk its ops backwards, allocating each
/// activation gradient and freeing what the op saved; parameter gradients are allocated the
/// first time backward reaches them (`zero_grad(set_to_none=True)` freed them at the end of the
/// previous step). The optimizer allocates Adam's two moments at the first step (kept) and one
/// temporary per parameter tensor per step.
fn training(rng: &mut Rng, p: TrainingParams) -> Built {
    const LAYERS: usize = 24;
    const HIDDEN: u64 = 1024;
    const HEADS: u64 = 16;
    const VOCAB: u64 = 50257;
    const BATCH: u64 = 8;
    const MAX_CTX: u64 = 1024;
    const ACT: u64 = 2; // bf16 activations
    const F32: u64 = 4;
    const SEGMENT: usize = 2;
    let buckets = [128u64, 256, 512, 1024];
    let h = HIDDEN;

    let mut b = Builder::default();
    // Parameter tensors: embeddings, then per layer LN1, QKV, out proj, LN2, MLP up/down.
    let mut params: Vec<u64> = vec![VOCAB * h, MAX_CTX * h];
    for _ in 0..LAYERS {
        params.extend([
            h,
            h,
            h * 3 * h,
            3 * h,
            h * h,
            h,
            h,
            h,
            h * 4 * h,
            4 * h,
            4 * h * h,
            h,
        ]);
    }
    params.extend([h, h]);
    let param_ids: Vec<u64> = params.iter().map(|&p| b.alloc(p * F32)).collect();
    let mut adam: Vec<u64> = Vec::new();

    for step in 0..p.iters {
        let drawn = buckets[rng.below(buckets.len() as u64) as usize];
        let s = p.seq.unwrap_or(drawn);
        let bsh = BATCH * s * h * ACT;
        let scores = BATCH * HEADS * s * s * ACT;
        // Activations one layer's forward saves for backward, in order, and the output.
        let layer_saved = [
            bsh,
            bsh,
            3 * bsh,
            scores,
            scores,
            bsh,
            bsh,
            bsh,
            4 * bsh,
            4 * bsh,
        ];
        let layer_forward = |b: &mut Builder, input: u64, keep: bool| -> (u64, Vec<(u64, u64)>) {
            let mut saved = Vec::new();
            for &sz in &layer_saved {
                let id = b.alloc(sz);
                saved.push((id, sz));
                // Without `keep` (checkpointed forward) each intermediate dies once the next op
                // has consumed it: free the one before this.
                if !keep && saved.len() >= 2 {
                    let (prev, _) = saved[saved.len() - 2];
                    b.free(prev);
                }
            }
            let out = b.alloc(bsh);
            if !keep {
                if let Some(&(last, _)) = saved.last() {
                    b.free(last);
                }
                saved.clear();
            }
            let _ = input;
            (out, saved)
        };

        let ids = b.alloc(BATCH * s * 8);
        let targets = b.alloc(BATCH * s * 8);
        let mut x = b.alloc(bsh); // embedding output: the first checkpoint
        let mut checkpoints = Vec::new();
        for seg in 0..LAYERS / SEGMENT {
            checkpoints.push(x);
            for l in 0..SEGMENT {
                let (out, _) = layer_forward(&mut b, x, false);
                if l > 0 {
                    b.free(x); // inner layer outputs are not checkpoints
                }
                x = out;
            }
            let _ = seg;
        }
        let ln_f = b.alloc(bsh);
        b.free(x);
        let logits = b.alloc(BATCH * s * VOCAB * ACT);
        let logits32 = b.alloc(BATCH * s * VOCAB * F32);
        b.free(logits);
        let loss = b.alloc(F32);

        // Backward.
        let mut grads: Vec<Option<u64>> = vec![None; params.len()];
        let mut grad_param = |b: &mut Builder, k: usize| {
            if grads[k].is_none() {
                grads[k] = Some(b.alloc(params[k] * F32));
            }
        };
        let g_logits = b.alloc(BATCH * s * VOCAB * F32);
        b.free(logits32);
        b.free(loss);
        let g_logits16 = b.alloc(BATCH * s * VOCAB * ACT);
        b.free(g_logits);
        let mut g = b.alloc(bsh);
        grad_param(&mut b, 0); // tied output embedding
        b.free(g_logits16);
        b.free(ln_f);
        let first_layer_param = 2;
        for seg in (0..LAYERS / SEGMENT).rev() {
            // Recompute the segment from its checkpoint, keeping what backward needs.
            let mut layers = Vec::new();
            let mut inp = checkpoints[seg];
            for _ in 0..SEGMENT {
                let (out, saved) = layer_forward(&mut b, inp, true);
                layers.push((out, saved));
                inp = out;
            }
            for (l, (out, saved)) in layers.into_iter().enumerate().rev() {
                b.free(out);
                let layer = seg * SEGMENT + l;
                for (k, &(id, sz)) in saved.iter().enumerate().rev() {
                    let tmp = b.alloc(sz); // gradient w.r.t. this activation
                    if k % 3 == 0 {
                        let p = first_layer_param + layer * 12 + (k * 12 / layer_saved.len());
                        grad_param(&mut b, p);
                        grad_param(&mut b, p + 1);
                    }
                    b.free(id);
                    b.free(tmp);
                }
                let g_in = b.alloc(bsh);
                b.free(g);
                g = g_in;
            }
            b.free(checkpoints[seg]);
        }
        grad_param(&mut b, 1);
        b.free(g);
        b.free(ids);
        b.free(targets);
        for k in 0..params.len() {
            grad_param(&mut b, k);
        }

        // Optimizer.
        if step == 0 {
            for &p in &params {
                adam.push(b.alloc(p * F32));
                adam.push(b.alloc(p * F32));
            }
        }
        for &p in &params {
            let tmp = b.alloc(p * F32);
            b.free(tmp);
        }
        for id in grads.into_iter().flatten() {
            b.free(id);
        }
    }
    let _ = (&param_ids, &adam);
    b.finish()
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum LengthSource {
    Azure,
    Mooncake,
}

/// `(prompt, output)` token lengths of requests, from the characterization files.
fn load_lengths(dir: &Path, src: LengthSource) -> Result<Vec<(u64, u64)>, String> {
    let wc = dir.join("workload_characterization");
    match src {
        LengthSource::Azure => {
            let path = wc.join("azure_llm_inference_2023/AzureLLMInferenceTrace_conv.csv");
            let text =
                std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            let mut lines = text.lines().enumerate();
            let header: Vec<&str> = lines
                .next()
                .map(|(_, l)| l.split(',').map(str::trim).collect())
                .unwrap_or_default();
            let col = |name: &str| {
                header.iter().position(|h| *h == name).ok_or_else(|| {
                    format!("{}: line 1: expected a `{name}` column", path.display())
                })
            };
            let (ci, gi) = (col("ContextTokens")?, col("GeneratedTokens")?);
            let mut out = Vec::new();
            for (n, line) in lines {
                if line.trim().is_empty() {
                    continue;
                }
                let f: Vec<&str> = line.split(',').map(str::trim).collect();
                let get = |i: usize| -> Result<u64, String> {
                    f.get(i).and_then(|x| x.parse().ok()).ok_or_else(|| {
                        format!(
                            "{}: line {}: expected token counts, found {line:?}",
                            path.display(),
                            n + 1
                        )
                    })
                };
                out.push((get(ci)?, get(gi)?));
            }
            Ok(out)
        }
        LengthSource::Mooncake => {
            let path = wc.join("mooncake_fast25_kvcache/conversation_trace.jsonl");
            let text =
                std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            let mut out = Vec::new();
            for (n, line) in text.lines().enumerate() {
                if line.trim().is_empty() {
                    continue;
                }
                let v: serde_json::Value = serde_json::from_str(line)
                    .map_err(|e| format!("{}: line {}: {e}", path.display(), n + 1))?;
                let get = |k: &str| {
                    v.get(k).and_then(serde_json::Value::as_u64).ok_or_else(|| {
                        format!(
                            "{}: line {}: expected an integer `{k}`",
                            path.display(),
                            n + 1
                        )
                    })
                };
                out.push((get("input_length")?, get("output_length")?));
            }
            Ok(out)
        }
    }
}

/// LLM serving on one GPU with Llama-3-8B's KV cache (32 layers × 8 KV heads × 128 dims × 2
/// (K and V) × 2 bytes = 128 KiB per token), each request's cache one contiguous buffer.
///
/// 256 requests (a contiguous window of the characterization trace from a seeded offset) wait
/// in a queue; the engine admits them in order while fewer than `batch` run and the caches fit
/// a budget (continuous batching, closed loop): 32 requests and 48 GiB for the Azure lengths, 8
/// and 24 GiB for Mooncake's. Prompts are capped at half the budget. Admission runs the prefill: the cache is
/// allocated for the prompt rounded up to 16 tokens, plus a prefill activation temporary. Each
/// decode iteration allocates and frees the batch's logits and activations, and appends one
/// token to every running request; a cache that is full is re-allocated 16 tokens larger and
/// the old one freed after the copy. A request that produced its output frees its cache.
fn llm_serving(rng: &mut Rng, dir: &Path, src: LengthSource) -> Result<(String, Built), String> {
    const KV_PER_TOKEN: u64 = 128 * KIB;
    const CHUNK: u64 = 16;
    const REQUESTS: usize = 256;
    const HIDDEN: u64 = 4096;
    const VOCAB: u64 = 128_256;
    // Mooncake's prompts are ~10x longer (mean 12k tokens, 1.5 GiB of cache): a smaller batch
    // and budget keep its peak near 30 GiB, inside an 80 GiB device for every allocator model.
    let (base, batch, budget) = match src {
        LengthSource::Azure => (
            "llm-serving (Azure conv 2023, Llama-3-8B KV",
            32usize,
            48u64 << 30,
        ),
        LengthSource::Mooncake => (
            "llm-serving-mooncake (Mooncake conversation, Llama-3-8B KV",
            8,
            24 << 30,
        ),
    };
    // Keep a single prompt within the budget.
    let max_prompt = budget / KV_PER_TOKEN / 2;
    let (label, lengths) = match load_lengths(dir, src) {
        Ok(all) if !all.is_empty() => {
            let start = rng.below(all.len() as u64) as usize;
            let picked: Vec<(u64, u64)> = (0..REQUESTS)
                .map(|k| all[(start + k) % all.len()])
                .collect();
            (format!("{base})"), picked)
        }
        _ => {
            // Built-in: log-normal prompt (median ~1000) and output (median ~130) lengths,
            // close to the Azure conversation trace's medians.
            let picked = (0..REQUESTS)
                .map(|_| {
                    let p = (1000.0 * (0.8 * rng.normal()).exp()).round() as u64;
                    let o = (130.0 * (0.9 * rng.normal()).exp()).round() as u64;
                    (p.clamp(1, 16_000), o.clamp(1, 2000))
                })
                .collect();
            (
                format!("{base}, built-in lengths: characterization data not found)"),
                picked,
            )
        }
    };
    let round = |t: u64| t.div_ceil(CHUNK).max(1) * CHUNK;
    let mut b = Builder::default();
    struct Running {
        cache: u64,
        cap_tokens: u64,
        tokens: u64,
        left: u64,
    }
    let mut queue = lengths
        .into_iter()
        .map(|(p, o)| (p.clamp(1, max_prompt), o.max(1)));
    let mut pending = queue.next();
    let mut running: Vec<Running> = Vec::new();
    let mut kv_bytes = 0u64;
    loop {
        // Admit.
        while let Some((p, o)) = pending {
            let need = round(p + 1) * KV_PER_TOKEN;
            if running.len() >= batch || (kv_bytes + need > budget && !running.is_empty()) {
                break;
            }
            let cache = b.alloc(need);
            kv_bytes += need;
            let act = b.alloc(p * HIDDEN * 2 * 4);
            b.free(act);
            running.push(Running {
                cache,
                cap_tokens: round(p + 1),
                tokens: p,
                left: o,
            });
            pending = queue.next();
        }
        if running.is_empty() {
            break;
        }
        // One decode iteration.
        let n = running.len() as u64;
        let act = b.alloc(n * HIDDEN * 2 * 4);
        let logits = b.alloc(n * VOCAB * 4);
        b.free(act);
        b.free(logits);
        let mut k = 0;
        while k < running.len() {
            let r = &mut running[k];
            r.tokens += 1;
            r.left -= 1;
            if r.left == 0 {
                b.free(r.cache);
                kv_bytes -= r.cap_tokens * KV_PER_TOKEN;
                running.swap_remove(k);
                continue;
            }
            if r.tokens >= r.cap_tokens {
                let new_cap = r.cap_tokens + CHUNK;
                let new = b.alloc(new_cap * KV_PER_TOKEN);
                b.free(r.cache);
                kv_bytes += CHUNK * KV_PER_TOKEN;
                r.cache = new;
                r.cap_tokens = new_cap;
            }
            k += 1;
        }
    }
    Ok((label, b.finish()))
}

/// RMM's `random_allocations` benchmark loop (`cpp/benchmarks/random_allocations`): 2 × 1000
/// iterations; each allocates with probability 73% while fewer than 1000 allocations were made
/// and live bytes stay under 16,000 MiB, else frees a uniformly chosen live allocation. Sizes
/// are uniform in [1 B, 64 MiB] (RMM's default distribution; 64 MiB is one of its size points)
/// or, for `normal`, normal with mean 32 MiB and deviation 16 MiB clamped to [1 B, 64 MiB]
/// (RMM leaves its normal variant as a TODO). As in RMM, what is live at the end is not freed.
fn rmm_random(rng: &mut Rng, normal: bool) -> Built {
    const N: usize = 1000;
    const MAX_SIZE: u64 = 64 * MIB;
    const MAX_USAGE: u64 = 16_000 * MIB;
    let mut b = Builder::default();
    let mut live: Vec<(u64, u64)> = Vec::new();
    let mut live_bytes = 0u64;
    let mut count = 0;
    for _ in 0..2 * N {
        let size = if normal {
            let x = 32.0 * MIB as f64 + 16.0 * MIB as f64 * rng.normal();
            (x.round() as i64).clamp(1, MAX_SIZE as i64) as u64
        } else {
            1 + rng.below(MAX_SIZE)
        };
        let do_alloc =
            live.is_empty() || (rng.below(100) < 73 && count < N && live_bytes + size < MAX_USAGE);
        if do_alloc {
            live.push((b.alloc(size), size));
            live_bytes += size;
            count += 1;
        } else if !live.is_empty() {
            let i = rng.below(live.len() as u64) as usize;
            let (id, sz) = live.swap_remove(i);
            b.free(id);
            live_bytes -= sz;
        }
    }
    b.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rng_is_fixed() {
        let mut r = Rng::new(1);
        let a: Vec<u64> = (0..3).map(|_| r.below(1000)).collect();
        let mut r = Rng::new(1);
        let b: Vec<u64> = (0..3).map(|_| r.below(1000)).collect();
        assert_eq!(a, b);
        let mut r = Rng::new(7);
        let mean: f64 = (0..10_000).map(|_| r.normal()).sum::<f64>() / 10_000.0;
        assert!(mean.abs() < 0.05, "{mean}");
    }

    #[test]
    fn unknown_name_lists_the_known_ones() {
        let e = generate("nope", 0).unwrap_err();
        assert!(e.contains("training") && e.contains("rmm-random"), "{e}");
    }

    #[test]
    fn training_takes_iterations_and_a_fixed_length() {
        let ops = |name: &str| generate(name, 42).unwrap().sequence.ops.len();
        let one = ops("training:iters=1,seq=512");
        let three = ops("training:iters=3,seq=512");
        let five = ops("training:iters=5,seq=512");
        // Step 1 also allocates Adam's state; every later step is the same pattern.
        assert_eq!(five - three, three - one);
        assert_eq!(
            ops("training"),
            ops(&format!("training:iters={TRAINING_ITERS}"))
        );
        assert!(generate("training", 1).unwrap().name.contains("10 iters"));
        for bad in [
            "training:iters=0",
            "training:iters=x",
            "training:seq=4096",
            "training:lr=1",
        ] {
            let e = generate(bad, 0).unwrap_err();
            assert!(e.contains("training") && e.contains('`'), "{bad}: {e}");
        }
        let e = generate("rmm-random:iters=3", 0).unwrap_err();
        assert!(e.contains("takes no parameters"), "{e}");
    }

    #[test]
    fn builtin_lengths_when_data_is_absent() {
        let t = generate_from("llm-serving", 3, Path::new("/nonexistent")).unwrap();
        assert!(t.name.contains("built-in lengths"), "{}", t.name);
        assert!(t.sequence.replay().is_ok());
        assert!(generate_from("minimalloc-A", 0, Path::new("/nonexistent")).is_err());
    }
}
