//! Model-free scheduler tests: exact block ids, chunking, admission order, preemption, release.

use super::*;
use crate::kv::{BlockPool, KvCacheManager};

/// A scheduler's settings with its KV cache's, for tests.
#[derive(Clone, Copy)]
pub(super) struct TestConfig {
    pub block_size: usize,
    pub max_batch_tokens: usize,
    pub max_running: usize,
    pub prefix_caching: bool,
    pub max_prefill_tokens_while_decoding: usize,
}

impl TestConfig {
    pub fn scheduler(self, num_blocks: usize) -> Scheduler {
        self.with_pool(BlockPool::new(num_blocks))
    }

    pub fn with_pool(self, pool: BlockPool) -> Scheduler {
        let config = SchedulerConfig { max_batch_tokens: self.max_batch_tokens, max_running: self.max_running, max_prefill_tokens_while_decoding: self.max_prefill_tokens_while_decoding, max_background_chunk: usize::MAX };
        Scheduler::new(config, KvCacheManager::new(self.block_size, pool, self.prefix_caching))
    }
}

fn config(block_size: usize, max_batch_tokens: usize) -> TestConfig {
    TestConfig { block_size, max_batch_tokens, max_running: 16, prefix_caching: false, max_prefill_tokens_while_decoding: usize::MAX }
}

/// Queues a greedy request (what `validate` passed: its prompt and a token fit).
pub(super) fn add(s: &mut Scheduler, id: RequestId, prompt: Vec<u32>, max_new_tokens: usize) {
    add_salted(s, id, prompt, max_new_tokens, None);
}

pub(super) fn add_salted(s: &mut Scheduler, id: RequestId, prompt: Vec<u32>, max_new_tokens: usize, salt: Option<&[u8]>) {
    let blocks = s.kv().new_blocks(salt);
    s.add(Request::for_test(id, prompt, max_new_tokens, blocks));
}

fn prompt(n: usize) -> Vec<u32> {
    (0..n as u32).collect()
}

/// Runs the plan as a model would: one sampled token (`100 + id`) per sampling chunk.
pub(super) fn step(s: &mut Scheduler) -> StepPlan {
    let plan = s.schedule();
    let sampled: Vec<Vec<u32>> = plan.chunks.iter().filter(|c| c.samples).map(|c| vec![100 + c.id as u32]).collect();
    s.complete_step(&plan, &sampled);
    plan
}

fn chunk(id: RequestId, start: usize, len: usize, samples: bool) -> ScheduledChunk {
    ScheduledChunk { id, start, len, samples, draft: 0, draft_span: None }
}

#[test]
fn pool_hands_out_ids_in_order_and_frees_tail_first() {
    let mut pool = BlockPool::new(6);
    assert_eq!(pool.allocate(3), Some(vec![0, 1, 2]));
    assert_eq!(pool.allocate(4), None, "all or nothing");
    assert_eq!(pool.num_free(), 3);
    // blocks that hold no cached prefix go back to the front, in table order
    pool.release(&[0, 1, 2]);
    assert_eq!(pool.free_ids().collect::<Vec<_>>(), vec![0, 1, 2, 3, 4, 5]);
    assert_eq!(pool.allocate(4), Some(vec![0, 1, 2, 3]));
    assert_eq!(pool.num_free(), 2);
}

#[test]
fn prompts_get_whole_blocks_in_admission_order() {
    let mut s = config(4, 64).scheduler(10);
    add(&mut s, 1, prompt(9), 10);
    add(&mut s, 2, prompt(4), 10);
    let plan = step(&mut s);
    assert_eq!(plan.chunks, vec![chunk(1, 0, 9, true), chunk(2, 0, 4, true)]);
    assert_eq!(s.request(1).unwrap().blocks.table(), vec![0, 1, 2]);
    assert_eq!(s.request(2).unwrap().blocks.table(), vec![3]);
    // decode: seq 1 has 10 tokens (fits its 3 blocks), seq 2 has 5 (needs a second block)
    let plan = step(&mut s);
    assert_eq!(plan.chunks, vec![chunk(1, 9, 1, true), chunk(2, 4, 1, true)]);
    assert_eq!(s.request(2).unwrap().blocks.table(), vec![3, 4]);
    assert_eq!(s.request(1).unwrap().tokens.len(), 11);
    assert_eq!(s.request(1).unwrap().num_computed_tokens, 10);
}

