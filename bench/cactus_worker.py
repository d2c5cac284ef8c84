"""Run cactus-needle's own ``finetune_local`` and time its phases (runs in .cache/bench-venv).

This file is executed by the benchmark virtualenv's Python with ``-I`` (isolated mode), so the
``needle`` it imports is the installed ``cactus-needle`` package, never this repository's
``needle``. It therefore imports nothing from the repository. It:

1. trains a stand-in sentencepiece model on the JSONL (the real tokenizer comes from a hub we
   cannot reach) with the ids ``needle.model.tokenizer`` hard-wires (pad 0, eos 1, bos 2,
   unk 3, then the chat markers from 4), and points ``TOKENIZER_PREFIX`` at it;
2. builds a random-init base the way the package's own code does (``TransformerConfig``,
   ``SimpleAttentionNetwork.init``, ``checkpoints.write_checkpoint`` at format version 2),
   choosing ``d_model`` so the parameter count is closest to the target;
3. runs ``finetune_local`` and timestamps every progress line it emits (it syncs the loss to
   the host every step, so the gaps between "step" lines are step times).

    .cache/bench-venv/bin/python -I bench/cactus_worker.py spec.json out.json
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from types import SimpleNamespace


def train_stand_in_tokenizer(jsonl: str, prefix: str, vocab_size: int) -> int:
    """Train a sentencepiece model whose special ids match cactus-needle's tokenizer module."""
    import sentencepiece as spm
    from needle.model import finetune as ft
    from needle.model import tokenizer as tk

    texts = []
    for example in ft.read_examples(jsonl):
        prompt, target = ft.render_example(example)
        texts.append(prompt + target)
    spm.SentencePieceTrainer.Train(
        sentence_iterator=iter(texts),
        model_prefix=prefix,
        vocab_size=vocab_size,
        model_type="bpe",
        pad_id=tk.PAD_ID,
        eos_id=tk.EOS_ID,
        bos_id=tk.BOS_ID,
        unk_id=tk.UNK_ID,
        user_defined_symbols=tk.CHAT_MARKERS,
        byte_fallback=True,
        hard_vocab_limit=False,
        character_coverage=1.0,
        minloglevel=2,
    )
    tk.TOKENIZER_PREFIX = prefix  # get_tokenizer reads this module global at call time
    tok = tk.get_tokenizer(vocab_size)
    if tok.piece_id(tk.IM_START) != tk.IM_START_ID or tok.piece_id(tk.TOOL_CALL_END) != tk.TOOL_CALL_END_ID:
        raise RuntimeError("stand-in tokenizer does not put the chat markers at the ids the package expects")
    return tok.vocab_size


def make_config(spec: dict, d_model: int):
    from needle.model.architecture import TransformerConfig

    heads = spec["n_heads"]
    return TransformerConfig(
        vocab_size=spec["vocab_size"], d_model=d_model, num_heads=heads,
        num_kv_heads=spec["n_kv_heads"], num_layers=spec["n_layers"],
        qk_head_dim=d_model // heads, v_head_dim=d_model // heads,
        # Room for prompt + 96 generated tokens in its scorer; training still caps at max_len.
        max_seq_len=2 * spec["max_len"],
        # No engram tables and no sliding window: dense compute comparable to ours (the engram
        # is a hashed gather whose tables would dominate the parameter count).
        engram_layers=(), global_layers=(), sliding_window=0,
    )


def config_dict(config) -> dict:
    """Every field of a TransformerConfig: its __init__ sets only the keys given, so ``__dict__``
    misses the defaults, and ``from_saved`` would read those missing keys as "off"."""
    import dataclasses

    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def count_params(config) -> int:
    import jax
    import jax.numpy as jnp
    from needle.model.architecture import SimpleAttentionNetwork

    shapes = jax.eval_shape(
        lambda: SimpleAttentionNetwork(config).init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
    )
    return int(sum(x.size for x in jax.tree.leaves(shapes["params"])))


