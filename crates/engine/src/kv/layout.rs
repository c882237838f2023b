//! Which layers share a KV block: the hybrid layout of a model whose layers attend over different spans
//! (Gemma-3: 5 of every 6 layers within a 512-token sliding window), after vLLM v1's hybrid allocator.
//!
//! The layers are split into *groups* of equal size `slots`, each group holding layers of one kind
//! (global, or one sliding window). A block id names a *page*: `block_size` cells of `slots` layers. Every
//! group gives a sequence a block table of its own, all drawn from one pool, so a page is a page whatever
//! group holds it: memory moves between kinds of layers as the sequences need it, with no split fixed at
//! start-up. A sliding group's table releases the blocks behind its window (`kv::window` with no sinks),
//! so a sequence's sliding layers hold about `window + chunk` positions however long it runs, and only its
//! global layers grow with it.
//!
//! Gemma-3-270M (18 layers, layers 5, 11 and 17 global): groups of 3 layers, one global group and five
//! sliding ones; a page is 16 tokens × 3 layers. At 8,192 positions a sequence holds 512 global pages and
//! at most 5 × 65 sliding ones (32 for the window, one off the block grid, 32 for a
//! 512-token chunk), against 512 pages of all 18 layers (3,072 of the hybrid's pages) uniform.
//!
//! Slot `i` of a page serves layer `i` of whichever group holds it: a layer reads and writes the storage's
//! slot `place(layer).1` through its group's table. With one group (every model without sliding layers,
//! or the hybrid layout turned off) a page holds every layer and the group's table is the sequence's only
//! one, as before.
//!
//! A hybrid recurrent model (LFM2) keeps no keys or values in its convolution layers: its layout is one
//! group whose pages hold the attention layers only (`attention_only`), a convolution layer having no
//! slot (`place` is not asked for it).
//!
//! Groups of one kind whose layers do not fill the last group leave its spare slots unused (none for the
//! models here). The layout is not combined with a StreamingLLM window (`--kv-window`), nor with the disk
//! tier, whose files hold one table's blocks: either makes the engine use one group.

use super::window::KvWindow;

/// The slot of a layer that keeps no keys or values (`attention_only`).
const NO_SLOT: usize = usize::MAX;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// Each group's sliding window (`None`: its layers attend to every position).
    windows: Vec<Option<usize>>,
    /// Each model layer's group and its slot within a page.
    place: Vec<(usize, usize)>,
    /// Layers per page.
    slots: usize,
}

impl KvLayout {
    /// One group of every layer: a page holds all `n_layers`.
    pub fn uniform(n_layers: usize) -> Self {
        KvLayout { windows: vec![None], place: (0..n_layers).map(|l| (0, l)).collect(), slots: n_layers }
    }

    /// One group of the layers with `has_kv` (in order, a slot each); the others have no slot.
    pub fn attention_only(has_kv: &[bool]) -> Self {
        let mut next = 0;
        let place = has_kv
            .iter()
            .map(|&a| {
                next += a as usize;
                (0, if a { next - 1 } else { NO_SLOT })
            })
            .collect();
        KvLayout { windows: vec![None], place, slots: next }
    }

    /// Groups for layers whose windows are `layer_windows` (`None`: global): the layers of each kind in
    /// order, cut into groups of the size of the smallest kind. One kind only: `uniform` (with that
    /// kind's window).
    pub fn hybrid(layer_windows: &[Option<usize>]) -> Self {
        let mut kinds: Vec<Option<usize>> = Vec::new();
        for w in layer_windows {
            if !kinds.contains(w) {
                kinds.push(*w);
            }
        }
        let count = |k: &Option<usize>| layer_windows.iter().filter(|w| *w == k).count();
        let slots = kinds.iter().map(count).min().unwrap_or(0);
        if kinds.len() <= 1 {
            let mut u = KvLayout::uniform(layer_windows.len());
            u.windows = vec![kinds.first().copied().flatten()];
            return u;
        }
        let (mut windows, mut place) = (Vec::new(), vec![(0, 0); layer_windows.len()]);
        for kind in kinds {
            let layers: Vec<usize> = (0..layer_windows.len()).filter(|&l| layer_windows[l] == kind).collect();
            for group in layers.chunks(slots) {
                for (slot, &l) in group.iter().enumerate() {
                    place[l] = (windows.len(), slot);
                }
                windows.push(kind);
            }
        }
        KvLayout { windows, place, slots }
    }

