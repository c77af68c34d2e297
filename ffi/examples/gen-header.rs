//! Writes `ffi/include/cistern.h` from the exports in `ffi/src/lib.rs` (cbindgen).
//!
//! `cargo run -p cistern-ffi --example gen-header`; `tests/header.rs` fails when the checked-in
//! header is stale.

#[path = "../tests/common/header.rs"]
mod header;

fn main() {
    let text = match header::generate() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("gen-header: {e}");
            std::process::exit(1);
        }
    };
    let path = header::checked_in_path();
    if let Err(e) = std::fs::write(&path, text) {
        eprintln!("gen-header: cannot write {}: {e}", path.display());
        std::process::exit(1);
    }
    println!("wrote {}", path.display());
}
