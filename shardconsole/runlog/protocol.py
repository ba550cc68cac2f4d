"""The metrics stream: one frozen dataclass per message, encoded as one JSON line each.

Standard library only: the ranks write these lines, the front ends read them.

Every line carries `v` (protocol version), `kind`, `run` (run id), `rank` (-1 for the front end) and
`t` (wall time, seconds since the epoch). A line is at most MAX_LINE bytes; longer text fields are cut
so that a line always fits (a reader can then treat anything longer as garbage).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

VERSION = 1
MAX_LINE = 4096
# The step meter's version (backends/observe/metrics.StepMeter), in every step line and speed-book entry:
# 2 counts optimizer steps (issue 45). Lines without it (0) came from the meter that counted micro-batches,
# whose step_s, tokens/s, samples/s and MFU were per micro-batch: off by train.grad_accum.
METER_VERSION = 2

# Phases a run goes through, reported with Event(name="phase", detail=<phase>).
PHASES = ("starting", "loading model", "building ops", "reference pass", "training", "evaluating", "saving checkpoint",
          "finished")

# Failure classes, also used for exit codes (see session/outcome.EXIT_CODES).
FAILURE_CAUSES = ("gpu_oom", "host_oom", "nccl_timeout", "hang", "nan_loss", "loss_scale_floor",
                  "config_error", "crash", "stopped", "disk_full", "run_folder_gone", "run_folder_moved")


class DecodeError(ValueError):
    pass


def gpu_uuid_key(uuid: str | None) -> str:
    """One spelling of a GPU's UUID for matching: NVML says 'GPU-8f3a...', torch's device properties
    '8f3a...' (no prefix)."""
    u = (uuid or "").strip().lower()
    return u[4:] if u.startswith("gpu-") else u


@dataclass(frozen=True)
class Message:
    kind: ClassVar[str] = ""
    run: str = ""
    rank: int = -1
    t: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Hello(Message):
    kind: ClassVar[str] = "hello"
    world: int = 1
    local_rank: int = 0
    host: str = ""
    pid: int = 0
    device: str = ""          # "cuda:0", "cpu"
    gpu_name: str | None = None
    gpu_uuid: str | None = None
    backend: str = ""         # "fsdp" / "deepspeed"
    n_params: int | None = None


@dataclass(frozen=True)
class Step(Message):
    kind: ClassVar[str] = "step"
    step: int = 0
    steps: int = 0                     # total steps of the run, for progress
    loss: float | None = None
    lr: float = 0.0
    grad_norm: float | None = None
    tokens_per_s: float = 0.0          # global, all ranks
    samples_per_s: float = 0.0
    step_s: float = 0.0
    mfu: float | None = None           # fraction 0..1; None on CPU
    loss_scale: float | None = None    # None unless fp16
    skipped_steps: int = 0             # fp16 overflow steps skipped so far
    tokens: int = 0                    # tokens seen so far (real ones: a preference pair's padding is not counted)
    # Preference training: the share of the rows' tokens since the last line that were padding (tokens_per_s
    # counts the others); None under SFT, whose packed windows have none.
    padding: float | None = None
    # Preference training (train.objective dpo / orpo; backends/objective/preference.py), over the pairs
    # since the last step line, all ranks; None under SFT. loss is then the preference loss.
    reward_chosen: float | None = None     # beta * (policy - reference) log-prob of the chosen answers, mean
    reward_rejected: float | None = None   # the same for the rejected answers (ORPO: lambda * mean token log-prob)
    reward_margin: float | None = None     # reward_chosen - reward_rejected
    pref_accuracy: float | None = None     # share of pairs whose chosen reward is above the rejected one, 0..1
    # GRPO (train.objective grpo; backends/objective/grpo.py), over the completions since the last step line,
    # all ranks; None otherwise. loss is then GRPO's.
    reward_mean: float | None = None       # the weighted sum of the reward functions, mean over completions
    reward_std: float | None = None        # its std over the completions
    rewards: dict | None = None            # "FILE.py:FUNCTION" -> that function's mean reward
    completion_len: float | None = None    # tokens a completion, mean (EOS counted)
    kl: float | None = None                # GRPO: the k3 KL to the reference a token, mean (None when beta = 0);
                                           # KTO: its KL estimate z (mismatched rows' log-ratio, mean)
    clip_ratio: float | None = None        # share of completion tokens whose ratio was clipped
    generate_s: float | None = None        # seconds a step sampling completions (and scoring them)
    meter: int = 0                     # METER_VERSION of the meter that wrote it; 0: before issue 45
    # precision.fp8's recipe when the decoder linears multiply in float8 ("tensorwise", "rowwise"), else "".
    # mfu stays a share of the GPU's bf16 peak, so that runs with and without FP8 compare.
    fp8: str = ""


@dataclass(frozen=True)
class Memory(Message):
    kind: ClassVar[str] = "memory"
    step: int = 0
    allocated_bytes: int | None = None    # the rank's CUDA allocator; None on CPU
    reserved_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    host_rss_bytes: int = 0
    device_index: int | None = None


# Events written for the stream's readers (tests, benchmarks, the planner's calibration), not for a
# person: the headless lines and the console's Logs leave them out (every rank writes one a save).
RECORD_ONLY_EVENTS = frozenset({"save_host_peak"})


@dataclass(frozen=True)
class Event(Message):
    kind: ClassVar[str] = "event"
    name: str = ""          # "phase", "checkpoint_saved", "overflow", "warning", "info"
    detail: str = ""
    step: int | None = None


@dataclass(frozen=True)
class Finished(Message):
    kind: ClassVar[str] = "finished"
    steps: int = 0
    elapsed_s: float = 0.0
    tokens: int = 0


@dataclass(frozen=True)
class Failed(Message):
    kind: ClassVar[str] = "failed"
    cause: str = "crash"        # one of FAILURE_CAUSES
    message: str = ""
    exc_type: str = ""
    traceback_tail: str = ""
    step: int | None = None
    hint: str = ""


@dataclass(frozen=True)
class Eval(Message):
    """Held-out loss over the whole eval set, all ranks (rank 0 writes it)."""
    kind: ClassVar[str] = "eval"
    step: int = 0
    loss: float | None = None        # mean token loss over every token under loss in the eval set
    tokens: int = 0                  # tokens under loss that the mean covers
    seconds: float = 0.0
    # Preference training: loss is the mean preference loss over the held-out pairs, these as in Step
    pairs: int = 0
    reward_chosen: float | None = None
    reward_rejected: float | None = None
    reward_margin: float | None = None
    pref_accuracy: float | None = None
    # Several data sources (data.path names them): the held-out loss of each source with eval records
    sources: tuple[str, ...] = ()
    source_losses: tuple[float, ...] = ()
    kl: float | None = None


@dataclass(frozen=True)
class DataSummary(Message):
    """What the ranks will train on, sent once at start by rank 0."""
    kind: ClassVar[str] = "data"
    source: str = ""                 # the file or folder ("synthetic" for generated tokens)
    format: str = ""                 # text, chat, prompt_completion, alpaca, tokens, synthetic, preference, kto
    tokenizer: str = ""              # where the tokenizer came from, or "bytes"
    template: str = ""               # chat template in use ("" when none applies)
    records: int = 0
    tokens: int = 0                  # training tokens after packing
    samples: int = 0                 # packed training windows of seq_len
    loss_share: float = 1.0          # fraction of tokens under loss
    epochs: float = 0.0              # passes over the training samples this run makes
    eval_records: int = 0
    eval_samples: int = 0
    cross_document_attention: bool = True
    note: str = ""
    # Several data sources mixed by data.weights: per source, in data.path's order, its share of the rows,
    # the passes this run makes over it (a source that runs out starts another) and its training tokens
    sources: tuple[str, ...] = ()
    source_shares: tuple[float, ...] = ()
    source_epochs: tuple[float, ...] = ()
    source_tokens: tuple[int, ...] = ()
    desirable: int = 0               # kto: the training records labelled desirable (the rest undesirable)


@dataclass(frozen=True)
class GpuSample(Message):
    """NVML view of one GPU, sampled by the front end (rank = -1)."""
    kind: ClassVar[str] = "gpu"
    index: int = 0
    name: str = ""
    used_bytes: int = 0
    total_bytes: int = 0
    util_pct: float | None = None
    pids: tuple[int, ...] = ()
    # Matched against each rank's Hello.gpu_uuid: NVML's index is not CUDA's on a mixed rig.
    uuid: str = ""
    temp_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    sm_clock_mhz: float | None = None
    sm_clock_max_mhz: float | None = None
    throttle: tuple[str, ...] = ()          # NVML's active clock-event reasons that slow the card
    pcie_rx_bps: float | None = None        # bytes/s into the GPU (host -> GPU), NVML's 20 ms window
    pcie_tx_bps: float | None = None        # bytes/s out of the GPU


@dataclass(frozen=True)
class OffloadTiming(Message):
    """Where an offloaded step goes, one rank's mean over `steps` steps up to `step` (backends/observe/step_timing.py).
    GPU times come from CUDA events read one step late; CPU ranks time the same phases by wall clock
    (`clock` says which). None: that phase was not measured for this backend."""
    kind: ClassVar[str] = "offload"
    step: int = 0
    steps: int = 0
    clock: str = "cuda_events"              # or "wall_clock"
    step_s: float = 0.0                     # the rank's wall time a step
    gpu_s: float | None = None              # forward + backward on the compute stream
    host_step_s: float | None = None        # the optimizer step on the host
    h2d_s: float | None = None              # host -> GPU copies (parameters), on their streams
    d2h_s: float | None = None              # GPU -> host copies (gradients)
    h2d_bytes: int = 0                      # a step
    d2h_bytes: int = 0
    pinned_bytes: int | None = None         # page-locked host memory of this rank (VmLck)
    verdict: str = ""                       # "host step bound", "PCIe bound", "GPU bound" (offload_verdict.py)
    hint: str = ""                          # the setting most likely to help
    view_s: float | None = None             # this view's own host time a step (its cost)
    # fsdp.offload_overlap: "on", "off" or "off: why"; "" where it does not apply (DeepSpeed, older lines)
    overlap: str = ""
    host_hidden_s: float | None = None      # of host_step_s, the seconds that ran under the backward


@dataclass(frozen=True)
class HostSample(Message):
    """psutil view of the host, sampled by the front end (rank = -1)."""
    kind: ClassVar[str] = "host"
    used_bytes: int = 0
    total_bytes: int = 0
    ranks_rss_bytes: int = 0
    pinned_bytes: int | None = None


@dataclass(frozen=True)
class SaveProgress(Message):
    """A save under way (rank 0, about once a second, and once at its end with done=True): a checkpoint of
    tens of GB takes tens of seconds, and the front ends show it and do not take it for a hang."""
    kind: ClassVar[str] = "save"
    step: int = 0
    what: str = "checkpoint"         # "checkpoint" (full, resumable), "model" (weights only), "export"
    written_bytes: int = 0           # bytes written so far, all ranks (the save folder as it grows)
    total_bytes: int = 0             # bytes to write in all, all ranks (0 when not known)
    elapsed_s: float = 0.0
    path: str = ""                   # the folder written to
    done: bool = False


KINDS: dict[str, type[Message]] = {
    m.kind: m for m in (Hello, Step, Memory, Event, Finished, Failed, Eval, DataSummary, GpuSample, HostSample,
                        OffloadTiming, SaveProgress)
}
_FIELDS = {kind: {f.name: f for f in fields(cls)} for kind, cls in KINDS.items()}
_TEXT_FIELDS = ("detail", "message", "traceback_tail", "hint", "name", "host", "source", "format",
                "tokenizer", "template", "note", "clock", "verdict", "what", "path")


def _clean(value: Any) -> Any:
    # JSON has no NaN/inf: a NaN loss is a fact worth sending, so it travels as a string.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def encode(msg: Message) -> str:
    """One line (no newline) of at most MAX_LINE bytes."""
    body: dict[str, Any] = {"v": VERSION, "kind": msg.kind}
    body.update({k: _clean(v) for k, v in asdict(msg).items()})
    line = json.dumps(body, separators=(",", ":"), ensure_ascii=False)
    if len(line.encode()) <= MAX_LINE:
        return line
    # Too long: halve the longest free-text field until the line fits. A message keeps its head (the
    # error itself); a traceback keeps its tail (the frame that raised).
    while len(line.encode()) > MAX_LINE:
        texts = [k for k in _TEXT_FIELDS if isinstance(body.get(k), str) and len(body[k]) > 1]
        if not texts:
            break
        key = max(texts, key=lambda k: len(body[k]))
        text = body[key]
        keep = max(len(text) // 2, len(text) - (len(line.encode()) - MAX_LINE) - 8)
        body[key] = text[:keep] + "…" if key != "traceback_tail" else "…" + text[len(text) - keep:]
        line = json.dumps(body, separators=(",", ":"), ensure_ascii=False)
    if len(line.encode()) <= MAX_LINE:
        return line
    raise ValueError(f"{msg.kind} message does not fit in {MAX_LINE} bytes")


def decode(line: str | bytes) -> Message:
    """Parse one line. Raises DecodeError for anything that is not a valid message of this version."""
    if isinstance(line, bytes):
        if len(line) > MAX_LINE + 1:
            raise DecodeError("line too long")
        try:
            line = line.decode()
        except UnicodeDecodeError:
            raise DecodeError("not UTF-8") from None
    if len(line) > MAX_LINE + 1:
        raise DecodeError("line too long")
    try:
        body = json.loads(line)
    except (json.JSONDecodeError, RecursionError):
        raise DecodeError("not JSON") from None
    if not isinstance(body, dict):
        raise DecodeError("not a JSON object")
    if body.get("v") != VERSION:
        raise DecodeError(f"protocol version {body.get('v')!r}, expected {VERSION}")
    kind = body.get("kind")
    if not isinstance(kind, str) or kind not in KINDS:
        raise DecodeError(f"unknown kind {kind!r}")
    known = _FIELDS[kind]
    kwargs = {}
    for k, v in body.items():
        if k in ("v", "kind") or k not in known:
            continue  # unknown fields are ignored: a newer writer may add some
        if isinstance(v, str) and v in ("nan", "inf", "-inf") and _TYPES[kind][k].startswith("float"):
            v = float(v)
        if isinstance(v, list):
            v = tuple(v)
        kwargs[k] = v
    try:
        msg = KINDS[kind](**kwargs)
    except TypeError as e:
        raise DecodeError(str(e)) from None
    _check_types(msg)
    return msg


def _check_types(msg: Message) -> None:
    """Every field of the type its annotation names, counts never negative: a reader does arithmetic and
    formatting with these, and a line that would make it raise is skipped and counted instead."""
    for name, annotation in _TYPES[msg.kind].items():
        v = getattr(msg, name)
        if v is None and "None" in annotation:
            continue
        base = annotation.split(" |")[0]
        if base == "int" or base.startswith("tuple[int"):
            items = v if base.startswith("tuple") and isinstance(v, tuple) else (v,)
            if base.startswith("tuple") and not isinstance(v, tuple):
                raise DecodeError(f"{name} is not a list of integers")
            for x in items:
                if not isinstance(x, int) or isinstance(x, bool):
                    raise DecodeError(f"{name} is not an integer")
                if x < 0 and name not in _SIGNED:
                    raise DecodeError(f"{name} is negative")
        elif base == "float":
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise DecodeError(f"{name} is not a number")
        elif base == "bool":
            if not isinstance(v, bool):
                raise DecodeError(f"{name} is not true or false")
        elif base == "str" and not isinstance(v, str):
            raise DecodeError(f"{name} is not a string")
        elif base.startswith("tuple[str") and not (isinstance(v, tuple) and all(isinstance(x, str) for x in v)):
            raise DecodeError(f"{name} is not a list of strings")


_SIGNED = ("rank",)   # -1: the front end
_TYPES = {kind: {f.name: str(f.type) for f in fields(cls)} for kind, cls in KINDS.items()}
