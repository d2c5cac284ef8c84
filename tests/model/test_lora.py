"""LoRA trees: adapter placement, identity at init, merge equivalence, split/combine, attach."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from needle.config import LoraConfig
from needle.errors import CheckpointMismatchError
from needle.model.lora import attach_base, combine, count_params, merge_lora, split_trainable
from needle.model.decoder.transformer import Transformer


def _flat(tree: dict) -> dict[str, np.ndarray]:
    return {"/".join(k): np.asarray(v) for k, v in traverse_util.flatten_dict(tree).items()}


def _zeros_like_shapes(model: Transformer) -> dict:
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def test_adapters_only_on_targets(cfg):
    lora = LoraConfig(rank=3, targets=("q", "down"))
    flat = _flat(_zeros_like_shapes(Transformer(cfg, lora)))
    adapted = {k.rsplit("/", 1)[0] for k in flat if k.endswith("/lora_a")}
    want = {f"block_{i}/{p}" for i in range(cfg.n_layers) for p in ("attn/q_proj", "mlp/down_proj")}
    assert adapted == want
    assert flat["block_0/attn/q_proj/lora_a"].shape == (cfg.d_model, 3)
    assert flat["block_0/mlp/down_proj/lora_b"].shape == (3, cfg.d_model)


def test_fresh_adapter_is_identity(cfg, lora_cfg, base_params, lora_params, make_tokens, logits_of):
    flat = _flat(lora_params)
    assert all(not v.any() for k, v in flat.items() if k.endswith("lora_b"))
    assert all(v.std() > 0 for k, v in flat.items() if k.endswith("lora_a"))
    tokens = make_tokens((2, 8))
    base = logits_of(Transformer(cfg), base_params, tokens)
    adapted = logits_of(Transformer(cfg, lora_cfg), lora_params, tokens)
    np.testing.assert_allclose(np.asarray(adapted), np.asarray(base), atol=1e-6)


def test_merge_matches_adapter_path(cfg, lora_cfg, base_params, lora_params, make_tokens, logits_of):
    rng = np.random.default_rng(2)
    flat = traverse_util.flatten_dict(lora_params)
    for k in flat:
        if k[-1] == "lora_b":
            flat[k] = jnp.asarray(0.1 * rng.standard_normal(flat[k].shape), jnp.float32)
    tuned = traverse_util.unflatten_dict(flat)
    tokens = make_tokens((2, 8))
    adapted = logits_of(Transformer(cfg, lora_cfg), tuned, tokens)
    base = logits_of(Transformer(cfg), base_params, tokens)
    assert float(jnp.max(jnp.abs(adapted - base))) > 1e-2

    merged = merge_lora(tuned, lora_cfg)
    assert jax.tree.structure(merged) == jax.tree.structure(base_params)
    np.testing.assert_allclose(
        np.asarray(logits_of(Transformer(cfg), merged, tokens)), np.asarray(adapted), atol=1e-4
    )
    with pytest.raises(ValueError, match="rank 4"):
        merge_lora(tuned, LoraConfig(rank=8))


def test_split_combine_round_trip(base_params, lora_params):
    trainable, frozen = split_trainable(lora_params, "lora")
    t, f = _flat(trainable), _flat(frozen)
    assert t and all(k.rsplit("/", 1)[1] in ("lora_a", "lora_b") for k in t)
    assert not any("lora_" in k for k in f)
    assert count_params(trainable) + count_params(frozen) == count_params(lora_params)
    back = _flat(combine(trainable, frozen))
    assert back.keys() == _flat(lora_params).keys()
    assert all(np.array_equal(back[k], v) for k, v in _flat(lora_params).items())

    for mode in ("full", "scratch"):
        trainable, frozen = split_trainable(base_params, mode)
        assert frozen == {} and trainable is base_params
        assert combine(trainable, frozen).keys() == base_params.keys()
    with pytest.raises(ValueError, match="no lora_a/lora_b"):
        split_trainable(base_params, "lora")
    with pytest.raises(ValueError, match="unknown training mode"):
        split_trainable(base_params, "qlora")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="both halves"):
        combine(base_params, {"final_norm": base_params["final_norm"]})


def test_attach_base_refuses_mismatches(cfg, lora_cfg, base_params, lora_params):
    other = _zeros_like_shapes(Transformer(cfg.model_copy(update={"d_ff": 32})))
    with pytest.raises(CheckpointMismatchError, match=r"block_0/mlp/gate_proj/kernel: base shape \(32, 32\)"):
        attach_base(lora_params, other)
    with pytest.raises(CheckpointMismatchError, match="merge_lora it first"):
        attach_base(lora_params, lora_params)
    missing = {k: v for k, v in base_params.items() if k != "final_norm"}
    with pytest.raises(CheckpointMismatchError, match="final_norm/scale"):
        attach_base(lora_params, missing)


def test_count_params_matches_formula(cfg, lora_cfg, base_params, lora_params):
    d, f, v, hd = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.head_dim
    q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    per_block = 2 * d + d * q + 2 * d * kv + q * d + 3 * d * f
    assert count_params(base_params) == v * d + cfg.n_layers * per_block + d
    r = lora_cfg.rank
    adapters = r * ((d + q) + 2 * (d + kv) + (q + d) + 2 * (d + f) + (f + d))
    assert count_params(lora_params) - count_params(base_params) == cfg.n_layers * adapters


def test_grads_before_input_is_an_exact_identity_with_the_same_gradients():
    """The scheduling dependency in LoraDense's backward changes no value: forward and every gradient are bit-equal."""
    import jax
    import jax.numpy as jnp

    from needle.model.decoder.recompute import grads_before_input

    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(0), 4)
    x = jax.random.normal(k1, (6, 8))
    a = jax.random.normal(k2, (8, 4))
    b = jax.random.normal(k3, (4, 5))
    w = jax.random.normal(k4, (8, 5))

    def plain(x, a, b):
        return jnp.sum(jnp.tanh(x @ w + (x @ a) @ b))

    def tied(x, a, b):
        xa, a, b = grads_before_input(x, a, b)
        return jnp.sum(jnp.tanh(xa @ w + (xa @ a) @ b))

    assert float(plain(x, a, b)) == float(tied(x, a, b))
    for g_plain, g_tied in zip(jax.grad(plain, (0, 1, 2))(x, a, b), jax.grad(tied, (0, 1, 2))(x, a, b)):
        assert jnp.array_equal(g_plain, g_tied)


