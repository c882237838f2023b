//! Model-free tests of a KV window (`kv::window`): exact block ids as blocks leave a sequence's window,
//! the memory a long sequence holds, and what a windowed sequence leaves in the prefix cache.

use super::scheduler_tests::{add, step};
use super::*;
use crate::kv::{BlockPool, KvCacheManager, KvWindow, NULL_BLOCK};

fn windowed(window: usize, sinks: usize, num_blocks: usize, prefix_caching: bool) -> Scheduler {
    windowed_chunks(window, sinks, num_blocks, prefix_caching, 64)
}

fn windowed_chunks(window: usize, sinks: usize, num_blocks: usize, prefix_caching: bool, max_batch_tokens: usize) -> Scheduler {
    let config = SchedulerConfig { max_batch_tokens, max_running: 16, max_prefill_tokens_while_decoding: usize::MAX, max_background_chunk: usize::MAX };
    Scheduler::new(config, KvCacheManager::new(4, BlockPool::new(num_blocks), prefix_caching).with_window(Some(KvWindow { window, sinks })))
}

fn prompt(n: usize) -> Vec<u32> {
    (0..n as u32).collect()
}

#[test]
fn blocks_behind_the_window_return_to_the_pool_and_are_reused_first() {
    // blocks of 4; the sinks are block 0 (positions 0..4); a query at pos sees the block holding pos - 7 on
    let mut s = windowed(8, 4, 10, false);
    add(&mut s, 1, prompt(10), 1000);
    step(&mut s); // prefill 0..10, blocks 0, 1, 2
    assert_eq!(s.request(1).unwrap().blocks.table(), vec![0, 1, 2]);
    for _ in 0..4 {
        step(&mut s); // decodes at 10..14: block 3 for position 12; a query at 14 still sees 7..14
    }
    assert_eq!(s.request(1).unwrap().blocks.table(), vec![0, 1, 2, 3]);
    step(&mut s); // decode at 14: the next query (15) sees 8.. only, so block 1 (4..8) is dead
    assert_eq!(s.request(1).unwrap().blocks.table(), vec![0, NULL_BLOCK, 2, 3]);
    assert_eq!(s.pool().free_ids().next(), Some(1), "a released block is reused first");
    step(&mut s); // decode at 15
    step(&mut s); // decode at 16 takes a fifth block: the one just released
    assert_eq!(s.request(1).unwrap().blocks.table(), vec![0, NULL_BLOCK, 2, 3, 1]);
}

#[test]
fn a_long_sequence_holds_its_sinks_and_its_window_only() {
    let mut s = windowed(8, 4, 6, false);
    add(&mut s, 1, prompt(10), 10_000);
    for _ in 0..500 {
        step(&mut s);
        let table = &s.request(1).unwrap().blocks.table();
        let held = table.iter().filter(|&&b| b != NULL_BLOCK).count();
        // the sink block, the 2 or 3 blocks of the last 8..11 positions, and the block the next token needs
        assert!(held <= 5, "{held} blocks held at {} tokens", table.len() * 4);
        assert_eq!(table[0], 0, "the sinks stay");
        assert_eq!(s.pool().num_free(), 6 - held);
    }
    assert_eq!(s.request(1).unwrap().num_computed_tokens, 509, "500 tokens in a pool of 24 slots");
    assert_eq!(s.num_preemptions(), 0);
    s.finish(1);
    assert_eq!(s.pool().num_free(), 6, "every block back");
}

#[test]
fn without_sinks_nothing_before_the_window_is_kept() {
    let mut s = windowed(4, 0, 20, false);
    add(&mut s, 1, prompt(20), 100);
    step(&mut s); // prefill 20; the next query (20) sees 16.. (the block holding 17)
    assert_eq!(s.request(1).unwrap().blocks.table(), vec![NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 4]);
    assert_eq!(s.pool().num_free(), 19);
}

#[test]
fn released_blocks_stay_cached_and_a_hit_takes_the_sink_blocks_and_the_window() {
    let mut s = windowed(8, 4, 30, true);
    add(&mut s, 1, prompt(40), 100);
    step(&mut s); // prefill 40: blocks 0..10 registered, then 1..8 (positions 4..32) leave the window
    const N: u32 = NULL_BLOCK;
    assert_eq!(s.request(1).unwrap().blocks.table(), vec![0, N, N, N, N, N, N, N, 8, 9]);
    assert_eq!(s.pool().num_cached(), 10, "the released blocks stay cached");
    assert_eq!(s.pool().num_free(), 30 - 3);
    s.finish(1);
    // the same prompt: 9 blocks may hit (the last token is computed). A query at 36 attends to the sink
    // block and to 29.. (blocks 7 and 8): those three make the hit, blocks 1..7 are not needed
    add(&mut s, 2, prompt(40), 100);
    let plan = step(&mut s);
    assert_eq!(s.request(2).unwrap().num_cached_tokens, 36);
    assert_eq!((plan.chunks[0].start, plan.chunks[0].len), (36, 4));
    // it took blocks 0, 7 and 8 and a new block (the first free one, uncached) for positions 36..40;
    // after computing them the next query (40) attends to 33.., so block 7 left again
    assert_eq!(s.request(2).unwrap().blocks.table(), vec![0, N, N, N, N, N, N, N, 8, 10]);
}

