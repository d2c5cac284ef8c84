"""Typed, validated configuration for needle, with presets.

Every config is a frozen pydantic model that rejects unknown keys, so a typo in a flow
parameter or a CLI override is an error rather than a silently ignored setting. Flows take
plain JSON-friendly dicts and build these with ``Config.model_validate(d)``.

    from needle.config import model_preset, TrainConfig
    cfg = model_preset("tiny")
    train = TrainConfig(mode="lora", steps=10)
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from needle.hardware import REMAT_POLICIES


class _Strict(BaseModel):
    """Base: unknown keys are errors, instances are immutable and hashable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


Arch = Literal["needle", "llama", "qwen2", "qwen3", "gemma3_text", "needle3"]
LayerType = Literal["sliding_attention", "full_attention"]


class RopeScaling(_Strict):
    """RoPE frequency scaling as Hugging Face configs spell it (``linear`` or Llama 3.x ``llama3``)."""

    type: Literal["linear", "llama3"] = Field(..., description="linear: every frequency / factor; llama3: smooth band")
    factor: float = Field(..., gt=0, description="context extension factor")
    low_freq_factor: float = Field(1.0, gt=0, description="llama3: wavelengths above orig/low are scaled fully")
    high_freq_factor: float = Field(4.0, gt=0, description="llama3: wavelengths below orig/high are kept")
    original_max_len: int = Field(8192, gt=0, description="llama3: pretraining context length")


class Needle3Config(_Strict):
    """cactus-needle 3.2.8's ``TransformerConfig``, field for field (names and defaults as there).

    A Needle 3 checkpoint carries this as JSON in its safetensors metadata; ``needle.model.needle3``
    computes its forward. A key Needle 3 does not have is an error, like everywhere in needle.
    """

    vocab_size: int = Field(16384, gt=0, description="input vocabulary (SentencePiece pieces, specials included)")
    d_model: int = Field(768, gt=0, description="residual stream width")
    num_heads: int = Field(12, gt=0, description="query heads")
    num_kv_heads: int = Field(2, gt=0, description="key/value heads (grouped-query attention)")
    num_layers: int = Field(20, gt=0, description="blocks")
    qk_head_dim: int = Field(48, ge=0, description="width of one query/key head")
    v_head_dim: int = Field(64, ge=0, description="width of one value head")
    max_seq_len: int = Field(4096, gt=0, description="longest sequence (RoPE table length)")
    pad_token_id: int = Field(0, ge=0, description="padding id")
    embedding_dim: int = Field(128, ge=0, description="embedding probe head: output width")
    embedding_probes: int = Field(4, ge=0, description="embedding probe head: probes")
    embedding_queries: int = Field(4, ge=0, description="embedding probe head: queries")
    confidence_probes: int = Field(4, ge=0, description="confidence probe head: probes")
    confidence_queries: int = Field(4, ge=0, description="confidence probe head: queries")
    router_probes: int = Field(4, ge=0, description="router probe head: probes")
    router_queries: int = Field(4, ge=0, description="router probe head: queries")
    rope_theta: float = Field(100000.0, gt=0, description="RoPE base frequency")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("bfloat16", description="compute dtype of the reference")
    flash: bool = Field(True, description="reference's fused-attention switch (numerics unchanged)")
    engram_orders: tuple[int, ...] = Field((2, 3), description="Engram n-gram orders")
    engram_heads: int = Field(0, ge=0, description="Engram hash heads per order (0: derived from d_model; Engram is off when engram_layers is empty)")
    engram_slots: int = Field(18432, ge=0, description="Engram table rows per head")
    engram_seed_heads: int = Field(0, ge=0, description="Engram heads seeded from unigram ids")
    engram_layers: tuple[int, ...] = Field((3, 7, 11, 15, 19), description="layers that read Engram memory")
    global_layers: tuple[int, ...] = Field((4, 9, 14, 19), description="full-attention layers (others: sliding)")
    sliding_window: int = Field(1024, ge=0, description="window of the sliding layers (0: all full)")
    ladder_depths: tuple[int, ...] = Field((), description="early-exit depths trained as a ladder")
    ladder_sample: bool = Field(False, description="sample one ladder depth per step in training")
    ladder_widths: tuple[float, ...] = Field((), description="width ladder (sliced sub-models)")
    ladder_order: tuple[int, ...] = Field((), description="layer order of the depth ladder")
    mhc_lanes: int = Field(4, gt=0, description="hyper-connection lanes of the residual stream")
    qkv_conv_taps: int = Field(3, ge=0, description="causal conv taps on q/k/v (0: off)")
    out_vocab: int = Field(0, ge=0, description="separate output vocabulary size (0: vocab_size)")
    kv_window: int = Field(0, ge=0, description="on-device KV window (0: from the byte budget)")
    kv_bits: int = Field(8, ge=0, description="deploy numerics: KV cache bits")
    act_bits: int = Field(8, ge=0, description="deploy numerics: activation bits")
    weight_bits: str = Field("", description="deploy numerics: weight bits spec ('' = the export default)")
    remat: bool = Field(True, description="reference's rematerialisation switch (numerics unchanged)")
    scan_unroll: int = Field(1, gt=0, description="reference's scan unroll (numerics unchanged)")


