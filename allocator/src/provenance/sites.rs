//! Call sites: sampled stacks interned to small ids (a native backtrace, or the frames a
//! [`SiteProvider`] gives: Note [Foreign frames]), symbolised only when a report asks
//! ([`site_frames`]), and the one-line label reports print ([`site_label`]). Part of
//! [`crate::provenance`]; `origin` there decides when a stack is due.

use std::hash::{Hash, Hasher};
use std::sync::{Arc, OnceLock};

use parking_lot::{Mutex, RwLock};
use rustc_hash::{FxHashMap, FxHasher};

use super::{MAX_FRAMES, MAX_SITES};

/// What a call site is made of.
enum SiteFrames {
    /// Return addresses of a native backtrace, innermost first (symbolised when read).
    Native(Box<[usize]>),
    /// Frames a [`SiteProvider`] gave as text, innermost first (shared with the provider's
    /// own cache: a frame common to many sites is stored once).
    Text(Box<[Arc<str>]>),
}

struct Sites {
    by_hash: FxHashMap<u64, u32>,
    /// Frames by site id (index 0: unused).
    frames: Vec<SiteFrames>,
}

fn sites() -> &'static Mutex<Sites> {
    static SITES: OnceLock<Mutex<Sites>> = OnceLock::new();
    SITES.get_or_init(|| {
        Mutex::new(Sites {
            by_hash: FxHashMap::default(),
            frames: vec![SiteFrames::Native(Box::new([]))],
        })
    })
}

// Note [Foreign frames]
// ~~~~~~~~~~~~~~~~~~~~~
// A native backtrace of an allocation made by Python code shows the interpreter's loop
// (`_PyEval_EvalFrameDefault` ...), never the line of Python that allocated: `cistern leaks`
// would name no user code. So a client may install a [`SiteProvider`]: when a sampled stack is
// due ([`origin`], before any lock of the pool), [`capture_site`] asks it first, and when it
// gives frames (the calling thread runs Python code), the site is those frames, interned by
// their text; when it gives none, the native backtrace as before. A provider is called on the
// allocating thread with no lock of cistern's held, only when a stack is due (one allocation in
// `stack_sample_rate` with `provenance:stacks`, none otherwise), and must not allocate from the
// pool. `libcistern.so` has one for CPython (`cistern_python_frames`), which cistern_torch turns
// on.

/// Fills `frames` with the calling thread's frames, innermost first, each as
/// `function (file:line)`, at most `max` of them; leaves it empty when it has none. Frames are
/// shared strings, so that a provider can keep one copy of each and sites share it.
pub type SiteProvider = fn(frames: &mut Vec<Arc<str>>, max: usize);

fn provider() -> &'static RwLock<Option<SiteProvider>> {
    static PROVIDER: RwLock<Option<SiteProvider>> = RwLock::new(None);
    &PROVIDER
}

/// Installs (or, with `None`, removes) the provider of foreign frames that sampled call sites
/// ask first (Note [Foreign frames]); returns the previous one.
pub fn set_site_provider(p: Option<SiteProvider>) -> Option<SiteProvider> {
    std::mem::replace(&mut *provider().write(), p)
}

/// The provider installed by [`set_site_provider`], if any.
pub fn site_provider() -> Option<SiteProvider> {
    *provider().read()
}

/// Interns `frames` (innermost first) as a call site; 0 when [`MAX_SITES`] are already kept.
fn intern_site(hash: u64, frames: impl FnOnce() -> SiteFrames) -> u32 {
    let mut s = sites().lock();
    if let Some(&id) = s.by_hash.get(&hash) {
        return id;
    }
    if s.frames.len() > MAX_SITES {
        return 0;
    }
    let id = s.frames.len() as u32;
    s.frames.push(frames());
    s.by_hash.insert(hash, id);
    id
}

/// Captures the calling thread's stack and interns it; returns its site id (0 when
/// [`MAX_SITES`] distinct sites are already kept). The frames of the installed
/// [`SiteProvider`] when it gives any, else a native backtrace. Costs a stack walk
/// (microseconds).
#[inline(never)]
pub fn capture_site() -> u32 {
    if let Some(provide) = site_provider() {
        let mut text = Vec::new();
        provide(&mut text, MAX_FRAMES);
        if !text.is_empty() {
            text.truncate(MAX_FRAMES);
            return intern_text_site(text);
        }
    }
    let mut ips = [0usize; MAX_FRAMES];
    let mut n = 0;
    backtrace::trace(|f| {
        ips[n] = f.ip() as usize;
        n += 1;
        n < MAX_FRAMES
    });
    let ips = &ips[..n];
    let mut h = FxHasher::default();
    0u8.hash(&mut h);
    ips.hash(&mut h);
    intern_site(h.finish(), || SiteFrames::Native(ips.into()))
}