@pytest.mark.parametrize(("backend", "tied"), [("cpu", 3), ("tpu", 0), ("gpu", 0)])
def test_adapter_gradients_are_ordered_on_the_cpu_only(cfg, backend, tied):
    """The CPU scheduler's workaround (grads_before_input, a custom VJP per adapted projection) is
    in the CPU's program and not in an accelerator's, whose values it would not change anyway."""
    import dataclasses

    from needle.hardware import settings_for
    from needle.model.decoder.block import Mlp

    settings = dataclasses.replace(settings_for(backend), compute_dtype="float32")
    mlp = Mlp(cfg, LoraConfig(rank=4, targets=("gate", "up", "down")), settings)
    x = jnp.ones((2, 3, cfg.d_model))
    params = mlp.init(jax.random.PRNGKey(0), x)["params"]
    params = jax.tree.map(lambda a: a + 0.1, params)  # lora_b starts at zero: nonzero adapter gradients
    program = str(jax.make_jaxpr(lambda p: mlp.apply({"params": p}, x))(params))
    assert program.count("custom_vjp_call") == tied
    grads = jax.grad(lambda p: jnp.sum(jnp.tanh(mlp.apply({"params": p}, x))))(params)
    ordered = dataclasses.replace(mlp, settings=settings_for("cpu"))
    grads_cpu = jax.grad(lambda p: jnp.sum(jnp.tanh(ordered.apply({"params": p}, x))))(params)
    for g, g_cpu in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_cpu)):
        assert jnp.array_equal(g, g_cpu)


