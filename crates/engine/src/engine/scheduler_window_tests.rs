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
fn released_blocks_are_never_served_as_a_prefix() {
    let mut s = windowed(8, 4, 30, true);
    add(&mut s, 1, prompt(40), 100);
    step(&mut s); // prefill 40: blocks 1..8 (positions 4..32) leave the window at once
    let table = s.request(1).unwrap().blocks.table().to_vec();
    assert_eq!(table[0], 0);
    assert!(table[1..8].iter().all(|&b| b == NULL_BLOCK));
    // only the sink block, before the first gap, is in the prefix cache
    assert_eq!(s.pool().num_cached(), 1);
    add(&mut s, 2, prompt(40), 100);
    step(&mut s);
    assert_eq!(s.request(2).unwrap().num_cached_tokens, 4, "the same prompt hits the sink block only");
    assert_eq!(s.request(2).unwrap().blocks.table()[0], 0, "shared");
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
fn blocks_cached_before_the_window_opened_a_gap_leave_the_cache_with_it() {
    // chunks of 8: the first chunk's blocks are registered before any is dead; the second chunk's gap
    // releases block 1, which leaves the cache, and nothing after it is registered
    let mut s = windowed_chunks(8, 4, 20, true, 8);
    add(&mut s, 1, prompt(20), 100);
    step(&mut s);
    assert_eq!(s.request(1).unwrap().blocks.table(), vec![0, 1]);
    assert_eq!(s.pool().num_cached(), 2);
    step(&mut s);
    assert_eq!(s.request(1).unwrap().blocks.table(), vec![0, NULL_BLOCK, 2, 3]);
    assert_eq!(s.pool().num_cached(), 1, "only the sink block");
    for _ in 0..10 {
        step(&mut s);
    }
    assert_eq!(s.pool().num_cached(), 1);
    add(&mut s, 2, prompt(20), 100);
    step(&mut s);
    assert_eq!(s.request(2).unwrap().num_cached_tokens, 4);
}