#[test]
fn long_prompts_are_chunked_and_mixed_with_decodes() {
    let mut s = config(4, 8).scheduler(20);
    add(&mut s, 1, prompt(3), 10);
    add(&mut s, 2, prompt(18), 10);
    // step 1: seq 1 whole (3), seq 2's first 5 tokens
    assert_eq!(step(&mut s).chunks, vec![chunk(1, 0, 3, true), chunk(2, 0, 5, false)]);
    // step 2: seq 1 decodes, seq 2 continues with 7
    assert_eq!(step(&mut s).chunks, vec![chunk(1, 3, 1, true), chunk(2, 5, 7, false)]);
    // step 3: decode + the remaining 6, which samples
    assert_eq!(step(&mut s).chunks, vec![chunk(1, 4, 1, true), chunk(2, 12, 6, true)]);
    assert_eq!(s.request(2).unwrap().num_computed_tokens, 18);
    assert_eq!(s.request(2).unwrap().tokens.len(), 19);
    // seq 1 took block 4 for its fifth token before seq 2 grew in the same step
    assert_eq!(s.request(1).unwrap().blocks.table(), vec![0, 4]);
    assert_eq!(s.request(2).unwrap().blocks.table(), vec![1, 2, 3, 5, 6]);
}

#[test]
fn admission_is_first_come_first_served_and_waits_for_blocks() {
    let mut s = config(4, 100).scheduler(6);
    add(&mut s, 1, prompt(12), 100); // 3 blocks
    add(&mut s, 2, prompt(16), 100); // 4 blocks: does not fit beside seq 1
    add(&mut s, 3, prompt(2), 100); // 1 block: would fit, but must not overtake seq 2
    assert_eq!(step(&mut s).chunks, vec![chunk(1, 0, 12, true)]);
    assert_eq!(s.num_waiting(), 2);
    s.finish(1);
    assert_eq!(s.pool().num_free(), 6);
    assert_eq!(step(&mut s).chunks, vec![chunk(2, 0, 16, true), chunk(3, 0, 2, true)]);
    // seq 1's blocks (no prefix caching) went back to the front of the queue
    assert_eq!(s.request(2).unwrap().blocks.table(), vec![0, 1, 2, 3]);
    assert_eq!(s.request(3).unwrap().blocks.table(), vec![4]);
}

#[test]
fn the_newest_sequence_is_preempted_and_recomputed_later() {
    let mut s = config(4, 100).scheduler(4);
    add(&mut s, 1, prompt(7), 100);
    add(&mut s, 2, prompt(8), 100);
    step(&mut s); // 1: blocks [0, 1] (8 tokens after sampling), 2: [2, 3] (9 tokens)
    assert_eq!(s.pool().num_free(), 0);
    // seq 1 decodes its 8th token in block 1 (fits); seq 2 needs a third block: none free, and it is the
    // newest, so it is preempted itself
    let plan = step(&mut s);
    assert_eq!(plan.chunks, vec![chunk(1, 7, 1, true)]);
    assert_eq!(plan.preempted, vec![2]);
    let seq2 = s.request(2).unwrap();
    assert_eq!((seq2.num_computed_tokens, seq2.blocks.table().len(), seq2.num_preemptions), (0, 0, 1));
    assert_eq!(seq2.tokens.len(), 9, "generated tokens are kept");
    assert_eq!(s.pool().free_ids().collect::<Vec<_>>(), vec![2, 3]);
    // seq 1 now needs block 3 of its table: it takes the front of the free queue, id 2
    let plan = step(&mut s);
    assert_eq!(plan.chunks, vec![chunk(1, 8, 1, true)], "seq 2's 9 tokens need 3 blocks; only 1 is free");
    assert_eq!(s.request(1).unwrap().blocks.table(), vec![0, 1, 2]);
    assert_eq!(s.num_preemptions(), 1);
    // when seq 1 finishes, seq 2 recomputes prompt and generated tokens in one chunk and samples
    s.finish(1);
    assert_eq!(step(&mut s).chunks, vec![chunk(2, 0, 9, true)]);
    assert_eq!(s.request(2).unwrap().tokens.len(), 10);
}

