"""Export of a LoRA / QLoRA run (train.method): its checkpoint holds the adapters (and lora.modules_to_save)
only, so the base comes from the run's model folder, unchanged. peft builds both outputs, so they are in
the format everyone loads:

- the merged model (default): peft's merge_and_unload folds B @ A * alpha / rank into each base weight,
  and the folder is a plain Hugging Face model (`AutoModelForCausalLM.from_pretrained(DIR)`);
- the adapter folder (`--adapter`): peft's save_pretrained (adapter_config.json,
  adapter_model.safetensors), which `PeftModel.from_pretrained(base, DIR)` puts onto the base.

A QLoRA run's adapters were trained against the 4-bit base; they merge into the bf16/fp32 base here
(the usual QLoRA export: the small difference of the dequantised weights is not in the merged model).
"""

from __future__ import annotations

from pathlib import Path

from shardconsole.export_model.checkpoint import ExportError, check_exportable  # noqa: F401  (its home: no torch)
from shardconsole.backends.checkpoint.hf_export import copy_tokenizer
from shardconsole.settings import config as C
from shardconsole.settings.models import ModelSpec

PEFT_PREFIX = "base_model.model."


def _quiet() -> None:
    """The command's output is its one line: peft's import pulls torchao where it is installed, which logs
    its missing kernels and torch's pytree deprecations; transformers draws a loading bar and warns of a
    renamed method peft calls. None of it is the user's to act on."""
    import logging
    import warnings
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()


def build(cfg: C.RunConfig, spec: ModelSpec, state: dict, dtype, source: Path, *, merged: bool):
    """The base from the model folder with the checkpoint's adapters on it (a peft model), or merged into
    it (a plain transformers model). `state`: the checkpoint's tensors under the HF model's names."""
    _quiet()
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from shardconsole.backends.model.adapters import lora_config
    base = AutoModelForCausalLM.from_pretrained(spec.path, local_files_only=True, dtype=torch.float32)
    model = get_peft_model(base, lora_config(cfg))
    expected = {k for k, p in model.named_parameters() if p.requires_grad}
    given = {PEFT_PREFIX + k: v.float() for k, v in state.items()}
    missing, unexpected = sorted(expected - set(given)), sorted(set(given) - expected)
    if missing or unexpected:
        what = "; ".join(f"{label} {', '.join(k[len(PEFT_PREFIX):] for k in keys[:3])}"
                         f"{' ...' if len(keys) > 3 else ''}"
                         for label, keys in (("missing", missing), ("unexpected", unexpected)) if keys)
        raise ExportError(f"{source}: the checkpoint's adapters do not fit [lora] of the run on {spec.path} "
                          f"({what}); were the model folder or the [lora] settings changed after the run?")
    try:
        model.load_state_dict(given, strict=False)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[-1].strip()
        raise ExportError(f"{source}: the checkpoint's adapters do not fit the run's model: {first}") from None
    if merged:
        return model.merge_and_unload().to(dtype)
    return model.to(dtype)


def trained_count(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def write_adapter(model, spec: ModelSpec, folder: Path) -> int:
    """peft's adapter folder, with the base's tokenizer and chat template beside it; the number of
    safetensors files."""
    folder.mkdir()
    model.save_pretrained(folder)
    assert spec.path is not None        # an adapter run's base is a model folder (checkpoint.check_exportable)
    copy_tokenizer(Path(spec.path), folder)
    return len(list(folder.glob("*.safetensors")))


def load_lines(title: str, base: str) -> list[str]:
    """The README's load snippet of an adapter folder."""
    return ["from peft import PeftModel",
            "from transformers import AutoModelForCausalLM",
            f"base = AutoModelForCausalLM.from_pretrained({base!r})",
            f"model = PeftModel.from_pretrained(base, {title!r})"]
