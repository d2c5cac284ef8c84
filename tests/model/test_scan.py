"""The scanned layer loop (``BackendSettings.scan_layers``) computes what the unrolled loop does.

Same parameter tree, same logits, same gradients (full and LoRA), packed rows, the Gemma 3
sliding/global pattern scanned by its period, remat policies inside the scanned body, and cached
decoding with the stacked KV cache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from needle.config import LoraConfig
from needle.hardware import settings_for
from needle.model.lora import combine, init_params, split_trainable
from needle.model.decoder.scan import layer_period
from needle.model.decoder.transformer import Transformer, init_cache

CPU = dataclasses.replace(settings_for("cpu"), remat="none")
SCAN = dataclasses.replace(CPU, scan_layers=True)


def _gemma(cfg):
    return cfg.model_copy(update=dict(
        arch="gemma3_text", qk_norm=True, norm_offset_one=True, post_norms=True, embed_scale=True,
        mlp_act="gelu_tanh", rope_local_theta=10000.0, rope_theta=1e6, sliding_window=5, n_layers=4,
        layer_types=("sliding_attention", "full_attention") * 2, attn_softcap=50.0, final_softcap=30.0,
    ))  # fmt: skip


def test_auto_remat_keeps_what_fits_beside_the_train_state(cfg, monkeypatch):
    from needle.model.decoder import scan as transformer

    monkeypatch.setattr(transformer, "device_memory_bytes", lambda: int(15.75 * 2**30))  # a TPU v5e
    smol = cfg.model_copy(update=dict(vocab_size=49152, d_model=576, n_heads=9, n_kv_heads=3, head_dim=64,
                                      d_ff=1536, n_layers=30))  # fmt: skip
    for trains_all in (False, True):  # 5.8 GiB of projections, beside a 0.3 or 2.0 GiB state
        assert transformer.resolve_remat("auto", smol, 16 * 1024, trains_all=trains_all) == "projections_saveable"
    qwen = cfg.model_copy(update=dict(vocab_size=151936, d_model=1024, n_heads=16, n_kv_heads=8, head_dim=128,
                                      d_ff=3072, n_layers=28))  # fmt: skip
    assert transformer.count_model_params(qwen) == 595_984_384  # Qwen3-0.6B: 596,049,920 with its 65,536 norm scales
    # LoRA: the MLP's 7.5 GB, not the 15 GB every projection would keep
    assert transformer.resolve_remat("auto", qwen, 16 * 1024, trains_all=False) == "mlp_saveable"
    # full fine-tuning: 9.5 GB of weights, gradients and moments leave too little for either
    assert transformer.resolve_remat("auto", qwen, 16 * 1024, trains_all=True) == "nothing_saveable"
    assert transformer.resolve_remat("auto", qwen, 16 * 2048, trains_all=False) == "nothing_saveable"  # 15 GB of MLP
    assert transformer.resolve_remat("dots_saveable", qwen, 16 * 1024, trains_all=False) == "dots_saveable"
    monkeypatch.setattr(transformer, "device_memory_bytes", lambda: None)
    assert transformer.resolve_remat("auto", cfg, 8, trains_all=False) == "nothing_saveable"


def _saved_scan_residuals(cfg, policy, capsys, lora=None):
    """The shapes (``f32[L,B,T,F]`` ...) the scanned blocks keep for the backward pass under ``policy``."""
    from jax.ad_checkpoint import print_saved_residuals

    tokens = jnp.zeros((2, 32), jnp.int32)
    model = Transformer(cfg, lora, settings=dataclasses.replace(SCAN, remat=policy, attention="blocked"))
    params = model.init(jax.random.key(0), tokens)["params"]
    print_saved_residuals(lambda p: model.apply({"params": p}, tokens).sum(), params)
    return sorted(ln.split(" ")[0] for ln in capsys.readouterr().out.splitlines() if "scan_blocks" in ln)


def test_auto_remat_keeps_projections_but_not_attention_scores(cfg, capsys):
    """dots_with_no_batch_dims_saveable keeps each projection's output of the
    scanned body and none of the blocked path's score einsums, which dots_saveable keeps (out of a
    TPU's HBM at 135M x 16k tokens)."""
    kept = {}
    for policy in ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable"):
        ranks = [shape.count(",") + 1 for shape in _saved_scan_residuals(cfg, policy, capsys)]
        kept[policy] = (sum(r >= 6 for r in ranks), sum(r == 4 for r in ranks))  # [L,B,K,G,q,s] / [L,B,T,F]
    assert kept["dots_saveable"][0] > 0  # the score tensors, per layer
    assert kept["dots_with_no_batch_dims_saveable"] == (0, kept["dots_saveable"][1])  # projections all kept
    assert kept["nothing_saveable"][1] < kept["dots_saveable"][1]  # ... which nothing_saveable recomputes


