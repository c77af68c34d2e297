//! A small reader for Python pickles made of builtin types (protocols 2 to 5).
//!
//! Only the opcodes that build `None`, `bool`, `int`, `float`, `str`, `bytes`, `list`, `tuple`,
//! `dict`, `set` and `frozenset` are understood; anything that would import or call Python code
//! (`GLOBAL`, `REDUCE`, `BUILD`, ...) is rejected with a [`PickleError`]. That is enough for
//! PyTorch memory snapshots (`torch.cuda.memory._snapshot()`), which are plain builtin pickles.
//!
//! Python's pickler memoizes every container and string and the snapshots refer to the same
//! objects (frame dicts) from many places. The reader keeps containers in an arena while parsing,
//! so a memo entry and the value on the stack are the *same* container: a list memoized while
//! empty and filled by later `APPENDS` is seen filled through every reference. The finished
//! [`Value`] tree shares each container through an [`Arc`], so a dict referenced a thousand
//! times is built once. A truly recursive structure (a list that contains itself) cannot be a
//! finite tree and is reported as an error.
//!
//! The reader never panics: truncated input, unknown opcodes, bad memo indices, stack underflow
//! and nesting deeper than [`MAX_DEPTH`] are all errors carrying the byte offset.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

/// Deepest container nesting accepted in a finished value.
pub const MAX_DEPTH: usize = 256;

/// A Python value made of builtin types.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// `None`.
    None,
    /// `True` or `False`.
    Bool(bool),
    /// An `int` that fits in 64 bits.
    Int(i64),
    /// An `int` that needs more than 64 but at most 128 bits.
    BigInt(i128),
    /// A `float`.
    Float(f64),
    /// A `str`.
    Str(Arc<str>),
    /// A `bytes` object.
    Bytes(Arc<[u8]>),
    /// A `list`.
    List(Arc<[Value]>),
    /// A `tuple`.
    Tuple(Arc<[Value]>),
    /// A `dict`, in insertion order. Keys are usually strings or ints.
    Dict(Arc<[(Value, Value)]>),
    /// A `set` or `frozenset`, in the order the pickle listed its items.
    Set(Arc<[Value]>),
}

impl Value {
    /// The value under string key `key` when `self` is a dict (the last one if repeated).
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Dict(items) => items
                .iter()
                .rev()
                .find(|(k, _)| matches!(k, Value::Str(s) if &**s == key))
                .map(|(_, v)| v),
            _ => None,
        }
    }

    /// The integer as `i128`, for `Int` and `BigInt`; `bool` is not an integer here.
    pub fn as_i128(&self) -> Option<i128> {
        match self {
            Value::Int(i) => Some(i128::from(*i)),
            Value::BigInt(i) => Some(*i),
            _ => None,
        }
    }

    /// The integer when it is in `0..=u64::MAX`.
    pub fn as_u64(&self) -> Option<u64> {
        self.as_i128().and_then(|i| u64::try_from(i).ok())
    }

    /// The string slice of a `Str`.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The items of a `List` or `Tuple`.
    pub fn as_seq(&self) -> Option<&[Value]> {
        match self {
            Value::List(v) | Value::Tuple(v) => Some(v),
            _ => None,
        }
    }

    /// The pairs of a `Dict`.
    pub fn as_dict(&self) -> Option<&[(Value, Value)]> {
        match self {
            Value::Dict(v) => Some(v),
            _ => None,
        }
    }

    /// A short name of the Python type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::None => "None",
            Value::Bool(_) => "bool",
            Value::Int(_) | Value::BigInt(_) => "int",
            Value::Float(_) => "float",
            Value::Str(_) => "str",
            Value::Bytes(_) => "bytes",
            Value::List(_) => "list",
            Value::Tuple(_) => "tuple",
            Value::Dict(_) => "dict",
            Value::Set(_) => "set",
        }
    }
}

/// Malformed or unsupported pickle input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PickleError {
    /// Byte offset in the input where the problem was found.
    pub offset: usize,
    /// What was expected and what was found.
    pub message: String,
}

impl fmt::Display for PickleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "byte {}: {}", self.offset, self.message)
    }
}

impl std::error::Error for PickleError {}

/// Parse one pickle (up to its `STOP`) from `data`. Bytes after `STOP` are ignored.
pub fn from_slice(data: &[u8]) -> Result<Value, PickleError> {
    Parser::new(data).run()
}

// ---------------------------------------------------------------------------------------------
// Parsing: containers live in an arena and are referred to by index while the pickle is read.

