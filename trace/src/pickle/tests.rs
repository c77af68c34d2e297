//! The unit tests of `pickle.rs`, beside it (as rlsf keeps `tlsf/tests.rs`).

use super::*;

fn s(x: &str) -> Value {
    Value::Str(Arc::from(x))
}

#[test]
fn scalars() {
    // (None, True, False, 1, -2, 300, 2**40, 1.5, 'hé', b'ab')
    let mut p = vec![0x80, 4, b'(', b'N', 0x88, 0x89, b'K', 1, b'J'];
    p.extend((-2i32).to_le_bytes());
    p.extend([b'M', 0x2c, 0x01, 0x8a, 6, 0, 0, 0, 0, 0, 1, b'G']);
    p.extend(1.5f64.to_be_bytes());
    p.extend([0x8c, 3, b'h', 0xc3, 0xa9, b'C', 2, b'a', b'b', b't', b'.']);
    let v = from_slice(&p).unwrap();
    let items = v.as_seq().unwrap();
    assert_eq!(items[0], Value::None);
    assert_eq!(items[1], Value::Bool(true));
    assert_eq!(items[2], Value::Bool(false));
    assert_eq!(items[3], Value::Int(1));
    assert_eq!(items[4], Value::Int(-2));
    assert_eq!(items[5], Value::Int(300));
    assert_eq!(items[6], Value::Int(1 << 40));
    assert_eq!(items[7], Value::Float(1.5));
    assert_eq!(items[8], s("hé"));
    assert_eq!(items[9], Value::Bytes(Arc::from(&b"ab"[..])));
}

#[test]
fn long1_signs_and_bigint() {
    // -1 as LONG1 1 byte 0xff; 2**64 as LONG1 9 bytes; -2**70.
    let mut p = vec![
        0x80, 2, b'(', 0x8a, 1, 0xff, 0x8a, 9, 0, 0, 0, 0, 0, 0, 0, 0, 1,
    ];
    p.extend([0x8a, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0xc0, 0x8a, 0, b'l', b'.']);
    let v = from_slice(&p).unwrap();
    let items = v.as_seq().unwrap();
    assert_eq!(items[0], Value::Int(-1));
    assert_eq!(items[1], Value::BigInt(1i128 << 64));
    assert_eq!(items[2], Value::BigInt(-(1i128 << 70)));
    assert_eq!(items[3], Value::Int(0));
    assert_eq!(items[2].as_u64(), None);
}

/// `d = {'a': 1}; pickle.dumps([d, d], protocol=4)` : the serde-pickle failure case.
#[test]
fn shared_dict_referenced_twice() {
    let p: &[u8] =
        b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00]\x94(}\x94\x8c\x01a\x94K\x01sh\x01e.";
    let v = from_slice(p).unwrap();
    let items = v.as_seq().unwrap();
    assert_eq!(items.len(), 2);
    assert_eq!(items[0], items[1]);
    assert_eq!(items[0].get("a"), Some(&Value::Int(1)));
    // Shared, not copied.
    match (&items[0], &items[1]) {
        (Value::Dict(a), Value::Dict(b)) => assert!(Arc::ptr_eq(a, b)),
        _ => panic!("expected dicts"),
    }
}

/// `d = {'x': 1}; pickle.dumps({'l1': [d], 'l2': [d, d]}, protocol=4)`.
#[test]
fn shared_dict_in_two_lists() {
    let p: &[u8] = b"\x80\x04\x95#\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x02l1\x94]\x94}\x94\x8c\x01x\x94K\x01sa\x8c\x02l2\x94]\x94(h\x03h\x03eu.";
    let v = from_slice(p).unwrap();
    let l1 = v.get("l1").and_then(Value::as_seq).unwrap();
    let l2 = v.get("l2").and_then(Value::as_seq).unwrap();
    assert_eq!(l1.len(), 1);
    assert_eq!(l2.len(), 2);
    assert_eq!(l2[1].get("x"), Some(&Value::Int(1)));
    assert_eq!(l1[0], l2[0]);
}

/// A list memoized while empty and filled afterwards must be seen filled through the memo.
#[test]
fn container_mutated_after_memoization() {
    // EMPTY_LIST MEMOIZE(0) EMPTY_LIST MEMOIZE(1) MARK BINGET(0) K5 APPENDS -> y = [x, 5]
    // BINGET(0) K7 APPEND -> x = [7] (after y took a reference); TUPLE2 -> (y, x).
    // Python's pickle.loads gives ([[7], 5], [7]).
    let p: &[u8] = b"\x80\x04]\x94]\x94(h\x00K\x05eh\x00K\x07a\x86.";
    let v = from_slice(p).unwrap();
    let t = v.as_seq().unwrap();
    let y = t[0].as_seq().unwrap();
    let x = t[1].as_seq().unwrap();
    assert_eq!(x, &[Value::Int(7)]);
    assert_eq!(y[0].as_seq().unwrap(), &[Value::Int(7)]);
    assert_eq!(y[1], Value::Int(5));
}

