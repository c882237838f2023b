"""The official `openai` SDK's Responses API against `reckon serve` with Qwen2.5-Coder-0.5B: a response
streamed and not (the event sequence Codex reads), a forced call into a namespace tool group (Codex's MCP
shape) coming back as a `function_call` with `namespace` and `name` apart, the call's output sent back,
`previous_response_id`, `store: false`, `GET`/`DELETE`, and the tool types Codex sends that do not exist
here (accepted, ignored). Run by scripts/test-clients."""

import json
import unittest

import openai
from reckon_server import ReckonServer

MODEL = "qwen2.5-coder-0.5b"
FILES = {
    "type": "namespace",
    "name": "mcp__files",
    "description": "Tools of the MCP server 'files'.",
    "tools": [
        {
            "type": "function",
            "name": "read_file",
            "description": "Read a text file and return its contents.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        }
    ],
}
SHELL = {
    "type": "function",
    "name": "shell",
    "description": "Run a shell command.",
    "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}}, "required": ["command"]},
}
# what Codex sends besides its function tools
CODEX_EXTRAS = [{"type": "custom", "name": "apply_patch", "description": "patch", "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}, {"type": "web_search"}]


class Responses(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = ReckonServer("-m", MODEL, "-c", "4096", "--kv-memory", "8192")
        cls.client = openai.OpenAI(base_url=cls.server.base + "/v1", api_key="unused", max_retries=0, timeout=300)

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    def create(self, **kw):
        args = dict(model=MODEL, input="Write one sentence about caches.", max_output_tokens=24, temperature=0)
        args.update(kw)
        return self.client.responses.create(**args)

    def test_text_streamed_equals_not_streamed(self):
        r = self.create(instructions="You are terse.")
        self.assertEqual((r.object, r.model), ("response", MODEL))
        self.assertIn(r.status, ["completed", "incomplete"])
        self.assertEqual([o.type for o in r.output], ["message"])
        text = r.output_text
        self.assertTrue(text)
        self.assertEqual(r.usage.total_tokens, r.usage.input_tokens + r.usage.output_tokens)
        events = list(self.create(instructions="You are terse.", stream=True))
        types = [e.type for e in events]
        self.assertEqual(types[:4], ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"])
        self.assertEqual(types[-4:], ["response.output_text.done", "response.content_part.done", "response.output_item.done", f"response.{r.status}"])
        self.assertEqual([e.sequence_number for e in events], list(range(len(events))))
        self.assertEqual("".join(e.delta for e in events if e.type == "response.output_text.delta"), text)
        done = [e for e in events if e.type == "response.output_item.done"][0]
        self.assertEqual(done.item.content[0].text, text)
        self.assertEqual(events[-1].response.output_text, text)

    def test_namespace_call_round_trips(self):
        tools = [SHELL, FILES] + CODEX_EXTRAS
        ask = "Show me the contents of src/main.rs."
        forced = {"type": "function", "name": "read_file", "namespace": "mcp__files"}
        r = self.create(input=ask, tools=tools, tool_choice=forced, max_output_tokens=48, store=False)
        calls = [o for o in r.output if o.type == "function_call"]
        self.assertEqual(len(calls), 1, r.output)
        call = calls[0].model_dump()
        self.assertEqual((call["namespace"], call["name"]), ("mcp__files", "read_file"))
        self.assertIsInstance(json.loads(call["arguments"]), dict)  # the grammar: always parses
        self.assertTrue(call["call_id"])
        # streamed: output_item.done carries the whole call, then response.completed
        events = list(self.create(input=ask, tools=tools, tool_choice=forced, max_output_tokens=48, store=False, stream=True))
        done = [e.item.model_dump() for e in events if e.type == "response.output_item.done"]
        self.assertEqual([(d["namespace"], d["name"], d["arguments"]) for d in done], [(call["namespace"], call["name"], call["arguments"])])
        self.assertEqual(events[-1].type, "response.completed")
        self.assertEqual(
            "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta"), call["arguments"]
        )
        # the call's output goes back as Codex sends it: the whole history, store false
        history = [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ask}]},
            {"type": "function_call", "call_id": call["call_id"], "namespace": "mcp__files", "name": "read_file", "arguments": call["arguments"]},
            {"type": "function_call_output", "call_id": call["call_id"], "output": "fn main() { println!(\"hi\"); }"},
        ]
        r2 = self.create(input=history, tools=tools, max_output_tokens=48, store=False)
        self.assertIn(r2.status, ["completed", "incomplete"])
        self.assertGreater(r2.usage.input_tokens_details.cached_tokens, 0, "the second turn reuses the first's prefix")

    def test_previous_response_id_get_and_delete(self):
        first = self.create(input="My name is Ada. Say hello.", max_output_tokens=16)
        self.assertEqual(self.client.responses.retrieve(first.id).output_text, first.output_text)
        second = self.create(input="What is my name?", previous_response_id=first.id, max_output_tokens=16)
        self.assertEqual(second.previous_response_id, first.id)
        self.assertGreater(second.usage.input_tokens, first.usage.input_tokens, "the earlier turn is in the prompt")
        self.assertGreater(second.usage.input_tokens_details.cached_tokens, 0)
        self.client.responses.delete(first.id)
        with self.assertRaises(openai.NotFoundError):
            self.client.responses.retrieve(first.id)
        with self.assertRaises(openai.NotFoundError):
            self.create(input="again", previous_response_id=first.id)
        unstored = self.create(input="Hi", store=False, max_output_tokens=4)
        with self.assertRaises(openai.NotFoundError):
            self.client.responses.retrieve(unstored.id)


if __name__ == "__main__":
    unittest.main()
