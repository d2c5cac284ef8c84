"""Needle 3 port (needle/model/needle3) against cactus-needle 3.2.8's own outputs.

The fixtures in tests/fixtures/needle3/ were computed by the reference package in its side
virtualenv (tests/model/make_needle3_fixtures.py says how to regenerate them); these tests only
read them. Configs: "full" (Engram, 4 mHC lanes, sliding window, conv taps), "plain" (all of
those off, out_vocab, non-flash attention), "odd" (padded Hadamard, 3 n-gram orders, seed heads,
width-ladder perms, CQ 4-bit KV, 6-bit activations), "bf16" (bfloat16 compute).
"""

from __future__ import annotations

import json
import struct
from functools import lru_cache
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from needle.config import LoraConfig
from needle.errors import ModelImportError
from needle.model.lora import combine, merge_lora, split_trainable
from needle.model.needle3.architecture import Needle3Model
from needle.model.needle3.checkpoint import (
    Needle3CheckpointError, needle3_model_config, read_needle3_checkpoint, write_needle3_checkpoint,
)  # fmt: skip
from needle.model.decoder.transformer import init_cache

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "needle3"
NAMES = ("full", "plain", "odd", "bf16")
TOL = {"float32": 1e-4, "bfloat16": 3e-2}


@lru_cache(maxsize=None)
def fixture(name: str) -> tuple[dict, dict, dict]:
    """(params, config dict, reference outputs) straight from the committed files."""
    path = FIXTURES / f"{name}.safetensors"
    with safe_open(str(path), framework="np") as f:
        config = json.loads(f.metadata()["config"])
    params = traverse_util.unflatten_dict({tuple(k.split("/")): v for k, v in load_file(str(path)).items()})
    with np.load(FIXTURES / f"{name}.npz", allow_pickle=False) as z:
        ref = {k: z[k] for k in z.files}
    return params, config, ref


@lru_cache(maxsize=None)
def forward(model: Needle3Model, quant: bool | None = None):
    """Jitted ids -> logits through ``return_hidden`` then ``method="logits"`` (the chunked-loss
    pair); one compilation per (model, quant) shared by the tests (compiles dominate their time)."""

    def run(p, ids):
        hidden = model.apply({"params": p}, ids, quant=quant, return_hidden=True)
        return model.apply({"params": p}, hidden, quant=quant, method="logits")

    return jax.jit(run)


def model_of(name: str, **kw) -> Needle3Model:
    return Needle3Model(needle3_model_config(fixture(name)[1]), **kw)


@pytest.mark.parametrize(
    "name", ["full", "plain", pytest.param("odd", marks=pytest.mark.slow), pytest.param("bf16", marks=pytest.mark.slow)]
)
def test_logits_match_reference_plain_and_quant(name: str) -> None:
    params, config, ref = fixture(name)
    model = model_of(name)
    tol = TOL[config["dtype"]]
    tokens = jnp.asarray(ref["tokens"])
    for quant, want in ((False, ref["logits"]), (True, ref["quant_logits"])):
        got = np.asarray(forward(model, quant)(params, tokens))
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=tol, rtol=0, err_msg=f"{name} quant={quant}")


def test_parameter_tree_is_the_references() -> None:
    params, config, _ = fixture("full")
    model = model_of("full")
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    mine = {k: v.shape for k, v in traverse_util.flatten_dict(shapes).items()}
    theirs = {k: v.shape for k, v in traverse_util.flatten_dict(params).items()}
    assert mine == theirs


def test_logits_of_a_hidden_chunk() -> None:
    """``method="logits"`` on a slice of hidden states gives that slice of the logits."""
    params, _, ref = fixture("plain")
    model = model_of("plain")
    hidden = jax.random.normal(jax.random.key(0), (2, 3, 32))
    whole = model.apply({"params": params}, hidden, method="logits")
    assert whole.shape == (2, 3, 48) and whole.dtype == jnp.float32  # out_vocab rows of the table
    np.testing.assert_array_equal(model.apply({"params": params}, hidden[:, 1:2], method="logits"), whole[:, 1:2])


def test_chunked_loss_and_grads_equal_dense() -> None:
    """needle/train/loss.py's fused chunked loss through Needle 3's tied head (``head_names``, the
    out_vocab-cut table): loss and every gradient, the head's included, equal the dense path's."""
    from loss_checks import assert_chunked_equals_dense

    params, _, ref = fixture("plain")
    tokens = jnp.asarray(ref["tokens"])
    rng = np.random.default_rng(0)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:] % 48,  # out_vocab 48
             "mask": jnp.asarray(rng.random(tokens[:, 1:].shape) > 0.3, jnp.float32)}  # fmt: skip
    grads = assert_chunked_equals_dense(model_of("plain"), params, batch, (5,))
    assert float(jnp.abs(grads["embedding"]["embedding"]).max()) > 0


