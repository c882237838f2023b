//! Model-free prefix cache tests: exact block ids reused, reference counts, eviction order, collisions
//! and leaks.

use super::scheduler_tests::{add, add_salted, step, TestConfig};
use super::*;
use crate::kv::{BlockHash, BlockPool, PrefixCacheStats};

fn cached_config(block_size: usize) -> TestConfig {
    TestConfig { block_size, max_batch_tokens: 1000, max_running: 16, prefix_caching: true, max_prefill_tokens_while_decoding: usize::MAX }
}

fn chunk(id: RequestId, start: usize, len: usize) -> ScheduledChunk {
    ScheduledChunk { id, start, len, samples: true, draft: 0, draft_span: None }
}

fn free(s: &Scheduler) -> Vec<u32> {
    s.pool().free_ids().collect()
}

#[test]
fn a_repeated_prompt_reuses_its_full_blocks() {
    let mut s = cached_config(4).scheduler(8);
    let prompt: Vec<u32> = (0..10).collect();
    add(&mut s, 1, prompt.clone(), 5);
    step(&mut s);
    assert_eq!(s.request(1).unwrap().blocks.table(), vec![0, 1, 2]);
    assert_eq!(s.pool().num_cached(), 2, "two full blocks computed");
    s.finish(1);
    // the partial block 2 holds nothing reusable: front; cached blocks at the back, tail first
    assert_eq!(free(&s), vec![2, 3, 4, 5, 6, 7, 1, 0]);
    add(&mut s, 2, prompt, 5);
    assert_eq!(step(&mut s).chunks, vec![chunk(2, 8, 2)]);
    let seq = s.request(2).unwrap();
    assert_eq!((seq.blocks.table().to_vec(), seq.num_cached_tokens), (vec![0, 1, 2], 8));
    assert_eq!(s.prefix_stats(), PrefixCacheStats { queried_tokens: 20, hit_tokens: 8, disk_hit_tokens: 0 });
}

#[test]
fn a_hit_leaves_the_last_prompt_token_to_compute() {
    let mut s = cached_config(4).scheduler(8);
    let prompt: Vec<u32> = (0..8).collect();
    add(&mut s, 1, prompt.clone(), 5);
    step(&mut s);
    s.finish(1);
    add(&mut s, 2, prompt, 5);
    // both blocks are cached, but only the first is used: the prompt's last token needs its logits
    assert_eq!(step(&mut s).chunks, vec![chunk(2, 4, 4)]);
    assert_eq!(s.request(2).unwrap().blocks.table()[0], 0);
    assert_ne!(s.request(2).unwrap().blocks.table()[1], 1, "a cached block is never written into");
}

#[test]
fn concurrent_requests_share_blocks_by_reference() {
    let mut s = cached_config(4).scheduler(8);
    let system: Vec<u32> = (0..8).collect();
    add(&mut s, 1, [system.clone(), vec![50, 51]].concat(), 5);
    step(&mut s);
    add(&mut s, 2, [system, vec![60, 61, 62]].concat(), 5);
    let plan = step(&mut s);
    assert_eq!(plan.chunks, vec![ScheduledChunk { id: 1, start: 10, len: 1, samples: true, draft: 0, draft_span: None }, chunk(2, 8, 3)]);
    assert_eq!(s.request(2).unwrap().blocks.table(), vec![0, 1, 3]);
    assert_eq!((s.pool().ref_count(0), s.pool().ref_count(1)), (2, 2));
    s.finish(1);
    assert_eq!((s.pool().ref_count(0), s.pool().ref_count(1), s.pool().ref_count(2)), (1, 1, 0));
    s.finish(2);
    assert_eq!(s.pool().num_free(), 8);
}

#[test]
fn eviction_takes_the_least_recently_used_blocks_tail_first() {
    let mut s = cached_config(2).scheduler(8);
    add(&mut s, 1, vec![1, 2, 3, 4, 5], 1); // blocks 0 [1 2], 1 [3 4], 2 [5 ..]
    step(&mut s);
    s.finish(1);
    add(&mut s, 2, vec![7, 8, 9, 10, 11], 1); // blocks 2 [7 8], 3 [9 10], 4 [11 ..]
    step(&mut s);
    s.finish(2);
    assert_eq!(free(&s), vec![4, 5, 6, 7, 1, 0, 3, 2]);
    // 6 blocks for a new prompt: the four uncached, then seq 1's tail block, then its first
    add(&mut s, 3, (20..31).collect(), 1);
    let plan = step(&mut s);
    assert_eq!(s.request(3).unwrap().blocks.table(), vec![4, 5, 6, 7, 1, 0]);
    let evicted: Vec<(u32, Vec<u32>)> = plan.evicted.iter().map(|e| (e.block, e.tokens.to_vec())).collect();
    assert_eq!(evicted, vec![(1, vec![3, 4]), (0, vec![1, 2])]);
    // seq 2's prefix survived
    s.finish(3);
    add(&mut s, 4, vec![7, 8, 9, 10, 99], 1);
    step(&mut s);
    assert_eq!(s.request(4).unwrap().num_cached_tokens, 4);
    assert_eq!(&s.request(4).unwrap().blocks.table()[..2], &[2, 3]);
}

