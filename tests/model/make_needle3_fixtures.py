"""Reference fixtures for needle's Needle 3 port, computed by cactus-needle 3.2.8 itself.

Runs ONLY in a side virtualenv that has ``cactus-needle[train]==3.2.8`` installed (its import
package is also called ``needle``, so this script imports nothing from this repository and must
be run isolated, from any directory)::

    V=$(.venv/bin/python -c 'from needle.model.needle3.cactus_env import ensure_cactus_env as e; print(e())')
    JAX_PLATFORMS=cpu $V -I tests/model/make_needle3_fixtures.py

For each tiny config in CONFIGS it writes into tests/fixtures/needle3/:

- ``<name>.safetensors``: random parameters from ``SimpleAttentionNetwork.init`` (probe heads
  included, as a trained checkpoint has them) in the reference's format-version-2 checkpoint
  (``write_checkpoint``, config JSON in the metadata), read back with its ``load_checkpoint``;
- ``<name>_lora.safetensors``: a random LoRA (A, B both non-zero) on the reference's
  ``lora_target_paths``, tensors ``<path joined by />/A`` and ``.../B``;
- ``<name>.npz`` (plain arrays, no pickle): ``tokens [2, 12]``, ``logits`` (``quant=False``),
  ``quant_logits`` (``quant=True`` after ``configure_deploy(act_bits, kv_bits)`` from the
  config, as the reference's fine-tuning sets them), ``qat_logits`` (its LoRA ``loss_fn``
  forward: ``cq_ste_params(merge_lora(params, lora, scale), WEIGHT_BITS)`` with ``quant=True``),
  ``lora_scale``, ``prompt`` and ``greedy`` (20 tokens of its ``generate`` loop: full forward on
  the PAD-filled buffer, argmax, no EOS stop).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

if Path.cwd().joinpath("needle", "config.py").exists() and str(Path.cwd()) in sys.path:
    sys.exit("run isolated (python -I) so that cactus-needle's `needle`, not this repo's, is imported")

from needle.model import quantize as q  # noqa: E402
from needle.model.architecture import SimpleAttentionNetwork, TransformerConfig  # noqa: E402
from needle.model.checkpoints import flatten, write_checkpoint  # noqa: E402
from needle.model.finetune import init_lora, lora_target_paths, merge_lora  # noqa: E402
from needle.model.run import CHECKPOINT_FORMAT_VERSION, load_checkpoint  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "fixtures" / "needle3"
TINY = dict(vocab_size=64, d_model=32, num_heads=4, num_kv_heads=2, num_layers=3, qk_head_dim=8, v_head_dim=16,
            max_seq_len=64, embedding_dim=8, engram_slots=32, dtype="float32")  # fmt: skip
CONFIGS = {
    # everything on: Engram (2 sites), 4 mHC lanes, sliding window 4 (layer 1 global), conv taps 3
    "full": dict(TINY, engram_heads=1, engram_layers=(0, 2), global_layers=(1,), sliding_window=4, mhc_lanes=4,
                 qkv_conv_taps=3),
    # everything off: no Engram, 1 lane, no window, no taps; out_vocab; the non-flash attention path
    "plain": dict(TINY, num_layers=2, engram_layers=(), global_layers=(), sliding_window=0, mhc_lanes=1,
                  qkv_conv_taps=0, out_vocab=48, flash=False, qk_head_dim=0, v_head_dim=0),
    # odd shapes: d_model 48 (Hadamard padded to 64), 3 orders x 2 heads, seed heads, width-ladder
    # perms, 2 taps, window 2 smaller than the taps' reach, CQ 4-bit KV, 6-bit activations
    "odd": dict(TINY, d_model=48, num_heads=6, num_kv_heads=3, engram_orders=(2, 3, 4), engram_heads=2,
                engram_seed_heads=3, engram_layers=(1,), global_layers=(0,), sliding_window=2, mhc_lanes=2,
                qkv_conv_taps=2, ladder_widths=(0.5,), kv_bits=4, act_bits=6, rope_theta=1000.0),
    # the reference's default compute dtype
    "bf16": dict(TINY, dtype="bfloat16", engram_heads=1, engram_layers=(1,), global_layers=(2,),
                 sliding_window=4, mhc_lanes=2, qkv_conv_taps=3),
}
GREEDY = 20
PAD_ID = 0


def _all_heads(module, tokens):
    return (module(tokens), module.forward_embedding(tokens), module.forward_confidence(tokens),
            module.forward_router(tokens))  # fmt: skip


def build(name: str, fields: dict, seed: int) -> None:
    cfg = TransformerConfig(**fields)
    model = SimpleAttentionNetwork(cfg)
    params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, 8), jnp.int32), method=_all_heads)["params"]
    # Perturb every leaf but the embedding (the zero/identity-initialised ones too) so each switch
    # shows in the logits; the residual branches' gains strongly, so that greedy decoding does not
    # just repeat the last token (the tied head's default).
    rng = np.random.default_rng(seed)
    flat = flatten(jax.tree.map(np.asarray, params))
    for key, value in flat.items():
        if key != "embedding/embedding":
            noise = 0.5 if key.endswith(("/d4", "/attn_gate", "out_proj/kernel")) else 0.05
            flat[key] = (value + rng.normal(0, noise, value.shape)).astype(np.float32)
    from needle.model.checkpoints import unflatten

    params = unflatten(flat)
    path = OUT / f"{name}.safetensors"
    write_checkpoint(path, {"format_version": CHECKPOINT_FORMAT_VERSION, "params": params,
                            "config": dict(cfg.__dict__), "step": 7, "run": {"name": name}})  # fmt: skip
    params, cfg = load_checkpoint(str(path))  # the reference's own loader reads it back
    model = SimpleAttentionNetwork(cfg)

    tokens = jnp.asarray(rng.integers(8, cfg.vocab_size, size=(2, 12)), jnp.int32)
    q.configure_deploy(act_bits=cfg.act_bits, kv_bits=cfg.kv_bits)
    fwd = jax.jit(lambda p, ids, quant: model.apply({"params": p}, ids, quant=quant), static_argnums=2)
    logits = np.asarray(fwd(params, tokens, False), np.float32)
    quant_logits = np.asarray(fwd(params, tokens, True), np.float32)

    lm = {k: v for k, v in params.items() if not k.endswith("_head")}
    paths = lora_target_paths(lm)
    lora = init_lora(lm, paths, 4, jax.random.PRNGKey(seed + 1))
    lora = {p: {"A": a["A"], "B": jax.random.normal(jax.random.PRNGKey(seed + 2 + i), a["B"].shape) * 0.05}
            for i, (p, a) in enumerate(lora.items())}  # fmt: skip
    scale = 2.0
    merged = q.cq_ste_params(merge_lora(params, lora, scale), q.WEIGHT_BITS)
    qat_logits = np.asarray(fwd(merged, tokens, True), np.float32)
    from safetensors.numpy import save_file

    save_file({f"{'/'.join(p)}/{m}": np.asarray(a[m], np.float32) for p, a in lora.items() for m in ("A", "B")},
              str(OUT / f"{name}_lora.safetensors"))  # fmt: skip

    prompt = [2] + [int(t) for t in rng.integers(8, cfg.vocab_size, size=5)]
    buf_len = len(prompt) + GREEDY
    buffer = np.full((1, buf_len), PAD_ID, np.int32)
    buffer[0, : len(prompt)] = prompt
    greedy = []
    for pos in range(len(prompt) - 1, buf_len - 1):
        nxt = int(np.argmax(np.asarray(fwd(params, jnp.asarray(buffer), False))[0, pos]))
        greedy.append(nxt)
        buffer[0, pos + 1] = nxt
    np.savez(OUT / f"{name}.npz", tokens=np.asarray(tokens), logits=logits, quant_logits=quant_logits,
             qat_logits=qat_logits, lora_scale=np.float32(scale), prompt=np.asarray(prompt, np.int32),
             greedy=np.asarray(greedy, np.int32))  # fmt: skip
    print(f"{name}: {len(flat)} tensors, logits {logits.shape}, |quant - plain| max "
          f"{np.abs(quant_logits - logits).max():.3g}, greedy {greedy}", flush=True)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for i, (name, fields) in enumerate(CONFIGS.items()):
        build(name, fields, seed=i)
    (OUT / "README.md").write_text(
        "Generated by tests/model/make_needle3_fixtures.py with cactus-needle 3.2.8 (see its docstring).\n"
        + json.dumps({k: {f: list(v) if isinstance(v, tuple) else v for f, v in c.items()} for k, c in CONFIGS.items()},
                     indent=1) + "\n")  # fmt: skip
    total = sum(f.stat().st_size for f in OUT.iterdir())
    print(f"{OUT}: {total / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
