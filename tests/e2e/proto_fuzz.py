"""Hypothesis strategies that make hostile protobuf requests, for fuzzing gRPC services (tests/e2e/test_fuzz_grpc.py).

Three kinds of request bytes, mixed by `request_bytes`:
- `message(descriptor)`: a message built by walking its descriptor: every field may be set, to any value of its type
  with the extremes drawn often (uint64 max, int32 min, -1, NaN, long strings, huge repeated lists), nested
  messages down to a depth, one member of each oneof, enum numbers that name no value;
- `mutated_message(seeds)`: a valid request with one to three of its fields (at any depth) cleared or set as above, then
  perhaps its bytes mutated (`ByteMutation`: truncated, bits flipped, garbage inserted or appended, duplicated);
- `raw_bytes()`: random bytes and hand-made wire-format fields (unknown field numbers, wrong or invalid wire types,
  overlong varints, length prefixes past the end, invalid UTF-8 in length-delimited fields).

`draw(strategy, n)` collects n examples of a strategy through @given (deterministic: derandomized, no database), so
that the caller can send them all at once, concurrently, instead of one per test run.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

from google.protobuf.descriptor import Descriptor, FieldDescriptor as F
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

_INTS = {
    F.TYPE_INT32: (-2**31, 2**31 - 1), F.TYPE_SINT32: (-2**31, 2**31 - 1), F.TYPE_SFIXED32: (-2**31, 2**31 - 1),
    F.TYPE_INT64: (-2**63, 2**63 - 1), F.TYPE_SINT64: (-2**63, 2**63 - 1), F.TYPE_SFIXED64: (-2**63, 2**63 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1), F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_FIXED64: (0, 2**64 - 1),
}
# Lengths of the long strings, bytes and repeated fields: past every id/address bound (256), past a KV block, past
# the router's text-prompt limit (4 MiB), and (5 million 4-byte characters) past its message limit (16 MiB).
_LONG = [257, 5_000, 70_000]
_HUGE = [1_000_000, 5_000_000]
MAX_DEPTH = 3


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = sorted(v for v in {lo, lo + 1, hi - 1, hi, -1, 0, 1, 2, 2**31 - 1, 2**31, 2**32 - 1, 10**9, -10**9}
                   if lo <= v <= hi)
    return st.one_of(st.sampled_from(edges), st.integers(0, 100), st.integers(lo, hi))


def _text() -> st.SearchStrategy[str]:
    long = st.builds(lambda c, n: c * n, st.sampled_from(["x", "\u00e9", "\U0001F600", "\x00", "a\n"]),
                     st.sampled_from(_LONG + _HUGE))
    # (Lone surrogates are not valid UTF-8, so protobuf refuses to serialize them: raw_bytes sends invalid UTF-8.)
    return st.one_of(st.just(""), st.text(st.characters(exclude_categories=["Cs"]), max_size=40), long)


def _binary() -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=64), st.builds(lambda b, n: b * n, st.sampled_from([b"\x00", b"\xff"]),
                                                       st.sampled_from(_LONG + _HUGE)))


def scalar(field: F) -> st.SearchStrategy:
    """Values of one (non-repeated) scalar field, extremes drawn often."""
    t = field.type
    if t in _INTS:
        return _ints(*_INTS[t])
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        width = 64 if t == F.TYPE_DOUBLE else 32
        edges = [0.0, -0.0, 1.0, -1.0, math.nan, math.inf, -math.inf, 1e-6, 1e-30, 1e300 if width == 64 else 3e38]
        return st.one_of(st.sampled_from(edges), st.floats(width=width))
    if t == F.TYPE_STRING:
        return _text()
    if t == F.TYPE_BYTES:
        return _binary()
    if t == F.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), _ints(-2**31, 2**31 - 1))  # proto3 enums are open: any int32
    raise AssertionError(field.type)


def _values(field: F, depth: int) -> st.SearchStrategy:
    """What to assign to a field: a value, or for a repeated field a list (sometimes one value many times)."""
    one = message(field.message_type, depth + 1) if field.type == F.TYPE_MESSAGE else scalar(field)
    if not _is_repeated(field):
        return one
    many = st.lists(one, max_size=6)
    if field.type != F.TYPE_MESSAGE:
        many = st.one_of(many, st.builds(lambda v, n: [v] * n, one.filter(_small),
                                         st.sampled_from(_LONG + _HUGE[:1])))
    return many


def _small(v) -> bool:
    return not isinstance(v, (str, bytes)) or len(v) < 100


def _is_repeated(field: F) -> bool:
    return field.is_repeated


def _assign(msg: Message, field: F, value) -> None:
    if _is_repeated(field):
        target = getattr(msg, field.name)
        del target[:]
        if field.type == F.TYPE_MESSAGE:
            for v in value:
                target.add().CopyFrom(v)
        else:
            target.extend(value)
    elif field.type == F.TYPE_MESSAGE:
        getattr(msg, field.name).CopyFrom(value)
    else:
        setattr(msg, field.name, value)


def message(desc: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """Messages of type `desc` with any subset of their fields set (one member per oneof), nested to MAX_DEPTH."""
    if depth >= MAX_DEPTH:
        return st.builds(GetMessageClass(desc))
    plain = [f for f in desc.fields if f.containing_oneof is None or f.containing_oneof.name.startswith("_")]
    oneofs = [o for o in desc.oneofs if not o.name.startswith("_")]  # (`_x`: proto3 `optional`'s synthetic oneof)

    def build(values: dict, chosen: list) -> Message:
        msg = GetMessageClass(desc)()
        for f in plain:
            if values[f.name] is not None:
                _assign(msg, f, values[f.name])
        for pick in chosen:
            if pick is not None:
                _assign(msg, *pick)
        return msg

    fields = st.fixed_dictionaries({f.name: st.one_of(st.none(), st.deferred(lambda f=f: _values(f, depth)))
                                    for f in plain})
    picks = st.tuples(*[st.one_of(st.none(), st.sampled_from(list(o.fields)).flatmap(
        lambda f: st.tuples(st.just(f), st.deferred(lambda f=f: _values(f, depth))))) for o in oneofs])
    return st.builds(build, fields, picks.map(list))


# ---- mutations of valid requests -------------------------------------------------------------------------------
def _paths(desc: Descriptor, depth: int = 0) -> list[tuple[F, ...]]:
    """Every field of desc and of its message fields (to MAX_DEPTH), as paths from the top."""
    out = []
    for f in desc.fields:
        out.append((f,))
        if f.type == F.TYPE_MESSAGE and depth + 1 < MAX_DEPTH:
            out += [(f, *rest) for rest in _paths(f.message_type, depth + 1)]
    return out


@st.composite
def mutated_message(draw, seeds: list[Message]) -> Message:
    """A copy of one of `seeds` with one to three fields, at any depth, cleared or given a random value."""
    msg = copy.deepcopy(draw(st.sampled_from(seeds)))
    paths = _paths(msg.DESCRIPTOR)
    for _ in range(draw(st.integers(1, 3)) if paths else 0):
        path = draw(st.sampled_from(paths))
        target = msg
        for f in path[:-1]:
            target = getattr(target, f.name)
            if _is_repeated(f):
                target = target[0] if len(target) and draw(st.booleans()) else target.add()
        leaf = path[-1]
        if draw(st.integers(0, 4)) == 0:
            target.ClearField(leaf.name)
        else:
            _assign(target, leaf, draw(_values(leaf, len(path) - 1)))
    return msg


@dataclass(frozen=True)
class ByteMutation:
    """A mutation of serialized bytes; positions are fractions of the length, so it applies to any message."""
    op: str  # truncate | flip | insert | append | duplicate | none
    at: float = 0.0
    bits: int = 1
    garbage: bytes = b""

    def __call__(self, raw: bytes) -> bytes:
        i = min(len(raw), int(self.at * len(raw)))
        if self.op == "truncate":
            return raw[:i]
        if self.op == "flip":
            if not raw:
                return self.garbage
            out = bytearray(raw)
            out[min(i, len(raw) - 1)] ^= self.bits
            return bytes(out)
        if self.op == "insert":
            return raw[:i] + self.garbage + raw[i:]
        if self.op == "append":
            return raw + self.garbage
        if self.op == "duplicate":
            return raw + raw
        return raw


def byte_mutations() -> st.SearchStrategy[ByteMutation]:
    at = st.floats(0, 1)
    garbage = st.one_of(st.binary(min_size=1, max_size=32), wire_fields())
    return st.one_of(
        st.builds(ByteMutation, st.just("truncate"), at),
        st.builds(ByteMutation, st.just("flip"), at, st.integers(1, 255), garbage),
        st.builds(ByteMutation, st.just("insert"), at, st.just(1), garbage),
        st.builds(ByteMutation, st.just("append"), at, st.just(1), garbage),
        st.just(ByteMutation("duplicate")),
    )


# ---- raw bytes ---------------------------------------------------------------------------------------------------
def varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_INVALID_UTF8 = [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf", b"ok\x80"]


@st.composite
def wire_fields(draw) -> bytes:
    """One to four hand-made wire-format fields: any field number, any wire type (6 and 7 are invalid), payloads that
    fit, lie (a length past the end), or break UTF-8."""
    out = b""
    for _ in range(draw(st.integers(1, 4))):
        number = draw(st.one_of(st.integers(1, 12), st.sampled_from([0, 19000, 2**29 - 1, 2**29])))
        wire = draw(st.integers(0, 7))
        out += varint(number << 3 | wire)
        if wire == 0:
            out += draw(st.one_of(st.builds(varint, st.integers(0, 2**64 - 1)),
                                  st.just(b"\xff" * 10 + b"\x01"), st.just(b"\x80")))  # overlong, cut short
        elif wire == 1:
            out += draw(st.binary(min_size=0, max_size=8))
        elif wire == 2:
            payload = draw(st.one_of(st.sampled_from(_INVALID_UTF8), st.binary(max_size=24), wire_fields()))
            size = draw(st.one_of(st.just(len(payload)), st.integers(0, 2**32)))
            out += varint(size) + payload
        elif wire == 5:
            out += draw(st.binary(min_size=0, max_size=4))
    return out


def raw_bytes() -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=256), wire_fields())


def request_bytes(desc: Descriptor, seeds: list[Message]) -> st.SearchStrategy[bytes]:
    """Serialized requests of type desc: random messages, mutated seeds, either of them or a seed with its bytes
    mutated, and raw bytes."""
    def serialized(msg: Message, mutation: ByteMutation) -> bytes:
        return mutation(msg.SerializeToString())

    plain = st.just(ByteMutation("none"))
    return st.one_of(  # (one_of picks a branch uniformly: two in three requests are messages that parse)
        st.builds(serialized, message(desc), plain),
        st.builds(serialized, mutated_message(seeds), plain),
        st.builds(serialized, message(desc), plain),
        st.builds(serialized, mutated_message(seeds), plain),
        st.builds(serialized, st.one_of(message(desc), mutated_message(seeds), st.sampled_from(seeds)),
                  byte_mutations()),
        raw_bytes(),
    )


def draw(strategy: st.SearchStrategy, n: int) -> list:
    """n examples of strategy, the same ones every run (derandomized, no example database)."""
    out: list = []

    @settings(max_examples=n, database=None, derandomize=True, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(example) -> None:
        out.append(example)

    collect()
    return out