#[test]
fn an_agent_session_under_a_window_keeps_its_cache_from_turn_to_turn() {
    // turn 1: 30 prompt tokens, 3 sampled (`101`); it computes positions 0..32, so full blocks 0..8
    let mut s = windowed(8, 4, 40, true);
    add(&mut s, 1, prompt(30), 3);
    for _ in 0..3 {
        step(&mut s);
    }
    const N: u32 = NULL_BLOCK;
    assert_eq!(s.request(1).unwrap().blocks.table(), vec![0, N, N, N, N, N, 6, 7]);
    s.finish(1);
    // turn 2 resends the history and its reply, then a new message: 30 + 3 + 9 tokens. The first 33
    // match turn 1's; a hit of 8 blocks (positions 0..32) needs the sink block and blocks 6, 7 only (a
    // query at 32 attends to 25..), all cached although turn 1 released blocks 1..5 while it ran.
    let mut turn2 = prompt(30);
    turn2.extend([101, 101, 101]);
    turn2.extend(200..209);
    add(&mut s, 2, turn2, 3);
    let plan = step(&mut s);
    let r = s.request(2).unwrap();
    assert_eq!(r.num_cached_tokens, 32);
    assert_eq!((plan.chunks[0].start, plan.chunks[0].len), (32, 10));
    // after 32..42 the next query (42) attends to 35.. (block 8 on): blocks 6 and 7 left again
    assert_eq!(r.blocks.table(), vec![0, N, N, N, N, N, N, N, 8, 9, 10]);
}

#[test]
fn a_hit_needs_its_whole_window_cached_and_falls_back_to_the_sinks() {
    const N: u32 = NULL_BLOCK;
    let mut s = windowed(8, 4, 12, true);
    add(&mut s, 1, prompt(40), 1);
    step(&mut s);
    s.finish(1);
    // every block of request 1 is free and cached: after the two never used, the released 1..7 (in the
    // order they left), then its last blocks (a sequence's later blocks are evicted first)
    assert_eq!(s.pool().free_ids().collect::<Vec<_>>(), vec![10, 11, 1, 2, 3, 4, 5, 6, 7, 9, 8, 0]);
    // another prompt of 36 tokens takes the 9 blocks at the front: 1..7 are evicted
    add(&mut s, 3, (1000..1036).collect(), 1);
    step(&mut s);
    assert_eq!(s.request(3).unwrap().blocks.table(), vec![10, N, N, N, N, N, N, 6, 7]);
    s.finish(3);
    // request 1's prompt again: every hit longer than the sink block needs one of blocks 1..7 (a hit of
    // m blocks attends to m - 2 or m - 3 on), so the hit is the sink block only
    add(&mut s, 2, prompt(40), 1);
    step(&mut s);
    assert_eq!(s.request(2).unwrap().num_cached_tokens, 4);
    assert_eq!(s.request(2).unwrap().blocks.table(), vec![0, N, N, N, N, N, N, N, 5, 7]);
}

#[test]
fn restored_blocks_in_the_window_gap_get_no_block_and_their_read_is_dropped() {
    const N: u32 = NULL_BLOCK;
    // nothing in memory; the engine read blocks 0..8 (positions 0..32) from disk. The next query (32)
    // attends to the sink block and to 25.. (blocks 6, 7): blocks 1..5 would be written and released
    // at once, so they get no block and need no free one
    let mut s = windowed(8, 4, 30, true);
    add(&mut s, 1, prompt(40), 1);
    assert_eq!(s.probe(1).map(|p| (p.1.len(), p.2)), Some((9, 0)));
    s.offer_restored(1, 0, vec![true; 8], Vec::new());
    let plan = step(&mut s);
    assert_eq!(s.request(1).unwrap().num_cached_tokens, 32);
    assert_eq!(plan.restores, vec![Restore { id: 1, skip: 0, blocks: vec![0, N, N, N, N, N, 1, 2] }]);
    assert_eq!((plan.chunks[0].start, plan.chunks[0].len), (32, 8));
    // positions 32..40 took blocks 3 and 4; after them the next query (40) attends to 33.., so table
    // entries 6 and 7 (blocks 1 and 2, restored) left as well
    assert_eq!(s.request(1).unwrap().blocks.table(), vec![0, N, N, N, N, N, N, N, 3, 4]);
}

