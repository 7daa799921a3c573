"""serving/logs.py: the json and text formats, and the request id that follows a request through its tasks."""
from __future__ import annotations

import asyncio
import io
import json
import logging
import sys

import pytest

from serving import logs


@pytest.fixture
def captured():
    """configure() on the root logger, its handler writing to a buffer; the root logger restored afterwards."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)

    def setup(fmt: str) -> io.StringIO:
        logs.configure("decode", "DEBUG", fmt)
        buf = io.StringIO()
        root.handlers[0].setStream(buf)
        return buf
    yield setup
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    logging.captureWarnings(False)  # (json routes the libraries through the root: undone for the other tests)
    sys.excepthook = sys.__excepthook__
    from transformers.utils import logging as hf_logging
    hf_logging.enable_default_handler()
    hf_logging.disable_propagation()


def test_json_lines_carry_the_request_id_role_and_exception(captured):
    buf = captured("json")
    log = logging.getLogger("tandem.decode")
    log.info("no request here")
    with logs.request_scope("cmpl-1"):
        log.warning("kv transfer for %s missed its deadline", "cmpl-1")
        try:
            raise ValueError("bad \"quote\"\nand a newline")
        except ValueError:
            log.exception("failed")
    log.debug("engine thread line", extra={"request_id": "cmpl-2"})
    lines = buf.getvalue().splitlines()
    assert len(lines) == 4
    rows = [json.loads(line) for line in lines]
    assert [r.get("request_id") for r in rows] == [None, "cmpl-1", "cmpl-1", "cmpl-2"]
    assert {r["role"] for r in rows} == {"decode"} and rows[0]["logger"] == "tandem.decode"
    assert rows[1]["level"] == "WARNING" and rows[1]["message"] == "kv transfer for cmpl-1 missed its deadline"
    assert rows[2]["exc"].startswith("Traceback") and 'ValueError: bad "quote"' in rows[2]["exc"]
    assert rows[0]["ts"].endswith("+00:00")


def test_text_lines_show_the_request_id_in_front_of_the_message(captured):
    buf = captured("text")
    with logs.request_scope("cmpl-9"):
        logging.getLogger("tandem.router").info("moving it")
    logging.getLogger("tandem.router").info("idle")
    first, second = buf.getvalue().splitlines()
    assert first.endswith("INFO tandem.router: [cmpl-9] moving it")
    assert second.endswith("INFO tandem.router: idle")


def test_tasks_started_for_a_request_inherit_its_id_and_others_do_not():
    seen = {}

    async def main():
        async def child(name):
            seen[name] = logs.current_request_id()

        async def serve_one():  # a gRPC call's task: tag_request for the rest of it
            logs.tag_request("cmpl-7")
            await asyncio.create_task(child("started by the request"))

        await asyncio.create_task(serve_one())
        await asyncio.create_task(child("another task"))

        async def stream():  # an async generator whose end runs in another context: no error
            with logs.request_scope("cmpl-8"):
                yield 1
                yield 2
        it = stream()
        await asyncio.create_task(it.__anext__())
        await it.aclose()
    asyncio.run(main())
    assert seen == {"started by the request": "cmpl-7", "another task": None}


def test_an_unknown_format_is_refused():
    with pytest.raises(ValueError, match="log_format='xml'"):
        logs.configure("router", "INFO", "xml")


def test_json_line_is_the_format_of_tandem_up():
    row = json.loads(logs.json_line("up", "tandem up: ready.", "INFO", "tandem.up"))
    assert (row["role"], row["logger"], row["message"], row["level"]) == ("up", "tandem.up", "tandem up: ready.",
                                                                          "INFO")
