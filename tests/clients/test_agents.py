"""The real agents against `reckon serve` on loopback with Qwen2.5-Coder-0.5B (a 32k context, as their
~9-12k-token prompts need): Codex CLI (`codex exec`, Responses API, with the project's stdio MCP server
tests/agents/mcp_files.py) and Claude Code (`claude -p`, Messages API). Each must exit 0 with a final
answer and no protocol error; the server's log must show the MCP namespace's tool in the prompt; the
second of two runs must read the shared prefix from the cache. The 0.5B model's answers are weak: the
protocol is what is tested. Installed by scripts/setup-clients; run by scripts/test-clients.

Both agents sample (Claude Code sends temperature 1, and no seed), so how long a run takes is up to what the
tiny model happens to draw: one CI run on record had Claude Code's model write 21,000 tokens in 800 s until
its next prompt overflowed the 32k context. So every run is bounded: Claude Code's replies are capped
(CLAUDE_CODE_MAX_OUTPUT_TOKENS), each attempt has ATTEMPT_TIMEOUT seconds, and a run whose model rambled
into the cap (an answer-side failure, never a protocol one) is tried again, at most ATTEMPTS times. The
attempts and seconds each run took are printed."""

import json
import os
import re
import subprocess
import tempfile
import time
import unittest

from reckon_server import REPO, ReckonServer

MODEL = "qwen2.5-coder-0.5b"
AGENTS = os.environ.get("RECKON_AGENTS_DIR", os.path.join(os.path.expanduser("~"), ".cache", "reckon", "agents"))
CODEX = os.path.join(AGENTS, "node_modules", ".bin", "codex")
CLAUDE = os.path.join(AGENTS, "node_modules", ".bin", "claude")
MCP_SERVER = os.path.join(REPO, "tests", "agents", "mcp_files.py")
# One attempt: the first request's ~11,600 prompt tokens take ~100 s to prefill on a 2-core AVX2 host, the
# rest come from the prefix cache; 512 output tokens a reply at ~20 tokens/s is ~25 s a turn.
ATTEMPT_TIMEOUT = 420
ATTEMPTS = 3
MAX_OUTPUT_TOKENS = 512


def missing():
    if not (os.path.exists(CODEX) and os.path.exists(CLAUDE)):
        return f"the agents in {AGENTS} (scripts/setup-clients, needs npm)"
    return None


