"""How an export's prompts were formatted in training, for `chat` to format them the same way.

A run on prompt + answer records given as plain strings (prompt/completion SFT records, string preference
pairs) trained on the prompt's text followed by the answer, with no chat template: TRL's standard form,
and the only safe reading of a prompt that may already hold a template's markers. Its export still carries
the tokenizer's own chat template (a user's later tooling may want it), so a file beside it says the run
never used it: `chat` reads it and gives the model what is typed as plain text to continue, the prompt it
learned to answer (wrapped in the template, the DPO model of FINETUNE.md's own example answered nothing).
export-model and train.export_dir both write it. Standard library only.
"""

from __future__ import annotations

import json
from pathlib import Path

FILE = "shardconsole_prompt.json"
RAW = "raw"
# The data formats whose prompts train as raw text when no chat template was applied (runlog DataSummary).
PROMPTED_FORMATS = ("prompt_completion", "preference", "kto")
RAW_WORDS = ("plain text: each prompt as it is, then the answer (no chat template; string records, as TRL's "
             "standard form); `shardconsole chat` gives this model what you type as text to continue")


def raw_prompts(fmt: str, template: str) -> bool:
    """A run's data (its format and chat template, as the token cache and the data line name them) whose
    prompts trained as plain text."""
    return fmt in PROMPTED_FORMATS and not template


def write_raw(folder: Path) -> None:
    (folder / FILE).write_text(json.dumps({"prompt_format": RAW, "why": RAW_WORDS}, indent=1) + "\n")


def trained_raw(folder: Path) -> bool:
    """True when the export says its prompts trained as plain text. A file that does not read is no
    statement (a user may have edited it): the tokenizer's template applies, as before the file existed."""
    try:
        return json.loads((folder / FILE).read_text()).get("prompt_format") == RAW
    except (OSError, ValueError, AttributeError):
        return False