class ModelConfig(_Strict):
    """Decoder-only transformer shape (RMSNorm, RoPE, grouped-query attention, gated MLP).

    The defaults are needle's own architecture; the switches below ``tie_embeddings`` add what
    Hugging Face families need (Llama 3.x, Qwen2/Qwen3, Gemma 3) to the same transformer. Each
    defaults to "off", so a native config computes exactly what it did before they existed.
    """

    preset: str = Field("custom", description="name of the preset this came from (for tracking)")
    vocab_size: int = Field(1024, gt=16, description="tokenizer vocabulary size, special tokens included")
    d_model: int = Field(128, gt=0, description="residual stream width")
    n_layers: int = Field(4, gt=0, description="number of transformer blocks")
    n_heads: int = Field(4, gt=0, description="query heads")
    n_kv_heads: int = Field(2, gt=0, description="key/value heads (grouped-query attention)")
    d_ff: int = Field(384, gt=0, description="hidden width of the gated MLP")
    max_len: int = Field(256, gt=0, description="longest sequence the model sees (tokens)")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base frequency (of the full-attention layers)")
    norm_eps: float = Field(1e-6, gt=0, description="RMSNorm epsilon")
    tie_embeddings: bool = Field(True, description="share the input embedding with the output projection")
    arch: Arch = Field("needle", description="family (needle's own or the Hugging Face model_type it came from)")
    head_dim: int = Field(
        None, gt=0, description="width of one attention head; omitted: d_model // n_heads (Qwen3/Gemma set it)"
    )  # type: ignore[assignment]  # filled in by _fill_head_dim before validation
    qkv_bias: bool = Field(False, description="biases on the q/k/v projections (Qwen2)")
    o_bias: bool = Field(False, description="bias on the attention output projection (Llama attention_bias)")
    qk_norm: bool = Field(False, description="RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)")
    norm_offset_one: bool = Field(False, description="norms scale by (1 + w) instead of w (Gemma)")
    post_norms: bool = Field(False, description="extra norms on the attention and MLP outputs before the residual add (Gemma 3)")
    embed_scale: bool = Field(False, description="multiply embeddings by sqrt(d_model), rounded to the compute dtype (Gemma)")
    mlp_act: Literal["silu", "gelu_tanh"] = Field("silu", description="gate activation of the MLP (Gemma: gelu_tanh)")
    rope_scaling: RopeScaling | None = Field(None, description="frequency scaling of the rope_theta layers (Llama 3.x)")
    rope_local_theta: float | None = Field(
        None, gt=0, description="RoPE base of sliding-window layers, unscaled (Gemma 3); None: as the full layers"
    )
    sliding_window: int | None = Field(None, gt=0, description="sliding layers attend to the last N positions, self included")
    layer_types: tuple[LayerType, ...] | None = Field(None, description="attention kind per layer; None: all full")
    query_pre_attn_scalar: float | None = Field(
        None, gt=0, description="attention scale is this ** -0.5 instead of head_dim ** -0.5 (Gemma 3)"
    )
    attn_softcap: float | None = Field(None, gt=0, description="tanh soft cap on attention logits (None: off)")
    final_softcap: float | None = Field(None, gt=0, description="tanh soft cap on output logits (None: off)")
    hf_config: str | None = Field(
        None, description="the imported model's original Hugging Face config.json (compact JSON), written back on export"
    )
    needle3: Needle3Config | None = Field(
        None, description="arch needle3: the Needle 3 TransformerConfig; the fields above then only mirror it"
    )

    @model_validator(mode="before")
    @classmethod
    def _fill_head_dim(cls, data: Any) -> Any:
        # head_dim defaults to d_model // n_heads, which must then divide evenly; an explicit
        # head_dim (Qwen3, Gemma 3) is independent of d_model.
        if isinstance(data, dict) and data.get("head_dim") is None:
            d_model = data.get("d_model", cls.model_fields["d_model"].default)
            n_heads = data.get("n_heads", cls.model_fields["n_heads"].default)
            if isinstance(d_model, int) and isinstance(n_heads, int) and n_heads > 0:
                if d_model % n_heads:
                    raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads} (or set head_dim)")
                data = {**data, "head_dim": d_model // n_heads}
        return data

    @model_validator(mode="after")
    def _check_heads(self) -> "ModelConfig":
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError("head dimension must be even for RoPE")
        if self.layer_types is not None and len(self.layer_types) != self.n_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for n_layers={self.n_layers}")
        if "sliding_attention" in self.resolved_layer_types() and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        return self

    @model_validator(mode="after")
    def _check_needle3(self) -> "ModelConfig":
        if (self.arch == "needle3") != (self.needle3 is not None):
            raise ValueError("arch 'needle3' and the needle3 config go together (one without the other)")
        return self

    def resolved_layer_types(self) -> tuple[str, ...]:
        """Attention kind of each layer (all ``full_attention`` when ``layer_types`` is None)."""
        return self.layer_types or ("full_attention",) * self.n_layers


LoraTarget = Literal["q", "k", "v", "o", "gate", "up", "down"]


class LoraConfig(_Strict):
    """Low-rank adapters: y = x·W + (alpha/rank)·(x·A)·B with W frozen."""

    rank: int = Field(16, gt=0, description="adapter rank r")
    alpha: float = Field(32.0, gt=0, description="scale numerator; the update is scaled by alpha/rank")
    targets: tuple[LoraTarget, ...] = Field(
        ("q", "k", "v", "o", "gate", "up", "down"),
        min_length=1,
        description="projections that get an adapter: attention q/k/v/o and MLP gate/up/down",
    )

    qat: bool = Field(
        True, description="Needle 3 bases only: quantisation-aware LoRA as Needle trains it (weights through the "
        "on-device quantiser with a straight-through estimator, 8-bit activations); False: plain float LoRA"
    )

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class OptimConfig(_Strict):
    """Optax chain: clip by global norm, AdamW, linear warmup then cosine decay."""

    lr: float = Field(3e-3, gt=0, description="peak learning rate")
    warmup_steps: int = Field(20, ge=0, description="linear warmup length in optimizer steps")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="final lr as a fraction of the peak")
    weight_decay: float = Field(0.01, ge=0, description="AdamW decoupled weight decay")
    b1: float = Field(0.9, ge=0, lt=1, description="Adam first-moment decay")
    b2: float = Field(0.98, ge=0, lt=1, description="Adam second-moment decay")
    clip_norm: float = Field(1.0, gt=0, description="global gradient-norm clip")


