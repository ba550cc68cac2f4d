"""Property-based fuzzing: any preset file and any --set value gives either settings or one ConfigError
line (exit code 2 in the CLI), never another exception; any metrics stream leaves the reader standing."""

from __future__ import annotations

import string

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataclasses import fields

from shardconsole.settings import config as C
from shardconsole.runlog import protocol as P
from shardconsole.runlog.stream import MetricsReader

try:
    import tomli_w
except ImportError:  # pragma: no cover
    tomli_w = None

TABLE_NAMES = list(C.TABLES) + ["trian", "extra", "description"]
KEYS = sorted({f for cls in C.TABLES.values() for f in cls.__dataclass_fields__}) + ["bogus", "stpes"]
scalars = st.one_of(st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=True),
                    st.text(max_size=20), st.sampled_from(["full_shard", "fp16", "bf16", "cpu", "nvme", "24GiB",
                                                           "deepspeed", "1b", "none", "auto"]))
values = st.one_of(scalars, st.lists(scalars, max_size=3))
tables = st.dictionaries(st.sampled_from(KEYS), values, max_size=6)
documents = st.dictionaries(st.sampled_from(TABLE_NAMES), st.one_of(tables, scalars), max_size=5)


def _check(fn) -> None:
    try:
        fn()
    except C.ConfigError as e:
        text = str(e)
        assert text and "\n" not in text and "Traceback" not in text


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents)
def test_any_preset_document_is_settings_or_one_line_error(doc):
    _check(lambda: C.build(doc, "fuzz.toml"))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(list(C.TABLES) + ["trian"]), st.sampled_from(KEYS),
                          st.text(alphabet=string.printable, max_size=12)), max_size=4))
def test_any_set_values_are_settings_or_one_line_error(items):
    overrides = [f"{t}.{k}={v}" for t, k, v in items]
    _check(lambda: C.build({}, "fuzz.toml", overrides))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=3000))
def test_any_preset_bytes_on_disk(tmp_path, data):
    p = tmp_path / "fuzz.toml"
    p.write_bytes(data)
    _check(lambda: C.load(p))


_texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=60)
_finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
_messages = st.one_of(
    st.builds(P.Step, run=_texts, rank=st.integers(-1, 4096), step=st.integers(0, 10**12),
              steps=st.integers(0, 10**12), loss=st.one_of(st.none(), _finite), lr=_finite,
              tokens_per_s=_finite, grad_norm=st.one_of(st.none(), _finite)),
    st.builds(P.Event, run=_texts, rank=st.integers(-1, 64), name=_texts, detail=_texts,
              step=st.one_of(st.none(), st.integers(0, 10**9))),
    st.builds(P.Hello, run=_texts, rank=st.integers(0, 64), pid=st.integers(1, 2**22), host=_texts),
)
# Garbage that can never decode ("#" is no JSON), without a newline inside, up to twice MAX_LINE.
_garbage = st.binary(max_size=2 * P.MAX_LINE).map(lambda b: b"#" + b.replace(b"\n", b" "))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(_messages, _garbage), max_size=12), st.lists(st.integers(0, 20_000), max_size=6))
def test_fuzzed_stream_gives_back_every_message_and_counts_every_bad_line(tmp_path, items, cuts):
    """Valid lines and garbage lines, written in pieces cut anywhere (a writer caught mid-line): the reader
    returns exactly the messages, in order, and counts exactly the garbage lines."""
    data = b"".join((P.encode(i).encode() if isinstance(i, P.Message) else i) + b"\n" for i in items)
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"")
    reader = MetricsReader(path)
    got = []
    with open(path, "ab") as fh:
        last = 0
        for cut in sorted({min(c, len(data)) for c in cuts}) + [len(data)]:
            fh.write(data[last:cut])
            fh.flush()
            last = cut
            got += reader.poll()
    got += reader.poll()
    reader.close()
    assert got == [i for i in items if isinstance(i, P.Message)]
    assert reader.bad_lines == sum(1 for i in items if not isinstance(i, P.Message))


# Settings documents that mostly validate: every key of every table, from its own default's type.
_DEFAULTS = {t: {f.name: getattr(getattr(C.build({}), t), f.name) for f in fields(getattr(C.build({}), t))}
             for t in C.TABLES}


def _plausible(value):
    if isinstance(value, bool):
        return st.booleans()
    if isinstance(value, int):
        return st.integers(max(0, value // 2), max(1, value * 2))
    if isinstance(value, float):
        return st.floats(min_value=value / 2, max_value=max(value * 2, 1e-9), allow_nan=False) if value > 0 \
            else st.just(value)
    return st.just(value)


_plausible_documents = st.fixed_dictionaries({}, optional={
    t: st.fixed_dictionaries({}, optional={k: _plausible(v) for k, v in keys.items() if v is not None})
    for t, keys in _DEFAULTS.items()})


def test_saved_settings_of_fuzzed_valid_documents_round_trip(tmp_path):
    """Whatever validated also saves and loads back to the same settings; most documents must validate,
    or this would test nothing."""
    validated = []

    @settings(max_examples=150, deadline=None)
    @given(_plausible_documents)
    def inner(doc):
        try:
            cfg = C.build(doc, "fuzz.toml")
        except C.ConfigError:
            return
        validated.append(doc)
        out = tmp_path / "round.toml"
        C.save(cfg, out)
        assert C.load(out) == cfg
    inner()
    assert len(validated) >= 50, f"only {len(validated)} of 150 documents validated"