    pub fn num_groups(&self) -> usize {
        self.windows.len()
    }

    pub fn is_hybrid(&self) -> bool {
        self.windows.len() > 1
    }

    /// Layers per page (the storage's layer count).
    pub fn slots(&self) -> usize {
        self.slots
    }

    pub fn num_layers(&self) -> usize {
        self.place.len()
    }

    /// Group `g`'s sliding window, if its layers have one.
    pub fn window(&self, g: usize) -> Option<usize> {
        self.windows[g]
    }

    /// Group `g`'s window as a `KvWindow` (no sinks): what `kv::window` releases for it.
    pub fn kv_window(&self, g: usize) -> Option<KvWindow> {
        self.windows[g].map(|window| KvWindow { window, sinks: 0 })
    }

    /// Model layer `layer`'s group and its slot within a page (a layer without keys and values gets a
    /// slot past the page's: any use of it panics).
    pub fn place(&self, layer: usize) -> (usize, usize) {
        self.place[layer]
    }

    /// Most blocks a sequence of `len` positions holds at once over all groups, when its steps carry at
    /// most `max_chunk` tokens.
    pub fn max_blocks_held(&self, len: usize, block_size: usize, max_chunk: usize) -> usize {
        let all = len.div_ceil(block_size);
        (0..self.num_groups()).map(|g| self.kv_window(g).map_or(all, |w| all.min(w.max_blocks(block_size, max_chunk)))).sum()
    }

    /// `(layers, window)` of each kind of layer, global first: what `reckon info` and `/metrics` report
    /// per layer type.
    pub fn layer_kinds(&self) -> Vec<(usize, Option<usize>)> {
        let mut kinds: Vec<(usize, Option<usize>)> = Vec::new();
        for &(g, _) in self.place.iter().filter(|p| p.1 != NO_SLOT) {
            let w = self.windows[g];
            match kinds.iter_mut().find(|(_, k)| *k == w) {
                Some((n, _)) => *n += 1,
                None => kinds.push((1, w)),
            }
        }
        kinds.sort_by_key(|&(_, w)| w.is_some());
        kinds
    }
}

/// One kind of layer's share of the KV cache (`KvLayout::memory_by_kind`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerKindMemory {
    pub layers: usize,
    /// `None`: global layers.
    pub window: Option<usize>,
    /// Keys and values of one token in all these layers.
    pub bytes_per_token: usize,
    /// Positions a sequence keeps in these layers at most (its window and a chunk, in whole blocks), or
    /// `None` for all of them: global layers, or any layer without a hybrid layout.
    pub max_positions: Option<usize>,
}

impl LayerKindMemory {
    /// Label of the kind: `full` or `sliding_window_{w}`.
    pub fn label(&self) -> String {
        self.window.map_or("full".to_string(), |w| format!("sliding_window_{w}"))
    }
}

impl KvLayout {
    /// Per kind of layer (global first), the bytes a token takes in its layers when one layer's key and
    /// value of a token take `cell_bytes`, and how many positions a sequence keeps there (steps of at
    /// most `max_chunk` tokens).
    pub fn memory_by_kind(&self, cell_bytes: usize, block_size: usize, max_chunk: usize) -> Vec<LayerKindMemory> {
        self.layer_kinds()
            .into_iter()
            .map(|(layers, window)| {
                let kept = window.filter(|_| self.is_hybrid() || self.num_groups() == 1 && self.windows[0].is_some());
                let max_positions = kept.map(|w| KvWindow { window: w, sinks: 0 }.max_blocks(block_size, max_chunk) * block_size);
                LayerKindMemory { layers, window, bytes_per_token: layers * cell_bytes, max_positions }
            })
            .collect()
    }