#[test]
fn preemption_takes_the_newest_running_sequence_first() {
    let mut s = config(2, 100).scheduler(6);
    for id in 1..=3 {
        add(&mut s, id, prompt(3), 100); // 2 blocks each
    }
    step(&mut s); // 4 tokens each
    step(&mut s); // token 4 fits the 2 blocks; 5 tokens each
    assert_eq!(s.pool().num_free(), 0);
    // token 5 needs a third block everywhere: seq 3 (the newest) is preempted, seqs 1 and 2 take its
    // blocks (4, then 5)
    let plan = step(&mut s);
    assert_eq!(plan.chunks, vec![chunk(1, 4, 1, true), chunk(2, 4, 1, true)]);
    assert_eq!(plan.preempted, vec![3]);
    assert_eq!(s.request(1).unwrap().blocks.table(), vec![0, 1, 4]);
    assert_eq!(s.request(2).unwrap().blocks.table(), vec![2, 3, 5]);
    assert_eq!(s.num_waiting(), 1);
}

#[test]
fn removing_sequences_returns_every_block() {
    let mut s = config(4, 16).scheduler(12);
    for id in 0..6 {
        add(&mut s, id, prompt(5 + id as usize), 100);
    }
    for _ in 0..5 {
        step(&mut s);
    }
    s.finish(3); // running: abort mid-stream
    for _ in 0..3 {
        step(&mut s);
    }
    for id in 0..6 {
        s.finish(id);
    }
    assert!(!s.has_work());
    assert_eq!(s.pool().num_free(), 12);
    assert!((0..12).all(|b| s.pool().ref_count(b) == 0));
}

#[test]
fn the_running_limit_holds_back_admission() {
    let mut s = TestConfig { block_size: 4, max_batch_tokens: 100, max_running: 2, prefix_caching: false, max_prefill_tokens_while_decoding: usize::MAX }.scheduler(20);
    for id in 1..=3 {
        add(&mut s, id, prompt(4), 10);
    }
    let plan = step(&mut s);
    assert_eq!(plan.chunks.iter().map(|c| c.id).collect::<Vec<_>>(), vec![1, 2]);
    s.finish(1);
    let plan = step(&mut s);
    assert_eq!(plan.chunks, vec![chunk(2, 4, 1, true), chunk(3, 0, 4, true)]);
}

#[test]
fn prompts_arriving_during_decodes_are_prefilled_in_capped_chunks() {
    let mut s = TestConfig { max_prefill_tokens_while_decoding: 8, ..config(4, 64) }.scheduler(40);
    add(&mut s, 1, prompt(3), 10);
    add(&mut s, 2, prompt(20), 10);
    // nothing decodes yet: both prompts whole, in one step
    assert_eq!(step(&mut s).chunks, vec![chunk(1, 0, 3, true), chunk(2, 0, 20, true)]);
    add(&mut s, 3, prompt(13), 10);
    // 1 and 2 decode; 3's prompt gets at most 8 tokens a step until it is in
    assert_eq!(step(&mut s).chunks, vec![chunk(1, 3, 1, true), chunk(2, 20, 1, true), chunk(3, 0, 8, false)]);
    assert_eq!(s.request(3).unwrap().blocks.table(), vec![7, 8]);
    assert_eq!(step(&mut s).chunks, vec![chunk(1, 4, 1, true), chunk(2, 21, 1, true), chunk(3, 8, 5, true)]);
    assert_eq!(s.request(1).unwrap().blocks.table(), vec![0, 9]);
    assert_eq!(s.request(3).unwrap().blocks.table(), vec![7, 8, 10, 11]);
    assert_eq!(step(&mut s).chunks, vec![chunk(1, 5, 1, true), chunk(2, 22, 1, true), chunk(3, 13, 1, true)]);
}

