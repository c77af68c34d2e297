//! The thread's stack of provenance tags (`cistern_tag_push` / `cistern_tag_pop`).
//!
//! The stack is the pool's own ([`cistern_alloc::provenance`]): a tag pushed here is attached to every
//! allocation this thread makes until it is popped, in the pool's ledger, its OOM reports and its
//! leak reports, exactly as with `cistern::tag_push` from Rust.

use cistern_alloc::provenance;

/// Deeper stacks are refused: an unbalanced push in a loop should fail loudly, not grow
/// without bound.
pub(crate) const MAX_DEPTH: usize = 1024;

/// Pushes `tag`. `Err` with the reason when the stack is full.
pub(crate) fn push(tag: String) -> Result<(), String> {
    if provenance::tag_depth() >= MAX_DEPTH {
        return Err(format!(
            "tag stack is {MAX_DEPTH} deep: a cistern_tag_push without its cistern_tag_pop?"
        ));
    }
    provenance::tag_push(&tag);
    Ok(())
}

/// Pops the innermost tag. `Err` when there is none.
pub(crate) fn pop() -> Result<(), String> {
    if provenance::tag_pop() {
        Ok(())
    } else {
        Err("no tag to pop (cistern_tag_pop without cistern_tag_push)".into())
    }
}

/// The innermost tag of this thread, if any (what the pool attaches to allocations).
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) fn current() -> Option<String> {
    provenance::current_tag()
}