def _with_lora(params: dict, lora_path: Path, rank: int) -> dict:
    flat = traverse_util.flatten_dict(params)
    for name, value in load_file(str(lora_path)).items():
        *module, matrix = name.split("/")
        kernel_path = tuple(module)
        assert kernel_path in flat, name
        flat[kernel_path[:-1] + ("lora_a" if matrix == "A" else "lora_b",)] = value
    return traverse_util.unflatten_dict(flat)


@pytest.mark.slow
def test_qat_lora_matches_reference_loss_forward() -> None:
    """LoRA + QAT = the reference's loss_fn: cq_ste_params(merge_lora(...)) with quant=True."""
    params, _, ref = fixture("full")
    rank = 4
    lora = LoraConfig(rank=rank, alpha=float(ref["lora_scale"]) * rank)  # default targets, qat=True
    model = model_of("full", lora=lora)
    assert model.use_qat
    p = _with_lora(params, FIXTURES / "full_lora.safetensors", rank)
    got = np.asarray(forward(model)(p, jnp.asarray(ref["tokens"])))
    np.testing.assert_allclose(got, ref["qat_logits"], atol=1e-4, rtol=0)


def _greedy_cached(model: Needle3Model, params: dict, prompt: np.ndarray, steps: int) -> tuple[list[int], np.ndarray]:
    n = len(prompt)
    cache = init_cache(model, 1, n + steps)
    step = jax.jit(lambda c, tok, pos: model.apply({"params": params, "cache": c}, tok, pos, decode=True,
                                                   mutable=["cache"]))  # fmt: skip
    logits, upd = step(cache, jnp.asarray(prompt[None]), jnp.arange(n, dtype=jnp.int32)[None])
    seq_logits = [np.asarray(logits[0])]
    out = [int(jnp.argmax(logits[0, n - 1]))]
    for i in range(steps - 1):
        logits, upd = step(upd["cache"], jnp.asarray([[out[-1]]], jnp.int32), jnp.asarray([[n + i]], jnp.int32))
        seq_logits.append(np.asarray(logits[0]))
        out.append(int(jnp.argmax(logits[0, 0])))
    return out, np.concatenate(seq_logits)


@pytest.mark.parametrize("name", ["full", pytest.param("bf16", marks=pytest.mark.slow)])
def test_cached_greedy_equals_reference(name: str) -> None:
    """20 greedy tokens through the KV cache equal the reference's uncached generate loop."""
    params, _, ref = fixture(name)
    tokens, _ = _greedy_cached(model_of(name), params, ref["prompt"], 20)
    assert tokens == ref["greedy"].tolist()


@pytest.mark.slow
def test_needle_decoder_runs_needle3_unchanged() -> None:
    """needle/eval/decode.py's batched cached greedy decoding (prefill + while_loop) on Needle 3."""
    from needle.eval import decode

    params, _, ref = fixture("full")
    greedy = ref["greedy"].tolist()
    end = next(i for i in range(64) if i not in greedy)
    prompts = [ref["prompt"].tolist(), ref["prompt"][:4].tolist()]
    out = decode.generate(model_of("full"), params, prompts, max_new_tokens=20, end_id=[end], pad_id=0, batch_size=2)
    assert out[0] == greedy


@pytest.mark.slow
def test_cached_decoding_equals_uncached_quant_ragged_rows() -> None:
    """Cached == uncached under quant=True (KV quantisation in the cache), two rows of different
    lengths (right-padded prefill, then one token per row per step)."""
    params, _, ref = fixture("full")
    model = model_of("full")
    rows = np.asarray(ref["tokens"])
    lengths = [7, 4]
    cache = init_cache(model, 2, 12)
    prompts = np.zeros((2, 8), np.int32)
    for b, n in enumerate(lengths):
        prompts[b, :n] = rows[b, :n]
    apply = jax.jit(lambda c, t, p: model.apply({"params": params, "cache": c}, t, p, decode=True, quant=True,
                                                mutable=["cache"]))  # fmt: skip
    logits, upd = apply(cache, jnp.asarray(prompts), jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8)))
    got = [[np.asarray(logits[b, n - 1])] for b, n in enumerate(lengths)]
    cache = upd["cache"]
    for i in range(3):
        feed = jnp.asarray([[rows[b, n + i]] for b, n in enumerate(lengths)], jnp.int32)
        pos = jnp.asarray([[n + i] for n in lengths], jnp.int32)
        logits, upd = apply(cache, feed, pos)
        cache = upd["cache"]
        for b in range(2):
            got[b].append(np.asarray(logits[b, 0]))
    want = np.asarray(forward(model, True)(params, jnp.asarray(rows)))
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(np.stack(got[b]), want[b, n - 1 : n + 3], atol=1e-4, rtol=0)


