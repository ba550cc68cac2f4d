"""Property-based fuzzing: any preset file and any --set value gives either settings or one ConfigError
line (exit code 2 in the CLI), never another exception; any metrics stream leaves the reader standing."""

from __future__ import annotations

import string

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardconsole import config as C
from shardconsole.stream import MetricsReader

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


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode),
                          st.just(b'{"v":1,"kind":"step","step":3}'), st.just(b'{"v":2,"kind":"step"}'),
                          st.just(b"x" * 9000), st.just(b'{"v":1,"kind":"memory","rank":"zero"}')),
                max_size=12))
def test_fuzzed_stream_never_breaks_the_reader(tmp_path, chunks):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"")
    reader = MetricsReader(path)
    with open(path, "ab") as fh:
        for c in chunks:
            fh.write(c)
            fh.flush()
            msgs = reader.poll()
            assert all(m.kind for m in msgs)
    reader.poll()
    assert reader.bad_lines >= 0


def test_saved_settings_of_fuzzed_valid_documents_round_trip(tmp_path):
    """Whatever validated also saves and loads back to the same settings."""
    @settings(max_examples=150, deadline=None)
    @given(documents)
    def inner(doc):
        try:
            cfg = C.build(doc, "fuzz.toml")
        except C.ConfigError:
            return
        out = tmp_path / "round.toml"
        C.save(cfg, out)
        assert C.load(out) == cfg
    inner()
