"""Where the data comes from, checked before any rank starts: the same rules the ranks apply as they read.

Standard library only (and `tokenizers`, a small Rust library, for a model folder's tokenizer.json): the
front ends call check_data(cfg) before a launch, so it must not import torch, datasets or transformers.
Every failure is one ConfigError line naming the setting ([data] path, [data] eval_path, [model] name).
"""

from __future__ import annotations

import codecs
import json
import re
from pathlib import Path

from shardconsole.settings import config as C
from shardconsole.settings import data_mix
from shardconsole.settings.data import kto_records, pair_records, prompt_records
from shardconsole.settings.data.data_scan import Scan, ScanError, scan
from shardconsole.settings.paths import PathError, kind_of, shown

# Files read through `datasets` (with the loader named here); a folder must be a save_to_disk folder.
LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
TEXT_SUFFIXES = (".jsonl", ".json", ".csv", ".txt")
# owner/name, as on the Hugging Face Hub ("tatsu-lab/alpaca"), or a bare dataset name without a suffix.
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def uses_records(cfg: C.RunConfig) -> bool:
    """True when the ranks read records from data.path (not synthetic tokens, not a token file)."""
    return cfg.data.source in ("auto", "text") and bool(cfg.data.path)


def locate(value: str, key: str, source: str = "preset") -> tuple[Path, str]:
    """(path, kind) of a data file or folder; kind is a LOADERS value or "saved" (save_to_disk folder)."""
    where = f"{source}: [data] {key}"
    path = Path(value).expanduser()
    try:
        found = kind_of(path)      # stat only: nothing is opened before it is known to be a file
    except PathError as e:
        raise C.ConfigError(f"{where}: {e}") from None
    if found == "missing":
        if _HUB_NAME.match(value) and not value.startswith(("./", "../", "~")) and not Path(value).suffix:
            raise C.ConfigError(
                f"{where}: {value!r} is not a local file or folder; a Hugging Face Hub dataset must be "
                f"downloaded first, on a machine with network: python -c \"import datasets; "
                f"datasets.load_dataset('{value}', split='train').save_to_disk('DIR')\", then set "
                f"data.{key} = \"DIR\" (runs never reach the network)")
        raise C.ConfigError(f"{where}: {shown(path)}: no such file or folder")
    if found == "folder":
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            return path, "saved"
        raise C.ConfigError(f"{where}: {path}: a folder must be one written by datasets' save_to_disk "
                            f"(it has no state.json or dataset_dict.json)")
    if found != "file":
        raise C.ConfigError(f"{where}: {shown(path)}: is {found}, not a regular file; data.{key} is a file "
                            f"or a save_to_disk folder (copy a stream to a file first)")
    kind = LOADERS.get(path.suffix.lower())
    if kind is None:
        raise C.ConfigError(f"{where}: {path}: unknown file type {path.suffix or '(no suffix)'!r}; use "
                            f"{', '.join(LOADERS)} or a save_to_disk folder (a token file needs "
                            f"data.source = \"tokens\")")
    if path.suffix.lower() in TEXT_SUFFIXES:
        _check_text(path, where)
    return path, kind


def _check_text(path: Path, where: str) -> None:
    try:
        with path.open("rb") as fh:
            head = fh.read(1 << 16)
    except OSError as e:
        raise C.ConfigError(f"{where}: {path}: cannot read: {e.strerror}") from None
    if b"\x00" in head:
        raise C.ConfigError(f"{where}: {path}: not a text file (it holds NUL bytes); for token ids use "
                            f"data.source = \"tokens\"")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError as e:
        raise C.ConfigError(f"{where}: {path}: not UTF-8 text (byte {e.start})") from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
BYTES = "bytes"       # data.tokenizer's word for "read the text as UTF-8 bytes"


def has_tokenizer_files(folder: Path) -> bool:
    return any((folder / f).is_file() for f in TOKENIZER_FILES)


def tokenizer_dir(d: C.DataSettings, model_path: str | None, model_has_tokenizer: bool) -> str | None:
    """The folder whose tokenizer reads the text (data.tokenizer, else the model folder's); None: the
    text is read as UTF-8 bytes (data.tokenizer = "bytes", or a catalog model, which has no tokenizer)."""
    if d.tokenizer == BYTES:
        return None
    if d.tokenizer:
        return str(Path(d.tokenizer).expanduser().absolute())
    return model_path if model_has_tokenizer else None