class TrainConfig(_Strict):
    """What to train and how long; the loop's cadence of hooks."""

    mode: Literal["lora", "full", "scratch"] = Field(
        "lora", description="lora: adapters on a frozen base; full: all weights from a base; scratch: random init"
    )
    steps: int = Field(200, gt=0, description="optimizer steps")
    batch_size: int = Field(16, gt=0, description="sequences per optimizer step (global, all devices); packed, each holds several rows")
    grad_accum: int = Field(1, gt=0, description="micro-batches per step; batch_size must divide by it")
    fsdp: int = Field(
        1, gt=0, description="devices the frozen base (and in full fine-tuning the trained weights and optimizer "
        "state) are sharded over, the mesh's fsdp axis; the rest form the data axis; must divide the device count"
    )
    packing: bool = Field(
        True, description="pack several whole rows into each sequence (segment ids: attention and RoPE positions "
        "per row); False: one row per sequence, padded to a length bucket"
    )
    seq_len: int | None = Field(
        None, gt=8, description="packed sequence length, one per run (None: chosen from the training rows, between the "
        "longest row and 2 * max_len, for the least compute per real token); rows stay <= max_len"
    )
    seed: int = Field(0, description="seed for init, shuffling and any sampling")
    log_every: int = Field(10, gt=0, description="fetch metrics from the device every N steps")
    eval_every: int = Field(0, ge=0, description="validation loss every N steps (0: only at the end)")
    checkpoint_every: int = Field(100, gt=0, description="save a checkpoint every N steps (and at the end)")
    keep_checkpoints: int = Field(2, gt=0, description="how many recent checkpoints to keep")
    compilation_cache_dir: str | None = Field(
        ".cache/jax", description="persistent XLA compilation cache directory (None: off)"
    )
    remat: Literal[REMAT_POLICIES] | None = Field(
        None, description="per-block rematerialisation policy (none: off; everything: recompute each block; or a "
        "jax.checkpoint_policies name; recompute: keep only each block's input, recomputed in a custom VJP, the "
        "one that takes effect on CPU); None: the backend's default (needle/hardware.py)"
    )  # fmt: skip
    attention: Literal["auto", "blocked", "dense", "splash", "flash"] | None = Field(
        None, description="attention path: blocked (query blocks, no [B,H,T,T] tensor), dense (the old full scores), "
        "splash (the Pallas TPU kernel), flash (needle's Pallas TPU kernel for packed rows, no window or soft "
        "cap), auto (splash on a TPU, cuDNN on NVIDIA GPUs where it serves, else blocked); "
        "None: the backend's default"
    )
    scan_layers: bool | None = Field(
        None, description="run the blocks as one lax.scan (one compiled block; True on accelerators) or unrolled; "
        "None: the backend's default"
    )
    loss_chunk: int | None = Field(
        None, ge=0, description="tokens per chunk of the output layer and cross-entropy (0: full [B,T,V] logits); "
        "None: the backend's default"
    )
    micro_batch_tokens: int | None = Field(
        None, ge=0, description="split each step's batch (after grad_accum's split) in halves while a micro-batch "
        "keeps at least this many tokens; the gradient is the same, summed in one step (0: off; None: the "
        "backend's default: on a TPU 4096, 8192 for a decoder's heads narrower than 128)"
    )

    @model_validator(mode="after")
    def _check_accum(self) -> "TrainConfig":
        if self.batch_size % self.grad_accum:
            raise ValueError(f"batch_size={self.batch_size} is not divisible by grad_accum={self.grad_accum}")
        return self


