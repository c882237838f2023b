//! Model-free tests of a hybrid recurrent model's prefix cache (`KvCacheManager::with_state_snapshots`):
//! which blocks get state slots, hits cut to a block that keeps one, slots taken back from cached blocks,
//! and restores from the disk tier that end on a block read with its state.

use super::scheduler_tests::{add, step};
use super::*;
use crate::kv::{BlockPool, KvCacheManager};

/// 4-token blocks, `num_blocks` of them, `slots` state slots, a snapshot every `every` blocks.
fn recurrent(num_blocks: usize, slots: usize, every: usize) -> Scheduler {
    let config = SchedulerConfig { max_batch_tokens: 1000, max_running: 16, max_prefill_tokens_while_decoding: usize::MAX, max_background_chunk: usize::MAX };
    let pool = BlockPool::new(num_blocks).with_state_slots(slots);
    Scheduler::new(config, KvCacheManager::new(4, pool, true).with_state_snapshots(every))
}

fn slots(s: &Scheduler, blocks: &[u32]) -> Vec<Option<u32>> {
    blocks.iter().map(|&b| s.pool().state_slot(b)).collect()
}

#[test]
fn every_second_block_keeps_the_state_and_a_hit_ends_on_one() {
    let mut s = recurrent(12, 6, 2);
    let prompt: Vec<u32> = (0..21).collect(); // 5 full blocks and a token
    add(&mut s, 1, prompt.clone(), 1);
    step(&mut s);
    assert_eq!(s.request(1).unwrap().blocks.table(), vec![0, 1, 2, 3, 4, 5]);
    // blocks 1, 3 and 5 end runs of two: slots 0, 1, 2
    assert_eq!(slots(&s, &[0, 1, 2, 3, 4, 5]), vec![None, Some(0), None, Some(1), None, Some(2)]);
    s.finish(1);
    // the partial block 5 is uncached: its slot is free again
    assert_eq!(s.pool().state_slot(5), None);
    add(&mut s, 2, prompt, 1);
    // 5 full blocks are cached, but the state is kept after the 4th: 16 tokens hit, not 20
    assert_eq!(step(&mut s).chunks[0].start, 16);
    let seq = s.request(2).unwrap();
    assert_eq!((&seq.blocks.table()[..4], seq.num_cached_tokens), (&[0, 1, 2, 3][..], 16));
}

#[test]
fn a_block_takes_the_slot_of_the_next_cached_block_to_go_and_that_one_ends_no_hit() {
    let mut s = recurrent(8, 2, 1);
    let (p1, p2): (Vec<u32>, Vec<u32>) = ((0..9).collect(), (100..109).collect());
    add(&mut s, 1, p1.clone(), 1);
    step(&mut s);
    assert_eq!(slots(&s, &[0, 1, 2]), vec![Some(0), Some(1), None], "two slots for three blocks");
    s.finish(1);
    // free queue: 2 (uncached) 3 4 5 6 7, then the cached 1 and 0
    add(&mut s, 2, p2.clone(), 1);
    step(&mut s);
    assert_eq!(s.request(2).unwrap().blocks.table(), vec![2, 3, 4]);
    // no free slot: blocks 2 and 3 take those of the cached blocks 1 and 0, in eviction order
    assert_eq!(slots(&s, &[0, 1, 2, 3, 4]), vec![None, None, Some(1), Some(0), None]);
    s.finish(2);
    // p2's blocks are a hit of two; p1's are still cached but keep no state: no hit
    add(&mut s, 3, p2, 1);
    step(&mut s);
    assert_eq!(s.request(3).unwrap().num_cached_tokens, 8);
    add(&mut s, 4, p1, 1);
    step(&mut s);
    assert_eq!(s.request(4).unwrap().num_cached_tokens, 0);
}

#[test]
fn a_restore_ends_on_a_block_read_with_its_state() {
    let mut s = recurrent(16, 16, 1);
    let prompt: Vec<u32> = (0..21).collect(); // 5 full blocks and a token
    add(&mut s, 1, prompt[..9].to_vec(), 1);
    step(&mut s); // blocks 0 and 1 cached, with their states
    s.finish(1);
    add(&mut s, 2, prompt.clone(), 1);
    let (_, hashes, in_memory) = s.probe(2).unwrap();
    assert_eq!((hashes.len(), in_memory), (5, 2));
    // blocks 2-4 read from disk, block 4's file without the state after it: blocks 2 and 3 restored
    s.offer_restored(2, 2, vec![true; 3], vec![true, true, false]);
    let plan = step(&mut s);
    let table = s.request(2).unwrap().blocks.table().to_vec();
    assert_eq!(plan.restores, vec![Restore { id: 2, skip: 0, blocks: table[2..4].to_vec() }]);
    assert_eq!(plan.chunks[0].start, 16);
    // the restored blocks hold slots, for the engine to write their states into
    assert!(slots(&s, &table[2..4]).iter().all(Option::is_some));
    // a restore may pass a block read without its state (which gets no slot) to end on one with it
    s.finish(2);
    add(&mut s, 3, [&prompt[..8], &[7; 13][..]].concat(), 1);
    s.offer_restored(3, 2, vec![true; 3], vec![false, true, false]);
    let plan = step(&mut s);
    let table = s.request(3).unwrap().blocks.table().to_vec();
    assert_eq!(plan.restores, vec![Restore { id: 3, skip: 0, blocks: table[2..4].to_vec() }]);
    assert_eq!(slots(&s, &table[2..4]).iter().map(Option::is_some).collect::<Vec<_>>(), vec![false, true]);
    assert_eq!(s.request(3).unwrap().num_cached_tokens, 16);
    // none read with its state: nothing is restored
    s.finish(3);
    add(&mut s, 4, [&prompt[..8], &[9; 13][..]].concat(), 1);
    s.offer_restored(4, 2, vec![true; 3], vec![false; 3]);
    let plan = step(&mut s);
    assert!(plan.restores.is_empty());
    assert_eq!(s.request(4).unwrap().num_cached_tokens, 8);
}
