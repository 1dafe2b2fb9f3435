//! The dashboard's event streams open at once (`api.max_event_streams`), and the memory they
//! leave: when the last one goes, the allocator is asked to give its free pages back.
//!
//! Owns: the count of open streams. Must not: know what a stream sends (`dashboard` does).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// The event streams open, against `api.max_event_streams`. Cheap to clone.
#[derive(Clone, Default)]
pub struct Watchers(Arc<AtomicUsize>);

impl Watchers {
    /// A place for one more stream while fewer than `cap` are open; it is given back when
    /// the [`Watcher`] is dropped.
    pub fn admit(&self, cap: usize) -> Option<Watcher> {
        self.0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < cap).then_some(n + 1)
            })
            .ok()
            .map(|_| Watcher(self.0.clone()))
    }

    /// The streams open now.
    pub fn open(&self) -> usize {
        self.0.load(Ordering::Acquire)
    }
}

/// One open stream's place among the [`Watchers`].
pub struct Watcher(Arc<AtomicUsize>);

impl Drop for Watcher {
    fn drop(&mut self) {
        if self.0.fetch_sub(1, Ordering::AcqRel) == 1 {
            give_back_memory();
        }
    }
}

/// Asks glibc's allocator to return the free pages of its heaps to the system: a stream's
/// pieces are many small allocations, which glibc keeps for reuse once freed, so the
/// daemon's resident memory would otherwise stay at its peak after the dashboards leave.
/// Off the runtime's threads: it walks every heap.
fn give_back_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        fn trim() {
            // SAFETY: malloc_trim only walks and releases the allocator's free memory.
            unsafe {
                nix::libc::malloc_trim(0);
            }
        }
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn_blocking(trim)),
            Err(_) => trim(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_admitted_up_to_the_cap_and_their_places_come_back() {
        let w = Watchers::default();
        // (cap, admitted, open after)
        let mut held = Vec::new();
        for (cap, want, open) in [(2, true, 1), (2, true, 2), (2, false, 2), (3, true, 3)] {
            let got = w.admit(cap);
            assert_eq!(got.is_some(), want, "cap {cap}");
            held.extend(got);
            assert_eq!(w.open(), open, "cap {cap}");
        }
        // A lower cap (a reload) lets no one in until enough have gone.
        assert!(w.admit(1).is_none());
        held.truncate(1);
        assert_eq!(w.open(), 1);
        assert!(w.admit(1).is_none());
        held.clear();
        assert_eq!(w.open(), 0);
        assert!(w.admit(1).is_some());
        assert_eq!(w.open(), 0, "a dropped place is given back");
    }
}
