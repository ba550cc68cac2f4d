"""The failures a rank raises on purpose, each carrying its class of failure (the `failed` line's cause)
and the hint a user acts on. In the lowest room so that observe/failures.classify tests types, not class
names, whichever room raises them (a stop in engine/, a checkpoint in checkpoint/, the data in data/)."""

from __future__ import annotations

from shardconsole.runlog.checkpoint_files import safe_reason


class RankFailure(Exception):
    """Base of the failures below: `cause` names the class (runlog/protocol.py's CAUSES), `hint` the fix."""
    cause = "crash"
    hint = ""


class Stopped(RankFailure):
    """The run was asked to stop (engine/trainstate.stop_with_save, end_now)."""
    cause = "stopped"
    hint = "continue it with `shardconsole resume RUN_DIR`"


class CheckpointError(RankFailure, RuntimeError):
    """A checkpoint that cannot be used; the message names its folder. torch's refusal of a pickle advises
    loading it with weights_only=False, which runs whatever the file says: never passed on (safe_reason)."""
    cause = "config_error"
    hint = "move that folder away to resume from the one before it, or set train.resume = false"

    def __init__(self, message: str) -> None:
        super().__init__(safe_reason(message))


class DiskFullError(RankFailure, OSError):
    """ENOSPC / EDQUOT during a save or an export; reads as its message alone (no "[Errno 28]")."""
    cause = "disk_full"
    hint = ("free space there, lower train.keep_checkpoints, set train.save_final = \"model\" (weights only), "
            "or point train.checkpoint_dir elsewhere; then `shardconsole resume RUN` continues from the last "
            "complete checkpoint")

    def __str__(self) -> str:
        return str(self.strerror)


class SaveOOMError(RankFailure, MemoryError):
    """The host ran out of memory during a save."""
    cause = "host_oom"
    hint = "the save needs the host memory of its largest tensor beside training's"


class NanLossError(RankFailure, RuntimeError):
    cause = "nan_loss"
    hint = "lower train.lr, keep train.clip_grad_norm on, or use precision.dtype = \"bf16\""


class LossScaleFloorError(RankFailure, RuntimeError):
    cause = "loss_scale_floor"
    hint = "fp16 overflows every step: use bf16, lower train.lr, or raise clipping"


class DataError(RankFailure, ValueError):
    """Data the rank cannot read or use; the message names the file and the setting."""
    cause = "config_error"


class StreamFailed(RankFailure):
    """The rank could not write the run's stream: cause "disk_full" or "run_folder_gone" (observe/stream_health)."""

    def __init__(self, cause: str, message: str, hint: str) -> None:
        super().__init__(message)
        self.cause, self.hint = cause, hint


class HostLimitReached(RankFailure):
    """The node's run passed memory.host_memory_limit and stopped, saving first (observe/host_limit)."""
    cause = "host_oom"

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.hint = hint


class RewardError(RankFailure, ValueError):
    """A GRPO reward function that raised, returned the wrong count or a value that is not a finite number;
    the message names the function and the record (backends/objective/rewards.py)."""
    cause = "config_error"
    hint = "fix the reward function (it is called as TRL calls it: prompts=, completions=, each column as keywords)"