/// Interns frames given as text (innermost first).
fn intern_text_site(text: Vec<Arc<str>>) -> u32 {
    let mut h = FxHasher::default();
    1u8.hash(&mut h);
    text.hash(&mut h);
    intern_site(h.finish(), || SiteFrames::Text(text.into_boxed_slice()))
}

/// How many distinct call sites have been captured.
pub fn site_count() -> usize {
    sites().lock().frames.len() - 1
}

/// This crate's sources, to recognise its frames by file when release builds inline them under
/// short names (`capture_site`, `origin<...>`) without the `cistern::` path.
const CRATE_SRC: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/src/");

/// A symbolised frame, `function (file:line)` (as [`site_frames`] and [`SiteProvider`]s write
/// them), split into its function, file and line; a frame with no place (an unresolved
/// address) is all function. Only the last ` (` opens the place: names may hold parentheses.
pub fn split_frame(frame: &str) -> (&str, Option<&str>, Option<u64>) {
    let Some((name, place)) = frame.strip_suffix(')').and_then(|f| f.rsplit_once(" (")) else {
        return (frame, None, None);
    };
    match place
        .rsplit_once(':')
        .and_then(|(file, line)| Some((file, line.parse::<u64>().ok()?)))
    {
        Some((file, line)) => (name, Some(file), Some(line)),
        None => (name, Some(place), None),
    }
}

/// The source file a symbolised frame names, if any.
fn frame_file(frame: &str) -> Option<&str> {
    split_frame(frame).1
}

/// Whether a symbolised frame belongs to the capture itself: the backtrace crate, or this
/// module (by name, or by file when the capture was inlined).
fn is_internal(frame: &str) -> bool {
    let n = frame.trim_start_matches('<');
    n.starts_with("backtrace::")
        || n.starts_with("cistern::provenance::")
        || n.contains("<cistern::provenance::")
        || frame_file(frame).is_some_and(|f| {
            f.contains("/backtrace-")
                || f == concat!(env!("CARGO_MANIFEST_DIR"), "/src/provenance.rs")
                || f == concat!(env!("CARGO_MANIFEST_DIR"), "/src/provenance/sites.rs")
        })
}

/// Whether a symbolised frame is plumbing between the user's code and the pool, which a
/// site's label skips: cistern's own (the pool's, the C ABI's, the Python package
/// cistern_torch's) and Rust's standard library (`catch_unwind` around every C export), by
/// name or by source file.
fn is_plumbing(frame: &str) -> bool {
    let name = frame.trim_start_matches('<');
    ["cistern::", "core::", "std::", "alloc::", "__rust"]
        .iter()
        .any(|p| name.starts_with(p))
        || frame_file(frame).is_some_and(|f| {
            f.starts_with(CRATE_SRC)
                || f.starts_with("/rustc/")
                || f.contains("/cistern_torch/")
                || CRATE_SRC
                    .strip_suffix("allocator/src/")
                    .is_some_and(|root| {
                        f.strip_prefix(root)
                            .is_some_and(|r| r.starts_with("ffi/src/"))
                    })
        })
}

/// The frames of call site `id`, symbolised now: `function (file:line)` per frame, innermost
/// first, without the frames of the capture itself. Empty for an unknown id.
pub fn site_frames(id: u32) -> Vec<String> {
    if id == 0 {
        return Vec::new();
    }
    let ips = match sites().lock().frames.get(id as usize) {
        Some(SiteFrames::Native(f)) => f.clone(),
        Some(SiteFrames::Text(t)) => return t.iter().map(|f| f.to_string()).collect(),
        None => return Vec::new(),
    };
    let mut out = Vec::new();
    for &ip in ips.iter() {
        // A return address points after the call; the call's line is one byte earlier.
        let addr = ip.wrapping_sub(1) as *mut std::ffi::c_void;
        let mut any = false;
        backtrace::resolve(addr, |sym| {
            any = true;
            let name = sym
                .name()
                .map(|n| format!("{n:#}"))
                .unwrap_or_else(|| format!("{ip:#x}"));
            let place = match (sym.filename(), sym.lineno()) {
                (Some(f), Some(l)) => format!(" ({}:{l})", f.display()),
                _ => String::new(),
            };
            out.push(format!("{name}{place}"));
        });
        if !any {
            out.push(format!("{ip:#x}"));
        }
    }
    let skip = out
        .iter()
        .position(|f| !is_internal(f))
        .unwrap_or(out.len());
    out.drain(..skip);
    out
}

/// Whether a frame is a library's rather than the program's own: installed Python packages
/// (`site-packages`, `dist-packages`: torch's `Module._call_impl`, transformers), Python's
/// standard library (`threading.py`), and crates from cargo's registry. A label names the
/// program's frames first: for a PyTorch program the innermost Python frames are torch's
/// (`Linear.forward`, `Module._call_impl`), the same for every site, and the line that matters
/// is the caller's.
fn is_library(frame: &str) -> bool {
    frame_file(frame).is_some_and(|f| {
        f.contains("/site-packages/")
            || f.contains("/dist-packages/")
            || f.contains("/lib/python3")
            || f.starts_with("<frozen ")
            || f.contains("/.cargo/registry/")
    })
}

