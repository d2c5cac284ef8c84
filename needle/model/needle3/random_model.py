"""Random Needle 3 bases in the hub repository's layout, for demos and tests, offline.

The published Needle 3 weights and tokenizer come from the hub, which is not reachable here, so
the Needle path is exercised on bases made locally in the layout a snapshot of
``Cactus-Compute/needle3`` has::

    OUT/checkpoints/needle3.safetensors   format-2 checkpoint (needle's Needle 3 module, random init)
    OUT/tokenizer/tokenizer.model         SentencePiece BPE trained on the given rows, Needle's special ids

    needle sample-model /tmp/n3 --arch needle3 --data data/sample/new.jsonl [--shape tiny|needle3]
    needle finetune data/sample/new.jsonl --base /tmp/n3

``SHAPES["tiny"]`` turns every switch on at a size tests compile in seconds; ``SHAPES["needle3"]``
is cactus-needle 3.2.8's ``TransformerConfig`` defaults (the published checkpoint's own config is
in its metadata and may differ).
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from needle.data.needle3_format import conversation_segments, render_example
from needle.data.sample import generate_rows
from needle.data.schema import parse_row
from needle.model.factory import module_for
from needle.model.needle3.checkpoint import write_needle3_checkpoint
from needle.model.needle3.io import model_config_of, needle3_config
from needle.tokenizers.markers import BOS_ID, EOS_ID, MARKERS, PAD_ID, UNK_ID

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=512, d_model=64, num_heads=4, num_kv_heads=2, num_layers=2, qk_head_dim=16,
                 v_head_dim=16, max_seq_len=1024, engram_heads=1, engram_slots=64, engram_layers=(1,),
                 global_layers=(1,), sliding_window=64, mhc_lanes=2, qkv_conv_taps=3, embedding_dim=16,
                 dtype="float32"),  # fmt: skip
    "needle3": {},
}


def rendered_texts(rows: Iterable[dict[str, Any]]) -> list[str]:
    """Each row as Needle renders it (prompt + target), the text a stand-in tokenizer learns from."""
    def text(row: dict[str, Any]) -> str:
        if "messages" in row:  # a conversation: its turns as Needle 3 continues them
            return "".join(t for t, _ in conversation_segments(parse_row(row, "rendered_texts")))
        return "".join(render_example(row))

    return [text(r) for r in rows]


def train_sp_model(texts: list[str], vocab_size: int) -> bytes:
    """A SentencePiece BPE with Needle's fixed ids (pad 0, eos 1, bos 2, unk 3, markers from 4)."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=buf, vocab_size=vocab_size, model_type="bpe",
        pad_id=PAD_ID, eos_id=EOS_ID, bos_id=BOS_ID, unk_id=UNK_ID, user_defined_symbols=list(MARKERS),
        byte_fallback=True, hard_vocab_limit=False, character_coverage=1.0, minloglevel=2,
        # Newlines are part of Needle's format: no NFKC folding, whitespace kept as written.
        normalization_rule_name="identity", remove_extra_whitespaces=False,
    )  # fmt: skip
    return buf.getvalue()


def write_random_needle3(out_dir: str | Path, *, data: str | Path | None = None, shape: str | dict[str, Any] = "tiny",
                         seed: int = 0) -> Path:  # fmt: skip
    """Write a random Needle 3 base (checkpoint + tokenizer) at ``shape``; return ``out_dir``."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    keys = SHAPES[shape] if isinstance(shape, str) else shape
    n3 = needle3_config(dict(keys), f"shape {shape!r}")
    rows = _read_rows(data) if data else generate_rows(400, "new", seed=seed)
    sp_bytes = train_sp_model(rendered_texts(rows), n3.vocab_size)  # fewer pieces where the rows hold fewer
    cfg = model_config_of(n3, min(n3.max_seq_len, 2048))
    model = module_for(cfg)
    params = model.init(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32))["params"]
    params = jax.tree.map(lambda a: np.asarray(a, np.float32), params)
    out = Path(out_dir)
    (out / "checkpoints").mkdir(parents=True, exist_ok=True)
    (out / "tokenizer").mkdir(parents=True, exist_ok=True)
    write_needle3_checkpoint(out / "checkpoints" / "needle3.safetensors", params, n3.model_dump(mode="json"),
                             step=0, run={"source": "needle sample-model", "seed": seed})  # fmt: skip
    (out / "tokenizer" / "tokenizer.model").write_bytes(sp_bytes)
    return out


def _read_rows(path: str | Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
