"""KV-cache events (`reckon serve --kv-events`) read the way vLLM's consumers read them: pyzmq SUB and
DEALER sockets, and msgspec structs declared as vLLM v0.11.0 declares them in
vllm/distributed/kv_events.py (array_like, tagged; field order and types), so a field out of place fails
the decode. Checks: every BlockStored carries its block's 16 token ids (the prompt's, sent as ids) and
its parent's hash, a chain from a first block with none; evictions produce BlockRemoved for stored
hashes; sequence numbers are gapless from 0; the replay socket returns missed batches, byte-identical to
the live ones, then the end marker; the map encoding (`"encoding": "map"`, vLLM v0.34.0's events) carries
the same fields by name in an array batch. Run by scripts/test-clients."""

import re
import time
import unittest
from typing import Optional, Union

import msgspec
import openai
import zmq
from reckon_server import ReckonServer

MODEL = "smollm2-135m"
BLOCK = 16
TOPIC = b"kv@test-pod@smollm2-135m"


# vLLM v0.11.0's event structs (ExternalBlockHash = Union[bytes, int])
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[Union[bytes, int]]
    parent_block_hash: Optional[Union[bytes, int]]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class BlockRemoved(KVCacheEvent):
    block_hashes: list[Union[bytes, int]]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


# vLLM v0.34.0's: the batch still array_like, the events tagged maps (fields at their defaults omitted)
class Event34(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored34(Event34, tag="BlockStored"):
    block_hashes: list[Union[bytes, int]]
    parent_block_hash: Optional[Union[bytes, int]]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list] = None
    group_idx: Optional[int] = None


class BlockRemoved34(Event34, tag="BlockRemoved"):
    block_hashes: list[Union[bytes, int]]
    medium: Optional[str]
    group_idx: Optional[int] = None


class AllBlocksCleared34(Event34, tag="AllBlocksCleared"):
    pass


class KVEventBatch34(EventBatch):
    events: list[Union[BlockStored34, BlockRemoved34, AllBlocksCleared34]]


def endpoints(server):
    log = "".join(server.log)
    m = re.search(r"KV-cache events on (tcp://[\d.:]+), replay on (tcp://[\d.:]+)", log)
    return m.group(1), m.group(2)


def complete(server, ids):
    c = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    return c.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0)