/// A stack or memo entry: a scalar, or a reference to a container in the arena.
#[derive(Debug, Clone)]
enum Node {
    None,
    Bool(bool),
    Int(i64),
    BigInt(i128),
    Float(f64),
    Str(Arc<str>),
    Bytes(Arc<[u8]>),
    Ref(usize),
}

#[derive(Debug)]
enum Container {
    List(Vec<Node>),
    Tuple(Vec<Node>),
    Dict(Vec<(Node, Node)>),
    Set(Vec<Node>),
}

#[derive(Debug, Clone, Copy)]
enum Freeze {
    NotYet,
    InProgress,
}

struct Parser<'a> {
    data: &'a [u8],
    pos: usize,
    /// Offset of the opcode being executed, for error messages.
    op_at: usize,
    stack: Vec<Node>,
    marks: Vec<usize>,
    arena: Vec<Container>,
    /// Memo entries `0..len`, the indices CPython's pickler writes (always the next one).
    memo: Vec<Node>,
    /// Memo entries written out of order, so a hostile `LONG_BINPUT 0xffffffff` cannot make the
    /// reader allocate gigabytes.
    sparse_memo: HashMap<u32, Node>,
}

impl<'a> Parser<'a> {
    fn new(data: &'a [u8]) -> Self {
        Parser {
            data,
            pos: 0,
            op_at: 0,
            stack: Vec::new(),
            marks: Vec::new(),
            arena: Vec::new(),
            memo: Vec::new(),
            sparse_memo: HashMap::new(),
        }
    }