/// A one-line label for site `id` (symbolised now): its first three frames of the program's
/// own, innermost first, the first with its file and line; without any, its first three
/// outside cistern and Rust's standard library (a site reached only through libraries).
pub fn site_label(id: u32) -> String {
    let frames = site_frames(id);
    let pick = |skip: &dyn Fn(&str) -> bool| -> Vec<&str> {
        frames
            .iter()
            .filter(|f| !is_plumbing(f) && !skip(f))
            .take(3)
            .enumerate()
            .map(|(i, f)| match f.find(" (") {
                Some(cut) if i > 0 => &f[..cut],
                _ => f.as_str(),
            })
            .collect()
    };
    let mut user = pick(&is_library);
    if user.is_empty() {
        user = pick(&|_| false);
    }
    if user.is_empty() {
        format!("site {id}")
    } else {
        format!("site {id}: {}", user.join(" <- "))
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;

    thread_local! {
        /// The frames the test provider gives on this thread (other tests' threads get none).
        static FOREIGN: RefCell<Vec<Arc<str>>> = const { RefCell::new(Vec::new()) };
    }

    fn test_provider(frames: &mut Vec<Arc<str>>, max: usize) {
        FOREIGN.with(|f| frames.extend(f.borrow().iter().take(max).cloned()));
    }

    #[test]
    fn a_site_provider_names_the_frames_of_its_language() {
        set_site_provider(Some(test_provider));
        let python = vec![
            "alloc_cache (/srv/model/kv.py:88)".to_string(),
            "helper (/usr/lib/python3/site-packages/cistern_torch/_alloc.py:40)".into(),
            "step (/srv/model/serve.py:12)".into(),
            "main (/srv/model/serve.py:3)".into(),
            "<module> (/srv/model/serve.py:1)".into(),
        ];
        FOREIGN.with(|f| *f.borrow_mut() = python.iter().map(|s| s.as_str().into()).collect());
        let a = capture_site();
        let b = capture_site();
        assert_ne!(a, 0);
        assert_eq!(a, b, "the same frames intern to the same site");
        assert_eq!(site_frames(a), python);
        // The label skips cistern_torch's own frame; only the first keeps its place.
        assert_eq!(
            site_label(a),
            format!("site {a}: alloc_cache (/srv/model/kv.py:88) <- step <- main")
        );
        // A PyTorch program: torch's own frames (innermost) and the standard library's are
        // skipped for the program's; a site reached only through libraries names them.
        let torch = "/venv/lib/python3.11/site-packages/torch/nn/modules";
        let in_torch = [
            format!("Linear.forward ({torch}/linear.py:125)"),
            format!("Module._call_impl ({torch}/module.py:1750)"),
            "train_step (/srv/train.py:88)".to_string(),
            format!("Module._wrapped_call_impl ({torch}/module.py:1739)"),
            "main (/srv/train.py:120)".into(),
            "Thread.run (/usr/lib/python3.11/threading.py:975)".into(),
        ];
        FOREIGN.with(|f| *f.borrow_mut() = in_torch.iter().map(|s| s.as_str().into()).collect());
        let t = capture_site();
        assert_eq!(
            site_label(t),
            format!("site {t}: train_step (/srv/train.py:88) <- main")
        );
        let only_torch = in_torch[..2].to_vec();
        FOREIGN.with(|f| *f.borrow_mut() = only_torch.iter().map(|s| s.as_str().into()).collect());
        let o = capture_site();
        assert_eq!(
            site_label(o),
            format!("site {o}: {} <- Module._call_impl", only_torch[0])
        );
        let mut deep: Vec<String> = (0..100).map(|i| format!("f{i} (/x.py:{i})")).collect();
        FOREIGN.with(|f| *f.borrow_mut() = deep.iter().map(|s| s.as_str().into()).collect());
        let d = capture_site();
        deep.truncate(MAX_FRAMES);
        assert_eq!(site_frames(d), deep, "at most MAX_FRAMES frames are kept");
        // No foreign frames on this thread: the native stack, as without a provider (this
        // file's frames are the capture's own and are skipped; the test runner's remain).
        FOREIGN.with(|f| f.borrow_mut().clear());
        let native = capture_site();
        assert!(native != a && native != d);
        assert!(
            site_frames(native)
                .iter()
                .any(|f| f.contains("test::run_test")),
            "{:?}",
            site_frames(native)
        );
        assert!(set_site_provider(None).is_some());
        assert!(site_provider().is_none());
    }
}
