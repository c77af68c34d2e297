//! Python frames as call sites: the [`SiteProvider`] that `cistern_python_frames` installs.
//!
//! A sampled call site of an allocation made by Python code (`provenance:stacks`) is a native
//! backtrace through CPython's interpreter loop, which names no line of the user's program. In a
//! Python process, this module walks the allocating thread's *Python* frames instead, so that
//! `cistern leaks`, `ps` and the OOM report name `forward (/srv/model.py:88)` (Note [Foreign
//! frames] in `cistern::provenance`).
//!
//! It links against nothing: the CPython functions are looked up in the process
//! (`dlsym(RTLD_DEFAULT)`) when the provider is turned on, so `libcistern.so` still loads in a
//! program without Python, where turning it on is refused with a message. Only functions every
//! CPython from 3.9 exports are used (`PyFrame_GetBack` is not in the limited API, but is in
//! every version's ABI).
//!
//! # When it walks, and the GIL
//!
//! The provider runs on the allocating thread, before any lock of cistern's is taken, and only
//! when a sampled stack is due. PyTorch calls its allocator with the GIL released (its operator
//! bindings release it), so reading the frames means taking the GIL back, as PyTorch's own
//! history recorder does at the same point. It is taken only on a thread that has a Python
//! thread state (`PyGILState_GetThisThreadState` is not NULL: others have no frames to read;
//! PyTorch's autograd threads have one, so a sampled allocation there waits for the GIL and
//! finds no frames), never while the interpreter is not initialised or is finalising, and never
//! when the thread has a Python error pending. A thread that takes the GIL once finalisation has
//! begun is ended by CPython on the spot, so cistern_torch turns the provider off in an
//! `atexit` hook, which runs before finalisation starts; turning it off waits for the walks in
//! progress ([`set`]).
//!
//! Taking the GIL inside an allocation orders the GIL after every lock the *caller* holds. A
//! caller that holds a lock while it allocates, which a thread holding the GIL may wait for,
//! deadlocks with the provider on: PyTorch's caching allocator calls cistern with its device
//! lock held when cistern serves a `torch.cuda.MemPool` (cistern_torch's `mem_pool()`, which
//! therefore turns the provider off). cistern's own locks are never held during a walk.
//!
//! # Note [Re-entry]
//!
//! A walk calls into CPython, and some of those calls can run Python code: on 3.11 on,
//! `PyEval_GetFrame` and `PyFrame_GetBack` create frame objects on demand, which may start a
//! collection, whose finalisers may allocate CUDA memory and so re-enter the provider on the
//! same thread, or release the GIL and let another thread walk. So a thread already walking
//! gets no Python frames (its site is a native backtrace: [`Walking`]), and the cache's lock is
//! held only around a lookup or an insert, never across a call that could run Python code.
//!
//! Frames are read through `PyEval_GetFrame`, `PyFrame_GetBack`, `PyFrame_GetCode` and the code
//! object's `co_qualname` (3.11 on) or `co_name`, and `co_filename`. Each (code object, line) is
//! formatted once and kept ([`FrameCache`], which holds a reference to the code object so that
//! its address never names another), and sites share the kept strings. Measured (a malloc+free
//! pair through ctypes, 23 frames deep, every allocation sampled): 3.8 µs a pair, against 10.5
//! µs formatting every frame every time and 5.1 µs with native backtraces.

use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use cistern_alloc::provenance::{self, SiteProvider};

type Obj = *mut c_void;
type IntFn = unsafe extern "C" fn() -> c_int;
type PtrFn = unsafe extern "C" fn() -> *mut c_void;
type ObjFn = unsafe extern "C" fn(Obj) -> Obj;

