"""The official `anthropic` Python SDK against `reckon serve` with Qwen2.5-Coder-0.5B: messages streamed and
not (the exact event sequence), stop sequences, a forced `tool_use` whose input is an object, a
`tool_result` turn, `count_tokens` equal to the prompt the server reports, `cache_read_input_tokens` on
a second call, `x-api-key` auth, model aliases, and errors in Anthropic's shape. Run by
scripts/test-clients."""

import json
import unittest
import urllib.request

import anthropic
from reckon_server import ReckonServer

MODEL = "qwen2.5-coder-0.5b"
ALIAS = "claude-haiku-4-5"
KEY = "test-key"
HELLO = [{"role": "user", "content": "Write one sentence about caches."}]
WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


class AnthropicSdk(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = ReckonServer("-m", MODEL, "-c", "4096", "--kv-memory", "8192", "--api-key", KEY, "--alias", f"{ALIAS}={MODEL}")
        cls.client = anthropic.Anthropic(base_url=cls.server.base, api_key=KEY, max_retries=0, timeout=300)

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    # This SDK (2.16) no longer has sampling parameters; the wire fields still exist: sent as extra_body.
    def create(self, temperature=0, **kw):
        args = dict(model=MODEL, messages=HELLO, max_tokens=24, extra_body={"temperature": temperature})
        args.update(kw)
        return self.client.messages.create(**args)

    def test_message_streamed_equals_not_streamed(self):
        m = self.create()
        self.assertEqual((m.type, m.role, m.model), ("message", "assistant", MODEL))
        self.assertTrue(m.id.startswith("msg_"))
        self.assertEqual([b.type for b in m.content], ["text"])
        self.assertTrue(m.content[0].text)
        self.assertIn(m.stop_reason, ["end_turn", "max_tokens"])
        self.assertLessEqual(m.usage.output_tokens, 24)
        names, text = [], ""
        with self.client.messages.stream(model=MODEL, messages=HELLO, max_tokens=24, extra_body={"temperature": 0}) as s:
            for ev in s:
                names.append(ev.type)
                if ev.type == "content_block_delta":
                    text += ev.delta.text
            final = s.get_final_message()
        # the SDK adds its own "text" events beside the wire's; the wire's, in order:
        wire = [n for n in names if n in ("message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop")]
        self.assertEqual(wire[:2], ["message_start", "content_block_start"])
        self.assertEqual(wire[-3:], ["content_block_stop", "message_delta", "message_stop"])
        self.assertEqual(set(wire[2:-3]), {"content_block_delta"})
        self.assertEqual(text, m.content[0].text)
        self.assertEqual(final.stop_reason, m.stop_reason)
        self.assertEqual(final.usage.output_tokens, m.usage.output_tokens)

    def test_raw_event_sequence_has_ping(self):
        req = urllib.request.Request(
            self.server.base + "/v1/messages?beta=true",
            data=json.dumps({"model": MODEL, "messages": HELLO, "max_tokens": 4, "stream": True}).encode(),
            headers={"content-type": "application/json", "x-api-key": KEY, "anthropic-version": "2023-06-01", "anthropic-beta": "x"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            body = r.read().decode()
        events = [l[len("event: "):] for l in body.splitlines() if l.startswith("event: ")]
        self.assertEqual(events[:3], ["message_start", "ping", "content_block_start"])
        self.assertEqual(events[-3:], ["content_block_stop", "message_delta", "message_stop"])

    def test_stop_sequence(self):
        text = self.create().content[0].text
        word = text.split()[1]
        m = self.create(stop_sequences=[word])
        self.assertEqual(m.stop_reason, "stop_sequence")
        self.assertEqual(m.stop_sequence, word)
        self.assertEqual(m.content[0].text, text[: text.index(word)])

    def test_forced_tool_use_and_result(self):
        ask = [{"role": "user", "content": "What is the weather in Paris?"}]
        m = self.create(messages=ask, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}, max_tokens=48)
        self.assertEqual(m.stop_reason, "tool_use")
        uses = [b for b in m.content if b.type == "tool_use"]
        self.assertEqual(len(uses), 1)
        self.assertEqual(uses[0].name, "get_weather")
        self.assertIsInstance(uses[0].input, dict)
        self.assertTrue(uses[0].id.startswith("toolu_"))
        # streamed: the same call, its input as input_json_delta pieces
        with self.client.messages.stream(model=MODEL, messages=ask, max_tokens=48, extra_body={"temperature": 0}, tools=[WEATHER],
                                         tool_choice={"type": "tool", "name": "get_weather"}) as s:
            final = s.get_final_message()
        self.assertEqual([(b.name, b.input) for b in final.content if b.type == "tool_use"], [(uses[0].name, uses[0].input)])
        self.assertEqual(final.stop_reason, "tool_use")
        # the result goes back: it reaches the prompt (count_tokens grows with it), the turn reuses the
        # first request's prefix, and the answer is a well-formed message (what a 0.5B model makes of
        # the result is not the protocol's business)
        def history(result):
            return ask + [
                {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": result}]},
            ]
        short = self.client.messages.count_tokens(model=MODEL, messages=history("sunny"), tools=[WEATHER]).input_tokens
        longer = self.client.messages.count_tokens(model=MODEL, messages=history("sunny, 21 degrees, light wind"), tools=[WEATHER]).input_tokens
        self.assertGreater(longer - short, 4)
        r = self.create(messages=history("sunny"), tools=[WEATHER], max_tokens=48)
        self.assertEqual(r.usage.input_tokens + r.usage.cache_read_input_tokens, short)
        self.assertGreater(r.usage.cache_read_input_tokens, 0)
        self.assertIn(r.stop_reason, ["end_turn", "tool_use", "max_tokens"])
        self.assertTrue(r.content)
        for b in r.content:
            self.assertIn(b.type, ["text", "tool_use"])
            if b.type == "tool_use":
                self.assertIsInstance(b.input, dict)

    def test_count_tokens_and_cache_reads(self):
        system = "You are a careful assistant. " * 20
        counted = self.client.messages.count_tokens(model=MODEL, system=system, messages=HELLO).input_tokens
        first = self.create(system=system)
        second = self.create(system=system)
        for m in (first, second):
            self.assertEqual(m.usage.input_tokens + m.usage.cache_read_input_tokens, counted)
        self.assertGreater(second.usage.cache_read_input_tokens, 0)

    def test_structured_output(self):
        schema = {"type": "object", "properties": {"language": {"type": "string", "enum": ["Rust", "Python", "C"]}, "stars": {"type": "integer", "minimum": 1, "maximum": 5}},
                  "required": ["language", "stars"], "additionalProperties": False}
        m = self.create(temperature=1.0, max_tokens=64, messages=[{"role": "user", "content": "Rate a programming language."}],
                        output_config={"format": {"type": "json_schema", "schema": schema}})
        v = json.loads(m.content[0].text)
        self.assertIn(v["language"], ["Rust", "Python", "C"])
        self.assertTrue(1 <= v["stars"] <= 5)
        self.assertEqual(m.stop_reason, "end_turn")

    def test_alias_and_system_message_inside_messages(self):
        msgs = [{"role": "system", "content": "Answer in French."}] + HELLO
        m = self.create(model=ALIAS, messages=msgs, max_tokens=32000)  # clamped, not refused
        self.assertEqual(m.model, ALIAS)
        self.assertTrue(m.content[0].text)

    def test_errors_in_anthropic_shape(self):
        bad = anthropic.Anthropic(base_url=self.server.base, api_key="wrong", max_retries=0)
        with self.assertRaises(anthropic.AuthenticationError) as e:
            bad.messages.create(model=MODEL, messages=HELLO, max_tokens=4)
        self.assertEqual(e.exception.body["error"]["type"], "authentication_error")
        with self.assertRaises(anthropic.NotFoundError) as e:
            self.create(model="no-such-model")
        self.assertEqual(e.exception.body["type"], "error")
        with self.assertRaises(anthropic.BadRequestError) as e:
            self.create(temperature=1.5)
        self.assertEqual(e.exception.body["error"]["type"], "invalid_request_error")


if __name__ == "__main__":
    unittest.main()