#[test]
fn a_read_that_skipped_the_gap_restores_the_same_blocks() {
    const N: u32 = NULL_BLOCK;
    // as above, but the reader loaded only what the query at 32 attends to: blocks 0, 6 and 7
    let mut s = windowed(8, 4, 30, true);
    add(&mut s, 1, prompt(40), 1);
    s.offer_restored(1, 0, vec![true, false, false, false, false, false, true, true], Vec::new());
    let plan = step(&mut s);
    assert_eq!(s.request(1).unwrap().num_cached_tokens, 32);
    assert_eq!(plan.restores, vec![Restore { id: 1, skip: 0, blocks: vec![0, N, N, N, N, N, 1, 2] }]);
}

#[test]
fn a_restore_cut_short_by_the_pool_never_takes_a_block_the_read_skipped() {
    // 3 free blocks and chunks of 4 tokens: all 8 restored blocks (3 live) and a chunk would need 4.
    // 7 (end 28) attends to block 5, 6 to block 4, ... 2 to block 1: skipped by the read, so the
    // restore falls back to block 0 alone, then the chunk 4..8
    let mut s = windowed_chunks(8, 4, 3, true, 4);
    add(&mut s, 1, prompt(40), 1);
    s.offer_restored(1, 0, vec![true, false, false, false, false, false, true, true], Vec::new());
    let plan = step(&mut s);
    assert_eq!(s.request(1).unwrap().num_cached_tokens, 4);
    assert_eq!(plan.restores, vec![Restore { id: 1, skip: 0, blocks: vec![0] }]);
    assert_eq!((plan.chunks[0].start, plan.chunks[0].len), (4, 4));
}

#[test]
fn a_prompt_within_the_window_is_cached_whole() {
    let mut s = windowed(64, 4, 30, true);
    add(&mut s, 1, prompt(20), 100);
    step(&mut s);
    s.finish(1);
    add(&mut s, 2, prompt(20), 100);
    step(&mut s);
    // all full blocks but the one holding the last token, as without a window
    assert_eq!(s.request(2).unwrap().num_cached_tokens, 16);
}

#[test]
fn a_preempted_windowed_request_recomputes_and_releases_again() {
    let mut s = windowed(8, 4, 7, false);
    add(&mut s, 1, prompt(10), 1000);
    add(&mut s, 2, prompt(10), 1000);
    for _ in 0..40 {
        step(&mut s);
    }
    // each needs up to 5 blocks; with 7, the newer one was preempted at least once and is back
    assert!(s.num_preemptions() > 0);
    for id in [1, 2] {
        if let Some(r) = s.request(id).filter(|r| r.num_computed_tokens > 0) {
            let held = r.blocks.table().iter().filter(|&&b| b != NULL_BLOCK).count();
            assert!(held <= 5);
        }
    }
    s.finish(1);
    s.finish(2);
    assert_eq!(s.pool().num_free(), 7);
}

#[test]
fn blocks_registered_before_the_window_opened_a_gap_stay_cached_with_it() {
    // chunks of 8: the first chunk's blocks are registered before any is dead; the second chunk's gap
    // releases block 1, which stays cached with every later full block
    let mut s = windowed_chunks(8, 4, 20, true, 8);
    add(&mut s, 1, prompt(20), 100);
    step(&mut s);
    assert_eq!(s.request(1).unwrap().blocks.table(), vec![0, 1]);
    assert_eq!(s.pool().num_cached(), 2);
    step(&mut s);
    assert_eq!(s.request(1).unwrap().blocks.table(), vec![0, NULL_BLOCK, 2, 3]);
    assert_eq!(s.pool().num_cached(), 4, "block 1 too, though released");
    for _ in 0..10 {
        step(&mut s);
    }
    // the prompt's 5 blocks and the decoded positions' full blocks
    assert_eq!(s.pool().num_cached(), 7);
    add(&mut s, 2, prompt(20), 100);
    step(&mut s);
    // 4 blocks may hit: a query at 16 attends to the sink block and to 9.. (blocks 2 and 3)
    assert_eq!(s.request(2).unwrap().num_cached_tokens, 16);
    // (after computing 16..20, block 2 left its window again)
    assert_eq!(s.request(2).unwrap().blocks.table()[..4], [0, NULL_BLOCK, NULL_BLOCK, 3]);
}