/// The CPython functions the walk needs, found in the running process.
struct Python {
    is_initialized: IntFn,
    is_finalizing: Option<IntFn>,
    this_thread_state: PtrFn,
    gil_ensure: IntFn,
    gil_check: IntFn,
    gil_release: unsafe extern "C" fn(c_int),
    get_frame: PtrFn,
    frame_back: ObjFn,
    frame_code: ObjFn,
    frame_line: unsafe extern "C" fn(Obj) -> c_int,
    get_attr: unsafe extern "C" fn(Obj, *const c_char) -> Obj,
    utf8: unsafe extern "C" fn(Obj, *mut isize) -> *const c_char,
    inc_ref: unsafe extern "C" fn(Obj),
    dec_ref: unsafe extern "C" fn(Obj),
    err_occurred: PtrFn,
    err_clear: unsafe extern "C" fn(),
    /// Whether code objects have `co_qualname` (CPython 3.11 on, which added `Py_Version`).
    has_qualname: bool,
    cache: Mutex<FrameCache>,
}

/// Frames read before: each (code object, line)'s text, formatted once. Holds one reference to
/// each code object it names. Bounded: at [`MAX_CACHED_FRAMES`] it is emptied (releasing its
/// code objects) and fills again.
#[derive(Default)]
struct FrameCache {
    frames: HashMap<(usize, c_int), Arc<str>>,
    codes: HashSet<usize>,
}

/// Entries of the [`FrameCache`] (a few MiB at most).
const MAX_CACHED_FRAMES: usize = 1 << 16;

/// Looks `name` (NUL-terminated) up in the process's global symbols.
fn symbol(name: &CStr) -> Option<*mut c_void> {
    // SAFETY: `name` is NUL-terminated; RTLD_DEFAULT searches the symbols already loaded and
    // returns NULL when there is none.
    let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    (!p.is_null()).then_some(p)
}

/// Looks CPython's function `$name` up as a `$ty`, or returns `Err` naming it.
macro_rules! function {
    ($name:literal as $ty:ty) => {
        match symbol($name) {
            // SAFETY: the symbol is CPython's function of that name, whose C signature in the
            // stable ABI is `$ty`.
            Some(p) => unsafe { std::mem::transmute::<*mut c_void, $ty>(p) },
            None => return Err(CStr::to_string_lossy($name).into_owned()),
        }
    };
}

impl Python {
    /// Finds every function; `Err` names the first one missing.
    fn find() -> Result<Python, String> {
        let is_finalizing = symbol(c"Py_IsFinalizing").or_else(|| symbol(c"_Py_IsFinalizing"));
        Ok(Python {
            is_initialized: function!(c"Py_IsInitialized" as IntFn),
            // SAFETY: `Py_IsFinalizing` (3.13) and `_Py_IsFinalizing` (3.7 to 3.12) both take
            // nothing and return an int.
            is_finalizing: is_finalizing
                .map(|p| unsafe { std::mem::transmute::<*mut c_void, IntFn>(p) }),
            this_thread_state: function!(c"PyGILState_GetThisThreadState" as PtrFn),
            gil_ensure: function!(c"PyGILState_Ensure" as IntFn),
            gil_check: function!(c"PyGILState_Check" as IntFn),
            gil_release: function!(c"PyGILState_Release" as unsafe extern "C" fn(c_int)),
            get_frame: function!(c"PyEval_GetFrame" as PtrFn),
            frame_back: function!(c"PyFrame_GetBack" as ObjFn),
            frame_code: function!(c"PyFrame_GetCode" as ObjFn),
            frame_line: function!(c"PyFrame_GetLineNumber" as unsafe extern "C" fn(Obj) -> c_int),
            get_attr: function!(
                c"PyObject_GetAttrString" as unsafe extern "C" fn(Obj, *const c_char) -> Obj
            ),
            utf8: function!(
                c"PyUnicode_AsUTF8AndSize"
                    as unsafe extern "C" fn(Obj, *mut isize) -> *const c_char
            ),
            inc_ref: function!(c"Py_IncRef" as unsafe extern "C" fn(Obj)),
            dec_ref: function!(c"Py_DecRef" as unsafe extern "C" fn(Obj)),
            err_occurred: function!(c"PyErr_Occurred" as PtrFn),
            err_clear: function!(c"PyErr_Clear" as unsafe extern "C" fn()),
            has_qualname: symbol(c"Py_Version").is_some(),
            cache: Mutex::new(FrameCache::default()),
        })
    }