def test_projections_saveable_keeps_one_output_per_lora_projection(cfg, capsys):
    """Under LoRA, projections_saveable keeps each projection's output once (base and adapter
    summed) and the rank-wide x·A; dots_with_no_batch_dims_saveable keeps x·W and (x·A)·B apart.
    Without LoRA the two keep the same."""
    lora = LoraConfig(rank=4, targets=("q", "k", "v", "o", "gate", "up", "down"))
    widths = {}
    for policy in ("projections_saveable", "dots_with_no_batch_dims_saveable"):
        shapes = [s for s in _saved_scan_residuals(cfg, policy, capsys, lora) if s.count(",") == 3]  # [L,B,T,F]
        widths[policy] = sorted(int(s.split(",")[-1].rstrip("]")) for s in shapes)
    kv, q = cfg.n_kv_heads * cfg.head_dim, cfg.n_heads * cfg.head_dim
    outputs = sorted([q, kv, kv, cfg.d_model, cfg.d_ff, cfg.d_ff, cfg.d_model])
    assert widths["projections_saveable"] == sorted([lora.rank] * 7 + outputs)
    assert len(widths["dots_with_no_batch_dims_saveable"]) > len(widths["projections_saveable"])
    assert _saved_scan_residuals(cfg, "projections_saveable", capsys) == _saved_scan_residuals(
        cfg, "dots_with_no_batch_dims_saveable", capsys)


def test_mlp_saveable_keeps_the_mlp_and_recomputes_the_attention_half(cfg, capsys):
    """mlp_saveable keeps, per layer, what nothing_saveable keeps plus the gate and up outputs
    [L, B, T, d_ff] and the residual before the MLP [L, B, T, D]: none of q/k/v or the other
    projections, which dots_with_no_batch_dims_saveable keeps."""
    saved = {p: _saved_scan_residuals(cfg, p, capsys) for p in ("nothing_saveable", "mlp_saveable",
                                                                 "dots_with_no_batch_dims_saveable")}  # fmt: skip
    extra = list(saved["mlp_saveable"])
    for shape in saved["nothing_saveable"]:
        extra.remove(shape)
    lbt = f"{cfg.n_layers},2,32"
    assert sorted(extra) == sorted([f"f32[{lbt},{cfg.d_ff}]"] * 2 + [f"f32[{lbt},{cfg.d_model}]"])
    assert len(saved["dots_with_no_batch_dims_saveable"]) > len(saved["mlp_saveable"])


def test_layer_period():
    assert layer_period(["full_attention"] * 30) == 1
    assert layer_period((["sliding_attention"] * 5 + ["full_attention"]) * 3) == 6
    assert layer_period(["sliding_attention", "full_attention", "sliding_attention"]) == 3


