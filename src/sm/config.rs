//! `sm`'s settings: fragment sizes and counts, and where single and split
//! copies start. Read from `BTL_SM_*` variables by [`crate::Config`].

use crate::{Error, Result};

/// Settings of the `sm` transport (`Config::sm`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SmConfig {
    /// Size of an eager fragment, header included; a message that fits in
    /// one (and is too big for the fast box) takes one. 16 KiB, so that
    /// every message below `cma_min` does: with 4 KiB ones a 4 KiB message
    /// (its header's cache line too many) and an 8 KiB one take a max fragment, and their
    /// half round trips are 1.13-1.14x longer. Env: `BTL_SM_EAGER`.
    pub eager_size: usize,
    /// Number of eager fragments per process. Env: `BTL_SM_EAGER_COUNT`.
    pub eager_count: usize,
    /// Size of a max fragment, header included. Env: `BTL_SM_MAX`.
    pub max_size: usize,
    /// Number of max fragments per process. Env: `BTL_SM_MAX_COUNT`.
    pub max_count: usize,
    /// Sends, and put/get to or from a registered (non-shared) buffer, of
    /// at least this many bytes may use a single kernel copy (CMA; a
    /// rendezvous for sends) instead of fragments, where ptrace rules
    /// allow. Sends below `adapt_max` take whichever of the two the sender
    /// measured cheaper lately (see `adapt_max`), larger ones the single
    /// copy. A send below `split_min` while a rendezvous of ours to the
    /// same peer is still being copied (a stream) goes through fragments
    /// instead, so that both processes copy at once. 16 KiB. Env:
    /// `BTL_SM_CMA_MIN` (a huge value turns CMA off).
    pub cma_min: usize,
    /// Sends (`Endpoint::send`, not the borrowed `send_inline`) from
    /// `cma_min` up to (not including) this size that find the peer
    /// caught up (a request, an answer, the first of a burst) go by single
    /// copy or through fragments, whichever cost less in the sender's
    /// recent measurements of both (per peer and per power-of-two size
    /// class; one message in 64 takes the other way, to measure it
    /// again); within a burst the `split_min` rule below applies. A
    /// single copy's fixed cost (a system call that pins pages) makes
    /// fragments faster while the two cores share a cache, and the lines
    /// fragments move between the cores make them slower while the cores
    /// do not. The band ends no later than `split_min` and four doublings
    /// of `cma_min`. 64 KiB. Env: `BTL_SM_ADAPT_MAX` (`0` turns choosing
    /// off: every send from `cma_min` takes the single copy).
    pub adapt_max: usize,
    /// Rendezvous sends of at least this many bytes are copied by both
    /// processes at once (the receiver reads the head, the sender writes
    /// the tail into the receiver's buffer; see ARCHITECTURE), so two cores
    /// run the kernel's copy instead of one. A sender that does not take
    /// its part in time leaves it to the receiver. 64 KiB: there split copy
    /// streams 1.23-1.33x a one-core copy, while at 32 KiB it loses (0.86x).
    /// Env: `BTL_SM_SPLIT_MIN` (a huge value turns it off).
    pub split_min: usize,
}

impl Default for SmConfig {
    fn default() -> Self {
        SmConfig {
            eager_size: 16 * 1024,
            eager_count: 64,
            max_size: 128 * 1024,
            max_count: 16,
            cma_min: 16 * 1024,
            adapt_max: 64 * 1024,
            split_min: 64 * 1024,
        }
    }
}

impl SmConfig {
    /// Override from the `BTL_SM_*` variables `get` finds.
    pub(crate) fn read(&mut self, get: &dyn Fn(&str) -> Option<String>) -> Result<()> {
        for (k, f) in [
            ("BTL_SM_EAGER", &mut self.eager_size),
            ("BTL_SM_EAGER_COUNT", &mut self.eager_count),
            ("BTL_SM_MAX", &mut self.max_size),
            ("BTL_SM_MAX_COUNT", &mut self.max_count),
            ("BTL_SM_CMA_MIN", &mut self.cma_min),
            ("BTL_SM_ADAPT_MAX", &mut self.adapt_max),
            ("BTL_SM_SPLIT_MIN", &mut self.split_min),
        ] {
            if let Some(v) = get(k) {
                *f = crate::sys::env::parse(k, &v)?;
            }
        }
        Ok(())
    }

    /// Check that the settings make sense together.
    pub(crate) fn validate(&self) -> Result<()> {
        let frag = super::FRAG_BODY;
        if self.eager_size < frag + 8 || self.eager_size % 8 != 0 {
            return Err(Error::Config(format!(
                "sm eager fragment size {} must be a multiple of 8 and at least {}",
                self.eager_size,
                frag + 8
            )));
        }
        if self.max_size < self.eager_size || self.max_size % 8 != 0 {
            return Err(Error::Config(format!(
                "sm max fragment size {} must be a multiple of 8 and at least the eager size {}",
                self.max_size, self.eager_size
            )));
        }
        if self.eager_count == 0 || self.max_count == 0 {
            return Err(Error::Config(
                "sm fragment counts must be at least 1".into(),
            ));
        }
        if self.max_size > u32::MAX as usize / 2 {
            return Err(Error::Config("sm max fragment size is too large".into()));
        }
        Ok(())
    }
}
