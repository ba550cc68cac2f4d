"""train.export_dir of a LoRA run, from the live state: the merged model (the default), or peft's adapter
folder (train.export_adapter = true), the two outputs export-model gives from a checkpoint.

peft injects each target Linear `x` as `x.base_layer` beside `x.lora_A.default` / `x.lora_B.default`,
and each module of lora.modules_to_save as `x.original_module` (frozen) beside `x.modules_to_save.default`
(trained); backends/model/adapters.py says so. Merged, every base weight becomes
W + (B @ A) * lora.alpha / lora.rank (peft's merge_and_unload, computed in fp32), a trained copy replaces
its original, and the folder is a plain Hugging Face model, streamed one tensor at a time by hf_export.
The adapter folder holds the adapters alone (small): rank 0 gathers them and peft writes its own format
on a base built on the meta device, so no second copy of the base is ever made.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shardconsole.backends.checkpoint import hf_export
from shardconsole.backends.checkpoint.hf_export import FullTensors
from shardconsole.backends.model import adapters
from shardconsole.backends.rank.common import Rank
from shardconsole.settings.values import format_size

LORA_A, LORA_B, BASE = ".lora_A.default.", ".lora_B.default.", ".base_layer."
ORIGINAL, SAVED = ".original_module.", ".modules_to_save.default."


def merged(src: FullTensors, scale: float) -> FullTensors:
    """The base model's tensors with the adapters folded in, under the base model's names."""
    names = {n for n, _, _ in src.entries}
    entries: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    recipe: dict[str, tuple[str, ...]] = {}
    for name, shape, dtype in src.entries:
        if LORA_A in name or LORA_B in name or ORIGINAL in name:
            continue
        if BASE in name:
            module, leaf = name.split(BASE, 1)
            a, b = f"{module}{LORA_A}weight", f"{module}{LORA_B}weight"
            recipe[f"{module}.{leaf}"] = (name, a, b) if leaf == "weight" and a in names else (name,)
            entries.append((f"{module}.{leaf}", shape, dtype))
        else:
            base = name.replace(SAVED, ".")
            recipe[base] = (name,)
            entries.append((base, shape, dtype))

    def full(name: str) -> torch.Tensor:
        parts = recipe[name]
        if len(parts) == 1:
            return src.full(parts[0])
        w, a, b = (src.full(p) for p in parts)
        return (w.float() + scale * (b.float() @ a.float())).to(w.dtype)

    return FullTensors(entries, full)


def export(r: Rank, src: FullTensors, step: int) -> Path:
    """Every rank: the merged model or the adapter folder at train.export_dir."""
    lo = r.cfg.lora
    if not r.cfg.train.export_adapter:
        return hf_export.export(r, merged(src, lo.alpha / lo.rank), step)
    out = Path(r.cfg.train.export_dir).expanduser()
    trained = [e for e in src.entries if adapters.is_trained("." + e[0])]
    state = {name: src.full(name).detach().to("cpu", torch.float32) for name, _, _ in trained}
    total = sum(t.numel() * t.element_size() for t in state.values())

    def write(tmp: Path) -> None:
        if r.rank == 0:
            _write_adapter_folder(r, state, tmp, step)

    hf_export.written_to(r, out, step, total, write)
    if r.rank == 0:
        r.event("exported", f"{out}: peft adapters, {format_size(total)}")
    return out


def _write_adapter_folder(r: Rank, state: dict[str, torch.Tensor], tmp: Path, step: int) -> None:
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM
    config = hf_export.hf_config(r)
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config)
    model = get_peft_model(base, adapters.lora_config(r.cfg))
    dtype = hf_export.export_dtype(r)
    given = {"base_model.model." + k: v.to(dtype) for k, v in state.items()}
    missing = {k for k, p in model.named_parameters() if p.requires_grad} - set(given)
    if missing:
        raise RuntimeError(f"the trained adapters lack {', '.join(sorted(missing)[:3])}")
    model.load_state_dict(given, strict=False, assign=True)
    if r.spec.path is not None:
        model.peft_config["default"].base_model_name_or_path = str(r.spec.path)
    model.save_pretrained(tmp)
    if r.spec.path is not None:
        hf_export.copy_tokenizer(Path(r.spec.path), tmp)
    hf_export.say_prompt_format(r, tmp)
    base_name = str(r.spec.path) if r.spec.path is not None else r.spec.name
    (tmp / "README.md").write_text("\n".join([
        f"# {Path(r.cfg.train.export_dir).name}", "",
        f"LoRA adapters written by shardconsole at the end of run `{r.run_id}` ({r.run_dir.resolve()}), after "
        f"step {step} (train.export_dir, train.export_adapter = true), for the base {base_name}.", "",
        "## Load", "", "```python", "from peft import PeftModel", "from transformers import AutoModelForCausalLM",
        f"base = AutoModelForCausalLM.from_pretrained({base_name!r})",
        f"model = PeftModel.from_pretrained(base, {str(Path(r.cfg.train.export_dir).expanduser())!r})", "```", ""]))