/// Every block gets the same key.
fn colliding_hash(_: BlockHash, _: &[u32]) -> BlockHash {
    7
}

#[test]
fn a_hash_collision_never_serves_another_prefix() {
    let mut s = cached_config(2).with_pool(BlockPool::with_hasher(16, colliding_hash, 0));
    add(&mut s, 1, vec![1, 2, 3, 4, 5], 1); // blocks [1 2] [3 4]
    add(&mut s, 2, vec![6, 7, 8, 9, 10], 1); // blocks [6 7] [8 9]
    step(&mut s);
    s.finish(1);
    s.finish(2);
    // same key everywhere: only equal tokens after the very same parent block match
    add(&mut s, 3, vec![6, 7, 8, 9, 0], 1);
    add(&mut s, 4, vec![1, 2, 8, 9, 0], 1); // first block of seq 1, second of seq 2
    add(&mut s, 5, vec![3, 4, 1, 2, 0], 1); // blocks of seq 1, wrong order
    step(&mut s);
    assert_eq!(s.request(3).unwrap().num_cached_tokens, 4);
    assert_eq!(&s.request(3).unwrap().blocks.table()[..2], &[3, 4]);
    assert_eq!(s.request(4).unwrap().num_cached_tokens, 2);
    assert_eq!(s.request(4).unwrap().blocks.table()[0], 0);
    assert_eq!(s.request(5).unwrap().num_cached_tokens, 0);
}

#[test]
fn a_block_whose_parent_was_evicted_is_never_served() {
    let mut pool = BlockPool::with_hasher(3, colliding_hash, 0);
    assert_eq!(pool.allocate(2), Some(vec![0, 1]));
    pool.register(0, 7, 0, None, &[1, 2], true);
    pool.register(1, 7, 7, Some(0), &[3, 4], false);
    pool.release(&[0]);
    pool.release(&[1]);
    assert_eq!(pool.free_ids().collect::<Vec<_>>(), vec![2, 0, 1]);
    assert_eq!(pool.lookup(0, &[7, 7], &[1, 2, 3, 4], 2), vec![0, 1]);
    // block 0 is evicted and computed again for the same tokens: its old child must not follow it
    assert_eq!(pool.allocate(2), Some(vec![2, 0]));
    pool.register(0, 7, 0, None, &[1, 2], true);
    assert_eq!(pool.lookup(0, &[7, 7], &[1, 2, 3, 4], 2), vec![0]);
}

#[test]
fn a_preempted_sequence_resumes_from_its_cached_blocks() {
    let mut s = cached_config(4).scheduler(4);
    add(&mut s, 1, (0..7).collect(), 100);
    add(&mut s, 2, (10..18).collect(), 100);
    step(&mut s); // 1: [0, 1], 8 tokens; 2: [2, 3], 9 tokens
    let plan = step(&mut s); // seq 2 needs a third block: preempted
    assert_eq!(plan.preempted, vec![2]);
    s.finish(1);
    // seq 2 comes back: its two full blocks are still cached, only its 9th token is recomputed
    let plan = step(&mut s);
    assert_eq!(plan.chunks, vec![chunk(2, 8, 1)]);
    assert_eq!(&s.request(2).unwrap().blocks.table()[..2], &[2, 3]);
    assert_eq!(s.request(2).unwrap().num_cached_tokens, 0, "cached_tokens counts the first admission only");
}

