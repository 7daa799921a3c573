"""`tandem up --log-format json`: every line the stack writes (the launcher's, the router's, the workers', uvicorn's)
is one JSON object, and the lines about a request carry its id in every process."""
from __future__ import annotations

import json

import httpx
import pytest

from stack import Stack

FIELDS = {"ts", "level", "logger", "message", "role"}


@pytest.mark.slow
def test_every_line_is_json_and_a_requests_lines_carry_its_id():
    # (debug: the request timelines, tandem.hops, log every process's part of the request)
    stack = Stack("--model", "random:tiny", "--log-format", "json", "--log-level", "debug", prefill=1, decode=1)
    try:
        stack.wait_ready()
        r = httpx.post(f"{stack.http}/v1/completions", timeout=60, json={
            "model": "random:tiny", "prompt": "one two three four five six seven eight " * 4, "max_tokens": 4})
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
        bad = httpx.post(f"{stack.http}/v1/completions", timeout=60, json={"model": "random:tiny", "prompt": "x",
                                                                          "max_tokens": 0})
        assert bad.status_code == 400
    finally:
        code = stack.stop()
    assert code == 0
    rows = []
    for line in stack.lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise AssertionError(f"not a JSON line: {line!r}") from None
        assert isinstance(row, dict) and FIELDS <= set(row), line
        rows.append(row)
    assert {"up", "router", "prefill", "decode"} <= {row["role"] for row in rows}
    assert any(row["logger"].startswith("uvicorn") for row in rows)  # (the libraries' lines too)
    assert any(row["message"].startswith("tandem up: ready.") for row in rows)
    about = [row for row in rows if rid in row["message"]]
    assert about and all(row.get("request_id", "").startswith(rid) for row in about), about
    tagged = [row for row in rows if row.get("request_id", "").startswith(rid)]
    assert {"router", "prefill", "decode"} <= {row["role"] for row in tagged}, tagged
    # A line that does not name the request, from a task started for it, carries its id too (the contextvar).
    assert any(row["logger"] == "tandem.router.disaggregated" and row["message"].startswith("kv transfer")
               and row["request_id"] == rid for row in rows)
