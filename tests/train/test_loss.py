"""Chunked cross-entropy (needle/train/loss.py) equals the dense loss and gradient (float32,
1e-5) for tied and untied output layers and Gemma's final soft cap; the train step's chunked
path equals its dense one; prefill's last-position logits equal the full prefill's."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from loss_checks import assert_chunked_equals_dense

from needle.config import LoraConfig, model_preset
from needle.hardware import settings_for
from needle.model import lora as lora_lib
from needle.model.decoder.transformer import Transformer, init_cache
from needle.train.loss import chunked_loss_sum, dense_loss_sum

CPU = settings_for("cpu")


def _cfg(kind: str):
    cfg = model_preset("tiny", vocab_size=96, d_model=16, n_layers=1, d_ff=32, max_len=64)
    if kind == "untied":
        return cfg.model_copy(update={"tie_embeddings": False})
    if kind == "softcap":
        return cfg.model_copy(update={"final_softcap": 3.0, "attn_softcap": 20.0})
    return cfg


def _batch(b=2, t=11, vocab=96, packed=False, seed=0):
    rng = np.random.default_rng(seed)
    batch = {"inputs": rng.integers(0, vocab, (b, t)), "targets": rng.integers(0, vocab, (b, t)),
             "mask": (rng.random((b, t)) > 0.3).astype(np.float32)}  # fmt: skip
    if packed:
        seg = np.ones((b, t), np.int32)
        seg[0, 5:] = 2
        pos = np.tile(np.arange(t), (b, 1))
        pos[0, 5:] -= 5
        batch.update(segment_ids=seg, positions=pos)
    return {k: jnp.asarray(v, jnp.float32 if k == "mask" else jnp.int32) for k, v in batch.items()}


@pytest.mark.parametrize("kind", ["tied", "untied", "softcap"])
@pytest.mark.parametrize("packed", [False, True])
def test_chunked_loss_and_grad_equal_dense(kind, packed):
    cfg = _cfg(kind)
    lora = LoraConfig(rank=2, alpha=4.0)
    model = Transformer(cfg, lora, dataclasses.replace(CPU, remat="none", attention="dense"))
    params = lora_lib.init_params(cfg, lora, 0)
    # Non-zero adapters so their gradient is not trivially tied to the base's.
    params = jax.tree.map(lambda x: x + 0.01, params)
    batch = _batch(packed=packed)
    # ragged last chunk, several chunks, one exact chunk, one big
    assert_chunked_equals_dense(model, params, batch, (5, 8, 22, 1000))


@pytest.mark.parametrize("kind", ["untied", "softcap"])
def test_accelerator_chunked_loss_and_grad_equal_dense(kind):
    """An accelerator's settings (no chunk skipped) through the model, the head trained too."""
    cfg = _cfg(kind)
    model = Transformer(cfg, None, dataclasses.replace(CPU, backend="tpu", remat="none", attention="dense", loss_skip_empty=False))
    params = lora_lib.init_params(cfg, None, 0)
    assert_chunked_equals_dense(model, params, _batch(packed=True), (5,))


@pytest.mark.parametrize("skip_empty", [True, False])
def test_chunked_loss_sum_raw_function(skip_empty):
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.normal(size=(3, 7, 4)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(4, 13)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 13, (3, 7)), jnp.int32)
    m = jnp.asarray(rng.random((3, 7)) > 0.5, jnp.float32)
    ref = dense_loss_sum(h @ w, y, m)
    got = chunked_loss_sum(lambda w, x: x @ w, w, h, y, m, 4, skip_empty=skip_empty)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-6)
    # The fused gradient (one pass, head and hidden) against autodiff of the dense loss.
    dense = jax.grad(lambda w, x: dense_loss_sum(x @ w, y, m)[0], argnums=(0, 1))(w, h)
    fused = jax.jit(jax.grad(lambda w, x: chunked_loss_sum(lambda w, x: x @ w, w, x, y, m, 4, skip_empty=skip_empty)[0],
                             argnums=(0, 1)))(w, h)  # fmt: skip
    for a, b in zip(dense, fused):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
    # A head no gradient reaches (LoRA's frozen base) still gives the hidden states theirs.
    only_h = jax.grad(lambda x: chunked_loss_sum(lambda w, x: x @ w, jax.lax.stop_gradient(w), x, y, m, 4,
                                                 skip_empty=skip_empty)[0])(h)  # fmt: skip
    np.testing.assert_allclose(np.asarray(only_h), np.asarray(dense[1]), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError):
        chunked_loss_sum(lambda w, x: x @ w, w, h, y, m, 0)