#[test]
fn no_block_is_leaked_after_aborts() {
    let mut s = cached_config(4).scheduler(24);
    let system: Vec<u32> = (0..12).collect();
    let mut next_id = 0;
    for round in 0..30u32 {
        for k in 0..3 {
            let tail: Vec<u32> = (0..(round % 7 + k)).map(|t| 1000 + t * 3 + round).collect();
            add(&mut s, next_id, [system.clone(), tail].concat(), 6);
            next_id += 1;
        }
        step(&mut s);
        step(&mut s);
        // abort some mid-way, finish others at 6 tokens
        let ids: Vec<RequestId> = s.request_ids().collect();
        for id in ids {
            if (id % 2 == 0 && s.request(id).unwrap().status == RequestStatus::Running) || s.request(id).unwrap().num_generated() >= 6 {
                s.finish(id);
            }
        }
    }
    while s.has_work() {
        let plan = step(&mut s);
        for c in plan.chunks {
            if s.request(c.id).is_some_and(|q| q.num_generated() >= 6) {
                s.finish(c.id);
            }
        }
    }
    assert_eq!(s.pool().num_free(), 24);
    assert!((0..24).all(|b| s.pool().ref_count(b) == 0));
    let mut ids: Vec<u32> = free(&s);
    ids.sort_unstable();
    assert_eq!(ids, (0..24).collect::<Vec<_>>(), "each block once in the free queue");
    assert!(s.prefix_stats().hit_tokens > 0, "the shared system prompt was reused");
}

#[test]
fn restored_blocks_continue_the_memory_hit() {
    let mut s = cached_config(4).scheduler(10);
    let prompt: Vec<u32> = (0..21).collect(); // 5 full blocks and a token
    add(&mut s, 1, prompt[..9].to_vec(), 1);
    step(&mut s); // blocks 0 and 1 cached
    s.finish(1);
    add(&mut s, 2, prompt.clone(), 1);
    let (_, hashes, in_memory) = s.probe(2).unwrap();
    assert_eq!((hashes.len(), in_memory), (5, 2));
    // the engine read blocks 1-4 from disk; block 1 is in memory anyway, so 2-4 are restored
    s.offer_restored(2, 1, vec![true; 4], Vec::new());
    let plan = step(&mut s);
    assert_eq!(plan.chunks, vec![chunk(2, 20, 1)]);
    let table = s.request(2).unwrap().blocks.table().to_vec();
    assert_eq!(&table[..2], &[0, 1]);
    assert_eq!(plan.restores, vec![Restore { id: 2, skip: 1, blocks: table[2..5].to_vec() }]);
    assert_eq!(s.request(2).unwrap().num_cached_tokens, 20);
    assert_eq!(s.prefix_stats().disk_hit_tokens, 12);
    // restored blocks are registered like computed ones
    s.finish(2);
    add(&mut s, 3, prompt, 1);
    step(&mut s);
    assert_eq!(s.request(3).unwrap().num_cached_tokens, 20);
}

#[test]
fn a_short_pool_restores_fewer_blocks_and_a_gap_restores_none() {
    let config = TestConfig { max_batch_tokens: 6, ..cached_config(4) };
    let mut s = config.scheduler(7);
    let prompt: Vec<u32> = (0..21).collect();
    add(&mut s, 1, prompt[..9].to_vec(), 1);
    step(&mut s);
    step(&mut s); // 9 tokens in two chunks: blocks 0 and 1 cached
    s.finish(1);
    add(&mut s, 3, (200..206).collect(), 100);
    step(&mut s); // seq 3 holds two blocks from now on: 5 free, 2 of them seq 2's hit
    add(&mut s, 2, prompt.clone(), 1);
    s.offer_restored(2, 1, vec![true; 4], Vec::new());
    let plan = step(&mut s);
    // 5 budget tokens after seq 3's decode, 3 free blocks: restoring 1 block (then 5 tokens) fits
    assert_eq!(plan.chunks[1], ScheduledChunk { id: 2, start: 12, len: 5, samples: false, draft: 0, draft_span: None });
    assert_eq!(plan.restores.len(), 1);
    assert_eq!((plan.restores[0].skip, plan.restores[0].blocks.len()), (1, 1));
    assert_eq!(s.request(2).unwrap().num_cached_tokens, 12);
    // a restorable run that starts after the memory hit cannot be used
    s.finish(2);
    s.finish(3);
    add(&mut s, 4, [&prompt[..8], &[77; 13][..]].concat(), 1);
    s.offer_restored(4, 3, vec![true; 2], Vec::new());
    let plan = step(&mut s);
    assert!(plan.restores.is_empty());
    assert_eq!(s.request(4).unwrap().num_cached_tokens, 8);
}