    /// The string attribute `name` of `obj`, if it has one. Needs the GIL.
    fn str_attr(&self, obj: Obj, name: &CStr) -> Option<String> {
        // SAFETY: the caller holds the GIL and `obj` is a live object; the attribute is a new
        // reference (or NULL with an error set, which is cleared), released below; the UTF-8
        // buffer belongs to the string and is copied before the string is released.
        unsafe {
            let v = (self.get_attr)(obj, name.as_ptr());
            if v.is_null() {
                (self.err_clear)();
                return None;
            }
            let mut len: isize = 0;
            let p = (self.utf8)(v, &mut len);
            let out = if p.is_null() || len < 0 {
                (self.err_clear)();
                None
            } else {
                let bytes = std::slice::from_raw_parts(p as *const u8, len as usize);
                Some(String::from_utf8_lossy(bytes).into_owned())
            };
            (self.dec_ref)(v);
            out
        }
    }

    /// `function (file:line)` for code object `code` at `line`. Needs the GIL.
    fn describe(&self, code: Obj, line: c_int) -> String {
        let name = if self.has_qualname {
            self.str_attr(code, c"co_qualname")
        } else {
            None
        }
        .or_else(|| self.str_attr(code, c"co_name"))
        .unwrap_or_else(|| "?".into());
        let file = self
            .str_attr(code, c"co_filename")
            .unwrap_or_else(|| "?".into());
        format!("{name} ({file}:{line})")
    }

    /// Frame `f`'s text, from the cache when its code object and line were seen before. Needs
    /// the GIL. The cache's lock is held only to look up and to insert, never across a call
    /// into CPython that could run Python code (Note [Re-entry]).
    fn frame(&self, f: Obj) -> Arc<str> {
        // SAFETY: the caller holds the GIL and `f` is a live frame; the code object is a new
        // reference, released below, except the one reference the cache keeps of each code
        // object it names (so that its address is never another code object's).
        unsafe {
            let line = (self.frame_line)(f);
            let code = (self.frame_code)(f);
            if code.is_null() {
                (self.err_clear)();
                return format!("? (?:{line})").into();
            }
            let key = (code as usize, line);
            let cached = self.cache().frames.get(&key).cloned();
            let text = match cached {
                Some(t) => t,
                None => {
                    let t: Arc<str> = self.describe(code, line).into();
                    let evicted = {
                        let mut cache = self.cache();
                        let evicted = if cache.frames.len() >= MAX_CACHED_FRAMES {
                            // Full: start afresh (code generated at run time, `exec` per
                            // request or recompiled graphs, must not stay pinned for ever).
                            cache.frames.clear();
                            std::mem::take(&mut cache.codes)
                        } else {
                            HashSet::new()
                        };
                        if cache.codes.insert(code as usize) {
                            // A reference count only: runs no Python code.
                            (self.inc_ref)(code);
                        }
                        cache.frames.insert(key, t.clone());
                        evicted
                    };
                    // Released with the GIL held and the lock not: a code object's release
                    // may run a finaliser.
                    for c in evicted {
                        (self.dec_ref)(c as Obj);
                    }
                    t
                }
            };
            (self.dec_ref)(code);
            text
        }
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, FrameCache> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Appends the calling thread's Python frames, innermost first, at most `max`.
    fn walk(&self, frames: &mut Vec<Arc<str>>, max: usize) {
        // A walk re-entered on this thread (a collection during the walk ran a finaliser that
        // allocates) gets no frames: the site is a native backtrace (Note [Re-entry]).
        let Some(_walking) = Walking::enter() else {
            return;
        };
        // SAFETY: every call below is made as CPython's rules ask: the interpreter is running
        // and not finalising, the GIL is taken only by a thread that has a thread state, and
        // every object is used while the GIL is held. Each new reference (the frames from
        // `PyFrame_GetBack`, the first one after its `Py_IncRef`) is released once.
        unsafe {
            if (self.is_initialized)() == 0
                || self.is_finalizing.is_some_and(|f| f() != 0)
                || (self.this_thread_state)().is_null()
            {
                return;
            }
            let gil = (self.gil_ensure)();
            if (self.err_occurred)().is_null() {
                let mut f = (self.get_frame)();
                if !f.is_null() {
                    (self.inc_ref)(f);
                }
                while !f.is_null() && frames.len() < max {
                    frames.push(self.frame(f));
                    let back = (self.frame_back)(f);
                    (self.dec_ref)(f);
                    f = back;
                }
                if !f.is_null() {
                    (self.dec_ref)(f);
                }
                // None was pending on entry: one now is the walk's own (`PyFrame_GetBack`
                // creating a frame object may fail), and must not surface in the user's code.
                if !(self.err_occurred)().is_null() {
                    (self.err_clear)();
                }
            }
            (self.gil_release)(gil);
        }
    }
}

thread_local! {
    /// Whether this thread is walking its frames now.
    static WALKING: Cell<bool> = const { Cell::new(false) };
}

/// Walks in progress in the process; [`set`] waits for them when it turns the provider off.
static WALKERS: AtomicUsize = AtomicUsize::new(0);

/// A walk in progress on this thread: counted in [`WALKERS`] and marked in [`WALKING`].
struct Walking;

impl Walking {
    /// `None` when this thread is already walking, or the provider was turned off.
    fn enter() -> Option<Walking> {
        if WALKING.with(|w| w.replace(true)) {
            return None;
        }
        // Counted first, then checked: `set(false)` turns `ON` off first, then waits for the
        // count, so a walk it does not wait for sees the provider off.
        WALKERS.fetch_add(1, SeqCst);
        let w = Walking;
        ON.load(SeqCst).then_some(w)
    }
}

impl Drop for Walking {
    fn drop(&mut self) {
        WALKERS.fetch_sub(1, SeqCst);
        WALKING.with(|w| w.set(false));
    }
}

/// CPython's functions, looked up once (`Err`: the first one missing).
fn python() -> &'static Result<Python, String> {
    static PY: OnceLock<Result<Python, String>> = OnceLock::new();
    PY.get_or_init(Python::find)
}