class DataConfig(_Strict):
    """Where the tool-calling rows come from and how they become fixed-shape batches."""

    source: str = Field(..., description="JSONL path, glob, or a Hugging Face hub dataset id")
    max_len: int = Field(
        256, gt=8, description="longest tokenized row; a longer row is refused with file:line (or dropped and counted "
        "under on_error='drop'), never cut; raise it up to the model's context"
    )
    val_fraction: float = Field(0.1, ge=0, lt=1, description="share of rows held out for validation")
    test_fraction: float = Field(0.1, ge=0, lt=1, description="share of rows held out for the test split")
    split_seed: int = Field(0, description="seed of the deterministic train/val/test split")
    on_error: Literal["fail", "drop"] = Field(
        "fail", description="fail on the first bad or over-long rows (file:line), or drop them and report how many and why"
    )
    loss_on: Literal["all_assistant", "last_assistant"] = Field(
        "all_assistant", description="which assistant turns of a conversation row carry loss: every one (calls and "
        "answers in words) or only the last; a query/answers row has one either way"
    )

    @model_serializer(mode="wrap")
    def _stable_dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # loss_on is left out at its default so the configs hashed before it existed (prepared-data
        # cache keys, auto-base keys, run parameters) keep their values.
        out = handler(self)
        if out.get("loss_on") == "all_assistant":
            out.pop("loss_on")
        return out