#[test]
fn a_cache_salt_separates_prefixes_even_when_keys_collide() {
    let mut s = cached_config(2).with_pool(BlockPool::with_hasher(16, colliding_hash, 0));
    let prompt = vec![1, 2, 3, 4, 5];
    add_salted(&mut s, 1, prompt.clone(), 1, Some(b"tenant-a"));
    step(&mut s);
    s.finish(1);
    for (id, salt) in [(2, Some(&b"tenant-b"[..])), (3, None), (4, Some(&b"tenant-a"[..]))] {
        add_salted(&mut s, id, prompt.clone(), 1, salt);
        step(&mut s);
        s.finish(id);
    }
    // tenant b and the unsalted request computed their own blocks; tenant a's second request reused its first
    assert_eq!(s.prefix_stats().hit_tokens, 4);
}

#[test]
fn a_held_sequence_waits_for_its_disk_read_and_others_pass_it() {
    let mut s = cached_config(4).scheduler(10);
    add(&mut s, 1, (0..9).collect(), 1);
    s.hold(1);
    add(&mut s, 2, (50..55).collect(), 1);
    assert!(s.has_runnable_work());
    assert_eq!(step(&mut s).chunks, vec![chunk(2, 0, 5)]);
    s.finish(2);
    assert!(s.has_work() && !s.has_runnable_work(), "only a held sequence is left");
    assert!(step(&mut s).is_empty());
    s.offer_restored(1, 0, Vec::new(), Vec::new()); // nothing was on disk after all
    assert_eq!(step(&mut s).chunks, vec![chunk(1, 0, 9)]);
}

#[test]
fn a_held_sequence_keeps_its_memory_prefix_until_admitted() {
    let mut s = cached_config(4).scheduler(6);
    let prompt: Vec<u32> = (0..9).collect();
    add(&mut s, 1, prompt.clone(), 1);
    step(&mut s);
    s.finish(1);
    assert_eq!(free(&s), vec![2, 3, 4, 5, 1, 0]);
    add(&mut s, 2, prompt.clone(), 1);
    s.hold(2);
    // blocks 0 and 1 are pinned for seq 2: a 20-token prompt, which would evict them, must wait
    assert_eq!((s.pool().ref_count(0), s.pool().ref_count(1), s.pool().num_free()), (1, 1, 4));
    add(&mut s, 3, (100..120).collect(), 1);
    assert!(step(&mut s).is_empty());
    s.offer_restored(2, 2, Vec::new(), Vec::new());
    assert_eq!(step(&mut s).chunks, vec![chunk(2, 8, 1)]);
    assert_eq!((s.pool().ref_count(0), s.pool().ref_count(1)), (1, 1), "the pin became the sequence's own hold");
    s.finish(2);
    // a held sequence that is removed gives its pins back
    add(&mut s, 4, prompt, 1);
    s.hold(4);
    s.finish(4);
    s.finish(3);
    assert_eq!(s.pool().num_free(), 6);
}

/// A sparse prefill (`engine::sparse`): the request computes its kept tokens in consecutive cells; only
/// its genuine prefix (here blocks 0 and 1: positions 0..8 kept) is registered, so a later request whose
/// prompt equals the compacted tokens finds those two blocks and nothing of the thinned rest, and a
/// request with the full prompt finds the same two. Its usage counts the full prompt.
#[test]
fn a_sparse_prefill_registers_only_its_genuine_prefix() {
    let mut s = cached_config(4).scheduler(32);
    let prompt: Vec<u32> = (100..124).collect();
    add(&mut s, 1, prompt.clone(), 2);
    // keep 0..10, 16..20 and the last token: 15 of 24
    let kept: Vec<usize> = (0..10).chain(16..20).chain([23]).collect();
    assert!(s.sparsify(1, kept.clone()));
    assert!(!s.sparsify(1, kept.clone()), "a request is thinned once");
    let req = s.request(1).unwrap();
    assert_eq!(req.tokens, kept.iter().map(|&p| prompt[p]).collect::<Vec<_>>());
    assert_eq!((req.num_prompt_tokens, req.num_prompt_tokens_in_full()), (15, 24));
    assert_eq!(req.blocks.cache_limit(), Some(10));
    assert_eq!(step(&mut s).chunks, vec![chunk(1, 0, 15)]);
    step(&mut s);
    assert_eq!(s.pool().num_cached(), 2, "blocks 0 and 1 (positions 0..8) only");
    // the compacted tokens as a prompt: the two genuine blocks hit, the thinned ones do not
    let compacted = s.request(1).unwrap().tokens[..15].to_vec();
    add(&mut s, 2, compacted, 1);
    let plan = step(&mut s);
    assert!(plan.chunks.contains(&chunk(2, 8, 7)), "{:?}", plan.chunks);
    // the full prompt: the same two blocks
    add(&mut s, 3, prompt.clone(), 1);
    let plan = step(&mut s);
    assert!(plan.chunks.contains(&chunk(3, 8, 16)), "{:?}", plan.chunks);
    // a started request is not thinned
    assert!(!s.sparsify(3, (0..24).collect()));
    for id in [1, 2, 3] {
        s.finish(id);
    }
    assert_eq!(s.pool().num_free(), 32);
}