    fn err(&self, message: impl Into<String>) -> PickleError {
        PickleError {
            offset: self.op_at,
            message: message.into(),
        }
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], PickleError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.data.len());
        match end {
            Some(end) => {
                let s = &self.data[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(PickleError {
                offset: self.pos,
                message: format!(
                    "expected {n} bytes of {what}, found end of input ({} bytes left)",
                    self.data.len() - self.pos
                ),
            }),
        }
    }

    fn take_array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], PickleError> {
        let s = self.take(N, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(s);
        Ok(out)
    }

    fn u8(&mut self, what: &str) -> Result<u8, PickleError> {
        Ok(self.take_array::<1>(what)?[0])
    }

    fn u32(&mut self, what: &str) -> Result<u32, PickleError> {
        Ok(u32::from_le_bytes(self.take_array(what)?))
    }

    fn u64_len(&mut self, what: &str) -> Result<usize, PickleError> {
        let n = u64::from_le_bytes(self.take_array(what)?);
        // A length that does not fit in usize cannot fit in the input either.
        Ok(usize::try_from(n).unwrap_or(usize::MAX))
    }

    fn pop(&mut self) -> Result<Node, PickleError> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return Err(self.err(format!(
                "expected a value on the stack for opcode 0x{:02x}, found {}",
                self.data.get(self.op_at).copied().unwrap_or(0),
                if self.stack.len() == floor && !self.marks.is_empty() {
                    "a MARK"
                } else {
                    "an empty stack"
                }
            )));
        }
        self.stack.pop().ok_or_else(|| self.err("stack underflow"))
    }

    fn pop_mark(&mut self) -> Result<Vec<Node>, PickleError> {
        let Some(mark) = self.marks.pop() else {
            return Err(self.err("expected a MARK on the stack, found none"));
        };
        // The stack never shrinks below the topmost mark (see `pop`), so this cannot fail,
        // but stay defensive rather than index.
        if mark > self.stack.len() {
            return Err(self.err("MARK above the top of the stack"));
        }
        Ok(self.stack.split_off(mark))
    }

    fn new_container(&mut self, c: Container) -> Node {
        self.arena.push(c);
        Node::Ref(self.arena.len() - 1)
    }

    /// The container on top of the stack, as an arena index (not popped).
    fn top_container(&self) -> Result<usize, PickleError> {
        let floor = self.marks.last().copied().unwrap_or(0);
        match self.stack.last() {
            Some(Node::Ref(i)) if self.stack.len() > floor => Ok(*i),
            Some(_) if self.stack.len() > floor => {
                Err(self.err("expected a list, dict or set on the stack, found a scalar"))
            }
            _ => Err(self.err("expected a list, dict or set on the stack, found nothing")),
        }
    }

    fn extend_list(&mut self, items: Vec<Node>) -> Result<(), PickleError> {
        let idx = self.top_container()?;
        match self.arena.get_mut(idx) {
            Some(Container::List(v)) | Some(Container::Set(v)) => {
                v.extend(items);
                Ok(())
            }
            Some(_) => Err(self.err("expected a list (or set) to append to, found another type")),
            None => Err(self.err("dangling container reference")),
        }
    }

    fn extend_dict(&mut self, items: Vec<Node>) -> Result<(), PickleError> {
        if items.len() % 2 != 0 {
            return Err(self.err(format!(
                "expected an even number of items for SETITEMS, found {}",
                items.len()
            )));
        }
        let idx = self.top_container()?;
        let Some(Container::Dict(d)) = self.arena.get_mut(idx) else {
            return Err(self.err("expected a dict to set items in, found another type"));
        };
        let mut it = items.into_iter();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            d.push((k, v));
        }
        Ok(())
    }

    fn memo_put(&mut self, idx: u32) -> Result<(), PickleError> {
        let Some(top) = self.stack.last().cloned() else {
            return Err(self.err("expected a value to memoize, found an empty stack"));
        };
        let i = idx as usize;
        if let Some(slot) = self.memo.get_mut(i) {
            *slot = top;
        } else if i == self.memo.len() {
            self.memo.push(top);
        } else {
            self.sparse_memo.insert(idx, top);
        }
        Ok(())
    }

    fn memo_get(&mut self, idx: u32) -> Result<(), PickleError> {
        let found = self
            .memo
            .get(idx as usize)
            .cloned()
            .or_else(|| self.sparse_memo.get(&idx).cloned());
        match found {
            Some(n) => {
                self.stack.push(n);
                Ok(())
            }
            None => Err(self.err(format!(
                "expected a memo index that was stored, found {idx} (memo holds {})",
                self.memo.len()
            ))),
        }
    }

    fn int_from_le(&self, bytes: &[u8]) -> Result<Node, PickleError> {
        if bytes.len() > 16 {
            // Accept wider encodings of small numbers (sign-extension bytes only).
            let (low, high) = bytes.split_at(16);
            let neg = low[15] & 0x80 != 0;
            let ext = if neg { 0xff } else { 0 };
            if high.iter().any(|&b| b != ext) {
                return Err(self.err(format!(
                    "expected an integer of at most 128 bits, found {} bytes",
                    bytes.len()
                )));
            }
            return self.int_from_le(low);
        }
        if bytes.is_empty() {
            return Ok(Node::Int(0));
        }
        let neg = bytes[bytes.len() - 1] & 0x80 != 0;
        let mut buf = if neg { [0xffu8; 16] } else { [0u8; 16] };
        buf[..bytes.len()].copy_from_slice(bytes);
        let v = i128::from_le_bytes(buf);
        Ok(match i64::try_from(v) {
            Ok(i) => Node::Int(i),
            Err(_) => Node::BigInt(v),
        })
    }

    fn utf8(&self, bytes: &[u8]) -> Result<Node, PickleError> {
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(Node::Str(Arc::from(s))),
            Err(e) => Err(self.err(format!("expected UTF-8 string data, found {e}"))),
        }
    }

    fn run(mut self) -> Result<Value, PickleError> {
        loop {
            self.op_at = self.pos;
            let op = match self.data.get(self.pos) {
                Some(&b) => b,
                None => {
                    return Err(self.err("expected an opcode (or STOP), found end of input"));
                }
            };
            self.pos += 1;
            match op {
                // PROTO
                0x80 => {
                    let v = self.u8("protocol number")?;
                    if v > 5 {
                        return Err(self.err(format!(
                            "expected pickle protocol 2 to 5, found protocol {v}"
                        )));
                    }
                }
                // FRAME: framing is only a buffering hint.
                0x95 => {
                    self.take(8, "frame length")?;
                }
                // STOP
                b'.' => {
                    let root = self.pop()?;
                    return self.freeze_root(root);
                }
                // MARK
                b'(' => self.marks.push(self.stack.len()),
                // POP
                b'0' => {
                    self.pop()?;
                }
                // POP_MARK
                b'1' => {
                    self.pop_mark()?;
                }
                // DUP
                b'2' => {
                    let top = self.pop()?;
                    self.stack.push(top.clone());
                    self.stack.push(top);
                }
                // NONE, NEWTRUE, NEWFALSE
                b'N' => self.stack.push(Node::None),
                0x88 => self.stack.push(Node::Bool(true)),
                0x89 => self.stack.push(Node::Bool(false)),
                // BININT, BININT1, BININT2
                b'J' => {
                    let v = i32::from_le_bytes(self.take_array("BININT argument")?);
                    self.stack.push(Node::Int(i64::from(v)));
                }
                b'K' => {
                    let v = self.u8("BININT1 argument")?;
                    self.stack.push(Node::Int(i64::from(v)));
                }
                b'M' => {
                    let v = u16::from_le_bytes(self.take_array("BININT2 argument")?);
                    self.stack.push(Node::Int(i64::from(v)));
                }
                // LONG1, LONG4
                0x8a => {
                    let n = self.u8("LONG1 length")? as usize;
                    let b = self.take(n, "LONG1 data")?;
                    let v = self.int_from_le(b)?;
                    self.stack.push(v);
                }
                0x8b => {
                    let n = i32::from_le_bytes(self.take_array("LONG4 length")?);
                    let n = usize::try_from(n).map_err(|_| {
                        self.err(format!("expected a LONG4 length >= 0, found {n}"))
                    })?;
                    let b = self.take(n, "LONG4 data")?;
                    let v = self.int_from_le(b)?;
                    self.stack.push(v);
                }
                // BINFLOAT (big-endian)
                b'G' => {
                    let v = f64::from_be_bytes(self.take_array("BINFLOAT argument")?);
                    self.stack.push(Node::Float(v));
                }
                // SHORT_BINUNICODE, BINUNICODE, BINUNICODE8
                0x8c => {
                    let n = self.u8("SHORT_BINUNICODE length")? as usize;
                    let b = self.take(n, "SHORT_BINUNICODE data")?;
                    let s = self.utf8(b)?;
                    self.stack.push(s);
                }
                b'X' => {
                    let n = self.u32("BINUNICODE length")? as usize;
                    let b = self.take(n, "BINUNICODE data")?;
                    let s = self.utf8(b)?;
                    self.stack.push(s);
                }
                0x8d => {
                    let n = self.u64_len("BINUNICODE8 length")?;
                    let b = self.take(n, "BINUNICODE8 data")?;
                    let s = self.utf8(b)?;
                    self.stack.push(s);
                }
                // SHORT_BINBYTES, BINBYTES, BINBYTES8
                b'C' => {
                    let n = self.u8("SHORT_BINBYTES length")? as usize;
                    let b = self.take(n, "SHORT_BINBYTES data")?;
                    self.stack.push(Node::Bytes(Arc::from(b)));
                }
                b'B' => {
                    let n = self.u32("BINBYTES length")? as usize;
                    let b = self.take(n, "BINBYTES data")?;
                    self.stack.push(Node::Bytes(Arc::from(b)));
                }
                0x8e => {
                    let n = self.u64_len("BINBYTES8 length")?;
                    let b = self.take(n, "BINBYTES8 data")?;
                    self.stack.push(Node::Bytes(Arc::from(b)));
                }
                // EMPTY_LIST, EMPTY_DICT, EMPTY_TUPLE, EMPTY_SET
                b']' => {
                    let n = self.new_container(Container::List(Vec::new()));
                    self.stack.push(n);
                }
                b'}' => {
                    let n = self.new_container(Container::Dict(Vec::new()));
                    self.stack.push(n);
                }
                b')' => {
                    let n = self.new_container(Container::Tuple(Vec::new()));
                    self.stack.push(n);
                }
                0x8f => {
                    let n = self.new_container(Container::Set(Vec::new()));
                    self.stack.push(n);
                }
                // LIST, DICT, TUPLE, FROZENSET (from MARK)
                b'l' => {
                    let items = self.pop_mark()?;
                    let n = self.new_container(Container::List(items));
                    self.stack.push(n);
                }
                b'd' => {
                    let items = self.pop_mark()?;
                    let n = self.new_container(Container::Dict(Vec::new()));
                    self.stack.push(n);
                    self.extend_dict(items)?;
                }
                b't' => {
                    let items = self.pop_mark()?;
                    let n = self.new_container(Container::Tuple(items));
                    self.stack.push(n);
                }
                0x91 => {
                    let items = self.pop_mark()?;
                    let n = self.new_container(Container::Set(items));
                    self.stack.push(n);
                }
                // TUPLE1, TUPLE2, TUPLE3
                0x85..=0x87 => {
                    let k = usize::from(op - 0x84);
                    let mut items = Vec::with_capacity(k);
                    for _ in 0..k {
                        items.push(self.pop()?);
                    }
                    items.reverse();
                    let n = self.new_container(Container::Tuple(items));
                    self.stack.push(n);
                }
                // APPEND, APPENDS, ADDITEMS
                b'a' => {
                    let v = self.pop()?;
                    self.extend_list(vec![v])?;
                }
                b'e' | 0x90 => {
                    let items = self.pop_mark()?;
                    self.extend_list(items)?;
                }
                // SETITEM, SETITEMS
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    self.extend_dict(vec![k, v])?;
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    self.extend_dict(items)?;
                }
                // MEMOIZE, BINPUT, LONG_BINPUT
                0x94 => {
                    let idx = u32::try_from(self.memo.len())
                        .map_err(|_| self.err("memo is full (over 2^32 entries)"))?;
                    self.memo_put(idx)?;
                }
                b'q' => {
                    let idx = self.u8("BINPUT index")?;
                    self.memo_put(u32::from(idx))?;
                }
                b'r' => {
                    let idx = self.u32("LONG_BINPUT index")?;
                    self.memo_put(idx)?;
                }
                // BINGET, LONG_BINGET
                b'h' => {
                    let idx = self.u8("BINGET index")?;
                    self.memo_get(u32::from(idx))?;
                }
                b'j' => {
                    let idx = self.u32("LONG_BINGET index")?;
                    self.memo_get(idx)?;
                }
                other => {
                    return Err(self.err(format!(
                        "expected a builtin-type pickle opcode, found opcode 0x{other:02x}{}",
                        opcode_hint(other)
                    )));
                }
            }
        }
    }

    /// Turn the arena graph under `root` into a shared [`Value`] tree.
    fn freeze_root(mut self, root: Node) -> Result<Value, PickleError> {
        self.op_at = self.pos.saturating_sub(1);
        let mut state = vec![Freeze::NotYet; self.arena.len()];
        let mut done: Vec<Option<Value>> = vec![None; self.arena.len()];
        let arena = std::mem::take(&mut self.arena);
        freeze(&root, &arena, &mut state, &mut done, 0).map_err(|m| self.err(m))
    }
}

