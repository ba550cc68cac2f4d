"""A chat with a trained model: an exported Hugging Face folder, or a run's checkpoint exported on the way
through export-model's own code path, on the GPU where there is one and on the CPU otherwise.

The prompt is the model folder's chat template (export-model writes the template the run trained with,
the plain one included), so a conversation here is formatted as the training data was; a run whose prompts
trained as plain text (string records: settings/data/prompt_format.py) gets each message as plain text. Generation runs
in a worker thread with transformers' TextIteratorStreamer: tokens arrive as they are made, and a
threading.Event stops a generation between two tokens (Ctrl-C in the terminal, a key in a UI).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from shardconsole.settings import config as C
from shardconsole.settings.models import ModelError, resolve
from shardconsole.settings.data.prompt_format import RAW_WORDS, trained_raw

GiB = 1 << 30
ADAPTER_CONFIG = "adapter_config.json"      # peft's adapter folder (export-model --adapter)


def is_model_folder(folder: Path) -> bool:
    """A folder chat loads as it is: a model export (config.json) or an adapter folder (peft's)."""
    return (folder / "config.json").is_file() or (folder / ADAPTER_CONFIG).is_file()


def adapter_base(folder: Path) -> Path | None:
    """The base model folder an adapter folder goes onto (None: `folder` is no adapter folder): the one
    peft recorded, else the run's model.name from the README both exports write. ConfigError, one
    line saying what to do, when that base is not there any more."""
    import json
    config = Path(folder) / ADAPTER_CONFIG
    if not config.is_file():
        return None
    try:
        recorded = json.loads(config.read_text()).get("base_model_name_or_path") or ""
    except (OSError, ValueError) as e:
        raise C.ConfigError(f"chat: {config}: not readable as peft's adapter config ({e})") from None
    from shardconsole.tryout.base import of_export, of_folder
    base = of_folder(Path(recorded).expanduser()) if recorded else of_export(Path(folder))
    if base.folder is None and recorded:
        from_readme = of_export(Path(folder))
        base = from_readme if from_readme.folder is not None else base
    if base.folder is None:
        raise C.ConfigError(
            f"chat: {folder} is a LoRA adapter folder; its base model {recorded or '(not named)'} cannot be "
            f"loaded ({base.why}): put the base folder back there, or export the merged model "
            f"(`shardconsole export-model RUN -o DIR`, without --adapter) and chat with that")
    return base.folder


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0        # 0: greedy
    top_p: float = 1.0
    max_new_tokens: int = 256

    def check(self, source: str = "chat") -> "Sampling":
        if self.temperature < 0:
            raise C.ConfigError(f"{source}: temperature {self.temperature} is below 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise C.ConfigError(f"{source}: top_p {self.top_p} is not in (0, 1]")
        if self.max_new_tokens < 1:
            raise C.ConfigError(f"{source}: max_new_tokens {self.max_new_tokens} is below 1")
        return self


def weights_bytes(folder: Path, dtype_bytes: int = 2) -> int:
    """The weights as the planner counts them (the model's shapes, not its files)."""
    try:
        spec = resolve(str(folder))
    except ModelError as e:
        raise C.ConfigError(f"chat: {e}") from None
    return spec.n_params * dtype_bytes


def pick_device(need_bytes: int) -> str:
    """cuda when a GPU has room for the weights (bf16, need_bytes) and a margin, else cpu when the host has
    room for them in fp32 (twice that: the CPU computes in fp32); else one line with both figures."""
    import psutil
    import torch
    margin = GiB // 2
    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        if free >= need_bytes + margin:
            return "cuda"
    avail = psutil.virtual_memory().available
    if avail >= 2 * need_bytes + margin:
        return "cpu"
    raise C.ConfigError(f"chat: the weights take {need_bytes / GiB:.1f} GiB in bf16 ({2 * need_bytes / GiB:.1f} GiB "
                        f"in fp32 on the CPU) and no GPU or host RAM here has that free ({avail / GiB:.1f} GiB of "
                        f"host RAM available)")


class ChatModel:
    """One model folder, loaded once; `reply` streams the assistant's next turn."""

    def __init__(self, folder: Path, device: str | None = None, tokenizer_from: Path | None = None,
                 raw: bool = False) -> None:
        """tokenizer_from: the folder whose tokenizer and chat template format the prompts (default: folder).
        The base model beside a fine-tune takes the fine-tune's, so both see the very same prompt.
        raw: no chat template; each message is plain text for the model to continue. An export of a run
        whose prompts trained as plain text (settings/data/prompt_format.py) is raw without asking:
        `trained_raw` says so, for the caller to tell the user."""
        from shardconsole.quiet_libraries import quiet_libraries
        quiet_libraries()        # before transformers: no DeepSpeed accelerator line, no loading bar
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        self.folder = Path(folder)
        self.base = adapter_base(self.folder)      # an adapter folder: the base it goes onto
        weights = self.base or self.folder
        need = weights_bytes(weights)
        self.device = device or pick_device(need)
        dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        tok_folder = Path(tokenizer_from or folder)
        try:
            self.tok = AutoTokenizer.from_pretrained(tok_folder, local_files_only=True)
        except Exception as e:
            raise C.ConfigError(f"chat: {tok_folder}: no tokenizer loads from it ({str(e)[:120]})") from None
        self.trained_raw = trained_raw(tok_folder)
        self.raw = raw = raw or self.trained_raw
        if not raw and not getattr(self.tok, "chat_template", None):
            # export-model writes the template a run rendered its chats with: a run on plain text has none.
            raise C.ConfigError(f"chat: {tok_folder}: the tokenizer has no chat template (a model trained on plain "
                                f"text, not on chats, has no turns to format): it continues text; "
                                f"`shardconsole chat {self.folder} --raw` gives it what you type to continue")
        self.model = AutoModelForCausalLM.from_pretrained(weights, dtype=dtype, local_files_only=True)
        # The positions the model was made for: a longer prompt is refused (a 1 MB prompt on a 256-position
        # model ran 147 s and printed garbage), an answer is cut where they end (`cut` says so).
        self.positions: int | None = getattr(self.model.config, "max_position_embeddings", None)
        self.cut = False
        if self.base is not None:
            # the adapters merged into the base, as `export-model` without --adapter would write it
            from peft import PeftModel
            self.model = PeftModel.from_pretrained(self.model, self.folder).merge_and_unload()
        self.model.to(self.device).eval()

    def prompt_ids(self, messages: list[dict[str, str]]):
        if self.raw:        # the last message alone, as plain text to continue
            ids = self.tok(messages[-1]["content"] if messages else "", return_tensors="pt")["input_ids"]
        else:
            ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)["input_ids"]
        if self.positions and ids.shape[-1] >= self.positions:
            raise C.ConfigError(f"chat: the prompt is {ids.shape[-1]:,} tokens and {self.folder} reads at most "
                                f"{self.positions:,} (max_position_embeddings in its config.json): send a shorter "
                                f"message" + ("" if self.raw else ", or start the conversation again"))
        return ids.to(self.device)

    def answer_tokens(self, prompt_tokens: int, asked: int) -> int:
        """The new tokens an answer may have: those asked, or fewer, the positions left after the prompt."""
        return min(asked, self.positions - prompt_tokens) if self.positions else asked

    def reply(self, messages: list[dict[str, str]], sampling: Sampling,
              stop: threading.Event | None = None) -> Iterator[str]:
        """The assistant's next turn, a piece of text at a time; ends early once `stop` is set. `stop` is
        the caller's to read afterwards (set: the answer was cut); a caller that leaves early ends the
        generation through an event of its own."""
        from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer
        halt: threading.Event = stop or threading.Event()
        left = threading.Event()
        length = [0]        # the prompt and the answer so far, in tokens

        class _Stop(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs) -> bool:
                length[0] = input_ids.shape[-1]
                return halt.is_set() or left.is_set()

        streamer = TextIteratorStreamer(self.tok, skip_prompt=True, skip_special_tokens=True)
        greedy = sampling.temperature == 0
        ids = self.prompt_ids(messages)
        self.cut = False
        most = self.answer_tokens(ids.shape[-1], sampling.max_new_tokens)
        kwargs = dict(input_ids=ids, max_new_tokens=most,
                      do_sample=not greedy, streamer=streamer, stopping_criteria=StoppingCriteriaList([_Stop()]),
                      pad_token_id=self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id)
        if not greedy:
            kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        failed: list[BaseException] = []

        def work() -> None:
            import torch
            try:
                with torch.inference_mode():
                    self.model.generate(**kwargs)
            except BaseException as e:       # surfaced in the caller's thread, not lost in this one
                failed.append(e)
                streamer.end()

        thread = threading.Thread(target=work, name="generate", daemon=True)
        thread.start()
        try:
            yield from streamer
        finally:
            left.set()
            thread.join()
        if failed:
            raise failed[0]
        # Ended at the model's last position, short of the tokens asked for: the caller says so.
        self.cut = most < sampling.max_new_tokens and length[0] >= ids.shape[-1] + most