def check_tokenizer(model_dir: str | None, source: str = "preset", vocab: int | None = None,
                    key: str = "[model] name") -> None:
    """A tokenizer.json that does not load is an error, never a silent fallback to bytes; nor one with
    more tokens than the model's vocabulary (the ranks' embedding lookup would fail on its ids)."""
    if not model_dir:
        return
    f = Path(model_dir).expanduser() / "tokenizer.json"
    try:
        found = kind_of(f)
    except PathError as e:
        raise C.ConfigError(f"{source}: {key}: {e}") from None
    if found == "missing":
        return
    if found != "file":
        raise C.ConfigError(f"{source}: {key}: {f}: is {found}, not a regular file")
    try:
        json.loads(f.read_text(encoding="utf-8"))
        from tokenizers import Tokenizer
        size = Tokenizer.from_file(str(f)).get_vocab_size(with_added_tokens=True)
    except Exception as e:   # json, OSError, and the tokenizers library's own exception type
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise C.ConfigError(f"{source}: {key}: {f}: the tokenizer does not load ({first}); "
                            f"fix or replace tokenizer.json (text is never silently read as bytes)") from None
    if vocab is not None and size > vocab:
        raise C.ConfigError(f"{source}: {key}: {f}: the tokenizer has {size} tokens but the model's vocab_size "
                            f"is {vocab}; use the model's own tokenizer")


def _check_token_file(d: C.DataSettings, source: str) -> None:
    path = Path(d.path).expanduser()
    try:
        found = kind_of(path)
    except PathError as e:
        raise C.ConfigError(f"{source}: [data] path: {e}") from None
    if found != "file":
        what = "no such file" if found == "missing" else f"is {'a folder' if found == 'folder' else found}, " \
                                                          f"not a regular file"
        raise C.ConfigError(f"{source}: [data] path: {shown(path)}: {what}")


def check_data(cfg: C.RunConfig, source: str = "preset") -> Scan | None:
    """Everything about the data that can be known before launch: the files exist, are a kind the
    ranks read, every record (of the first SCAN_BYTES) has a shape the ranks read, in one format, the
    model's tokenizer is there and loads (or bytes were asked for and fit the vocabulary). Returns the
    scan of data.path (None: not a text file read here)."""
    d = cfg.data
    if d.source == "tokens":
        _check_token_file(d, source)
        return None
    if not uses_records(cfg):
        return None
    objective = getattr(cfg.train, "objective", "sft")
    if data_mix.is_mix(d):
        return _scan_mix(cfg, source)
    pref = getattr(cfg, "preference", None)
    weights = (pref.desirable_weight, pref.undesirable_weight) if pref is not None else (1.0, 1.0)
    found = _scan(d.path, "path", d, source, objective, weights)
    if d.eval_path:
        held = _scan(d.eval_path, "eval_path", d, source, objective, weights)
        if found is not None and held is not None:
            found.notes += held.notes
    _check_tokenizer_choice(cfg, source)
    return found


def _scan_mix(cfg: C.RunConfig, source: str) -> Scan | None:
    """Each source of a mix as a single data.path is checked (data_mix.py: several sources)."""
    data_mix.check(cfg.data, source, objective=getattr(cfg.train, "objective", "sft"))
    found: Scan | None = None
    for value in data_mix.paths(cfg.data):
        one = _scan(value, "path", cfg.data, source)
        if found is None:
            found = one
        elif one is not None:
            found.notes += one.notes
            found.records += one.records
    _check_tokenizer_choice(cfg, source)
    return found


def _scan(value: str, key: str, d: C.DataSettings, source: str, objective: str = "sft",
          weights: tuple[float, float] = (1.0, 1.0)) -> Scan | None:
    """objective dpo / orpo / simpo: preference records (settings/data/pair_records.py), one rule for all, and the
    pairs whose answers are the same counted (all of them: refused under DPO; some: a note); kto: unpaired
    labelled records; grpo: prompts."""
    path, kind = locate(value, key, source)
    if objective == "grpo":
        return _scan_prompts(path, kind, key, d, source)
    if objective == "kto":
        return _scan_kto(path, kind, key, d, source, weights)
    pairs = objective != "sft"
    count = pair_records.PairCount()
    if pairs and kind in ("parquet", "saved"):
        try:
            pair_records.scan_columnar(path, kind, count)
            note = count.verdict(shown(path), objective)
        except ScanError as e:
            raise C.ConfigError(f"{source}: [data] {key}: {e}") from None
        return Scan(records=count.pairs, formats={"preference": str(path)}, notes=[note] if note else [])
    if kind not in ("json", "csv", "text"):
        return None
    if pairs and kind == "text":
        raise C.ConfigError(f"{source}: [data] {key}: {shown(path)}: a .txt file holds no preference pairs; "
                            f"train.objective needs records with prompt, chosen and rejected (.jsonl, .parquet, ...)")
    try:
        found = scan(path, kind, d.text_key, d.text_split, check=count if pairs else None)
        note = count.verdict(shown(path), objective) if pairs else ""
        found.notes += [note] if note else []
        return found
    except ScanError as e:
        raise C.ConfigError(f"{source}: [data] {key}: {e}") from None
    except OSError as e:
        raise C.ConfigError(f"{source}: [data] {key}: {shown(path)}: cannot read: {e.strerror}") from None