/// Nothing sparse stays reachable after a sparse request ends early: held for scoring, it is not
/// admitted (and ends with nothing taken); aborted mid-prefill, after its genuine prefix and thinned
/// blocks were computed, only the genuine prefix (block 0) is ever registered; the full prompt then
/// finds that block and nothing else, and every block comes back.
#[test]
fn an_aborted_or_held_sparse_request_leaves_only_its_genuine_prefix() {
    let mut s = TestConfig { block_size: 4, max_batch_tokens: 8, max_running: 16, prefix_caching: true, max_prefill_tokens_while_decoding: usize::MAX }.scheduler(32);
    let prompt: Vec<u32> = (200..232).collect();
    add(&mut s, 1, prompt.clone(), 2);
    assert!(s.hold_for_scoring(1));
    assert!(step(&mut s).chunks.is_empty(), "a request being scored is not admitted");
    assert!(!s.has_runnable_work());
    // keep 0..6 (genuine: block 0 whole), 12..20 and the last 4: 18 of 32
    let kept: Vec<usize> = (0..6).chain(12..20).chain(28..32).collect();
    assert!(s.sparsify(1, kept));
    s.release_scoring(1);
    let partial = |start| ScheduledChunk { samples: false, ..chunk(1, start, 8) };
    assert_eq!(step(&mut s).chunks, vec![partial(0)]);
    assert_eq!(step(&mut s).chunks, vec![partial(8)]);
    // aborted before its last chunk: cells 0..16 computed (four full blocks), one of them genuine
    s.finish(1);
    assert_eq!(s.pool().num_cached(), 1, "block 0 (positions 0..4) only");
    assert_eq!(s.pool().num_free(), 32);
    add(&mut s, 2, prompt.clone(), 1);
    assert_eq!(step(&mut s).chunks, vec![ScheduledChunk { samples: false, ..chunk(2, 4, 8) }], "the full prompt hits block 0 only");
    // held and then dropped: nothing taken
    add(&mut s, 3, prompt, 1);
    assert!(s.hold_for_scoring(3));
    s.finish(3);
    s.finish(2);
    assert_eq!(s.pool().num_free(), 32);
}

#[test]
fn kv_events_name_each_key_once_as_it_is_stored_and_removed() {
    use crate::kv::{KvEvent, Medium};
    let mut s = cached_config(4).scheduler(4);
    s.record_kv_events();
    let prompt: Vec<u32> = (0..10).collect();
    add(&mut s, 1, prompt.clone(), 1);
    step(&mut s);
    let stored = s.take_kv_events();
    let hashes: Vec<BlockHash> = match &stored[..] {
        [KvEvent::BlockStored { hash: h0, parent: None, tokens: t0, medium: Medium::Memory }, KvEvent::BlockStored { hash: h1, parent: Some(p1), tokens: t1, medium: Medium::Memory }] => {
            assert_eq!((&t0[..], &t1[..], p1), (&prompt[..4], &prompt[4..8], h0), "each block's tokens, chained to its parent");
            vec![*h0, *h1]
        }
        other => panic!("two blocks stored: {other:?}"),
    };
    // the same prompt again while the first holds its blocks: a hit, and no event
    add(&mut s, 2, prompt.clone(), 1);
    step(&mut s);
    assert!(s.take_kv_events().is_empty());
    s.finish(1);
    s.finish(2);
    // another prompt takes every block: the cached ones are evicted, the tail first
    add(&mut s, 3, (50..63).collect(), 1);
    step(&mut s);
    let events = s.take_kv_events();
    let removed: Vec<BlockHash> = events.iter().filter_map(|e| match e { KvEvent::BlockRemoved { hash, medium: Medium::Memory } => Some(*hash), _ => None }).collect();
    assert_eq!(removed, vec![hashes[1], hashes[0]]);
    assert_eq!(events.iter().filter(|e| matches!(e, KvEvent::BlockStored { .. })).count(), 3, "prompt 3's three full blocks");
}