class EvalConfig(_Strict):
    """Generation-based evaluation of emitted tool calls."""

    max_new_tokens: int = Field(96, gt=0, description="token budget for each generated answer (two-call answers reach ~70)")
    batch_size: int = Field(32, gt=0, description="rows decoded together")
    max_rows: int | None = Field(None, gt=0, description="cap on evaluated rows (None: the whole split)")
    constrained: bool = Field(
        True, description="also decode under the offered tools' call grammar and report constrained_* metrics "
        "beside free decoding's (needle/eval/constrain.py)"
    )


class ClusterConfig(_Strict):
    """Where the fine-tune runs: in this process (one worker), or as one program on Ray workers."""

    workers: int = Field(1, gt=0, description="processes that train as one program; 1 and no address: in this "
                         "process, no Ray")
    address: str | None = Field(
        None, description="a Ray cluster's address (host:port, or 'auto'); None: $RAY_ADDRESS when set "
        "(deployments/stack-up.sh sets it for its flow runs), else a local Ray started for the run and stopped after it"
    )
    devices_per_worker: int = Field(
        1, gt=0, description="devices each worker trains on: GPUs it reserves, or on CPU virtual devices"
    )

    @property
    def on_ray(self) -> bool:
        """Whether the fine-tune runs on Ray workers: more than one, or one on a cluster named by address."""
        return self.workers > 1 or self.address is not None


_MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # Tests: seconds to compile and run. max_len 320 as small's: the bundled sample fits whole
    # (`needle finetune data/sample/new.jsonl --preset tiny` refuses no row).
    "tiny": dict(vocab_size=1024, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_len=320),
    # CPU default, the main job's model (about 17 minutes for base + LoRA + eval on 2 cores before
    # packing). max_len 320: with the base's tokenizer the longest new-tool row has 279 tokens
    # (15 of 4,000 exceed 256) and rows over max_len are refused, not cut.
    "small": dict(vocab_size=1024, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=384, max_len=320),
    # About 4x small's compute per token; the benchmark's "larger" config.
    "medium": dict(vocab_size=1024, d_model=256, n_layers=6, n_heads=8, n_kv_heads=4, d_ff=768, max_len=256),
    # Needle's size class, about 45M parameters: for GPUs.
    "needle-45m": dict(
        vocab_size=16384, d_model=512, n_layers=12, n_heads=8, n_kv_heads=4, d_ff=1536, max_len=512
    ),
}


# The model preset of a freshly trained base when none is named.
DEFAULT_PRESET = "small"

# Training defaults per mode, the only ones the pipeline (CLI, flow, benchmark) uses; tuned on
# the bundled sample data with the `small` preset on 2 CPU cores. ``batch_size`` counts packed
# sequences (TrainConfig.packing): the sample's rows pack two to a sequence, so 16 sequences
# hold about 31 rows, the 32 rows per step these step counts were tuned with before packing
# (LoRA: 300 steps gave exact match 0.57, 600 gave 0.69). Half of it (8 sequences, 600 steps per
# phase) was measured on the regenerated sample: base val loss 0.218 (0.086 at full), tuned
# exact match 0.43, tool-name 0.89, valid-call 0.86, off-topic 0.49: both phases are
# token-hungry, so the budget stays. (The field defaults of TrainConfig and OptimConfig above
# are for direct library use.)
MODE_DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    "scratch": {"train": dict(steps=600, batch_size=16), "optim": dict(lr=3e-3, warmup_steps=50)},
    "full": {"train": dict(steps=300, batch_size=16), "optim": dict(lr=1e-3, warmup_steps=20)},
    "lora": {"train": dict(steps=600, batch_size=16), "optim": dict(lr=5e-3, warmup_steps=20)},
}