#[test]
fn recursive_list_is_an_error() {
    // l = []; l.append(l)
    let p: &[u8] = b"\x80\x04]\x94h\x00a.";
    let e = from_slice(p).unwrap_err();
    assert!(e.message.contains("recursive"), "{e}");
}

#[test]
fn truncated_input() {
    let p: &[u8] = b"\x80\x04\x8c\x05ab";
    let e = from_slice(p).unwrap_err();
    assert_eq!(e.offset, 4);
    assert!(e.to_string().starts_with("byte 4: expected 5 bytes"), "{e}");
    assert!(from_slice(b"").is_err());
    assert!(from_slice(b"\x80\x04]").is_err());
}

#[test]
fn bad_opcode() {
    let p: &[u8] = b"\x80\x04]\x94c";
    let e = from_slice(p).unwrap_err();
    assert_eq!(e.offset, 4);
    assert!(e.to_string().contains("found opcode 0x63"), "{e}");
    let e = from_slice(b"\x80\x04\xff").unwrap_err();
    assert_eq!(
        e.to_string(),
        "byte 2: expected a builtin-type pickle opcode, found opcode 0xff"
    );
}

#[test]
fn bad_memo_reference() {
    let e = from_slice(b"\x80\x04]\x94h\x07.").unwrap_err();
    assert_eq!(e.offset, 4);
    assert!(e.message.contains("memo index"), "{e}");
    let e = from_slice(b"\x80\x04j\xff\xff\xff\xff.").unwrap_err();
    assert!(e.message.contains("memo index"), "{e}");
}

#[test]
fn huge_memo_index_does_not_allocate() {
    let v = from_slice(b"\x80\x04K\x01r\xff\xff\xff\xff0j\xff\xff\xff\xff.").unwrap();
    assert_eq!(v, Value::Int(1));
}

#[test]
fn stack_misuse() {
    assert!(from_slice(b"\x80\x04.").is_err()); // STOP on empty stack
    assert!(from_slice(b"\x80\x04K\x01a.").is_err()); // APPEND to an int
    assert!(from_slice(b"\x80\x04e.").is_err()); // APPENDS without MARK
    assert!(from_slice(b"\x80\x04}(K\x01u.").is_err()); // odd SETITEMS
    assert!(from_slice(b"\x80\x04(\x85.").is_err()); // TUPLE1 over a MARK
    assert!(from_slice(b"\x80\x06N.").is_err()); // protocol 6
    assert!(from_slice(b"\x80\x04\x8b\xff\xff\xff\xff.").is_err()); // negative LONG4
    assert!(from_slice(b"\x80\x04X\xff\xff\xff\xff.").is_err()); // huge length
}

#[test]
fn deep_nesting_is_an_error_not_a_crash() {
    // ] ( ] ( ] ... e e e : nesting N deep in 2 + 1 bytes per level.
    let n = 100_000;
    let mut p = vec![0x80, 4];
    for _ in 0..n {
        p.extend([b']', b'(']);
    }
    p.push(b']');
    p.extend(std::iter::repeat(b'e').take(n));
    p.push(b'.');
    let e = from_slice(&p).unwrap_err();
    assert!(e.message.contains("nested"), "{e}");
    // Just below the limit parses.
    let n = MAX_DEPTH - 1;
    let mut p = vec![0x80, 4];
    for _ in 0..n {
        p.extend([b']', b'(']);
    }
    p.push(b']');
    p.extend(std::iter::repeat(b'e').take(n));
    p.push(b'.');
    assert!(from_slice(&p).is_ok());
}

#[test]
fn sets_dicts_and_old_style_builders() {
    // {1: 'a'} via MARK ... DICT, frozenset via MARK ... FROZENSET, set via ADDITEMS
    let p: &[u8] = b"\x80\x04(K\x01\x8c\x01ad(K\x02\x91\x8f(K\x03\x90(K\x04l)\x87.";
    let v = from_slice(p).unwrap();
    let t = v.as_seq().unwrap();
    assert_eq!(t.len(), 3);
    // TUPLE3 takes the top three of [dict, frozenset, set, list, ()]; Python: ({3}, [4], ()).
    assert_eq!(t[0], Value::Set(Arc::from(vec![Value::Int(3)])));
    assert_eq!(t[1], Value::List(Arc::from(vec![Value::Int(4)])));
    assert_eq!(t[2], Value::Tuple(Arc::from(Vec::new())));
}
