"""A resume on data other than the checkpoint's, refused before the launch (issue 65 item 4).

The ranks refuse it too (backends/data/batches.check_resume), but only after the launch, torch's import
and the tokenizing: 10 s to minutes later, with the resumed session's `failed (config_error)` as the
folder's last word over a run that had finished. Here the same comparison runs on the front end's side
of the launch: the content hash the checkpoint's manifest recorded against the file's now
(settings/data/data_hash: the ranks' own hash), and the settings that tokenize it (the token-cache key's).
data.allow_changed = true goes on, as in the ranks.

Front-end side: standard library and the settings layer only.
"""

from __future__ import annotations

import json
from pathlib import Path

from shardconsole.runlog.checkpoint_files import MANIFEST, why_incomplete
from shardconsole.settings import config as C
from shardconsole.settings import data_mix
from shardconsole.settings.data import data_hash
from shardconsole.settings.data.data_check import uses_records
from shardconsole.settings.resolve import Resolved

# What the token-cache key holds besides the files' content (backends/data/token_cache.cache_key): a
# change of one tokenizes the same records otherwise, and the checkpoint's sample position means
# nothing in the new windows. The model (and so its tokenizer) cannot change on a resume (resume.SHAPE_KEYS).
TOKENIZING = (("data", "seq_len"), ("data", "text_key"), ("data", "text_split"), ("data", "eval_fraction"),
              ("data", "eval_path"), ("data", "tokenizer"))


def loaded_checkpoint(found: list[tuple[int, Path]], backend: str) -> Path | None:
    """The step folder the ranks will load: the newest that passes the completeness test."""
    return next((p for _, p in found if why_incomplete(p, backend) is None), None)


def saved_data(checkpoint: Path) -> dict | None:
    """What the checkpoint's manifest recorded of its data (path, sha256, hashed, records, cache_key)."""
    try:
        data = json.loads((checkpoint / MANIFEST).read_text()).get("data")
    except (OSError, ValueError, AttributeError):
        return None
    return data if isinstance(data, dict) and data.get("sha256") else None


def check_same_data(saved_cfg: C.RunConfig, resolved: Resolved, checkpoint: Path | None) -> None:
    """Refuse (ConfigError naming [data] path, or the tokenizing setting) a resume whose data changed
    since the checkpoint, unless data.allow_changed. saved_cfg: the settings the checkpoint was saved
    with (the folder's preset.toml before the overrides); resolved: those to resume with."""
    cfg = resolved.cfg
    saved = saved_data(checkpoint) if checkpoint is not None else None
    if saved is None or not uses_records(cfg) or cfg.data.allow_changed:
        return      # synthetic tokens, a token file, a checkpoint from before data identity, or allowed
    how = "or --set data.allow_changed=true to go on from the start of an epoch of the new data"
    if saved.get("sources") or data_mix.is_mix(cfg.data):
        _check_same_mix(saved, resolved, checkpoint, how)
        _check_tokenizing(saved_cfg, resolved, how)
        return
    path = Path(cfg.data.path).expanduser()
    if not path.exists():
        return      # the preflight names a missing file in its own words
    if not data_hash.same_content(saved, path, data_hash.content_hash(path)):
        assert checkpoint is not None
        raise C.ConfigError(f"{cfg.data.path}: its content changed since {checkpoint.name}"
                            f"{_records(saved, path, cfg)}; resume on the data the checkpoint was trained on, {how}",
                            source=resolved.origin("data", "path"), table="data", key="path")
    _check_tokenizing(saved_cfg, resolved, how)


def _check_tokenizing(saved_cfg: C.RunConfig, resolved: Resolved, how: str) -> None:
    """The settings that cut the same records into other samples (and the seed that draws the eval split)."""
    cfg = resolved.cfg
    if saved_cfg.train.seed != cfg.train.seed and cfg.data.eval_fraction:
        changed: tuple[str, str] | None = ("train", "seed")      # it draws the held-out records
    else:
        changed = next(((t, k) for t, k in TOKENIZING
                        if getattr(getattr(saved_cfg, t), k) != getattr(getattr(cfg, t), k)), None)
    if changed is not None:
        table, key = changed
        old, new = getattr(getattr(saved_cfg, table), key), getattr(getattr(cfg, table), key)
        raise C.ConfigError(f"the checkpoints were trained on {cfg.data.path} tokenized with {table}.{key} = "
                            f"{old!r}; {new!r} cuts the same records into other samples: keep {old!r}, {how}",
                            source=resolved.origin(table, key), table=table, key=key)


def _check_same_mix(saved: dict, resolved: Resolved, checkpoint: Path | None, how: str) -> None:
    """A run on several sources resumes on the same ones (paths, weights, content), as one file does."""
    cfg, name = resolved.cfg, checkpoint.name if checkpoint is not None else "the checkpoint"
    old = saved.get("sources") or [{"path": saved.get("path"), "weight": 1.0, "sha256": saved.get("sha256"),
                                    "hashed": saved.get("hashed")}]
    now = [Path(p).expanduser() for p in data_mix.paths(cfg.data)]
    if [Path(str(s["path"])).expanduser().resolve() for s in old] != [p.resolve() for p in now]:
        raise C.ConfigError(f"names {', '.join(map(str, now))}, but {name} was trained on "
                            f"{', '.join(str(s['path']) for s in old)}: resume on the same sources, {how}",
                            source=resolved.origin("data", "path"), table="data", key="path")
    was = [float(s.get("weight", 1.0)) for s in old]
    weights = data_mix.weights(cfg.data, resolved.origin("data", "weights"))
    if was != weights:
        raise C.ConfigError(f"{', '.join(f'{w:g}' for w in weights)}: {name} was trained with "
                            f"{', '.join(f'{w:g}' for w in was)}; keep them to resume the mix where it was, {how}",
                            source=resolved.origin("data", "weights"), table="data", key="weights")
    for s, p in zip(old, now):
        if p.exists() and s.get("sha256") and not data_hash.same_content(
                {**s, "hashed": s.get("hashed", saved.get("hashed"))}, p, data_hash.content_hash(p)):
            raise C.ConfigError(f"{p}: its content changed since {name}; resume on the data the checkpoint was "
                                f"trained on, {how}", source=resolved.origin("data", "path"), table="data",
                                key="path")


def _records(saved: dict, path: Path, cfg: C.RunConfig) -> str:
    """': 400 record(s) added' when a full scan of the file counts its records ('' when not known)."""
    was = saved.get("records")
    if not isinstance(was, int):
        return ""
    from shardconsole.settings.data.data_check import locate
    from shardconsole.settings.data.data_scan import ScanError, scan
    try:
        _, kind = locate(str(path), "path")
        if kind not in ("json", "csv", "text"):
            return ""
        found = scan(path, kind, cfg.data.text_key, cfg.data.text_split, budget_bytes=None)
    except (C.ConfigError, ScanError, OSError, ValueError):
        return ""
    has = found.records
    if has == was:
        return f": as many records ({has}), other content"
    return f": {has - was} record(s) added" if has > was else f": cut from {was} to {has} records"