@pytest.mark.parametrize("rank", [0, 4])
def test_heads_layout_projection_equals_the_flat_one(rank):
    """LoraDense(heads=H), q/k/v's form off the CPU, is the flat projection as [..., H, F/H]:
    the same parameters, outputs and (to float rounding) gradients, bias and adapter included."""
    from needle.model.decoder.layers import LoraDense

    x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 24))
    flat = LoraDense(32, rank=rank, scale=2.0, use_bias=True, order_grads=False)
    headed = LoraDense(32, rank=rank, scale=2.0, use_bias=True, order_grads=False, heads=4)
    params = flat.init(jax.random.PRNGKey(1), x)
    params = jax.tree.map(lambda a: a + 0.1, params)  # a non-zero lora_b and bias
    assert jax.tree.map(jnp.shape, headed.init(jax.random.PRNGKey(1), x)) == jax.tree.map(jnp.shape, params)
    out = headed.apply(params, x)
    assert out.shape == (2, 5, 4, 8)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(flat.apply(params, x)).reshape(2, 5, 4, 8))

    def grads(layer):
        return jax.grad(lambda p, x: jnp.sum(jnp.sin(layer.apply(p, x))), argnums=(0, 1))(params, x)

    for a, b in zip(jax.tree.leaves(grads(headed)), jax.tree.leaves(grads(flat))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_recompute_policy_gives_the_same_loss_and_gradients_as_no_remat():
    """remat="recompute" (a custom VJP that keeps only each block's input) changes no value."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from needle.config import LoraConfig
    from needle.hardware import settings_for
    from needle.model import lora as lora_lib
    from needle.model.hf.config import hf_config_to_model_config
    from needle.model.hf.random_model import shape_config
    from needle.model.decoder.transformer import Transformer

    cfg = hf_config_to_model_config({**shape_config("smollm2-135m"), "num_hidden_layers": 2, "vocab_size": 512}, max_len=64)
    lcfg, base = LoraConfig(rank=4), settings_for("cpu")
    trainable, frozen = lora_lib.split_trainable(lora_lib.init_params(cfg, lcfg, 0, base), "lora")
    trainable = jax.tree.map(lambda a: a + 0.01, trainable)  # B starts at zero: give A a gradient
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 512, (2, 32)), jnp.int32)
    segments = jnp.asarray([[1] * 20 + [2] * 12, [1] * 32], jnp.int32)

    def loss(tr, policy):
        model = Transformer(cfg, lcfg, dataclasses.replace(base, remat=policy))
        logits = model.apply({"params": lora_lib.combine(tr, frozen)}, ids, segment_ids=segments)
        return jnp.mean(logits**2)

    want, got = jax.value_and_grad(loss)(trainable, "none"), jax.value_and_grad(loss)(trainable, "recompute")
    assert float(want[0]) == float(got[0])
    for a, b in zip(jax.tree.leaves(want[1]), jax.tree.leaves(got[1])):
        assert jnp.max(jnp.abs(a)) > 0
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)


def test_init_adapters_computes_the_adapters_of_init_params_only():
    """The adapters a LoRA run starts from are init_params' own (same seed, same values below
    EAGER_INIT_MIN_LAYERS); the base leaves, replaced by the base's weights anyway, are only shapes."""
    from needle.config import LoraConfig, model_preset
    from needle.model.lora import init_adapters, init_params, split_trainable

    cfg, lora = model_preset("tiny"), LoraConfig(rank=4)
    full = init_params(cfg, lora, 3)
    cheap = init_adapters(cfg, lora, 3)
    assert jax.tree.structure(cheap) == jax.tree.structure(full)
    (ta, fa), (tb, fb) = split_trainable(cheap, "lora"), split_trainable(full, "lora")
    for a, b in zip(jax.tree.leaves(ta), jax.tree.leaves(tb)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(fa))
    assert [x.shape for x in jax.tree.leaves(fa)] == [x.shape for x in jax.tree.leaves(fb)]


def test_a_deep_model_initialises_op_by_op_with_the_jitted_values(monkeypatch):
    """From EAGER_INIT_MIN_LAYERS layers init_params runs op by op (one small program per distinct
    shape, not one program with a generator per leaf): the same tree, dtypes and values to float
    rounding; shallower models keep the jitted program's exact values."""
    from needle.config import LoraConfig, model_preset
    from needle.model import lora as lora_lib

    lora, make_init, traced = LoraConfig(rank=4), lora_lib._initializer, []

    def recording(*args):  # the init's key is a tracer exactly when the init runs under jit
        init, key = make_init(*args)
        return (lambda k: traced.append(isinstance(k, jax.core.Tracer)) or init(k)), key

    monkeypatch.setattr(lora_lib, "_initializer", recording)
    for n_layers, exact in ((2, True), (lora_lib.EAGER_INIT_MIN_LAYERS, False)):
        cfg = model_preset("tiny", n_layers=n_layers)
        init, key = make_init(cfg, lora, 5, None)
        jitted = jax.jit(init)(key)
        traced.clear()
        got = lora_lib.init_params(cfg, lora, 5)
        assert traced == [exact]  # one call of the init: traced for the shallow model, concrete for the deep one
        assert jax.tree.structure(got) == jax.tree.structure(jitted)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(jitted)):
            assert a.dtype == b.dtype and a.shape == b.shape
            if exact:
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            else:
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
