"""GGUF tensors <-> needle's parameter tree: llama.cpp's names, its q/k row order, Gemma's norms.

The names come from the Hugging Face key map (needle/model/hf/weights.py: ``hf_key_map``) renamed
the way llama.cpp's ``convert_hf_to_gguf.py`` renames them (``model.layers.0.self_attn.q_proj.weight``
-> ``blk.0.attn_q.weight``). A GGUF tensor in numpy layout is the Hugging Face tensor (``[out, in]``),
with two differences the converter makes and this module undoes (import) or redoes (export):

- ``llama``: q and k rows are permuted from the half-split RoPE layout to llama.cpp's interleaved
  pairs (``LlamaModel.permute``);
- ``gemma3``: norm weights are stored as ``1 + w`` (llama.cpp's RMSNorm scales by the weight itself).

    params = load_gguf_params(read_gguf("m.gguf"), cfg)      # float32 jax arrays
    tensors = params_to_gguf_tensors(params, cfg)             # {gguf name: float32 numpy}, for GGUFWriter
"""

from __future__ import annotations

import numpy as np

from needle.config import ModelConfig
from needle.model.gguf.config import HF_TO_GGUF, llama3_factors
from needle.model.gguf.reader import SUPPORTED_TYPES, GGUFFile
from needle.model.hf.weights import KeyMap, expected_shapes, hf_key_map, params_to_hf_tensors
from needle.model.lora import Params

_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}  # fmt: skip
_PROJ = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "input_layernorm": "attn_norm"}  # fmt: skip
# post_attention_layernorm is the MLP's input norm in Llama/Qwen, the attention output's in Gemma 3.
_NORMS = {False: {"post_attention_layernorm": "ffn_norm"},
          True: {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                 "post_feedforward_layernorm": "post_ffw_norm"}}  # fmt: skip


def gguf_name(hf_key: str, post_norms: bool) -> str:
    """llama.cpp's name of a Hugging Face tensor key."""
    if hf_key in _TOP:
        return _TOP[hf_key]
    _, _, layer, rest = hf_key.split(".", 3)  # model.layers.N.<module>.<weight|bias>
    module, leaf = rest.rsplit(".", 1)
    names = {**_PROJ, **_NORMS[post_norms]}
    return f"blk.{layer}.{names[module]}.{leaf}"


def gguf_key_map(cfg: ModelConfig) -> KeyMap:
    """``{gguf name: (needle path, transposed)}`` for every tensor a GGUF file of ``cfg`` holds."""
    return {gguf_name(k, cfg.post_norms): v for k, v in hf_key_map(cfg).items()}


def _permute(w: np.ndarray, heads: int, undo: bool) -> np.ndarray:
    """llama.cpp's q/k row permutation (half-split RoPE pairs <-> interleaved pairs), or its inverse."""
    rows = w.shape[0]
    split = (heads, rows // heads // 2, 2) if undo else (heads, 2, rows // heads // 2)
    return w.reshape(*split, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _convert(name: str, w: np.ndarray, cfg: ModelConfig, undo: bool) -> np.ndarray:
    """Undo (import) or redo (export) what llama.cpp's converter does to tensor ``name`` (HF layout)."""
    arch = HF_TO_GGUF[cfg.arch]
    if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
        return _permute(w, cfg.n_heads if ".attn_q." in name else cfg.n_kv_heads, undo)
    if arch == "gemma3" and name.endswith("norm.weight"):
        return w - 1.0 if undo else w + 1.0
    return w


def check_tensors(f: GGUFFile, cfg: ModelConfig) -> None:
    """Names and shapes against ``cfg``; every mismatch is named before any weight is read."""
    keys = gguf_key_map(cfg)
    want = {gguf_name(k, cfg.post_norms): s for k, s in expected_shapes(cfg).items()}
    found = {n: t.shape for n, t in f.tensors.items() if n != "rope_freqs.weight"}
    if cfg.tie_embeddings:
        found.pop("output.weight", None)
    problems = [f"missing tensor {n} (shape {list(want[n])})" for n in keys if n not in found]
    problems += [f"unexpected tensor {n} (shape {list(found[n])})" for n in found if n not in keys]
    problems += [f"tensor {n} has shape {list(found[n])}, the metadata implies {list(want[n])}"
                 for n in keys if n in found and found[n] != want[n]]  # fmt: skip
    if problems:
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise f.fail("tensors do not match the metadata:\n  " + "\n  ".join(problems[:10]) + more)

    odd = sorted({f"{t.type_name} ({n})" for n, t in f.tensors.items() if n in keys and t.type_name not in SUPPORTED_TYPES})
    if odd:
        raise f.fail(f"unsupported tensor type {odd[0]}; needle dequantises {', '.join(SUPPORTED_TYPES)}")


def load_gguf_params(f: GGUFFile, cfg: ModelConfig) -> Params:
    """Every tensor dequantised to float32, converted back to the HF layout and placed in needle's tree."""
    import jax
    from flax import traverse_util

    check_tensors(f, cfg)
    flat = {}
    for name, (path, transposed) in gguf_key_map(cfg).items():
        w = _convert(name, f.tensor(name), cfg, undo=True)
        flat[path] = jax.device_put(np.ascontiguousarray(w.T) if transposed else w)
        del w
    return traverse_util.unflatten_dict(flat)


def params_to_gguf_tensors(params: Params, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Needle params -> ``{gguf name: float32 array}`` in llama.cpp's layout (the inverse of the above)."""
    hf = params_to_hf_tensors(params, cfg, np.float32)
    out = {(n := gguf_name(k, cfg.post_norms)): _convert(n, np.asarray(v), cfg, undo=False) for k, v in hf.items()}
    factors = llama3_factors(cfg)
    if factors is not None:  # Llama 3.x: llama.cpp reads its RoPE scaling from this tensor
        out["rope_freqs.weight"] = factors
    return out
