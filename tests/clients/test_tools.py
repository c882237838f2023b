"""Tool calls through the official `openai` SDK against `reckon serve`: Qwen2.5-Coder-0.5B (whose template
renders tools) and SmolLM2-135M (whose template does not: the fallback prompt). Forced calls (a named
tool, `required`) streamed and not, a call the model chooses itself, and a multi-turn round trip with the
tool's result. Run by scripts/test-clients."""

import json
import os
import unittest

import openai
from reckon_server import ReckonServer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city, e.g. Paris"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current time in a timezone.",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def streamed_call(chunks):
    """The tool calls, content and finish reason a stream adds up to (as a client accumulates them)."""
    calls, content, finish = {}, "", None
    for c in chunks:
        if not c.choices:
            continue
        d = c.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                call["id"] = tc.id
            if tc.function and tc.function.name:
                assert call["name"] is None, "a call's name is sent once"
                call["name"] = tc.function.name
            if tc.function and tc.function.arguments:
                call["arguments"] += tc.function.arguments
        finish = c.choices[0].finish_reason or finish
    return [calls[i] for i in sorted(calls)], content, finish


class ToolsQwen(unittest.TestCase):
    MODEL = "qwen2.5-coder-0.5b"

    @classmethod
    def setUpClass(cls):
        cls.server = ReckonServer("-m", cls.MODEL, "-c", "4096", "--kv-memory", "8192")
        cls.client = openai.OpenAI(base_url=cls.server.base + "/v1", api_key="unused", max_retries=0, timeout=300)

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    def chat(self, **kw):
        args = dict(model=self.MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=64)
        args.update(kw)
        return self.client.chat.completions.create(**args)

    def test_named_tool_is_called(self):
        r = self.chat(tool_choice={"type": "function", "function": {"name": "get_weather"}})
        msg = r.choices[0].message
        self.assertEqual(len(msg.tool_calls), 1, msg)
        call = msg.tool_calls[0]
        self.assertEqual(call.type, "function")
        self.assertEqual(call.function.name, "get_weather")
        self.assertIsInstance(json.loads(call.function.arguments), dict)
        self.assertTrue(call.id)
        self.assertEqual(r.choices[0].finish_reason, "tool_calls")
        # streamed: the same call, its name once and its arguments in pieces
        calls, content, finish = streamed_call(self.chat(stream=True, tool_choice={"type": "function", "function": {"name": "get_weather"}}))
        self.assertEqual([(c["name"], c["arguments"]) for c in calls], [(call.function.name, call.function.arguments)])
        self.assertEqual(content, msg.content or "")
        self.assertEqual(finish, "tool_calls")

    def test_required_and_auto(self):
        for choice in ["required", "auto"]:
            r = self.chat(tool_choice=choice)
            msg = r.choices[0].message
            self.assertTrue(msg.tool_calls, f"{choice}: {msg}")
            self.assertIn(msg.tool_calls[0].function.name, ["get_weather", "get_time"])
            self.assertEqual(json.loads(msg.tool_calls[0].function.arguments).get("city"), "Paris", choice)
            calls, _, finish = streamed_call(self.chat(stream=True, tool_choice=choice))
            self.assertEqual([(c["name"], c["arguments"]) for c in calls], [(t.function.name, t.function.arguments) for t in msg.tool_calls], choice)
            self.assertEqual(finish, "tool_calls")

    def test_none_answers_in_text(self):
        r = self.chat(tool_choice="none", max_tokens=16)
        self.assertIsNone(r.choices[0].message.tool_calls)
        self.assertTrue(r.choices[0].message.content)

    def test_round_trip_with_the_result(self):
        first = self.chat(tool_choice="required").choices[0].message
        call = first.tool_calls[0]
        history = ASK + [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"city": "Paris", "sky": "sunny", "celsius": 21})},
        ]
        r = self.chat(messages=history, max_tokens=48)
        text = r.choices[0].message.content
        self.assertFalse(r.choices[0].message.tool_calls)
        self.assertIn("21", text)
        self.assertGreater(r.usage.prompt_tokens_details.cached_tokens, 0, "the turn reuses the first request's prefix")

    def test_unknown_named_tool_is_a_400(self):
        with self.assertRaises(openai.BadRequestError) as e:
            self.chat(tool_choice={"type": "function", "function": {"name": "nope"}})
        self.assertEqual(e.exception.body["param"], "tool_choice")


