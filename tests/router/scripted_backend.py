"""A scripted Backend (router/backend.py) for router tests that need no services."""
import asyncio

from engine.loader import load_tokenizer, resolve_model
from router.backend import Backend, GenerateDelta, RequestError


class Scripted(Backend):
    """Choice i of a prompt writes "a", "b", "c" (token ids 97, 98, 99 plus i); a prompt starting "fail" fails after
    its first token."""

    def __init__(self):
        super().__init__(load_tokenizer(resolve_model("random:tiny")), "tiny", 64, 512)
        self.served: list[tuple[str, int, int | None]] = []  # (sub-request id, index, seed)

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def ready(self) -> bool:
        return True

    async def serve_one(self, rid, index, prompt, params, queue) -> None:
        self.served.append((rid, index, params.seed))
        for k, text in enumerate("abc"):
            if k == 1 and self.tokenizer.decode(prompt).startswith("fail"):
                raise RequestError("unavailable", None, "decode x: gone")
            queue.put_nowait(GenerateDelta(index, [97 + k + index], text, None, "length" if k == 2 else None,
                                           len(prompt), k + 1))
            await asyncio.sleep(0)
