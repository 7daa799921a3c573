"""Small arithmetic shared by the engine and the services above it."""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers (b > 0): how many blocks of b hold a tokens."""
    return -(-a // b)