def test_packed_rows_equal_rows_alone() -> None:
    """Attention, the q/k/v conv and the Engram n-grams/conv never read across a segment."""
    params, _, ref = fixture("full")
    model = model_of("full")
    rows = np.asarray(ref["tokens"])
    a, b = rows[0, :7], rows[1, :5]
    packed = np.stack([np.concatenate([a, b]), np.concatenate([b, a])])
    segs = np.asarray([[1] * 7 + [2] * 5, [1] * 5 + [2] * 7])
    pos = np.asarray([list(range(7)) + list(range(5)), list(range(5)) + list(range(7))])
    run = jax.jit(lambda p, t, q, s: model.apply({"params": p}, t, q, segment_ids=s))
    out = np.asarray(run(params, jnp.asarray(packed), jnp.asarray(pos), jnp.asarray(segs)))
    alone = np.asarray(forward(model, None)(params, jnp.asarray(rows)))  # causal: row prefixes are alone
    np.testing.assert_allclose(out[0, :7], alone[0, :7], atol=1e-5, rtol=0)
    np.testing.assert_allclose(out[0, 7:], alone[1, :5], atol=1e-5, rtol=0)
    np.testing.assert_allclose(out[1, :5], alone[1, :5], atol=1e-5, rtol=0)
    np.testing.assert_allclose(out[1, 5:], alone[0, :7], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_lora_step_trains_only_adapters_and_merge_folds_them() -> None:
    import optax

    params, _, ref = fixture("plain")
    lora = LoraConfig(rank=2, alpha=4.0, qat=False)
    model = model_of("plain", lora=lora)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(1), jnp.zeros((1, 4), jnp.int32))["params"])
    rng = np.random.default_rng(0)
    flat = {k: (rng.normal(0, 1 / 2, v.shape) if k[-1] == "lora_a" else np.zeros(v.shape)).astype(np.float32)
            for k, v in traverse_util.flatten_dict(shapes).items()}  # A ~ N(0, 1/r), B = 0 as init makes them
    lora_paths = sorted("/".join(k) for k in flat if k[-1] in ("lora_a", "lora_b"))
    projs = sorted({p.split("/")[-2] for p in lora_paths})
    assert projs == ["gate_proj", "k_proj", "out_proj", "q_proj", "v_proj"]
    a = flat[("stack", "layers", "block", "self_attn", "q_proj", "lora_a")]
    assert a.shape == (2, 32, 2) and flat[("stack", "layers", "block", "self_attn", "q_proj", "lora_b")].shape == (2, 2, 32)
    base = traverse_util.flatten_dict(params)
    p = traverse_util.unflatten_dict({**{k: v for k, v in flat.items() if k[-1] in ("lora_a", "lora_b")}, **base})
    trainable, frozen = split_trainable(p, "lora")
    tokens = jnp.asarray(ref["tokens"])

    @jax.jit
    @jax.value_and_grad
    def loss(tr):
        logits = model.apply({"params": combine(tr, frozen)}, tokens)[:, :-1]
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:] % 48).mean()  # out_vocab 48

    l0, grads = loss(trainable)
    stepped = jax.tree.map(lambda w, g: w - 0.5 * g, trainable, grads)
    assert float(loss(stepped)[0]) < float(l0)
    after = combine(stepped, frozen)
    changed = {"/".join(k) for k, v in traverse_util.flatten_dict(after).items()
               if not np.array_equal(np.asarray(v), np.asarray(traverse_util.flatten_dict(p)[k]))}  # fmt: skip
    assert changed and all(k.endswith(("lora_a", "lora_b")) for k in changed)
    merged = merge_lora(after, lora)  # needle's own merge: stacked [L, ...] adapters, scale alpha/rank
    np.testing.assert_allclose(
        np.asarray(forward(Needle3Model(model.cfg), None)(merged, tokens)),
        np.asarray(forward(model, None)(after, tokens)), atol=1e-5, rtol=0,
    )  # fmt: skip


def test_lora_without_needle3_targets_is_refused() -> None:
    with pytest.raises(ValueError, match="up/down"):
        model_of("plain", lora=LoraConfig(targets=("up", "down"))).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))