@unittest.skipIf(missing() and not os.environ.get("RECKON_REQUIRE_MODELS"), f"missing {missing()}")
class Agents(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if missing():
            raise RuntimeError(f"missing {missing()}")
        cls.server = ReckonServer("-m", MODEL, "-c", "32768", "--kv-memory", "65536", "--alias", f"claude-haiku-4-5={MODEL}", timeout=300)
        cls.work = tempfile.mkdtemp(prefix="reckon-agents-")
        with open(os.path.join(cls.work, "main.rs"), "w") as f:
            f.write('fn main() {\n    println!("hello from reckon");\n}\n')

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    def run_agent(self, cmd, env, rambled=lambda events: False):
        """Runs an agent to its end, again (at most ATTEMPTS in all) where `rambled(events)` says the model's
        sampled reply ran into the output cap; returns its JSON events, stderr, attempts and seconds."""
        full_env = dict(os.environ, **env)
        started = time.monotonic()
        for attempt in range(1, ATTEMPTS + 1):
            try:
                done = subprocess.run(cmd, cwd=self.work, env=full_env, capture_output=True, text=True, timeout=ATTEMPT_TIMEOUT, stdin=subprocess.DEVNULL)
            except subprocess.TimeoutExpired as e:
                self.fail(f"{cmd[0]} ran past {ATTEMPT_TIMEOUT} s (attempt {attempt})\nstdout: {str(e.stdout)[-3000:]}")
            events = [json.loads(l) for l in done.stdout.splitlines() if l.startswith("{")]
            if attempt < ATTEMPTS and rambled(events):
                print(f"\n{os.path.basename(cmd[0])}: attempt {attempt} ran into the {MAX_OUTPUT_TOKENS}-token output cap; again")
                continue
            self.assertEqual(done.returncode, 0, f"{cmd[0]} exited {done.returncode}\nstdout: {done.stdout[-3000:]}\nstderr: {done.stderr[-3000:]}")
            return events, done.stderr, attempt, time.monotonic() - started

    def server_log(self):
        return re.sub(r"\x1b\[[0-9;]*m", "", "".join(self.server.log))

    def test_codex_exec(self):
        home = tempfile.mkdtemp(prefix="codex-home-", dir=os.path.expanduser("~"))
        mcp_log = os.path.join(home, "mcp.log")
        with open(os.path.join(home, "config.toml"), "w") as f:
            f.write(f'''model = "{MODEL}"
model_provider = "reckon"
check_for_update_on_startup = false

[model_providers.reckon]
name = "reckon"
base_url = "{self.server.base}/v1"
wire_api = "responses"

[features]
plugins = false

[analytics]
enabled = false

[feedback]
enabled = false

[mcp_servers.files]
command = "python3"
args = ["{MCP_SERVER}"]
env = {{ MCP_LOG = "{mcp_log}" }}
''')
        usages, mcp_calls, budgets = [], [], []
        # The same prompt twice (the second run reads the first one's prefix from the cache). Whether a
        # 0.5B model sampled at Codex's temperature calls the MCP tool varies; any call it makes must
        # reach Codex as the MCP server's tool (the namespace round trip). A prompt naming the tool was
        # tried and dropped: the model can loop on the call and end its turn without an answer.
        prompts = ["What does main.rs print? Use the read_file tool."] * 2
        for prompt in prompts:
            events, stderr, attempts, seconds = self.run_agent([CODEX, "exec", "--skip-git-repo-check", "--json", prompt], {"CODEX_HOME": home})
            budgets.append((attempts, round(seconds)))
            kinds = [e["type"] for e in events]
            self.assertIn("turn.completed", kinds, events)
            self.assertNotIn("turn.failed", kinds, events)
            # the one error item Codex writes is its note that it has no metadata for this model name
            errors = [e["item"]["message"] for e in events if e["type"] == "item.completed" and e["item"]["type"] == "error"]
            self.assertTrue(all("Model metadata" in m for m in errors), errors)
            answers = [e["item"]["text"] for e in events if e["type"] == "item.completed" and e["item"]["type"] == "agent_message"]
            self.assertTrue(answers and answers[-1].strip(), events)
            usages.append([e["usage"] for e in events if e["type"] == "turn.completed"][-1])
            mcp_calls += [e["item"] for e in events if e["type"] == "item.completed" and e["item"]["type"] == "mcp_tool_call"]
        for call in mcp_calls:
            self.assertEqual((call["server"], call["tool"]), ("files", "read_file"), call)
            self.assertIsInstance(call["arguments"], dict)
        # the MCP server's tools reached the prompt as a namespace, under the name the model sees
        self.assertIn("mcp__files__read_file", self.server_log())
        with open(mcp_log) as f:
            self.assertIn("tools/list", f.read())
        self.assertGreater(usages[1]["cached_input_tokens"], 0, usages)
        print(f"\ncodex usage per run: {usages}; MCP calls: {len(mcp_calls)}; (attempts, seconds) per run: {budgets}")

    def test_claude_code_print(self):
        env = {
            "ANTHROPIC_BASE_URL": self.server.base,
            "ANTHROPIC_API_KEY": "unused",
            "ANTHROPIC_MODEL": MODEL,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
            "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1",
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(MAX_OUTPUT_TOKENS),
            "HOME": tempfile.mkdtemp(prefix="claude-home-"),
        }
        usages, budgets = [], []
        # the cap is reached when a reply stops for max_tokens (Claude Code then ends the turn with an
        # "exceeded the N output token maximum" error) or the prompt outgrew the context
        def rambled(events):
            results = [e for e in events if e["type"] == "result"]
            text = json.dumps(results)
            return "output token maximum" in text or "Prompt is too long" in text or any(
                e.get("message", {}).get("stop_reason") == "max_tokens" for e in events if e["type"] == "assistant")
        for _ in range(2):
            events, stderr, attempts, seconds = self.run_agent([CLAUDE, "-p", "What does main.rs print? Answer briefly.", "--output-format", "stream-json", "--verbose"], env, rambled)
            budgets.append((attempts, round(seconds)))
            result = [e for e in events if e["type"] == "result"]
            self.assertEqual(len(result), 1, events)
            r = result[0]
            self.assertEqual((r["subtype"], r["is_error"], r.get("api_error_status")), ("success", False, None), r)
            self.assertTrue(str(r["result"]).strip())
            usages.append(r["usage"])
        self.assertIn('api="messages"', self.server_log())
        # the second session reuses the first's system prompt and tools from the cache (the volatile
        # billing line is dropped, so the prefix is the same)
        self.assertGreater(usages[1]["cache_read_input_tokens"], 0, usages)
        print(f"\nclaude usage per run: {[(u['input_tokens'], u['cache_read_input_tokens'], u['output_tokens']) for u in usages]}; (attempts, seconds) per run: {budgets}")


if __name__ == "__main__":
    unittest.main()
