//! The unit tests of the module beside this folder.
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
fn builtin_workloads_read_no_file_and_minimalloc_names_the_fix() {
    // The built-in set is what the main command runs: it must not depend on any folder.
    for &name in builtin() {
        let a = generate_in(name, 3, None).unwrap_or_else(|e| panic!("{name}: {e}"));
        let b = generate_from(name, 3, Path::new("/nonexistent")).unwrap();
        assert_eq!(a, b, "{name}: the same with or without a traces folder");
        assert!(a.sequence.replay().is_ok(), "{name}");
        assert!(!a.name.contains("not found"), "{}", a.name);
    }
    let e = generate_in("minimalloc-A", 0, None).unwrap_err();
    assert!(
        e.contains("CISTERN_TRACES_DIR") && e.contains("packed-A"),
        "{e}"
    );
    assert!(
        !e.contains(env!("CARGO_MANIFEST_DIR")),
        "no path baked in: {e}"
    );
    assert!(generate_from("minimalloc-A", 0, Path::new("/nonexistent")).is_err());
    for &b in builtin() {
        assert!(names().contains(&b), "{b}");
    }
}

#[test]
fn bins_hold_the_integers_of_their_half_octave() {
    for x in 1u64..5000 {
        let k = (2.0 * (x as f64).log2()).floor() as u8;
        let (lo, hi) = bin_range(k);
        assert!(lo <= x && x <= hi, "{x} in bin {k}: [{lo}, {hi}]");
    }
}

/// The fitted tables are the histogram of the characterization files, when they are here:
/// `scripts/fit-serving-lengths.py` and this reader agree.
#[test]
fn fitted_lengths_match_the_characterization() {
    let dir = std::env::var_os("CISTERN_TRACES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces"));
    if !dir.join("workload_characterization").is_dir() {
        eprintln!(
            "skipping: no characterization data in {} (set CISTERN_TRACES_DIR)",
            dir.display()
        );
        return;
    }
    for (src, table) in [
        (LengthSource::Azure, lengths::AZURE_CONV),
        (LengthSource::Mooncake, lengths::MOONCAKE_CONVERSATION),
    ] {
        let rows = load_lengths(&dir, src).unwrap();
        let mut hist = std::collections::BTreeMap::new();
        let bin = |x: u64| (2.0 * (x.max(1) as f64).log2()).floor() as u8;
        for (p, o) in rows {
            *hist.entry((bin(p), bin(o))).or_insert(0u16) += 1;
        }
        let fitted: Vec<(u8, u8, u16)> = hist.into_iter().map(|((p, o), n)| (p, o, n)).collect();
        assert_eq!(
            fitted, table,
            "regenerate with scripts/fit-serving-lengths.py"
        );
    }
}

#[test]
fn drawn_lengths_follow_the_fitted_medians() {
    // Azure conv: median prompt 1020, output 129; Mooncake: 6909 and 350 (the traces'
    // own medians). Half-octave bins keep the drawn medians within a bin of them.
    for (table, p50, o50) in [
        (lengths::AZURE_CONV, 1020.0, 129.0),
        (lengths::MOONCAKE_CONVERSATION, 6909.0, 350.0),
    ] {
        let mut rng = Rng::new(9);
        let mut d: Vec<(u64, u64)> = (0..20_000).map(|_| draw_lengths(&mut rng, table)).collect();
        d.sort_by_key(|x| x.0);
        let p = d[d.len() / 2].0 as f64;
        d.sort_by_key(|x| x.1);
        let o = d[d.len() / 2].1 as f64;
        assert!((p / p50).log2().abs() < 0.5, "prompt median {p} for {p50}");
        assert!((o / o50).log2().abs() < 0.5, "output median {o} for {o50}");
    }
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