    /// Bytes of one block (page): `block_size` cells of each slot.
    pub fn page_bytes(&self, cell_bytes: usize, block_size: usize) -> usize {
        self.slots * cell_bytes * block_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gemma3(n_layers: usize) -> Vec<Option<usize>> {
        (0..n_layers).map(|l| (l % 6 < 5).then_some(512)).collect()
    }

    #[test]
    fn gemma3_270m_has_one_global_group_and_five_sliding_ones_of_three_layers() {
        let l = KvLayout::hybrid(&gemma3(18));
        assert_eq!((l.num_groups(), l.slots()), (6, 3));
        // sliding layers first (layer 0 is one), then the global ones
        assert_eq!((0..5).map(|g| l.window(g)).collect::<Vec<_>>(), vec![Some(512); 5]);
        assert_eq!(l.window(5), None);
        assert_eq!([5, 11, 17].map(|x| l.place(x)), [(5, 0), (5, 1), (5, 2)]);
        assert_eq!([0, 1, 2, 3, 4, 6].map(|x| l.place(x)), [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]);
        assert_eq!(l.layer_kinds(), vec![(3, None), (15, Some(512))]);
        // every (group, slot) serves one layer
        let mut places: Vec<_> = (0..18).map(|x| l.place(x)).collect();
        places.sort();
        places.dedup();
        assert_eq!(places.len(), 18);
    }

    #[test]
    fn a_sequence_at_8k_holds_its_global_blocks_and_a_window_per_sliding_group() {
        let l = KvLayout::hybrid(&gemma3(18));
        // 512 global blocks; each sliding group: 32 window blocks + 1 off the grid + 32 for a 512 chunk
        assert_eq!(l.max_blocks_held(8192, 16, 512), 512 + 5 * 65);
        // short sequences hold all their blocks in every group
        assert_eq!(l.max_blocks_held(100, 16, 512), 6 * 7);
        assert_eq!(KvLayout::uniform(18).max_blocks_held(8192, 16, 512), 512);
    }

    #[test]
    fn groups_of_the_smallest_kind_leave_spare_slots_in_the_last_group() {
        // Gemma-3-1B: 26 layers, 4 global
        let l = KvLayout::hybrid(&gemma3(26));
        assert_eq!((l.num_groups(), l.slots()), (7, 4));
        assert_eq!([20, 24, 25].map(|x| l.place(x)), [(4, 1), (5, 0), (5, 1)]);
        assert_eq!(l.place(23), (6, 3));
    }

    #[test]
    fn memory_by_kind_reports_global_and_sliding_layers() {
        let (cell, bs) = (1024, 16); // Gemma-3-270M, f16: one KV head of 256
        let hybrid = KvLayout::hybrid(&gemma3(18)).memory_by_kind(cell, bs, 512);
        assert_eq!(hybrid[0], LayerKindMemory { layers: 3, window: None, bytes_per_token: 3 * 1024, max_positions: None });
        assert_eq!(hybrid[1], LayerKindMemory { layers: 15, window: Some(512), bytes_per_token: 15 * 1024, max_positions: Some(65 * 16) });
        assert_eq!(hybrid[1].label(), "sliding_window_512");
        // one group: every layer keeps every position (the kernels still read the window only)
        let uniform = KvLayout::uniform(18);
        assert_eq!(uniform.memory_by_kind(cell, bs, 512), vec![LayerKindMemory { layers: 18, window: None, bytes_per_token: 18 * 1024, max_positions: None }]);
        assert_eq!(KvLayout::hybrid(&gemma3(18)).page_bytes(cell, bs), 3 * 1024 * 16);
    }

    #[test]
    fn a_recurrent_hybrid_keeps_pages_of_its_attention_layers_only() {
        // LFM2-style: conv conv attn conv attn conv
        let l = KvLayout::attention_only(&[false, false, true, false, true, false]);
        assert_eq!((l.num_groups(), l.slots(), l.num_layers()), (1, 2, 6));
        assert_eq!([2, 4].map(|x| l.place(x)), [(0, 0), (0, 1)]);
        assert_eq!(l.layer_kinds(), vec![(2, None)]);
    }

    #[test]
    fn one_kind_is_one_group() {
        assert_eq!(KvLayout::hybrid(&[None; 4]), KvLayout::uniform(4));
        let swa = KvLayout::hybrid(&[Some(64); 4]);
        assert_eq!((swa.num_groups(), swa.slots(), swa.window(0)), (1, 4, Some(64)));
    }
}
