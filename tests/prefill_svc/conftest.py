import pytest

from engine import EngineArgs, LLMEngine
from svc_pair import ARGS


@pytest.fixture(scope="module")
def engines():
    """A prefill engine and a decode engine (random:tiny on the CPU), shared by a module's tests."""
    return LLMEngine.from_engine_args(EngineArgs(**ARGS)), LLMEngine.from_engine_args(EngineArgs(**ARGS))
