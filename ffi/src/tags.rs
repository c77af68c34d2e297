//! The thread's stack of provenance tags (`cistern_tag_push` / `cistern_tag_pop`).
//!
//! The ABI exists so that bindings (`cistern_torch.tag(...)`) can be written against it now.
//! The tags are **not yet attached to blocks**: the provenance layer of the pool will read the
//! innermost tag ([`current`]) when it records an allocation. Until then pushing and popping
//! only maintain the stack.

use std::cell::RefCell;

/// Deeper stacks are refused: an unbalanced push in a loop should fail loudly, not grow
/// without bound.
pub(crate) const MAX_DEPTH: usize = 1024;

thread_local! {
    static TAGS: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
}

/// Pushes `tag`. `Err` with the reason when the stack is full.
pub(crate) fn push(tag: String) -> Result<(), String> {
    TAGS.with(|t| {
        let mut t = t.borrow_mut();
        if t.len() >= MAX_DEPTH {
            return Err(format!(
                "tag stack is {MAX_DEPTH} deep: a cistern_tag_push without its cistern_tag_pop?"
            ));
        }
        t.push(tag);
        Ok(())
    })
}

/// Pops the innermost tag. `Err` when there is none.
pub(crate) fn pop() -> Result<(), String> {
    TAGS.with(|t| match t.borrow_mut().pop() {
        Some(_) => Ok(()),
        None => Err("no tag to pop (cistern_tag_pop without cistern_tag_push)".into()),
    })
}

/// The innermost tag of this thread, if any (what the provenance layer will attach).
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) fn current() -> Option<String> {
    TAGS.with(|t| t.borrow().last().cloned())
}