/// Speculative decoding (`engine::spec`): a decoding request's chunk carries its n-gram guesses; the
/// blocks for them are allocated with it, and after the step only the kept guesses count as computed:
/// blocks that held nothing kept go back to the pool.
#[test]
fn guesses_ride_in_the_decode_chunk_and_rejected_ones_give_their_blocks_back() {
    use super::spec::{SpecConfig, SpecState};
    let mut s = config(4, 64).scheduler(16);
    // ... 2 3 4 [5 6 7 1] ... 2 3 | 4: the suffix 2 3 4 was seen before, followed by 5 6 7 1
    add(&mut s, 1, vec![1, 2, 3, 4, 5, 6, 7, 1, 2, 3], 100);
    s.request_mut(1).unwrap().spec = Some(SpecState { config: SpecConfig { k: 4, min_n: 2, max_n: 3, auto: false, draft: false }, ..Default::default() });
    let plan = s.schedule();
    assert_eq!(plan.chunks, vec![ScheduledChunk { id: 1, start: 0, len: 10, samples: true, draft: 0, draft_span: None }]);
    s.complete_step(&plan, &[vec![4]]);
    assert_eq!(s.request(1).unwrap().blocks.table(), vec![0, 1, 2]);
    let plan = s.schedule();
    assert_eq!(plan.chunks, vec![ScheduledChunk { id: 1, start: 10, len: 5, samples: true, draft: 4, draft_span: None }]);
    assert_eq!(s.request(1).unwrap().spec.as_ref().unwrap().draft, vec![5, 6, 7, 1]);
    assert_eq!(s.request(1).unwrap().blocks.table(), vec![0, 1, 2, 3], "positions 10..15 need a fourth block");
    // the model kept no guess and said 9: positions 0..11 are computed, block 3 held nothing kept
    s.complete_step(&plan, &[vec![9]]);
    let req = s.request(1).unwrap();
    assert_eq!((req.num_computed_tokens, req.tokens.len()), (11, 12));
    assert_eq!(req.blocks.table(), vec![0, 1, 2]);
    assert_eq!(s.pool().free_ids().next(), Some(3));
    let spec = req.spec.as_ref().unwrap();
    assert_eq!((spec.drafts, spec.drafted, spec.accepted), (1, 4, 0));
    // 1 2 3 4 5 6 7 1 2 3 4 9: no suffix of 2 or 3 seen before; a plain decode
    let plan = s.schedule();
    assert_eq!(plan.chunks, vec![ScheduledChunk { id: 1, start: 11, len: 1, samples: true, draft: 0, draft_span: None }]);
    s.complete_step(&plan, &[vec![2]]);
    // ... 9 2: "9 2" was not seen, and neither was anything longer: no guess; then 2 3 -> 4 9 2 3
    let plan = s.schedule();
    assert_eq!(plan.chunks[0].draft, 0);
    s.complete_step(&plan, &[vec![3]]);
    let plan = s.schedule();
    assert_eq!(plan.chunks, vec![ScheduledChunk { id: 1, start: 13, len: 5, samples: true, draft: 4, draft_span: None }]);
    assert_eq!(s.request(1).unwrap().spec.as_ref().unwrap().draft, vec![4, 9, 2, 3]);
    // two guesses kept and the model's own token: 3 new tokens, positions 0..16 computed
    s.complete_step(&plan, &[vec![4, 9, 5]]);
    let req = s.request(1).unwrap();
    assert_eq!((req.num_computed_tokens, &req.tokens[13..]), (16, &[3, 4, 9, 5][..]));
    assert_eq!(req.blocks.table().len(), 4);
    let spec = req.spec.as_ref().unwrap();
    assert_eq!((spec.drafts, spec.drafted, spec.accepted), (2, 8, 2));
    s.finish(1);
    assert_eq!(s.pool().num_free(), 16);
}