# --- checkpoints ---------------------------------------------------------------------------


def test_checkpoint_roundtrip(tmp_path: Path) -> None:
    params, config, meta = read_needle3_checkpoint(FIXTURES / "plain.safetensors")
    assert meta["step"] == 7 and meta["heads"] and meta["run"] == {"name": "plain"}
    assert config["out_vocab"] == 48 and config["engram_layers"] == []
    out = write_needle3_checkpoint(tmp_path / "x.safetensors", params, config, step=3, run={"name": "t"})
    params2, config2, meta2 = read_needle3_checkpoint(out)
    assert config2 == config and meta2["step"] == 3 and meta2["run"] == {"name": "t"}
    f1, f2 = traverse_util.flatten_dict(params), traverse_util.flatten_dict(params2)
    assert f1.keys() == f2.keys() and all(np.array_equal(f1[k], f2[k]) for k in f1)
    with safe_open(str(out), framework="np") as f:
        assert f.metadata()["format_version"] == "2"


def _rewrite(tmp_path: Path, name: str, tensors: dict | None = None, metadata: dict | None = None,
             drop: tuple = ()) -> Path:  # fmt: skip
    src = FIXTURES / "plain.safetensors"
    with safe_open(str(src), framework="np") as f:
        meta = dict(f.metadata())
    flat = {k: v for k, v in load_file(str(src)).items() if k not in drop}
    flat.update(tensors or {})
    meta.update(metadata or {})
    path = tmp_path / f"{name}.safetensors"
    save_file(flat, str(path), metadata={k: v for k, v in meta.items() if v is not None})
    return path


def test_bad_checkpoints_are_refused_with_file_and_reason(tmp_path: Path) -> None:
    config = json.loads(safe_open(str(FIXTURES / "plain.safetensors"), framework="np").metadata()["config"])
    pickle = tmp_path / "p.safetensors"
    pickle.write_bytes(b"\x80\x04\x95" + b"\0" * 64)
    zipped = tmp_path / "z.safetensors"
    zipped.write_bytes(b"PK\x03\x04" + b"\0" * 64)
    good = (FIXTURES / "plain.safetensors").read_bytes()
    short = tmp_path / "short.safetensors"
    short.write_bytes(good[: len(good) // 2])
    tiny = tmp_path / "tiny.safetensors"
    tiny.write_bytes(struct.pack("<Q", 10))
    cases = {
        tmp_path / "model.pt": "must be a .safetensors file",
        tmp_path / "absent.safetensors": "no such checkpoint file",
        pickle: "pickle",
        zipped: "zip",
        short: "truncated",
        tiny: "truncated",
        _rewrite(tmp_path, "noconfig", metadata={"config": None}): "no 'config' metadata",
        _rewrite(tmp_path, "v1", metadata={"format_version": "1"}): "format-v2",
        _rewrite(tmp_path, "n2", metadata={"config": json.dumps({"attn_dim": 64, "d_model": 32})}): "Needle 2",
        _rewrite(tmp_path, "switch", metadata={"config": json.dumps({**config, "engram_layers": [5]})}): "unsupported",
        _rewrite(tmp_path, "unknown", metadata={"config": json.dumps({**config, "bogus": 1})}): "unsupported",
        _rewrite(tmp_path, "missing", drop=("stack/final_norm/scale",)): "lacks 1 tensors",
        _rewrite(tmp_path, "extra", {"stack/extra": np.zeros(2, np.float32)}): "does not have",
        _rewrite(tmp_path, "shape", {"stack/final_norm/scale": np.zeros(5, np.float32)}): "shape (5,)",
        _rewrite(tmp_path, "ab", {"ab_scales/x/a": np.zeros(2, np.float32)}): "ab_scales",
    }
    for path, reason in cases.items():
        with pytest.raises(Needle3CheckpointError) as err:
            read_needle3_checkpoint(path)
        assert isinstance(err.value, ModelImportError)
        assert str(path) in str(err.value) and reason in str(err.value), (path, str(err.value))


def test_writer_refuses_lora_leaves(tmp_path: Path) -> None:
    params, config, _ = read_needle3_checkpoint(FIXTURES / "plain.safetensors")
    params["stack"]["layers"]["block"]["self_attn"]["q_proj"]["lora_a"] = np.zeros((2, 32, 2), np.float32)
    with pytest.raises(Needle3CheckpointError, match="LoRA"):
        write_needle3_checkpoint(tmp_path / "x.safetensors", params, config)
