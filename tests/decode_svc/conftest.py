import pytest

from decode_one import ARGS
from engine import EngineArgs, LLMEngine


@pytest.fixture(scope="module")
def engine():
    """A decode engine (random:tiny on the CPU, 64 blocks of 16 tokens), shared by a module's tests."""
    return LLMEngine.from_engine_args(EngineArgs(**ARGS))
