"""Quiet the libraries a one-shot command loads (export-model, chat): their lines are not the user's to
act on, and they buried the one line the command prints.

DeepSpeed, installed beside transformers, is imported by transformers' own integrations and, finding no
GPU, warns "Setting accelerator to CPU. If you have GPU ..." on every export and chat; naming its
accelerator skips that detection (these commands never compute through DeepSpeed, on the GPU or not).
transformers draws "Loading weights" and "Writing model shards" bars through its logging's tqdm.
Called before transformers is imported: DeepSpeed reads DS_ACCELERATOR when it is first imported.
"""

from __future__ import annotations

import os


def quiet_libraries() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