fn freeze(
    node: &Node,
    arena: &[Container],
    state: &mut [Freeze],
    done: &mut [Option<Value>],
    depth: usize,
) -> Result<Value, String> {
    let idx = match node {
        Node::None => return Ok(Value::None),
        Node::Bool(b) => return Ok(Value::Bool(*b)),
        Node::Int(i) => return Ok(Value::Int(*i)),
        Node::BigInt(i) => return Ok(Value::BigInt(*i)),
        Node::Float(f) => return Ok(Value::Float(*f)),
        Node::Str(s) => return Ok(Value::Str(s.clone())),
        Node::Bytes(b) => return Ok(Value::Bytes(b.clone())),
        Node::Ref(i) => *i,
    };
    if let Some(Some(v)) = done.get(idx) {
        return Ok(v.clone());
    }
    if depth >= MAX_DEPTH {
        return Err(format!(
            "expected containers nested at most {MAX_DEPTH} deep, found deeper nesting"
        ));
    }
    match state.get(idx) {
        Some(Freeze::InProgress) => {
            return Err(
                "expected a tree or shared DAG, found a recursive structure \
                        (a container that contains itself)"
                    .to_string(),
            )
        }
        Some(Freeze::NotYet) => {}
        None => return Err("dangling container reference".to_string()),
    }
    state[idx] = Freeze::InProgress;
    let seq = |items: &[Node], state: &mut [Freeze], done: &mut [Option<Value>]| {
        items
            .iter()
            .map(|n| freeze(n, arena, state, done, depth + 1))
            .collect::<Result<Vec<Value>, String>>()
    };
    let value = match &arena[idx] {
        Container::List(items) => Value::List(seq(items, state, done)?.into()),
        Container::Tuple(items) => Value::Tuple(seq(items, state, done)?.into()),
        Container::Set(items) => Value::Set(seq(items, state, done)?.into()),
        Container::Dict(pairs) => {
            let mut out = Vec::with_capacity(pairs.len());
            for (k, v) in pairs {
                let k = freeze(k, arena, state, done, depth + 1)?;
                let v = freeze(v, arena, state, done, depth + 1)?;
                out.push((k, v));
            }
            Value::Dict(out.into())
        }
    };
    done[idx] = Some(value.clone());
    Ok(value)
}

fn opcode_hint(op: u8) -> &'static str {
    match op {
        b'c' | 0x93 => " (GLOBAL/STACK_GLOBAL: the pickle refers to a Python class or function)",
        b'R' | b'b' | 0x81 | 0x92 => " (REDUCE/BUILD/NEWOBJ: the pickle constructs Python objects)",
        b'I' | b'L' | b'F' | b'V' | b'S' | b'p' | b'g' => " (text opcode of protocol 0)",
        _ => "",
    }
}

#[cfg(test)]
mod tests;