#[test]
fn guesses_give_way_to_a_short_pool_and_never_pass_the_token_limit() {
    use super::spec::{SpecConfig, SpecState};
    // 3 blocks of 4: a 10-token prompt and its next token fill them; guesses would need a fourth
    let mut s = config(4, 64).scheduler(3);
    add(&mut s, 1, vec![1, 2, 3, 4, 5, 6, 7, 1, 2, 3], 100);
    s.request_mut(1).unwrap().spec = Some(SpecState { config: SpecConfig { k: 4, min_n: 2, max_n: 3, auto: false, draft: false }, ..Default::default() });
    let plan = s.schedule();
    s.complete_step(&plan, &[vec![4]]);
    let plan = s.schedule();
    assert_eq!(plan.chunks, vec![ScheduledChunk { id: 1, start: 10, len: 1, samples: true, draft: 0, draft_span: None }]);
    assert!(plan.preempted.is_empty());
    s.finish(1);
    // two tokens left to generate: one guess at most (the step then gives at most two)
    let mut s = config(4, 64).scheduler(16);
    add(&mut s, 2, vec![1, 2, 3, 4, 5, 6, 7, 1, 2, 3], 3);
    s.request_mut(2).unwrap().spec = Some(SpecState { config: SpecConfig { k: 4, min_n: 2, max_n: 3, auto: false, draft: false }, ..Default::default() });
    let plan = s.schedule();
    s.complete_step(&plan, &[vec![4]]);
    let plan = s.schedule();
    assert_eq!(plan.chunks[0].draft, 1);
}

/// A draft model's share of the plan: it follows every prompt chunk, catches up and guesses from the
/// newest token, and its cells are valid through its own guesses that were kept (not the last one, which
/// it never computed). Blocks record its cells, so a request that hits the prefix cache starts its draft
/// there; a block handed out anew starts with none.
#[test]
fn a_draft_model_follows_the_prompt_and_its_cells_come_with_cached_blocks() {
    use super::spec::{SpecConfig, SpecState};
    let draft = SpecState { config: SpecConfig { k: 3, min_n: 2, max_n: 3, auto: false, draft: true }, ..Default::default() };
    let mut s = TestConfig { prefix_caching: true, ..config(4, 6) }.scheduler(16);
    add(&mut s, 1, prompt(10), 100);
    s.request_mut(1).unwrap().spec = Some(draft.clone());
    // a 6-token step budget: the prompt in two chunks, the draft model beside each
    let plan = step(&mut s);
    assert_eq!((plan.chunks[0].len, plan.chunks[0].draft_span), (6, Some((0, 6))));
    let plan = step(&mut s);
    assert_eq!((plan.chunks[0].start, plan.chunks[0].len, plan.chunks[0].draft_span), (6, 4, Some((6, 10))));
    assert_eq!(s.request(1).unwrap().blocks.table(), vec![0, 1, 2]);
    assert_eq!([0, 1, 2].map(|b| s.pool().draft_cells(b)), [4, 4, 2]);
    // decode: three guesses from the draft model (placeholders until the engine writes them); it
    // computes position 10 (the newest token), then guesses positions 11..14
    let plan = s.schedule();
    assert_eq!(plan.chunks, vec![ScheduledChunk { id: 1, start: 10, len: 4, samples: true, draft: 3, draft_span: Some((10, 11)) }]);
    assert!(s.request(1).unwrap().spec.as_ref().unwrap().from_model);
    assert_eq!(s.request(1).unwrap().blocks.table(), vec![0, 1, 2, 3]);
    // every guess kept, and the model's token: positions 0..14 computed; the draft model wrote 10..13
    s.complete_step(&plan, &[vec![7, 8, 9, 5]]);
    let spec = s.request(1).unwrap().spec.as_ref().unwrap();
    assert_eq!((s.request(1).unwrap().num_computed_tokens, spec.draft_computed), (14, 13));
    assert_eq!(spec.acceptance(true), 4.0 / 5.0, "recorded as the draft model's");
    assert_eq!([2, 3].map(|b| s.pool().draft_cells(b)), [4, 1]);
    // next: it catches up over position 13 and the newest token at 14
    let plan = s.schedule();
    assert_eq!(plan.chunks[0].draft_span, Some((13, 15)));
    // one guess kept of three: 16 computed, the draft's cells through 15
    s.complete_step(&plan, &[vec![1, 2]]);
    let req = s.request(1).unwrap();
    assert_eq!((req.num_computed_tokens, req.spec.as_ref().unwrap().draft_computed), (16, 16));
    assert_eq!(req.blocks.table(), vec![0, 1, 2, 3], "the guesses' fifth block went back");
    assert_eq!(s.pool().draft_cells(3), 4);
    // the same prompt again: the cached blocks bring the draft model's cells (the hit stops one block
    // short of the last token); the rest follows the prompt chunk
    add(&mut s, 2, prompt(10), 100);
    s.request_mut(2).unwrap().spec = Some(draft.clone());
    let plan = s.schedule();
    let mine = plan.chunks.iter().find(|c| c.id == 2).unwrap();
    assert_eq!((mine.start, mine.draft_span), (8, Some((8, 10))));
    assert_eq!(s.request(2).unwrap().spec.as_ref().unwrap().draft_computed, 8);
    // finished and evicted, a block is handed out anew without the draft's cells
    s.finish(1);
    s.finish(2);
    add(&mut s, 3, (50..114).collect(), 1);
    s.request_mut(3).unwrap().spec = Some(draft);
    let mut held = 0;
    while s.request(3).is_some_and(|r| !r.is_decoding()) {
        let plan = s.schedule();
        // blocks new to the table (cached ones evicted among them) hold none of the draft's cells
        let table = s.request(3).unwrap().blocks.table().to_vec();
        assert!(table[held..].iter().all(|&b| s.pool().draft_cells(b) == 0), "{table:?}");
        held = table.len();
        let sampled: Vec<Vec<u32>> = plan.chunks.iter().filter(|c| c.samples).map(|_| vec![1]).collect();
        s.complete_step(&plan, &sampled);
    }
    assert_eq!(held, 16);
    assert_eq!(s.pool().num_cached(), 16, "every block of the new prompt cached, the old ones evicted");
}

