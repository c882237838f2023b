"""The official `openai` Python SDK against `reckon serve` with the default model (SmolLM2-135M):
chat and text completions, streamed and not, stop sequences, seeds, logprobs, usage, errors, and a
client that goes away mid-stream. Run by scripts/test-clients."""

import time
import unittest

import openai
from reckon_server import ReckonServer

MODEL = "smollm2-135m"
HAIKU = [{"role": "user", "content": "Write a haiku about caches."}]


class OpenAISdk(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = ReckonServer("-m", MODEL, "-c", "2048", "--kv-memory", "4096")
        cls.client = openai.OpenAI(base_url=cls.server.base + "/v1", api_key="unused", max_retries=0, timeout=120)

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    def chat(self, **kw):
        args = dict(model=MODEL, messages=HAIKU, temperature=0, max_tokens=16)
        args.update(kw)
        return self.client.chat.completions.create(**args)

    def test_models(self):
        self.assertIn(MODEL, [m.id for m in self.client.models.list()])

    def test_chat_streamed_equals_not_streamed(self):
        full = self.chat()
        text = full.choices[0].message.content
        self.assertTrue(text)
        self.assertEqual(full.choices[0].finish_reason, "length")
        self.assertEqual(full.usage.completion_tokens, 16)
        self.assertEqual(full.usage.total_tokens, full.usage.prompt_tokens + 16)
        # the prefix cache reuses whole 16-token blocks of earlier identical prompts, never the last token
        cached = full.usage.prompt_tokens_details.cached_tokens
        self.assertEqual(cached % 16, 0)
        self.assertLess(cached, full.usage.prompt_tokens)
        chunks = list(self.chat(stream=True, stream_options={"include_usage": True}))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        self.assertEqual(streamed, text)
        self.assertEqual([c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason], ["length"])
        self.assertEqual(chunks[-1].usage.completion_tokens, 16)

    def test_stop_sequence_cuts_before_it(self):
        text = self.chat().choices[0].message.content
        word = text.split()[2]
        cut = self.chat(stop=[word, "never-appears"])
        self.assertEqual(cut.choices[0].message.content, text[: text.index(word)])
        self.assertEqual(cut.choices[0].finish_reason, "stop")
        streamed = "".join(c.choices[0].delta.content or "" for c in self.chat(stop=word, stream=True) if c.choices)
        self.assertEqual(streamed, text[: text.index(word)])

    def test_seed_reproduces_sampling(self):
        a = self.chat(temperature=1.0, seed=42, max_tokens=32).choices[0].message.content
        b = self.chat(temperature=1.0, seed=42, max_tokens=32).choices[0].message.content
        streamed = "".join(c.choices[0].delta.content or "" for c in self.chat(temperature=1.0, seed=42, max_tokens=32, stream=True) if c.choices)
        self.assertEqual(a, b)
        self.assertEqual(a, streamed)
        others = {self.chat(temperature=1.0, seed=s, max_tokens=32).choices[0].message.content for s in (1, 2, 3)}
        self.assertGreater(len(others | {a}), 1, "different seeds give different samples")

    def test_chat_logprobs(self):
        r = self.chat(logprobs=True, top_logprobs=3, max_tokens=6)
        content = r.choices[0].logprobs.content
        self.assertEqual(len(content), 6)
        for e in content:
            self.assertEqual(len(e.top_logprobs), 3)
            self.assertEqual((e.token, e.logprob), (e.top_logprobs[0].token, e.top_logprobs[0].logprob))
            self.assertLessEqual(e.logprob, 0.0)
        self.assertEqual("".join(e.token for e in content), r.choices[0].message.content)

    def test_completions(self):
        args = dict(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=8)
        full = self.client.completions.create(**args)
        self.assertEqual(full.usage.completion_tokens, 8)
        text = full.choices[0].text
        self.assertEqual("".join(c.choices[0].text for c in self.client.completions.create(stream=True, **args) if c.choices), text)
        lp = self.client.completions.create(logprobs=2, **args).choices[0].logprobs
        self.assertEqual("".join(lp.tokens), text)
        self.assertEqual(len(lp.token_logprobs), 8)
        self.assertEqual(lp.text_offset[0], 0)
        for tok, top, chosen in zip(lp.tokens, lp.top_logprobs, lp.token_logprobs):
            self.assertEqual(top[tok], chosen)

    def test_errors_are_sdk_exceptions(self):
        with self.assertRaises(openai.NotFoundError):
            self.chat(model="gpt-4")
        with self.assertRaises(openai.BadRequestError) as e:
            self.chat(temperature=3)
        self.assertEqual(e.exception.body["param"], "temperature")
        with self.assertRaises(openai.BadRequestError):
            self.chat(n=2)
        with self.assertRaises(openai.BadRequestError) as e:
            self.chat(messages=[{"role": "user", "content": "cache " * 3000}])
        self.assertIn("maximum context length is 2048 tokens", e.exception.message)

    def test_client_gone_mid_stream_frees_everything(self):
        stream = self.chat(max_tokens=200, stream=True)
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()
        self.assertEqual(self.chat(max_tokens=4).usage.completion_tokens, 4)
        for _ in range(100):
            m = self.server.metrics()
            if f'vllm:num_requests_running{{model_name="{MODEL}"}} 0' in m and f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} 0\n' in m:
                return
            time.sleep(0.05)
        self.fail("requests still running or KV blocks held:\n" + m)


class ApiKey(unittest.TestCase):
    def test_key_required(self):
        server = ReckonServer("-m", MODEL, "-c", "512", "--kv-memory", "1024", "--api-key", "sekrit")
        try:
            bad = openai.OpenAI(base_url=server.base + "/v1", api_key="wrong", max_retries=0)
            with self.assertRaises(openai.AuthenticationError):
                bad.chat.completions.create(model=MODEL, messages=HAIKU, max_tokens=2)
            good = openai.OpenAI(base_url=server.base + "/v1", api_key="sekrit", max_retries=0)
            self.assertEqual(good.chat.completions.create(model=MODEL, messages=HAIKU, max_tokens=2).usage.completion_tokens, 2)
        finally:
            server.stop()


if __name__ == "__main__":
    unittest.main()