def build_base(spec: dict, path: str) -> dict:
    """Pick d_model (a multiple of 2*heads) closest to the target count; write the checkpoint."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from needle.model.architecture import SimpleAttentionNetwork
    from needle.model.checkpoints import write_checkpoint
    from needle.model.run import CHECKPOINT_FORMAT_VERSION

    if "n3_config" in spec:  # an exact Needle 3 config (bench/needle3.py), no size search
        from needle.model.architecture import TransformerConfig

        config = TransformerConfig(**spec["n3_config"])
        params = SimpleAttentionNetwork(config).init(
            jax.random.PRNGKey(spec.get("seed", 0)), jnp.zeros((1, 8), jnp.int32)
        )["params"]
        params = jax.tree.map(np.asarray, params)
        write_checkpoint(path, {"format_version": CHECKPOINT_FORMAT_VERSION, "params": params,
                                "config": config_dict(config)})
        return {"d_model": config.d_model, "n_params": int(sum(x.size for x in jax.tree.leaves(params))),
                "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in config_dict(config).items()}}
    step = 2 * spec["n_heads"] * 8
    candidates = [(abs(count_params(make_config(spec, d)) - spec["target_params"]), d)
                  for d in range(step, 8 * spec["d_model"] + 1, step)]
    d_model = min(candidates)[1]
    config = make_config(spec, d_model)
    params = SimpleAttentionNetwork(config).init(
        jax.random.PRNGKey(spec.get("seed", 0)), jnp.zeros((1, 8), jnp.int32)
    )["params"]
    params = jax.tree.map(np.asarray, params)
    write_checkpoint(path, {"format_version": CHECKPOINT_FORMAT_VERSION,
                            "params": params, "config": config_dict(config)})
    return {"d_model": d_model, "n_params": int(sum(x.size for x in jax.tree.leaves(params))),
            "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in config_dict(config).items()}}


def summarise(events: list[tuple[float, str]], t0: float, batch: int, seq_len: int) -> dict:
    """Turn timestamped progress lines into phase times (see docs/benchmark.md)."""
    def first(word: str) -> float | None:
        return next((t for t, m in events if m.split()[:1] == [word]), None)

    steps = [(t, m) for t, m in events if m.split()[:1] == ["step"]]
    epochs = [t for t, m in events if m.split()[:1] == ["epoch"]]
    t_sched = first("schedule")
    out: dict = {"n_step_lines": len(steps)}
    if t_sched is None or len(steps) < 3:
        return out
    total = int(steps[0][1].split()[1].split("/")[1])
    per_epoch = total // max(1, len(epochs)) if epochs else total
    times = [t for t, _ in steps]
    gaps = [b - a for a, b in zip(times, times[1:])]
    # Steady steps: skip the first (compile) and each epoch's last (ragged batch recompile).
    steady = [g for i, g in enumerate(gaps, start=2) if i % per_epoch != 0]
    steady.sort()
    step_s = steady[len(steady) // 2] if steady else None
    out.update(
        setup_s=t_sched - t0,
        first_step_s=times[0] - t_sched,
        last_batch_of_epoch1_s=gaps[per_epoch - 2] if per_epoch >= 2 and len(gaps) >= per_epoch - 1 else None,
        step_s=step_s,
        steps=len(steps),
        steps_per_epoch=per_epoch,
        padded_tokens_per_s=batch * seq_len / step_s if step_s else None,
        validation_s=(epochs[0] - times[per_epoch - 1]) if epochs and len(times) >= per_epoch else None,
        scoring_s=(first("accuracy") - epochs[-1]) if epochs and first("accuracy") else None,
    )
    return out


def run(spec: dict) -> dict:
    from needle.model import finetune as ft
    from needle.model.tokenizer import PAD_ID, get_tokenizer

    work = spec["workdir"]
    os.makedirs(work, exist_ok=True)
    result: dict = {"package_version": None}
    try:
        from importlib.metadata import version

        result["package_version"] = version("cactus-needle")
    except Exception:  # the version is informative only
        pass
    t = time.perf_counter()
    result["tokenizer_vocab"] = train_stand_in_tokenizer(spec["jsonl"], os.path.join(work, "tokenizer"), spec["vocab_size"])
    base_path = os.path.join(work, "base.safetensors")
    result["base"] = build_base(spec, base_path)
    result["prep_s"] = time.perf_counter() - t
    if spec.get("keep_dir"):  # the same base for needle, laid out as the hub repository is
        import shutil

        keep = spec["keep_dir"]
        os.makedirs(os.path.join(keep, "checkpoints"), exist_ok=True)
        os.makedirs(os.path.join(keep, "tokenizer"), exist_ok=True)
        shutil.copyfile(base_path, os.path.join(keep, "checkpoints", "needle3.safetensors"))
        shutil.copyfile(os.path.join(work, "tokenizer.model"), os.path.join(keep, "tokenizer", "tokenizer.model"))

    if spec.get("base_only"):  # bench/needle3.py's published-shape base: no fine-tune here
        return result
    tok = get_tokenizer(spec["vocab_size"])
    seq_len = ft.fit_max_len(spec["jsonl"], tok, spec["max_len"])
    seqs, _ = ft.load_jsonl(spec["jsonl"], tok, seq_len)
    result.update(seq_len=seq_len, n_examples=int(len(seqs)),
                  real_token_fraction=float((seqs != PAD_ID).mean()))

    args = SimpleNamespace(
        checkpoint=base_path, jsonl_path=spec["jsonl"], generate=0, max_len=spec["max_len"],
        lora_rank=spec["lora_rank"], lora_alpha=spec["lora_alpha"], seed=spec.get("seed", 0),
        val_split=spec["val_split"], batch_size=spec["batch_size"], epochs=spec["epochs"],
        lr=spec.get("lr", 1e-4), score=spec.get("score", True),
        checkpoint_dir=os.path.join(work, "out"), out=None,
    )
    events: list[tuple[float, str]] = []
    t0 = time.perf_counter()
    ft.finetune_local(args, progress=lambda m: events.append((time.perf_counter(), m.strip())))
    result["wall_s"] = time.perf_counter() - t0
    result["log"] = [f"{t - t0:8.2f}s {m}" for t, m in events]
    n_val = min(int(len(seqs) * spec["val_split"]), len(seqs) - 1)
    result.update(n_val_rows=n_val, batch_size=spec["batch_size"])
    result.update(summarise(events, t0, spec["batch_size"], seq_len))
    if result.get("padded_tokens_per_s"):
        result["real_tokens_per_s"] = result["padded_tokens_per_s"] * result["real_token_fraction"]
    lora_paths = ft.lora_target_paths(__import__("needle.model.run", fromlist=["x"]).load_checkpoint(base_path)[0])
    result["lora_groups"] = len(lora_paths)
    return result


def main() -> int:
    spec_path, out_path = sys.argv[1], sys.argv[2]
    with open(spec_path, encoding="utf-8") as fh:
        spec = json.load(fh)
    try:
        result = {"ok": True, **run(spec)}
    except BaseException as exc:  # report any failure as data: the benchmark must not crash
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
    with open(out_path, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2, default=str)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