/// A request whose prefix hit brings no draft cells (a request without speculation computed it) catches
/// its draft model up a step's budget at a time, decoding meanwhile, and guesses once it is a budget
/// behind at most.
#[test]
fn a_draft_model_far_behind_catches_up_a_budget_per_step() {
    use super::spec::{SpecConfig, SpecState};
    let mut s = TestConfig { prefix_caching: true, ..config(4, 6) }.scheduler(32);
    add(&mut s, 1, prompt(30), 1);
    while s.request(1).is_some_and(|r| r.num_generated() == 0) {
        step(&mut s);
    }
    s.finish(1);
    add(&mut s, 2, prompt(30), 100);
    s.request_mut(2).unwrap().spec = Some(SpecState { config: SpecConfig { k: 3, min_n: 2, max_n: 3, auto: false, draft: true }, ..Default::default() });
    // the hit covers 28 tokens, none of them the draft's: the prompt's last chunk carries 6 of catching up
    let plan = step(&mut s);
    assert_eq!((plan.chunks[0].start, plan.chunks[0].len, plan.chunks[0].draft_span), (28, 2, Some((0, 6))));
    let spans: Vec<_> = (0..4)
        .map(|_| {
            let plan = step(&mut s);
            (plan.chunks[0].start, plan.chunks[0].draft, plan.chunks[0].draft_span)
        })
        .collect();
    // decodes without guesses while more than a budget behind, catching up a budget each; then guesses
    assert_eq!(spans, vec![(30, 0, Some((6, 12))), (31, 0, Some((12, 18))), (32, 0, Some((18, 24))), (33, 0, Some((24, 30)))]);
    let plan = s.schedule();
    assert_eq!((plan.chunks[0].start, plan.chunks[0].draft, plan.chunks[0].draft_span), (34, 3, Some((30, 35))));
}