# The context an imported model (Hugging Face, GGUF, Needle 3) is fine-tuned and decoded with
# unless max_len asks for another: tool-calling rows with a few tools fit, and batches, KV caches
# and attention stay a size a single accelerator holds.
IMPORTED_MAX_LEN = 2048


def imported_max_len(requested: int | None, model_limit: int | None) -> int:
    """An imported model's context: ``requested`` (default ``IMPORTED_MAX_LEN``), capped by the
    model's own limit (``max_position_embeddings``, Needle 3's ``max_seq_len``) when it has one."""
    wanted = requested or IMPORTED_MAX_LEN
    return min(wanted, model_limit) if model_limit else wanted


def data_config(source: str, model_cfg: ModelConfig, max_len: int | None = None, on_error: str = "fail") -> DataConfig:
    """How rows of ``source`` are prepared for a model of ``model_cfg``: rows up to ``max_len``
    tokens (default: the model's context). ``needle train``, the flow and its auto base all build
    their ``DataConfig`` here, so ``max_len`` means the same at every entry point: the longest
    tokenized row, and (given to ``load_model``) an imported model's context."""
    return DataConfig(source=source, max_len=max_len or model_cfg.max_len, on_error=on_error)


def lora_config(mode: str, lora: LoraConfig | dict[str, Any] | None = None) -> LoraConfig | None:
    """The adapter config a run of ``mode`` trains with: ``lora`` (a config or its keys; None: the
    defaults) in mode lora, None in every other mode. The one place that rule lives."""
    if mode != "lora":
        return None
    return lora if isinstance(lora, LoraConfig) else LoraConfig.model_validate(lora or {})


def training_configs(
    mode: str,
    *,
    steps: int | None = None,
    batch_size: int | None = None,
    seed: int = 0,
    train: dict[str, Any] | None = None,
    optim: dict[str, Any] | None = None,
) -> tuple[TrainConfig, OptimConfig]:
    """Train and optimizer configs of a mode: its defaults, then ``train``/``optim`` keys, then
    the ``steps``/``batch_size`` shortcuts (None keeps what is there). The one place overrides merge."""
    if mode not in MODE_DEFAULTS:
        raise ValueError(f"unknown mode {mode!r}; choose one of {sorted(MODE_DEFAULTS)}")
    overrides: dict[str, Any] = {"seed": seed, **(train or {})}
    if "mode" in overrides:
        raise ValueError("set the mode with the 'mode' argument, not train.mode")
    shortcuts = {"steps": steps, "batch_size": batch_size}
    overrides.update({k: v for k, v in shortcuts.items() if v is not None})
    defaults = MODE_DEFAULTS[mode]
    train_cfg = TrainConfig.model_validate({**defaults["train"], "mode": mode, **overrides})
    return train_cfg, OptimConfig.model_validate({**defaults["optim"], **(optim or {})})


def model_preset(name: str, **overrides: Any) -> ModelConfig:
    """Return the named model preset, with overrides validated like any other key."""
    if name not in _MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(_MODEL_PRESETS)}")
    return ModelConfig.model_validate({**_MODEL_PRESETS[name], "preset": name, **overrides})


def preset_names() -> list[str]:
    """Names accepted by :func:`model_preset`."""
    return list(_MODEL_PRESETS)


def flatten_config(obj: BaseModel | dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested configs to dotted keys (``lora.rank``) for tracking params."""
    data = obj.model_dump(mode="json") if isinstance(obj, BaseModel) else obj
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, BaseModel):
            value = value.model_dump(mode="json")
        if isinstance(value, tuple):
            value = list(value)
        if isinstance(value, dict):
            out.update(flatten_config(value, prefix=f"{name}."))
        else:
            out[name] = value
    return out
