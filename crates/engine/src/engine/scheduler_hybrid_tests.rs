//! Model-free tests of a hybrid KV layout (`kv::layout`): a block table per layer group from one pool,
//! exact block ids as a sliding group releases what leaves its window, the memory a long sequence holds,
//! and prefix hits that need only a sliding group's window.

use super::scheduler_tests::{add, step};
use super::*;
use crate::kv::{BlockPool, KvCacheManager, KvLayout, NULL_BLOCK};

/// Two layers: layer 0 attends within 8 positions, layer 1 to everything; one layer per page. Blocks
/// of 4 tokens.
fn hybrid(num_blocks: usize, prefix_caching: bool) -> Scheduler {
    let config = SchedulerConfig { max_batch_tokens: 64, max_running: 16, max_prefill_tokens_while_decoding: usize::MAX, max_background_chunk: usize::MAX };
    let layout = KvLayout::hybrid(&[Some(8), None]);
    assert_eq!((layout.num_groups(), layout.window(0), layout.window(1)), (2, Some(8), None));
    Scheduler::new(config, KvCacheManager::new(4, BlockPool::new(num_blocks), prefix_caching).with_layout(&layout))
}

fn prompt(n: usize) -> Vec<u32> {
    (0..n as u32).collect()
}

fn tables(s: &Scheduler, id: RequestId) -> Vec<Vec<u32>> {
    s.request(id).unwrap().blocks.tables().to_vec()
}

const N: u32 = NULL_BLOCK;

#[test]
fn every_group_gets_a_table_and_the_sliding_one_releases_behind_its_window() {
    let mut s = hybrid(20, false);
    add(&mut s, 1, prompt(10), 1000);
    step(&mut s); // prefill 0..10: three blocks in each group, the sliding group's first
    assert_eq!(tables(&s, 1), vec![vec![0, 1, 2], vec![3, 4, 5]]);
    step(&mut s); // decode at 10: the next query (11) attends to 4..11, so block 0 (0..4) is dead
    assert_eq!(tables(&s, 1), vec![vec![N, 1, 2], vec![3, 4, 5]]);
    assert_eq!(s.pool().free_ids().next(), Some(0), "an uncached released block is reused first");
    step(&mut s); // decode at 11
    step(&mut s); // decode at 12 needs a fourth block in each group: the released one, then a new one
    assert_eq!(tables(&s, 1), vec![vec![N, 1, 2, 0], vec![3, 4, 5, 6]]);
    s.finish(1);
    assert_eq!(s.pool().num_free(), 20, "every block back");
}

#[test]
fn a_long_sequence_holds_its_global_blocks_and_a_window_of_sliding_ones() {
    let mut s = hybrid(64, false);
    add(&mut s, 1, prompt(10), 10_000);
    for _ in 0..150 {
        step(&mut s);
        let req = s.request(1).unwrap();
        let t = req.blocks.tables();
        let held = |g: usize| t[g].iter().filter(|&&b| b != N).count();
        // the global group a block per 4 positions; the sliding group the 2 or 3 blocks of the last 8..11
        // positions and the block the next token needs
        assert_eq!(held(1), req.num_computed_tokens.div_ceil(4));
        assert!(held(0) <= 4, "{} sliding blocks held at {} tokens", held(0), req.tokens.len());
        assert_eq!(s.pool().num_free(), 64 - held(0) - held(1));
    }
    assert_eq!(s.num_preemptions(), 0);
    s.finish(1);
    assert_eq!(s.pool().num_free(), 64);
}

#[test]
fn a_prefix_hit_needs_the_global_blocks_and_only_the_sliding_window_before_it() {
    let mut s = hybrid(40, true);
    add(&mut s, 1, prompt(40), 1);
    step(&mut s); // prefill 0..40 (10 blocks each), then the sliding blocks 0..8 leave the window
    assert_eq!(tables(&s, 1), vec![vec![N, N, N, N, N, N, N, N, 8, 9], (10..20).collect()]);
    s.finish(1);
    // the same 40 tokens and 5 more: a hit of 10 blocks, of which the sliding group needs 8 and 9 only
    // (a query at 40 attends to 33..40); its released blocks stayed cached, still unused
    add(&mut s, 2, prompt(45), 1);
    let plan = step(&mut s);
    assert_eq!(plan.chunks, vec![ScheduledChunk { id: 2, start: 40, len: 5, samples: true, draft: 0, draft_span: None }]);
    let t = tables(&s, 2);
    // (block 8 was taken at admission; after computing 40..45 the next query, at 45, attends to 38.. only)
    assert_eq!(t[0][..10], [N, N, N, N, N, N, N, N, N, 9]);
    assert_eq!(t[1][..10], (10..20).collect::<Vec<_>>());
    assert_eq!(s.request(2).unwrap().num_cached_tokens, 40);
    s.finish(2);
    // a shorter prompt whose hit ends inside the released part: the sliding group's blocks 4 and 5 are
    // still cached (released, not reused), so 6 blocks hit; after 24..27 the next query needs 20.. only
    add(&mut s, 3, prompt(27), 1);
    step(&mut s);
    assert_eq!(s.request(3).unwrap().num_cached_tokens, 24);
    assert_eq!(tables(&s, 3)[0][..6], [N, N, N, N, N, 5]);
    assert_eq!(tables(&s, 3)[1][..6], [10, 11, 12, 13, 14, 15]);
    s.finish(3);
}

#[test]
fn a_hit_stops_where_a_sliding_group_lost_its_window() {
    let mut s = hybrid(24, true);
    add(&mut s, 1, prompt(40), 1);
    step(&mut s);
    s.finish(1);
    // another sequence takes 20 of the 24 blocks, in free-queue order: the 4 never used, the sliding
    // blocks released during the first's prefill, then the first's last blocks
    add(&mut s, 2, vec![7; 40], 1);
    step(&mut s);
    s.finish(2);
    add(&mut s, 3, prompt(45), 1);
    step(&mut s);
    // the global group still caches the first 4 blocks, but the sliding group lost every block a query
    // at 4, 8, 12 or 16 attends to: no hit (recomputing from a lost window would read another's cells)
    assert_eq!(s.request(3).unwrap().num_cached_tokens, 0);
    s.finish(3);
    assert_eq!(s.pool().num_free(), 24);
}

#[test]
fn preemption_releases_every_group_and_recomputes() {
    // 24 blocks: one sequence of 48 positions holds 12 global and at most 4 sliding blocks; two run out
    let mut s = hybrid(24, false);
    add(&mut s, 1, prompt(8), 40);
    add(&mut s, 2, prompt(8), 40);
    let mut preempted = 0;
    for _ in 0..200 {
        if !s.has_work() {
            break;
        }
        let plan = step(&mut s);
        preempted += plan.preempted.len();
        for id in [1, 2] {
            if s.request(id).is_some_and(|r| r.tokens.len() >= 8 + 40) {
                s.finish(id);
            }
        }
    }
    assert!(!s.has_work(), "both finished");
    assert!(preempted > 0, "the pool was short");
    assert_eq!(s.pool().num_free(), 24);
}