def _scan_prompts(path: Path, kind: str, key: str, d: C.DataSettings, source: str) -> Scan | None:
    """GRPO's prompt-only records (settings/data/prompt_records.py), .jsonl / .json / .csv."""
    if kind not in ("json", "csv"):
        raise C.ConfigError(f"{source}: [data] {key}: {shown(path)}: train.objective = \"grpo\" reads prompt "
                            f"records from a .jsonl, .json or .csv file (a 'prompt' each)")
    try:
        found = scan(path, kind, d.text_key, d.text_split, check=prompt_records.check)
    except ScanError as e:
        raise C.ConfigError(f"{source}: [data] {key}: {e}") from None
    except OSError as e:
        raise C.ConfigError(f"{source}: [data] {key}: {shown(path)}: cannot read: {e.strerror}") from None
    found.formats = {"prompts": str(path)}
    return found


def _scan_kto(path: Path, kind: str, key: str, d: C.DataSettings, source: str,
              weights: tuple[float, float]) -> Scan:
    """KTO's unpaired records (settings/data/kto_records.py): each record's fields and label, the labels counted."""
    count = kto_records.KtoCount()
    try:
        if kind in ("parquet", "saved"):
            pair_records.scan_columnar(path, kind, count, kto_records.is_kto, kto_records.no_kto)
            found = Scan(records=count.records, formats={"preference": str(path)}, notes=[])
        elif kind in ("json", "csv"):
            found = scan(path, kind, d.text_key, d.text_split, check=count)
        else:
            raise ScanError(f"{shown(path)}: train.objective = \"kto\" needs records with prompt, completion and "
                            f"label (.jsonl, .parquet, ...)")
        note = count.verdict(shown(path), *weights)
    except ScanError as e:
        raise C.ConfigError(f"{source}: [data] {key}: {e}") from None
    except OSError as e:
        raise C.ConfigError(f"{source}: [data] {key}: {shown(path)}: cannot read: {e.strerror}") from None
    found.notes += [note] if note else []
    return found


def _check_tokenizer_choice(cfg: C.RunConfig, source: str) -> None:
    from shardconsole.settings.models import ModelError, resolve
    try:
        spec = resolve(cfg.model.name)
    except ModelError:
        return   # the model check names [model] name itself
    d = cfg.data
    if d.tokenizer and d.tokenizer != BYTES:
        folder = Path(d.tokenizer).expanduser()
        try:
            found = kind_of(folder)
        except PathError as e:
            raise C.ConfigError(f"{source}: [data] tokenizer: {e}") from None
        if found != "folder" or not has_tokenizer_files(folder):
            raise C.ConfigError(f"{source}: [data] tokenizer: {shown(folder)}: not a folder with tokenizer files "
                                f"({', '.join(TOKENIZER_FILES)}); name a model folder's tokenizer, or "
                                f"\"bytes\" for UTF-8 bytes")
        check_tokenizer(str(folder), source, spec.vocab, key="[data] tokenizer")
        return
    if spec.path is not None and not spec.has_tokenizer and d.tokenizer != BYTES:
        raise C.ConfigError(f"{source}: [model] name: {spec.path}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); "
                            f"name one with data.tokenizer = \"FOLDER\", or data.tokenizer = \"bytes\" to "
                            f"train on UTF-8 bytes (rarely right for a pretrained model)")
    if tokenizer_dir(d, spec.path, spec.has_tokenizer) is None:
        if spec.vocab < 256:
            raise C.ConfigError(f"{source}: [model] name: text without a tokenizer is read as UTF-8 bytes, which "
                                f"needs vocab_size >= 256 (the model has {spec.vocab})")
        return
    check_tokenizer(spec.path, source, spec.vocab)
