"""A resolver for the discovery tests (serving/discovery.py's Resolver) whose answers the test sets."""
from __future__ import annotations


class FakeDns:
    """name -> addresses, or an exception to raise; counts the lookups."""

    def __init__(self, **records):
        self.records = {k.replace("_", "-"): v for k, v in records.items()}
        self.lookups = 0

    async def __call__(self, name: str) -> list[str]:
        self.lookups += 1
        answer = self.records.get(name, [])
        if isinstance(answer, Exception):
            raise answer
        return list(answer)
