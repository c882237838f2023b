#!/usr/bin/env python3
"""A tiny stdio MCP server for the agent tests: one tool, `read_file`, over newline-delimited JSON-RPC
(MCP's stdio transport). Every request is logged to $MCP_LOG if set, so a test can see the agent called it."""

import json
import os
import sys

TOOLS = [{
    "name": "read_file",
    "description": "Read a UTF-8 text file in the working directory and return its contents.",
    "inputSchema": {"type": "object", "properties": {"path": {"type": "string", "description": "relative path"}}, "required": ["path"]},
}]


def log(msg):
    if os.environ.get("MCP_LOG"):
        with open(os.environ["MCP_LOG"], "a") as f:
            f.write(json.dumps(msg) + "\n")


def answer(req):
    method, params = req.get("method"), req.get("params") or {}
    if method == "initialize":
        return {"protocolVersion": params.get("protocolVersion", "2025-06-18"), "capabilities": {"tools": {}},
                "serverInfo": {"name": "files", "version": "0.1.0"}}
    if method == "tools/list":
        return {"tools": TOOLS}
    if method == "tools/call":
        path = (params.get("arguments") or {}).get("path", "")
        try:
            with open(os.path.join(os.getcwd(), path)) as f:
                return {"content": [{"type": "text", "text": f.read()}], "isError": False}
        except OSError as e:
            return {"content": [{"type": "text", "text": str(e)}], "isError": True}
    if method == "ping":
        return {}
    raise KeyError(method)


for line in sys.stdin:
    if not line.strip():
        continue
    req = json.loads(line)
    log(req)
    if "id" not in req:
        continue  # a notification
    try:
        out = {"jsonrpc": "2.0", "id": req["id"], "result": answer(req)}
    except KeyError as e:
        out = {"jsonrpc": "2.0", "id": req["id"], "error": {"code": -32601, "message": f"unknown method {e}"}}
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