@pytest.mark.parametrize("skip_empty", [True, False])
def test_chunks_without_loss_tokens_add_nothing(skip_empty):
    rng = np.random.default_rng(2)
    h = np.asarray(rng.normal(size=(2, 8, 4)), np.float32)
    w = jnp.asarray(rng.normal(size=(4, 13)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 13, (2, 8)), jnp.int32)
    m = np.zeros((2, 8), np.float32)
    m[0, 6:] = m[1, 7] = 1.0  # loss tokens only in the 2nd and 4th chunks of 4
    h_nan = h.copy()
    h_nan[0, :4] = np.nan  # a chunk with no loss tokens: skipped, or its tokens masked out exactly
    ref_total, ref_n = dense_loss_sum(jnp.asarray(h) @ w, y, jnp.asarray(m))

    def loss(hidden, w):
        return chunked_loss_sum(lambda w, x: x @ w, w, hidden, y, jnp.asarray(m), 4, skip_empty=skip_empty)[0]

    total, n = chunked_loss_sum(lambda w, x: x @ w, w, jnp.asarray(h_nan), y, jnp.asarray(m), 4, skip_empty=skip_empty)
    np.testing.assert_allclose(float(total), float(ref_total), rtol=1e-6)
    assert float(n) == float(ref_n) == 3.0
    grad, grad_w = (np.asarray(g) for g in jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(h_nan), w))
    ref_grad = np.asarray(jax.grad(lambda x: dense_loss_sum(x @ w, y, jnp.asarray(m))[0])(jnp.asarray(h)))
    assert np.all(grad[0, :4] == 0) and np.all(grad[1, :4] == 0)
    np.testing.assert_allclose(grad[:, 4:], ref_grad[:, 4:], rtol=1e-5, atol=1e-6)
    if skip_empty:  # unmasked NaN states would reach the head's gradient without the skip
        ref_w = jax.grad(lambda w: dense_loss_sum(jnp.asarray(h) @ w, y, jnp.asarray(m))[0])(w)
        np.testing.assert_allclose(grad_w, np.asarray(ref_w), rtol=1e-5, atol=1e-6)


def test_train_step_chunked_equals_dense():
    from needle.config import OptimConfig
    from needle.train.run import make_apply_fn
    from needle.train.step import create_state, loss_and_grads

    cfg = _cfg("tied")
    lora = LoraConfig(rank=2, alpha=4.0)
    params = lora_lib.init_params(cfg, lora, 0)
    trainable, frozen = lora_lib.split_trainable(params, "lora")
    batch = _batch(packed=True)
    out = []
    for chunk in (0, 6):
        model = Transformer(cfg, lora, dataclasses.replace(CPU, loss_chunk=chunk))
        state = create_state(make_apply_fn(model), trainable, frozen, OptimConfig(), 10)
        out.append(jax.jit(loss_and_grads)(state, batch))
    np.testing.assert_allclose(float(out[1][0]), float(out[0][0]), rtol=1e-5)
    assert float(out[1][1]) == float(out[0][1])
    for a, b in zip(jax.tree.leaves(out[0][2]), jax.tree.leaves(out[1][2])):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)


@pytest.mark.parametrize("kind", ["tied", "untied", "softcap"])
def test_prefill_last_position_logits_equal_full(kind):
    from needle.eval.decode import _prefill

    cfg = _cfg(kind)
    model = Transformer(cfg, settings=CPU)
    params = lora_lib.init_params(cfg, None, 0)
    tokens = _batch(b=3, t=16)["inputs"]
    lengths = jnp.asarray([16, 3, 9], jnp.int32)
    cache = init_cache(model, 3, 24)
    full, _ = model.apply({"params": params, "cache": cache}, tokens, None, decode=True, mutable=["cache"])
    picked = full[jnp.arange(3), lengths - 1]
    last, _ = jax.jit(_prefill, static_argnums=0)(model, params, cache, tokens, lengths)
    assert last.shape == (3, cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(last), np.asarray(picked), atol=1e-5)
