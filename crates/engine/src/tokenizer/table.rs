//! Compact hash tables for the vocabulary. A 262k-token vocabulary must load in well under 300 ms on a
//! busy machine; `HashMap<String, u32>` spends most of that in per-token allocations and cache misses,
//! so the token texts live in one arena and the indexes are flat open-addressing arrays.

/// FxHash over 8-byte words, then a murmur3-style finalizer so both high and low bits are mixed.
/// Not DoS-resistant; the inputs are model files.
pub(crate) fn hash_bytes(bytes: &[u8]) -> u64 {
    let mut h: u64 = bytes.len() as u64;
    let mut add = |v: u64| h = (h.rotate_left(5) ^ v).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        add(u64::from_le_bytes(c.try_into().unwrap()));
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let mut buf = [0u8; 8];
        buf[..rest.len()].copy_from_slice(rest);
        add(u64::from_le_bytes(buf));
    }
    fmix(h)
}

fn fmix(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

fn slots_for(n: usize) -> usize {
    (n * 2).next_power_of_two().max(16)
}

/// Token texts, id -> &str, stored back to back.
#[derive(Default)]
pub(crate) struct Texts {
    arena: String,
    ends: Vec<u32>,
}

impl Texts {
    pub(crate) fn with_capacity(n: usize, bytes: usize) -> Texts {
        Texts { arena: String::with_capacity(bytes), ends: Vec::with_capacity(n) }
    }

    pub(crate) fn push(&mut self, s: &str) {
        self.arena.push_str(s);
        self.ends.push(self.arena.len() as u32);
    }

    pub(crate) fn len(&self) -> usize {
        self.ends.len()
    }

    pub(crate) fn get(&self, id: usize) -> &str {
        let start = if id == 0 { 0 } else { self.ends[id - 1] as usize };
        &self.arena[start..self.ends[id] as usize]
    }
}

/// text -> id over a [`Texts`]. Each slot holds (hash tag << 32 | id + 1); 0 is empty.
pub(crate) struct TextIndex {
    slots: Vec<u64>,
    mask: usize,
}

impl TextIndex {
    /// Indexes all texts; on a duplicate returns the (earlier id, later id) pair.
    pub(crate) fn build(texts: &Texts) -> Result<TextIndex, (u32, u32)> {
        let n = slots_for(texts.len());
        let mut index = TextIndex { slots: vec![0; n], mask: n - 1 };
        for id in 0..texts.len() {
            let s = texts.get(id);
            let h = hash_bytes(s.as_bytes());
            let mut i = h as usize & index.mask;
            loop {
                let slot = index.slots[i];
                if slot == 0 {
                    index.slots[i] = (h >> 32) << 32 | (id as u64 + 1);
                    break;
                }
                if slot >> 32 == h >> 32 && texts.get((slot as u32 - 1) as usize) == s {
                    return Err((slot as u32 - 1, id as u32));
                }
                i = (i + 1) & index.mask;
            }
        }
        Ok(index)
    }

    pub(crate) fn get(&self, texts: &Texts, s: &str) -> Option<u32> {
        let h = hash_bytes(s.as_bytes());
        let mut i = h as usize & self.mask;
        loop {
            let slot = self.slots[i];
            if slot == 0 {
                return None;
            }
            if slot >> 32 == h >> 32 {
                let id = slot as u32 - 1;
                if texts.get(id as usize) == s {
                    return Some(id);
                }
            }
            i = (i + 1) & self.mask;
        }
    }
}

/// u64 -> u32 map with first-insert-wins semantics; keys must not be u64::MAX.
pub(crate) struct PairMap {
    keys: Vec<u64>,
    values: Vec<u32>,
    mask: usize,
}

impl PairMap {
    pub(crate) fn with_capacity(n: usize) -> PairMap {
        let n = slots_for(n);
        PairMap { keys: vec![u64::MAX; n], values: vec![0; n], mask: n - 1 }
    }

    /// Inserts unless the key is present (keeps the first value).
    pub(crate) fn insert_first(&mut self, key: u64, value: u32) {
        let mut i = fmix(key) as usize & self.mask;
        while self.keys[i] != u64::MAX {
            if self.keys[i] == key {
                return;
            }
            i = (i + 1) & self.mask;
        }
        self.keys[i] = key;
        self.values[i] = value;
    }

    pub(crate) fn get(&self, key: u64) -> Option<u32> {
        let mut i = fmix(key) as usize & self.mask;
        loop {
            match self.keys[i] {
                u64::MAX => return None,
                k if k == key => return Some(self.values[i]),
                _ => i = (i + 1) & self.mask,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_index_finds_and_rejects_duplicates() {
        let mut t = Texts::default();
        for s in ["a", "b", "hello world, a longer text", ""] {
            t.push(s);
        }
        let idx = TextIndex::build(&t).unwrap();
        assert_eq!(idx.get(&t, "hello world, a longer text"), Some(2));
        assert_eq!(idx.get(&t, ""), Some(3));
        assert_eq!(idx.get(&t, "c"), None);
        t.push("b");
        assert_eq!(TextIndex::build(&t).err(), Some((1, 4)));
    }

    #[test]
    fn pair_map_keeps_first() {
        let mut m = PairMap::with_capacity(4);
        m.insert_first(7, 1);
        m.insert_first(7, 2);
        m.insert_first(1 << 40, 3);
        assert_eq!((m.get(7), m.get(1 << 40), m.get(8)), (Some(1), Some(3), None));
    }
}