/// The provider: this thread's Python frames (none outside Python).
fn python_frames(frames: &mut Vec<Arc<str>>, max: usize) {
    if let Ok(py) = python() {
        py.walk(frames, max);
    }
}

/// Whether [`set`] installed the provider (and nothing replaced it since). Walks check it.
static ON: AtomicBool = AtomicBool::new(false);

/// How long turning the provider off waits for the walks in progress.
const OFF_WAIT: Duration = Duration::from_secs(2);

/// Turns the Python provider on or off. `Err` says why it cannot be on.
///
/// Off waits (at most [`OFF_WAIT`]) for the walks in progress to end, so that once it returns
/// no thread is inside CPython on cistern's behalf: cistern_torch turns it off in an `atexit`
/// hook, and a thread still waiting for the GIL when finalisation begins would be ended by
/// CPython in the middle of an allocation, which unwinding cannot cross. A caller holding the
/// GIL does not wait (the walkers may be waiting for it).
pub(crate) fn set(on: bool) -> Result<(), String> {
    static SET: Mutex<()> = Mutex::new(());
    {
        let _one_at_a_time = SET.lock().unwrap_or_else(|e| e.into_inner());
        if on {
            return match python() {
                Ok(_) => {
                    ON.store(true, SeqCst);
                    provenance::set_site_provider(Some(python_frames as SiteProvider));
                    Ok(())
                }
                Err(missing) => Err(format!(
                    "this process runs no CPython 3.9 or later ({missing} is not loaded): \
                     Python frames can name call sites only in a Python process"
                )),
            };
        }
        if ON.swap(false, SeqCst) {
            provenance::set_site_provider(None);
        }
    }
    // Outside the lock: a finaliser run by a walk may itself turn the provider on or off.
    let holds_gil = python()
        .as_ref()
        // SAFETY: `PyGILState_Check` may be called by any thread at any time.
        .is_ok_and(|py| unsafe { (py.gil_check)() } != 0);
    let mine = usize::from(WALKING.with(|w| w.get()));
    let start = Instant::now();
    while !holds_gil && WALKERS.load(SeqCst) > mine && start.elapsed() < OFF_WAIT {
        std::thread::sleep(Duration::from_micros(200));
    }
    Ok(())
}

/// Whether the Python provider is on.
pub(crate) fn is_on() -> bool {
    ON.load(SeqCst) && provenance::site_provider().is_some()
}