@pytest.mark.parametrize("family", ["needle", "gemma3_text"])
def test_scanned_equals_unrolled_forward_packed(cfg, make_tokens, family):
    cfg = _gemma(cfg) if family == "gemma3_text" else cfg
    unrolled, scanned = Transformer(cfg, settings=CPU), Transformer(cfg, settings=SCAN)
    tokens = make_tokens((2, 24), seed=2)
    params = unrolled.init(jax.random.key(1), tokens)["params"]
    assert jax.tree.structure(scanned.init(jax.random.key(1), tokens)["params"]) == jax.tree.structure(params)
    segments = jnp.asarray(np.repeat([[1] * 10 + [2] * 14], 2, axis=0), jnp.int32)
    positions = jnp.asarray(np.repeat([list(range(10)) + list(range(14))], 2, axis=0), jnp.int32)
    for kwargs in ({}, {"positions": positions, "segment_ids": segments}):
        ref = unrolled.apply({"params": params}, tokens, **kwargs)
        out = jax.jit(lambda p, t: scanned.apply({"params": p}, t, **kwargs))(params, tokens)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(("mode", "remat"), [("full", "none"), ("lora", "recompute"), ("lora", "dots_saveable"),
                                           ("lora", "projections_saveable"), ("full", "mlp_saveable")])
def test_scanned_gradients_equal_unrolled(cfg, make_tokens, mode, remat):
    lora = LoraConfig(rank=4) if mode == "lora" else None
    params = init_params(cfg, lora, jax.random.key(3))
    if lora is not None:  # a trained-looking adapter: B non-zero so both factors get gradients
        params = jax.tree_util.tree_map_with_path(
            lambda p, x: x + 0.05 if str(p[-1]).find("lora_b") >= 0 else x, params)
    trainable, frozen = split_trainable(params, mode)
    tokens = make_tokens((2, 16), seed=4)

    def loss(model):
        def f(tr):
            logits = model.apply({"params": combine(tr, frozen)}, tokens)
            return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - logits[..., 0])
        return jax.jit(jax.value_and_grad(f))(trainable)

    ref_loss, ref_grads = loss(Transformer(cfg, lora, dataclasses.replace(CPU, remat=remat)))
    out_loss, out_grads = loss(Transformer(cfg, lora, dataclasses.replace(SCAN, remat=remat)))
    np.testing.assert_allclose(float(out_loss), float(ref_loss), rtol=1e-6)
    assert jax.tree.structure(out_grads) == jax.tree.structure(ref_grads)
    for a, b in zip(jax.tree.leaves(out_grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)  # f32 sum order
    assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(out_grads))


