//! Recurrent-state slots of a hybrid model's requests (`kv::ConvStates`): one per request that has run,
//! reused once the request is gone. A preempted request keeps its slot; recomputed, it starts from zeros
//! at position 0 or from the snapshot of its prefix-cache hit's last block.

use super::RequestId;
use std::collections::HashMap;

#[derive(Default)]
pub(super) struct StateSlots {
    by_request: HashMap<RequestId, u32>,
    free: Vec<u32>,
    next: u32,
}

impl StateSlots {
    /// Request `id`'s slot, assigned on first use (then `true`: whatever the slot held is another
    /// request's, to be forgotten).
    pub fn slot(&mut self, id: RequestId) -> (u32, bool) {
        if let Some(&s) = self.by_request.get(&id) {
            return (s, false);
        }
        let s = self.free.pop().unwrap_or_else(|| {
            self.next += 1;
            self.next - 1
        });
        self.by_request.insert(id, s);
        (s, true)
    }

    /// Frees the slots of requests for which `alive` says no.
    pub fn release_gone(&mut self, alive: impl Fn(RequestId) -> bool) {
        let free = &mut self.free;
        self.by_request.retain(|&id, &mut s| {
            let keep = alive(id);
            if !keep {
                free.push(s);
            }
            keep
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_per_live_request_reused_after_it_ends() {
        let mut slots = StateSlots::default();
        assert_eq!((slots.slot(7), slots.slot(9), slots.slot(7)), ((0, true), (1, true), (0, false)));
        slots.release_gone(|id| id == 9);
        assert_eq!(slots.slot(11), (0, true), "request 7's slot, free again");
        assert_eq!(slots.slot(9), (1, false));
    }
}