def replay(endpoint, start):
    """(seq, payload) of every batch the replay socket returns from `start`, up to its end marker."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.connect(endpoint)
    s.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    while True:
        if not s.poll(10_000):
            raise AssertionError("no end marker from the replay socket")
        _, seq, payload = s.recv_multipart()
        seq = int.from_bytes(seq, "big", signed=True)
        if seq == -1:
            s.close()
            return out
        out.append((seq, payload))


class KvEvents(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        # 96 blocks: the prompts below need more, so cached blocks are evicted
        cls.server = ReckonServer("-m", MODEL, "-c", "2048", "--kv-memory", "1536", "--kv-events", "tcp://127.0.0.1:0",
                                  "--kv-events-replay", "tcp://127.0.0.1:0", "--kv-events-topic", TOPIC.decode())
        cls.pub, cls.replay = endpoints(cls.server)

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    def test_stored_blocks_chain_with_their_tokens_and_evictions_remove_them(self):
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.connect(self.pub)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        time.sleep(0.5)  # (a subscription takes a moment to reach the publisher)
        # prompts as token ids, so the events' ids can be checked exactly
        prompts = [[1000 + 7 * i + j for j in range(400)] for i in range(4)]
        for p in prompts:
            complete(self.server, p)
        live = []
        while sub.poll(2000):
            topic, seq, payload = sub.recv_multipart()
            self.assertEqual(topic, TOPIC)
            live.append((int.from_bytes(seq, "big"), payload))
        sub.close()
        self.assertTrue(live, "no event batches arrived")
        seqs = [s for s, _ in live]
        self.assertEqual(seqs, list(range(seqs[0], seqs[0] + len(seqs))), "gapless sequence numbers")

        # every batch from 0, through the replay socket: the live ones among them byte for byte
        everything = replay(self.replay, 0)
        self.assertEqual([s for s, _ in everything], list(range(len(everything))), "replay from 0: gapless from 0")
        self.assertEqual(everything[seqs[0]:seqs[0] + len(live)], live)
        self.assertEqual(replay(self.replay, seqs[-1]), live[-1:], "a replay from a later start returns that batch on")

        stored, removed = {}, []
        for _, payload in everything:
            batch = DECODER.decode(payload)
            self.assertEqual(batch.data_parallel_rank, 0)
            self.assertGreater(batch.ts, 1.7e9)
            for e in batch.events:
                if isinstance(e, BlockStored):
                    self.assertEqual((len(e.block_hashes), e.block_size, len(e.token_ids), e.lora_id, e.medium), (1, BLOCK, BLOCK, None, "CPU"))
                    self.assertTrue(e.parent_block_hash is None or e.parent_block_hash in stored, "a parent is a stored block")
                    stored[e.block_hashes[0]] = (e.parent_block_hash, e.token_ids)
                elif isinstance(e, BlockRemoved):
                    self.assertEqual(e.medium, "CPU")
                    removed.extend(e.block_hashes)
        # each prompt's 25 full blocks, chained from a first block with no parent, holding its ids in order
        for p in prompts:
            chain = [h for h, (parent, ids) in stored.items() if parent is None and ids == p[:BLOCK]]
            self.assertEqual(len(chain), 1, "one first block per prompt")
            for j in range(1, len(p) // BLOCK):
                nxt = [h for h, (parent, ids) in stored.items() if parent == chain[-1] and ids == p[j * BLOCK:(j + 1) * BLOCK]]
                self.assertEqual(len(nxt), 1, f"block {j} of a prompt, chained to block {j - 1}")
                chain.append(nxt[0])
        # the publisher's own account: every batch published, none dropped
        metrics = self.server.metrics()
        published = re.search(r'^reckon_kv_events_batches_published_total\{[^}]*\} (\d+)', metrics, re.M)
        dropped = re.search(r'^reckon_kv_events_batches_dropped_total\{[^}]*\} (\d+)', metrics, re.M)
        self.assertEqual((int(published.group(1)), int(dropped.group(1))), (len(everything), 0))
        # 4 x 26 blocks do not fit in 96: the first prompts' blocks were evicted
        self.assertTrue(removed, "no BlockRemoved after the pool filled")
        self.assertTrue(set(removed) <= set(stored), "removed hashes were stored")

    def test_the_map_encoding_names_the_same_fields(self):
        server = ReckonServer("-m", MODEL, "-c", "2048", "--kv-memory", "1536", "--kv-events-replay", "tcp://127.0.0.1:0",
                              "--kv-events-config", '{"endpoint": "tcp://127.0.0.1:0", "bind": true, "encoding": "map", "hash": "bytes"}')
        try:
            _, rep = endpoints(server)
            ids = [2000 + j for j in range(40)]
            complete(server, ids)
            deadline = time.time() + 10
            batches = []
            while not batches and time.time() < deadline:
                batches = replay(rep, 0)
                time.sleep(0.1)
            raw = msgspec.msgpack.decode(batches[0][1])
            self.assertEqual((len(raw), raw[2]), (3, 0), "an array batch: ts, events, rank")
            self.assertEqual(set(raw[1][0]), {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"})
            batch = msgspec.msgpack.decode(batches[0][1], type=KVEventBatch34)
            first, second = batch.events[:2]
            self.assertIsInstance(first, BlockStored34)
            self.assertEqual((first.parent_block_hash, first.token_ids, len(first.block_hashes[0]), first.medium), (None, ids[:BLOCK], 16, "CPU"))
            self.assertEqual((second.parent_block_hash, second.token_ids), (first.block_hashes[0], ids[BLOCK:2 * BLOCK]))
        finally:
            server.stop()


if __name__ == "__main__":
    unittest.main()
