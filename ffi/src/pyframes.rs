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
//! `atexit` hook, which runs before finalisation starts.
//!
//! Frames are read through `PyEval_GetFrame`, `PyFrame_GetBack`, `PyFrame_GetCode` and the code
//! object's `co_qualname` (3.11 on) or `co_name`, and `co_filename`. Each (code object, line) is
//! formatted once and kept ([`FrameCache`], which holds a reference to the code object so that
//! its address never names another), and sites share the kept strings. Measured (a malloc+free
//! pair through ctypes, 23 frames deep, every allocation sampled): 3.8 µs a pair, against 10.5
//! µs formatting every frame every time and 5.1 µs with native backtraces.

use std::collections::{HashMap, HashSet};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Mutex, OnceLock};

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
/// each code object it names. Bounded: past [`MAX_CACHED_FRAMES`], frames are formatted afresh.
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
    /// the GIL.
    fn frame(&self, f: Obj, cache: &mut FrameCache) -> Arc<str> {
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
            let text = match cache.frames.get(&key) {
                Some(t) => t.clone(),
                None => {
                    let t: Arc<str> = self.describe(code, line).into();
                    if cache.frames.len() < MAX_CACHED_FRAMES {
                        if cache.codes.insert(code as usize) {
                            (self.inc_ref)(code);
                        }
                        cache.frames.insert(key, t.clone());
                    }
                    t
                }
            };
            (self.dec_ref)(code);
            text
        }
    }

    /// Appends the calling thread's Python frames, innermost first, at most `max`.
    fn walk(&self, frames: &mut Vec<Arc<str>>, max: usize) {
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
                // Taken with the GIL held, never the other way round.
                let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
                let mut f = (self.get_frame)();
                if !f.is_null() {
                    (self.inc_ref)(f);
                }
                while !f.is_null() && frames.len() < max {
                    frames.push(self.frame(f, &mut cache));
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

/// Whether [`set`] installed the provider (and nothing replaced it since).
static ON: AtomicBool = AtomicBool::new(false);

/// Turns the Python provider on or off. `Err` says why it cannot be on.
pub(crate) fn set(on: bool) -> Result<(), String> {
    if !on {
        if ON.swap(false, SeqCst) {
            provenance::set_site_provider(None);
        }
        return Ok(());
    }
    match python() {
        Ok(_) => {
            provenance::set_site_provider(Some(python_frames as SiteProvider));
            ON.store(true, SeqCst);
            Ok(())
        }
        Err(missing) => Err(format!(
            "this process runs no CPython 3.9 or later ({missing} is not loaded): Python \
             frames can name call sites only in a Python process"
        )),
    }
}

/// Whether the Python provider is on.
pub(crate) fn is_on() -> bool {
    ON.load(SeqCst) && provenance::site_provider().is_some()
}
