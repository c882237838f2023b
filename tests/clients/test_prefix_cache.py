"""Automatic prefix caching through the official `openai` SDK against `reckon serve` (SmolLM2-135M):
multi-turn sessions report the reused tokens in `usage.prompt_tokens_details.cached_tokens` and give
exactly the replies of a server without the cache; a prompt whose start changes every turn degrades to
no reuse without changing replies; the disk tier (`--prefix-cache-dir`) survives a restart. Run by
scripts/test-clients."""

import os
import re
import tempfile
import unittest

import openai
from reckon_server import ReckonServer

MODEL = "smollm2-135m"
BLOCK = 16
ARGS = ("-m", MODEL, "-c", "4096", "--kv-memory", "16384")


def long_system(tag, n=40):
    rules = [f"Rule {i} ({tag}): answer briefly, cite the file and line, and never invent an API." for i in range(n)]
    return "You are a coding agent.\n" + "\n".join(rules)


def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def ask(server, messages, max_tokens=12):
    r = client(server).chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens)
    return r.choices[0].message.content, r.usage


class PrefixCache(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.cached = ReckonServer(*ARGS)
        cls.cold = ReckonServer(*ARGS, "--no-prefix-cache")

    @classmethod
    def tearDownClass(cls):
        cls.cached.stop()
        cls.cold.stop()

    def converse(self, sessions, turns, system_for_turn):
        """Interleaved sessions; returns per session a list of (prompt_tokens, cached_tokens)."""
        histories = [[] for _ in range(sessions)]
        usage = [[] for _ in range(sessions)]
        for turn in range(turns):
            for s in range(sessions):
                histories[s].append({"role": "user", "content": f"Session {s}, question {turn}: what does function f{turn} in module m{s} do?"})
                messages = [{"role": "system", "content": system_for_turn(turn)}] + histories[s]
                text, u = ask(self.cached, messages)
                cold_text, cold_u = ask(self.cold, messages)
                self.assertEqual(text, cold_text, f"session {s} turn {turn}: a cache hit changed the reply")
                self.assertEqual(cold_u.prompt_tokens_details.cached_tokens, 0)
                usage[s].append((u.prompt_tokens, u.prompt_tokens_details.cached_tokens))
                histories[s].append({"role": "assistant", "content": text})
        return usage

    def test_two_interleaved_sessions_share_the_system_prompt(self):
        system = long_system("interleaved")
        usage = self.converse(2, 3, lambda turn: system)
        (a_prompt, a_cached), (b_prompt, b_cached) = usage[0][0], usage[1][0]
        self.assertEqual(a_cached, 0)
        # session 2's first turn reuses session 1's system prompt blocks (they part at the user message)
        self.assertGreater(b_cached, 0.8 * b_prompt)
        for s in range(2):
            for (prev_prompt, _), (prompt, cached) in zip(usage[s], usage[s][1:]):
                # each later turn reuses at least the previous turn's prompt, but for its partial block
                self.assertGreaterEqual(cached, prev_prompt - BLOCK, f"session {s}: {usage[s]}")
                self.assertLess(cached, prompt)

    def test_a_timestamp_first_defeats_the_cache_without_changing_replies(self):
        system = long_system("timestamp")
        usage = self.converse(1, 3, lambda turn: f"Current time: 2026-12-01T09:00:0{turn}Z\n" + system)
        for prompt, cached in usage[0][1:]:
            self.assertLessEqual(cached, BLOCK, f"only the template's first block can match: {usage}")
        hits = sum(c for _, c in usage[0])
        self.assertLess(hits, 0.05 * sum(p for p, _ in usage[0]))

    def test_streamed_usage_reports_cached_tokens(self):
        messages = [{"role": "system", "content": long_system("stream")}, {"role": "user", "content": "hi"}]
        _, first = ask(self.cached, messages)
        stream = client(self.cached).chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=4, stream=True, stream_options={"include_usage": True})
        usage = [c.usage for c in stream if c.usage is not None][-1]
        self.assertEqual(usage.prompt_tokens, first.prompt_tokens)
        self.assertEqual(usage.prompt_tokens_details.cached_tokens, (first.prompt_tokens - 1) // BLOCK * BLOCK)
        metrics = self.cached.metrics()
        hits = float(re.search(r'^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)', metrics, re.M).group(1))
        self.assertGreater(hits, 0)

    def test_a_cache_salt_shares_blocks_only_with_the_same_salt(self):
        messages = [{"role": "system", "content": long_system("salt")}, {"role": "user", "content": "hi"}]
        c = client(self.cached)

        def ask_salted(salt):
            extra = {"extra_body": {"cache_salt": salt}} if salt is not None else {}
            r = c.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=3, **extra)
            return r.usage.prompt_tokens_details.cached_tokens, r.choices[0].message.content

        a, b = "tenant-a-" + "k" * 32, "tenant-b-" + "k" * 32
        first, other, again, unsalted = ask_salted(a), ask_salted(b), ask_salted(a), ask_salted(None)
        self.assertEqual((first[0], other[0], unsalted[0]), (0, 0, 0), "other salts (and none) never see tenant a's blocks")
        self.assertGreater(again[0], 0)
        self.assertEqual({first[1], other[1], again[1], unsalted[1]}, {first[1]}, "the salt changes reuse, not replies")
        with self.assertRaises(openai.BadRequestError) as e:
            ask_salted("")
        self.assertEqual(e.exception.body.get("param"), "cache_salt")


class DiskTier(unittest.TestCase):
    def test_a_restarted_server_reuses_the_disk_tier(self):
        messages = [{"role": "system", "content": long_system("disk")}, {"role": "user", "content": "Which rule comes first?"}]
        with tempfile.TemporaryDirectory() as d:
            server = ReckonServer(*ARGS, "--prefix-cache-dir", d)
            try:
                text, usage = ask(server, messages)
            finally:
                server.stop()  # SIGTERM: the cached blocks are written before the process ends
            self.assertEqual(usage.prompt_tokens_details.cached_tokens, 0)
            files = [f for f in os.listdir(d) if f.endswith(".kvb")]
            self.assertGreaterEqual(len(files), usage.prompt_tokens // BLOCK)
            server = ReckonServer(*ARGS, "--prefix-cache-dir", d)
            try:
                again, usage2 = ask(server, messages)
                metrics = server.metrics()
            finally:
                server.stop()
            self.assertEqual(again, text)
            self.assertEqual(usage2.prompt_tokens_details.cached_tokens, (usage.prompt_tokens - 1) // BLOCK * BLOCK)
            disk = float(re.search(r'^reckon_prefix_cache_disk_hits_total\{[^}]*\} (\S+)', metrics, re.M).group(1))
            self.assertEqual(disk, usage2.prompt_tokens_details.cached_tokens)


if __name__ == "__main__":
    unittest.main()