@pytest.mark.parametrize("family", ["needle", "gemma3_text"])
def test_accelerator_form_of_a_lora_step_equals_the_cpu_one(cfg, make_tokens, family):
    """A TPU's settings (in float32, on the CPU host) build q/k/v in the heads layout, leave out
    the CPU's adapter-gradient ordering and keep projections_saveable's activations: the same
    loss and LoRA gradients as the CPU's program."""
    cfg = _gemma(cfg) if family == "gemma3_text" else cfg
    lora = LoraConfig(rank=4, targets=("q", "k", "v", "o", "gate", "up", "down"))
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x + 0.05 if str(p[-1]).find("lora_b") >= 0 else x, init_params(cfg, lora, jax.random.key(3)))
    trainable, frozen = split_trainable(params, "lora")
    tokens = make_tokens((2, 16), seed=4)
    tpu = dataclasses.replace(settings_for("tpu", cfg.n_layers), compute_dtype="float32",
                              residual_dtype="float32", remat="projections_saveable")  # fmt: skip

    def loss(model):
        def f(tr):
            logits = model.apply({"params": combine(tr, frozen)}, tokens)
            return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - logits[..., 0])
        return jax.jit(jax.value_and_grad(f))(trainable)

    ref_loss, ref_grads = loss(Transformer(cfg, lora, SCAN))
    out_loss, out_grads = loss(Transformer(cfg, lora, tpu))
    np.testing.assert_allclose(float(out_loss), float(ref_loss), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(out_grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(out_grads))


@pytest.mark.parametrize(("family", "backend"), [("needle", "cpu"), ("gemma3_text", "cpu"), ("needle", "tpu")])
def test_scanned_cached_decoding_matches_full_forward(cfg, make_tokens, family, backend):
    """backend "tpu" (float32 here) writes one-token steps into the cache by a select, not a scatter."""
    cfg = _gemma(cfg) if family == "gemma3_text" else cfg
    model = Transformer(cfg, settings=dataclasses.replace(SCAN, backend=backend))
    params = model.init(jax.random.key(5), jnp.zeros((1, 8), jnp.int32))["params"]
    max_len, bucket, lengths = 16, 8, np.array([3, 8])
    full_tokens = make_tokens((2, max_len), seed=6)
    full = model.apply({"params": params}, full_tokens)
    cache = init_cache(model, 2, max_len)
    period = layer_period(cfg.resolved_layer_types())
    assert set(cache) == {"layers"} and set(cache["layers"]) == {str(j) for j in range(period)}
    assert cache["layers"]["0"]["attn"]["cached_key"].shape == (
        cfg.n_layers // period, 2, max_len, cfg.n_kv_heads, cfg.head_dim)

    @jax.jit
    def step(cache, tokens, positions):
        return model.apply({"params": params, "cache": cache}, tokens, positions, decode=True, mutable=["cache"])

    rows = np.arange(2)
    positions = jnp.broadcast_to(jnp.arange(bucket, dtype=jnp.int32), (2, bucket))
    logits, upd = step(cache, full_tokens[:, :bucket], positions)
    np.testing.assert_allclose(np.asarray(logits[rows, lengths - 1]), np.asarray(full[rows, lengths - 1]), atol=1e-4)
    cache = upd["cache"]
    for i in range(5):
        pos = lengths + i
        logits, upd = step(cache, full_tokens[rows, pos][:, None], jnp.asarray(pos[:, None], jnp.int32))
        cache = upd["cache"]
        np.testing.assert_allclose(np.asarray(logits[:, 0]), np.asarray(full[rows, pos]), atol=1e-4)


def test_scanned_model_with_splash_attention_equals_blocked(cfg, make_tokens):
    """attention="splash" (the TPU's kernel, here in the Pallas interpreter) inside the scanned
    layers: packed rows with a sliding window give the blocked path's logits."""
    cfg = _gemma(cfg).model_copy(update={"n_layers": 2, "layer_types": ("sliding_attention", "full_attention")})
    tokens = make_tokens((1, 128), seed=7)
    segments = jnp.asarray([[1] * 70 + [2] * 58], jnp.int32)
    positions = jnp.asarray([list(range(70)) + list(range(58))], jnp.int32)
    blocked = Transformer(cfg, settings=dataclasses.replace(SCAN, attention="blocked"))
    params = blocked.init(jax.random.key(8), tokens)["params"]
    ref = blocked.apply({"params": params}, tokens, positions, segment_ids=segments)
    splash = Transformer(cfg, settings=dataclasses.replace(SCAN, attention="splash"))
    out = jax.jit(lambda p: splash.apply({"params": p}, tokens, positions, segment_ids=segments))(params)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["needle", "gemma3_text"])
def test_generate_on_a_scanned_model_equals_the_unrolled_one(cfg, make_tokens, family):
    """generate_detailed stacks a scanned model's blocks once per call (decoding_params): the
    loop reads layers/<j>, and the greedy tokens are the unrolled model's."""
    from needle.eval.decode import decoding_params, generate_detailed

    cfg = _gemma(cfg) if family == "gemma3_text" else cfg
    scanned, unrolled = Transformer(cfg, settings=SCAN), Transformer(cfg, settings=CPU)
    params = unrolled.init(jax.random.key(7), jnp.zeros((1, 8), jnp.int32))["params"]
    assert "layers" in decoding_params(scanned, params) and "layers" not in decoding_params(unrolled, params)
    prompts = [np.asarray(make_tokens((1, n), seed=n))[0].tolist() for n in (3, 6, 9)]
    options = dict(max_new_tokens=6, end_id=cfg.vocab_size + 1, pad_id=0, batch_size=4)
    assert generate_detailed(scanned, params, prompts, **options).ids == generate_detailed(unrolled, params, prompts, **options).ids
