"""The settings tables: one dataclass per TOML table, and RunConfig, which holds one of each.

Defaults, allowed values and help live on each field (`setting`): the console's forms, `shardconsole
settings`, the checks in config.py and the errors all read them from here. Loading, saving and the
checks of values are config.py's; the cross-key rules config_rules.py's. Imports neither torch nor
textual: the front end and the ranks share it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from shardconsole.settings.engine_tables import DeepspeedSettings, FsdpSettings
from shardconsole.settings.field_meta import setting
from shardconsole.settings.finetune_tables import GrpoSettings, LoraSettings, PreferenceSettings  # noqa: F401 (config's)
from shardconsole.settings.values import parse_size

# ---------------------------------------------------------------------------------------------------
# The tables; each field's metadata (`setting`) is described in field_meta.py. [lora] and [preference] are in
# finetune_tables.py, [fsdp] and [deepspeed] in engine_tables.py.

@dataclass
class ModelSettings:
    name: str = setting("tiny", "catalog size (tiny, 125m, 1b, 3b, 7b, 13b) or a local Hugging Face model directory")
    attn_implementation: Literal["sdpa", "eager"] = setting("sdpa", "attention kernel used by transformers")


@dataclass
class DataSettings:
    source: Literal["auto", "synthetic", "text", "tokens"] = setting(
        "auto", "auto: synthetic tokens without a path, the file's records with one; "
        "tokens: a pre-tokenized token file (text: the file's records, as auto)")
    path: str = setting("", "a local .jsonl/.json/.parquet/.csv/.txt file or a save_to_disk folder "
                   "(text, chat messages, prompt/completion or alpaca records), or a token file; several, "
                   "comma-separated or a TOML list, are mixed by data.weights", list=True)
    weights: str = setting("", "one weight per source of data.path, comma-separated or a TOML list (e.g. 3,1: "
                          "three rows of the first to one of the second); empty: equal shares", list=True)
    seq_len: int = setting(256, "tokens per sample", min=8, max=1_048_576)
    token_dtype: Literal["uint16", "uint32"] = setting("uint16", "element type of a token file")
    text_key: str = setting("text", "field holding the text of a plain-text record")
    cross_document_attention: bool = setting(
        False, "let packed documents attend to the ones before them in a sample (false: positions "
        "restart and attention is block-diagonal per document)")
    eval_fraction: float = setting(0.0, "share of the records held out for the eval loss (by train.seed)",
                              min=0.0, max=0.5)
    eval_path: str = setting("", "a separate file or folder of eval records (instead of eval_fraction)")
    text_split: Literal["blank_line", "line", "file"] = setting(
        "blank_line", "how a .txt file becomes records: blank_line (blocks between blank lines), line (one "
        "per line) or file (the whole file, one record)")
    tokenizer: str = setting("", "empty: the model folder's tokenizer (a folder without one is refused); "
                            "\"bytes\": UTF-8 bytes; or a folder holding tokenizer files")
    allow_changed: bool = setting(False, "resume even though the data changed since the checkpoint (from the "
                                    "start of an epoch of the new data)")


@dataclass
class TrainSettings:
    steps: int = setting(20, "optimizer steps to run", min=1)
    micro_batch: int = setting(1, "samples per rank per forward pass", min=1)
    grad_accum: int = setting(1, "micro-batches per optimizer step", min=1)
    lr: float = setting(3e-4, "peak learning rate", min=0.0)
    min_lr_ratio: float = setting(0.1, "final learning rate as a fraction of lr (cosine schedule)", min=0.0, max=1.0)
    warmup_steps: int = setting(0, "linear warm-up steps", min=0)
    schedule: Literal["cosine", "constant"] = setting("cosine", "learning-rate schedule after warm-up")
    # A resume that adds steps keeps the schedule the run had: `resume` sets this to the steps it spanned,
    # and past it the lr stays where the schedule ended (session/resume.py), so it never jumps back up.
    schedule_steps: int = setting(0, "steps the cosine schedule spans (0: train.steps); past them the lr stays at "
                             "its final value (resume sets it when it adds steps)", min=0)
    weight_decay: float = setting(0.0, "AdamW weight decay", min=0.0)
    beta1: float = setting(0.9, "AdamW beta1", min=0.0, max=1.0)
    beta2: float = setting(0.95, "AdamW beta2", min=0.0, max=1.0)
    clip_grad_norm: float = setting(1.0, "gradient clipping by global norm (0 turns it off)", min=0.0)
    seed: int = setting(1234, "random seed", min=0)
    log_every: int = setting(1, "steps between step lines (each is a host-device sync)", min=1)
    eval_every: int = setting(0, "steps between eval losses (0: only after the last step, when there is eval data)",
                         min=0)
    checkpoint_every: int = setting(0, "steps between checkpoints (0: only at the end, if save_final)", min=0)
    # "model" keeps the weights alone (what export-model reads, a quarter of a full checkpoint with fp32
    # masters and Adam): the choice where a full checkpoint does not fit the disk. true/false in older
    # presets and --set mean full/none ("aliases").
    save_final: Literal["full", "model", "none"] = setting(
        "full", "after the last step, write a checkpoint: full (resumable: weights, optimizer, data position, "
        "RNG), model (weights only, for export-model) or none", aliases={"true": "full", "false": "none"})
    keep_checkpoints: int = setting(0, "complete checkpoints kept, the oldest removed after a new one (0: all)", min=0)
    save_on_stop: bool = setting(True, "a stop (Ctrl-C, console, SIGTERM) saves at the next step boundary first")
    stop_save_timeout_s: float = setting(300.0, "seconds a save on stop may take before the ranks end without it",
                                    min=1.0)
    checkpoint_dir: str = setting("", "where checkpoints go (empty: <run dir>/checkpoints)")
    # A checkpoint or an export is the trained model: by default no other local user may read it, whatever
    # the umask (0644 on most systems). false leaves the modes to the umask, for a group that shares models.
    checkpoint_private: bool = setting(True, "checkpoints, train.export_dir and export-model's folders readable by "
                                        "their owner alone (0700 folders, 0600 files); false: the umask decides")
    export_dir: str = setting("", "write the trained model as a Hugging Face folder here after the last step "
                         "(empty: no export); no checkpoint is needed for it")
    export_adapter: bool = setting(False, "a LoRA run's train.export_dir holds peft's adapter folder instead of the "
                              "merged model")
    export_dtype: Literal["bf16", "fp32"] | None = setting(
        None, "dtype of train.export_dir's weights (default: the master weights' own dtype, as export-model)")
    # GGUF (issue 66): llama.cpp / Ollama / LM Studio read the trained model without a conversion of their own.
    export_gguf: Literal["f16", "bf16", "q8_0"] | None = setting(
        None, "also write train.export_dir's model as model-TYPE.gguf with an Ollama Modelfile beside it "
              "(f16, bf16 or q8_0; unset: no GGUF)")
    resume: bool = setting(False, "continue from the newest complete checkpoint in checkpoint_dir")
    compile: bool = setting(False, "torch.compile each decoder layer (GPU; first steps are slower; after the first "
                              "the log says what compiled, and warns if a layer fell back to eager)")
    peak_tflops: float = setting(0.0, "peak bf16 TFLOP/s of one GPU for MFU (0: from the GPU table)", min=0.0)
    # LoRA / QLoRA (issue 33): the base is frozen and only the [lora] adapters (and lora.modules_to_save)
    # train, so gradients and Adam's state are those of a few million parameters, not billions.
    method: Literal["full", "lora", "qlora"] = setting(
        "full", "what trains: every weight (full), LoRA adapters on a frozen base (lora), or LoRA on a "
        "4-bit NF4 base through bitsandbytes (qlora, CUDA only); settings in [lora]")
    hang_timeout_s: float = setting(
        0.0, "seconds without a step line before the run counts as hung (0: 20x the step time, at least 120 s)",
        min=0.0)
    # Preference training (issue 47; backends/objective/preference.py): a sample is a pair, a chosen row and
    # a rejected row (train.micro_batch counts pairs), settings in [preference].
    # GRPO (issue 61; backends/objective/grpo.py): a sample is a prompt, completed [grpo] generations times.
    objective: Literal["sft", "dpo", "orpo", "simpo", "kto", "grpo"] = setting(
        "sft", "what the loss is: next-token prediction (sft), DPO on chosen/rejected pairs against the starting "
        "model (dpo), ORPO's odds-ratio loss without a reference (orpo), SimPO's length-normalised margin without "
        "a reference (simpo), or KTO on unpaired prompt/completion/label records (kto), settings in [preference]; "
        "or online RL on prompts with your reward functions (grpo; settings in [grpo])")


@dataclass
class ParallelSettings:
    backend: Literal["fsdp", "deepspeed"] = setting("fsdp", "training engine: PyTorch FSDP2 or DeepSpeed ZeRO")
    device: Literal["auto", "cuda", "cpu"] = setting("auto", "where ranks compute (auto: cuda if present)")
    nproc_per_node: int = setting(1, "ranks per node (GPUs per node on a GPU box)", min=1, max=1024)
    nnodes: int = setting(1, "number of nodes", min=1, max=100_000)
    node_rank: int = setting(-1, "this node's rank for static rendezvous (-1: let c10d assign it)", min=-1)
    rdzv_endpoint: str = setting("", "host:port of the rendezvous (required when nnodes > 1)")
    rdzv_id: str = setting("", "rendezvous id shared by all nodes (empty: the run id)")
    master_port: int = setting(0, "port for single-node runs (0: pick a free one)", min=0, max=65535)
    launcher: Literal["torchrun", "deepspeed"] = setting("torchrun", "program that starts the ranks")
    timeout_s: int = setting(600, "collective timeout in seconds", min=10)
    # torchrun's c10d rendezvous (torch/distributed/elastic/rendezvous), as --rdzv-conf: read_timeout is
    # the TCPStore's timeout, so how long a node's agent keeps trying to reach the store node 0's agent
    # hosts (torch's default 60 s: a node started a minute before node 0 gave up) and the bound on each
    # store call; join_timeout bounds the wait, once the store answers, until every node has joined.
    rdzv_connect_timeout_s: int = setting(
        60, "multi-node torchrun (and --slurm): seconds a node keeps trying to reach the rendezvous host (node "
        "0's agent) before it gives up, and the bound on each rendezvous store call (torch's read_timeout)",
        min=1, max=86_400)
    rdzv_join_timeout_s: int = setting(
        600, "multi-node torchrun (and --slurm): seconds the nodes have, once the rendezvous host answers, "
        "until all nnodes have joined (torch's join_timeout)", min=1, max=604_800)
    # Recorded in the run folder's preset.toml, which every rank and reader validates again: a Slurm
    # run's node 0 is named by the job (its first node), not by rdzv_endpoint.
    rendezvous: Literal["endpoint", "slurm"] = setting(
        "endpoint", "who names node 0: endpoint (rdzv_endpoint; this machine for one node) or slurm (the "
        "job's first node; --slurm sets it)")


@dataclass
class PrecisionSettings:
    dtype: Literal["bf16", "fp16", "fp32"] = setting("bf16", "compute dtype of parameters in forward/backward")
    reduce_dtype: Literal["fp32", "bf16", "fp16"] | None = setting(
        None, "dtype of gradient reduction (default: fp32 for FSDP, the compute dtype for DeepSpeed)")
    # bf16 masters: 2 bytes of weights + 2 of gradients + 4 of Adam moments = 8 bytes a parameter
    # instead of 16, the difference between 7B and 13B on a 125 GiB host with everything offloaded.
    # The price: an update smaller than half a bf16 step of the weight (about 0.4% of it) is lost.
    master_dtype: Literal["fp32", "bf16"] = setting(
        "fp32", "dtype of the kept weights, their gradients and Adam's moments (bf16: 8 bytes a parameter "
        "instead of 16; updates below bf16's resolution are lost)")
    # How an fp32 update lands in bf16 masters (backends/optim/master_update.py). stochastic: rounded up or down
    # with the probability of its distance, so small updates survive on average (8 bytes a parameter);
    # kahan: a bf16 buffer keeps what rounding dropped (10 bytes); nearest: torch's AdamW as is.
    # Default nearest, from the measurement (docs/MEASURED.md, "master_rounding"): stochastic and kahan reach
    # fp32-master quality (+0.87% and -0.07% final loss against +6.0%) but their host step is
    # compute-bound, 4.5x torch's fused bf16 AdamW on the CI machine (13B stochastic offloaded: 1,626
    # tokens/s on the H200 under 24 GiB). Opt-in where quality matters more than step time.
    master_rounding: Literal["stochastic", "kahan", "nearest"] = setting(
        "nearest", "master_dtype = bf16: how updates are rounded into the bf16 weights (nearest: torch's "
        "fused AdamW, small updates are lost; stochastic: unbiased, same 8 bytes a parameter; kahan: +2 bytes "
        "a parameter for a compensation buffer; both within 1% of fp32 masters' loss, slower host step)")
    # torchao's float8 training (backends/model/float8.py): the decoder layers' linears multiply in FP8 on
    # cards that have FP8 tensor cores (SM 8.9+: RTX 4090/5090, L40S, H100/H200), twice bf16's rate there;
    # the head and embeddings stay bf16. tensorwise: one scale a tensor (fastest: 1.43x on 7B layers,
    # benchmarks/results/issue48); rowwise: a scale a row (more accurate with outliers, 1.17x).
    fp8: Literal["none", "tensorwise", "rowwise"] = setting(
        "none", "FP8 matrix multiplies in the decoder layers' linears (torchao float8 training; full "
        "fine-tuning in bf16 on a GPU of compute capability 8.9 or newer, either engine): tensorwise (fastest) or "
        "rowwise (a scale per row: closer to bf16 when activations have outliers)")
    # fp16 dynamic loss scaling, with DeepSpeed's names and meanings. None = not set (default applies);
    # setting any of them with a dtype other than fp16 is an error.
    initial_scale_power: int | None = setting(None, "fp16: start the loss scale at 2**this (default 16)", min=0, max=64)
    loss_scale_window: int | None = setting(None, "fp16: overflow-free steps before the scale doubles (default 1000)",
                                            min=1)
    hysteresis: int | None = setting(None, "fp16: overflows tolerated before the scale is cut (default 2)", min=1)
    min_loss_scale: float | None = setting(None, "fp16: the scale never drops below this (default 1)", min=0.0)
    loss_scale: float | None = setting(None, "fp16: a static loss scale instead of a dynamic one", min=0.0)

    FP16_KEYS = ("initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale", "loss_scale")

    def fp16_value(self, key: str) -> Any:
        """The value in force: what the user set or the default."""
        defaults = {"initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                    "min_loss_scale": 1.0, "loss_scale": 0.0}
        value = getattr(self, key)
        return defaults[key] if value is None else value


@dataclass
class OptimSettings:
    # torchao's low-bit AdamW (backends/optim/lowbit_optim.py): the two moments quantized block-wise, 8-bit
    # 2 bytes a parameter (+ an fp32 scale per 256), 4-bit 1 byte (+ one per 128), against fp32 Adam's 8:
    # for a model whose states then fit the card, no offload at all (issue 35). A numerics change: the
    # update is not fp32 Adam's (tune holds it unless named in --vary).
    # adam-mini (backends/optim/adam_mini.py, issue 60): 6 bytes a parameter against AdamW's 16, an 8B full
    # fine-tune on a 64 GB host; another update, measured against fp32 AdamW (docs/MEASURED.md).
    name: Literal["adamw", "adamw8bit", "adamw4bit", "adam-mini"] = setting(
        "adamw", "the optimizer: adamw (torch's, fp32 or master-dtype moments), adamw8bit or adamw4bit "
        "(torchao's block-quantized moments: 2 or 1 byte a parameter instead of 8; FSDP2 only), adam-mini "
        "(fp32 masters as bf16 + a 16-bit remainder, bf16 first moment, a second moment a row: 6 bytes a "
        "parameter, 4 with bf16 masters; FSDP2 only, made for cpu_offload)")
    # backends/optim/step_in_backward.py: torchtune's optimizer in backward. The step's result is the ordinary
    # one, but no clip, no accumulation, no fp16 scaler (settings/rules.py says why each is refused).
    step_in_backward: bool = setting(
        False, "step each parameter as its gradient is reduced in the backward pass and free the gradient "
        "(no whole-model gradient buffer; FSDP2 without offload; needs clip_grad_norm = 0, grad_accum = 1)")


@dataclass
class MemorySettings:
    activation_checkpointing: bool = setting(False, "recompute each decoder layer's activations in backward")
    checkpoint_policy: Literal["full", "selective"] = setting(
        "full", "with checkpointing: recompute the whole layer (least memory), or keep the matmul and "
        "attention outputs and recompute only the cheap element-wise ops (faster, saves less)")
    gpu_memory_limit: str = setting("", "cap each rank's CUDA memory, e.g. 24GiB, to rehearse a smaller card",
                                    size=True)
    activation_offload: bool = setting(
        False, "with activation_checkpointing: keep each layer's saved input in pinned host memory from its "
        "forward to its backward (long sequences: seq x hidden a layer leaves the GPU)")
    mlp_tile_tokens: int = setting(
        0, "compute each decoder layer's MLP this many tokens at a time, so no [tokens x intermediate] tensor "
        "is whole (long sequences; FSDP2); 0: the whole micro-batch at once", min=0)
    host_memory_limit: str = setting("", "the host RAM the run may use, e.g. 64GiB, to rehearse a smaller box: the "
                                "planner plans against it and a launch it puts over it is refused", size=True)
    empty_cache_every: int = setting(0, "call torch.cuda.empty_cache every N steps (0: never)", min=0)
    # Issue 48: the [tokens, vocab] logits are GiBs at a 32k-128k vocabulary; the fused loss never keeps
    # them (backends/model/fused_loss.py). auto leaves CPU runs on the chunked loss: memory is not their
    # limit there and the chunked path is the long-tested one. auto by default since the H200 measured it
    # (2026-12-05, benchmarks/results/issue48/20261205/): the 1b preset 85.5k tokens/s against 81.7k chunked
    # in one call, the head + loss at vocab 32k 16.4 ms (liger) / 20.8 ms (ours) against 25.7 ms, 0.83 / 1.56
    # GiB against 1.80, the same loss to 5e-7.
    loss: Literal["auto", "fused", "chunked"] = setting(
        "auto", "the next-token loss: fused (the output head and cross-entropy in one pass that works out "
        "the gradients in forward, so no logits are kept or recomputed; liger-kernel's Triton kernel on "
        "CUDA when installed, else ours), chunked (4096 tokens' logits at a time, recomputed in backward), "
        "or auto (fused on CUDA, chunked on CPU); DPO and ORPO always use the chunked per-row log-probs")

    def loss_on(self, cuda: bool) -> Literal["fused", "chunked"]:
        """memory.loss resolved for a rank on CUDA or not (the ranks and the planner read this rule)."""
        if self.loss == "auto":
            return "fused" if cuda else "chunked"
        return self.loss


TABLES: dict[str, type] = {
    "model": ModelSettings,
    "data": DataSettings,
    "train": TrainSettings,
    "parallel": ParallelSettings,
    "precision": PrecisionSettings,
    "fsdp": FsdpSettings,
    "deepspeed": DeepspeedSettings,
    "memory": MemorySettings,
    "lora": LoraSettings,
    "optim": OptimSettings,
    "preference": PreferenceSettings,
    "grpo": GrpoSettings,
}
TOP_LEVEL_KEYS = ("description",)


@dataclass
class RunConfig:
    description: str = ""
    model: ModelSettings = field(default_factory=ModelSettings)
    data: DataSettings = field(default_factory=DataSettings)
    train: TrainSettings = field(default_factory=TrainSettings)
    parallel: ParallelSettings = field(default_factory=ParallelSettings)
    precision: PrecisionSettings = field(default_factory=PrecisionSettings)
    fsdp: FsdpSettings = field(default_factory=FsdpSettings)
    deepspeed: DeepspeedSettings = field(default_factory=DeepspeedSettings)
    memory: MemorySettings = field(default_factory=MemorySettings)
    lora: LoraSettings = field(default_factory=LoraSettings)
    optim: OptimSettings = field(default_factory=OptimSettings)
    preference: PreferenceSettings = field(default_factory=PreferenceSettings)
    grpo: GrpoSettings = field(default_factory=GrpoSettings)

    # --- derived values, so that every consumer agrees -------------------------------------------
    @property
    def world_size(self) -> int:
        return self.parallel.nproc_per_node * self.parallel.nnodes

    @property
    def gpu_memory_limit_bytes(self) -> int | None:
        return parse_size(self.memory.gpu_memory_limit) if self.memory.gpu_memory_limit else None

    @property
    def host_memory_limit_bytes(self) -> int | None:
        return parse_size(self.memory.host_memory_limit) if self.memory.host_memory_limit else None

    @property
    def reshard_after_forward(self) -> bool:
        if self.fsdp.reshard_after_forward is not None:
            return self.fsdp.reshard_after_forward
        return self.fsdp.sharding != "shard_grad_op"

    @property
    def compiles_layers(self) -> bool:
        """train.compile as torch.compile of each decoder layer's body: always under FSDP2; under DeepSpeed
        when no ZeRO hook sits inside a layer (stages 0-2, or stage 3 gathering by layer)."""
        d = self.deepspeed
        return self.train.compile and (self.parallel.backend == "fsdp" or d.stage < 3 or d.stage3_layer_gather)

    @property
    def split_masters(self) -> bool:
        """adam-mini with fp32 masters and bf16 compute: bf16 shards, the masters' low 16 bits in the
        optimizer (backends/optim/adam_mini.py); LoRA's adapters stay fp32."""
        return (self.optim.name == "adam-mini" and self.precision.master_dtype == "fp32"
                and self.precision.dtype == "bf16" and not self.adapters)

    @property
    def kept_bytes(self) -> int:
        """Bytes of a kept (sharded) parameter: 2 when the shards are bf16 (bf16 masters, or split ones)."""
        return 2 if self.precision.master_dtype == "bf16" or self.split_masters else 4

    @property
    def adapters(self) -> bool:
        """Only adapters train (train.method lora or qlora): the base is frozen."""
        return self.train.method != "full"

    @property
    def rows_per_sample(self) -> int:
        """Sequences one sample is: 1, or a pair's chosen and rejected rows under a preference objective."""
        if self.train.objective == "grpo":
            return self.grpo.generations
        return 1 if self.train.objective == "sft" else 2

    @property
    def tokens_per_step(self) -> int:
        """Global tokens one optimizer step computes (a pair's two sequences both count)."""
        t = self.train
        return t.micro_batch * t.grad_accum * self.data.seq_len * self.world_size * self.rows_per_sample

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for TOML: None values (not set) are left out, since TOML has no null."""
        out: dict[str, Any] = {}
        if self.description:
            out["description"] = self.description
        for table in TABLES:
            section = getattr(self, table)
            out[table] = {f.name: getattr(section, f.name) for f in fields(section)
                          if getattr(section, f.name) is not None}
        return out

    def diff(self, other: "RunConfig") -> list[tuple[str, Any, Any]]:
        """(table.key, other's value, self's value) for each setting that differs."""
        out = []
        for table in TABLES:
            a, b = getattr(other, table), getattr(self, table)
            for f in fields(a):
                if getattr(a, f.name) != getattr(b, f.name):
                    out.append((f"{table}.{f.name}", getattr(a, f.name), getattr(b, f.name)))
        return out