class ToolsFallbackTemplate(ToolsQwen):
    """SmolLM2's template has no tools: the fallback prompt, the same parser."""

    MODEL = "smollm2-135m"

    # A 135M model does not choose tools or use results reliably; the protocol is what is tested, and
    # the grammar makes its forced arguments parse.
    def test_named_tool_is_called(self):
        for stream in [False, True]:
            forced = {"type": "function", "function": {"name": "get_weather"}}
            if stream:
                calls, _, finish = streamed_call(self.chat(stream=True, tool_choice=forced))
                names = [c["name"] for c in calls]
            else:
                r = self.chat(tool_choice=forced)
                names, finish = [c.function.name for c in r.choices[0].message.tool_calls], r.choices[0].finish_reason
            self.assertEqual(names, ["get_weather"])
            self.assertEqual(finish, "tool_calls")

    def test_required_and_auto(self):
        r = self.chat(tool_choice="required")
        calls = r.choices[0].message.tool_calls
        self.assertIn(calls[0].function.name, ["get_weather", "get_time"])
        self.assertIsInstance(json.loads(calls[0].function.arguments), dict)
        self.assertEqual(r.choices[0].finish_reason, "tool_calls")

    def test_round_trip_with_the_result(self):
        history = ASK + [
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        ]
        r = self.chat(messages=history, tool_choice="none", max_tokens=8)
        self.assertTrue(r.choices[0].message.content)


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "languages": {"type": "array", "items": {"type": "string", "enum": ["Rust", "Python", "C", "Go"]}, "maxItems": 4},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}


def check_person(tc, text):
    """The schema above, checked by hand (no validator dependency)."""
    v = json.loads(text)
    tc.assertEqual(set(v), {"name", "age", "languages"}, text)
    tc.assertIsInstance(v["name"], str)
    tc.assertLessEqual(len(v["name"]), 40)
    tc.assertIsInstance(v["age"], int)
    tc.assertTrue(0 <= v["age"] <= 130, text)
    tc.assertLessEqual(len(v["languages"]), 4)
    tc.assertTrue(all(l in ("Rust", "Python", "C", "Go") for l in v["languages"]), text)


class StructuredOutput(unittest.TestCase):
    """`response_format` json_schema on all three models, streamed and not, and json_object: the answer
    always parses and fits the schema (sampled at temperature 1, where nothing else would hold it)."""

    def test_all_models(self):
        for model in ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"]:
            server = ReckonServer("-m", model, "-c", "2048", "--kv-memory", "4096")
            try:
                client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=300)
                ask = [{"role": "user", "content": "Describe a programmer as JSON with name, age and languages."}]
                fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
                for seed in [1, 2]:
                    r = client.chat.completions.create(model=model, messages=ask, response_format=fmt, temperature=1.0, seed=seed, max_tokens=200)
                    self.assertEqual(r.choices[0].finish_reason, "stop", f"{model}: {r.choices[0].message.content}")
                    check_person(self, r.choices[0].message.content)
                chunks = client.chat.completions.create(model=model, messages=ask, response_format=fmt, temperature=1.0, seed=3, max_tokens=200, stream=True)
                check_person(self, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
                r = client.chat.completions.create(model=model, messages=ask, response_format={"type": "json_object"}, temperature=0, max_tokens=200)
                if r.choices[0].finish_reason == "stop":
                    self.assertIsInstance(json.loads(r.choices[0].message.content), dict)
                # Responses: text.format
                rr = client.responses.create(model=model, input="Describe a programmer.", text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}, max_output_tokens=200)
                check_person(self, rr.output_text)
            finally:
                server.stop()


if __name__ == "__main__":
    unittest.main()
