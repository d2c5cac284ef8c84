"""A GGUF file's tokenizer (``tokenizer.ggml.*``) as needle's ``HFTokenizer``, and back.

llama.cpp stores a byte-level BPE (``tokenizer.ggml.model`` ``gpt2``) as its token strings, merges
and token types, plus a pre-tokenizer *name* (``tokenizer.ggml.pre``) standing for a split regex it
hard-codes. Import builds the Hugging Face ``tokenizers`` object the model's own ``tokenizer.json``
holds (same vocabulary, merges and split rules, so the same ids), with control tokens as special
added tokens; the special tokens and ``tokenizer.chat_template`` become the tokenizer config and
template needle's ``HFTokenizer`` reads. Export goes the other way and names the pre-tokenizer from
the ``tokenizer.json`` pre-tokenizer it recognises (``gpt-2`` when it knows none, with a warning).

    tok = gguf_tokenizer(read_gguf("m.gguf"))            # HFTokenizer, ids as the HF tokenizer's
    meta = tokenizer_metadata(tok)                        # {"tokenizer.ggml.tokens": [...], ...}
"""

from __future__ import annotations

import json
import logging
from typing import Any

from needle.data.chat import with_tool_listing
from needle.model.gguf.reader import GGUFFile
from needle.model.gguf.spm import CONTROL, USER_DEFINED, added_tokens, spm_tokenizer_json
from needle.tokenizers.hf import HFTokenizer

log = logging.getLogger(__name__)

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_BYTES = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
_BYTES_NO_REGEX = {**_BYTES, "use_regex": False}


def _split(regex: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


# tokenizer.ggml.pre -> (tokenizer.json pre_tokenizer, ignore_merges): llama.cpp's regex per name
# (llama-vocab.cpp), spelt as the families' own tokenizer.json files spell them.
PRE_TOKENIZERS: dict[str, tuple[dict[str, Any], bool]] = {
    "gpt-2": (_BYTES, False),
    "smollm": ({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTES]}, False),
    "llama-bpe": ({"type": "Sequence", "pretokenizers": [_split(_LLAMA3), _BYTES_NO_REGEX]}, True),
    "qwen2": ({"type": "Sequence", "pretokenizers": [_split(_QWEN2), _BYTES_NO_REGEX]}, False),
}
# Other names llama.cpp gives the same split rules (llama-vocab.cpp).
PRE_ALIASES = {"llama3": "llama-bpe", "llama-v3": "llama-bpe", "starcoder": "smollm", "deepseek-r1-qwen": "qwen2"}
# Tokens llama.cpp ends generation at besides eos, found by their text (llama-vocab.cpp): needle
# stops at the same ones, so a GGUF model ends its turns where llama.cpp ends them.
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<|end_of_text|>",
             "<EOT>")  # fmt: skip


def _tokenizer_json(tokens: list[str], merges: list[str], types: list[int], pre: str, where: str) -> str:
    name = PRE_ALIASES.get(pre, pre)
    if name not in PRE_TOKENIZERS:
        log.warning("%s: pre-tokenizer %r is not one needle knows (%s); splitting text as GPT-2 does, "
                    "so ids of some texts may differ from the model's own tokenizer", where, pre, ", ".join(PRE_TOKENIZERS))  # fmt: skip
        name = "gpt-2"
    pre_tokenizer, ignore_merges = PRE_TOKENIZERS[name]
    added = added_tokens(tokens, types)
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": ignore_merges,
             "vocab": {t: i for i, t in enumerate(tokens)}, "merges": [m.split(" ", 1) for m in merges]}  # fmt: skip
    return json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"} if name == "qwen2" else None, "pre_tokenizer": pre_tokenizer,
        "post_processor": {**_BYTES_NO_REGEX, "trim_offsets": False}, "decoder": _BYTES_NO_REGEX, "model": model,
    }, ensure_ascii=False)  # fmt: skip


def gguf_tokenizer(f: GGUFFile) -> Any:
    """The ``HFTokenizer`` of ``f``'s ``tokenizer.ggml.*`` metadata and chat template."""
    from tokenizers import Tokenizer as RawTokenizer

    m = f.metadata
    kind = m.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        what = "no tokenizer" if kind is None else f"tokenizer.ggml.model {kind!r}"
        raise f.fail(f"{what}; needle reads GGUF tokenizers of type 'gpt2' (byte-level BPE) and 'llama' (SentencePiece)")
    tokens = m.get("tokenizer.ggml.tokens") or []
    types = m.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if not tokens or len(types) != len(tokens):
        raise f.fail(f"tokenizer.ggml.tokens/token_type are missing or of different lengths ({len(tokens)}, {len(types)})")
    if kind == "llama":

        scores = m.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        unk = m.get("tokenizer.ggml.unknown_token_id")
        text = spm_tokenizer_json(tokens, scores, types, bool(m.get("tokenizer.ggml.add_space_prefix", True)), unk)
    else:
        text = _tokenizer_json(tokens, m.get("tokenizer.ggml.merges") or [], types, m.get("tokenizer.ggml.pre", "default"),
                               str(f.path))  # fmt: skip
    names = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "pad_token": "padding_token_id",
             "unk_token": "unknown_token_id"}  # fmt: skip
    config: dict[str, Any] = {a: tokens[int(m[f"tokenizer.ggml.{k}"])] for a, k in names.items()
                              if 0 <= int(m.get(f"tokenizer.ggml.{k}", -1)) < len(tokens)}  # fmt: skip
    config["add_bos_token"] = bool(m.get("tokenizer.ggml.add_bos_token", False))
    template = m.get("tokenizer.chat_template")
    stops = [int(m[k]) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in m]
    stops += [i for i, t in enumerate(tokens) if t in EOG_TEXTS and types[i] in (CONTROL, USER_DEFINED)]
    try:
        return HFTokenizer(RawTokenizer.from_str(text), config, template, sorted(set(stops)), tokenizer_json=text)
    except ValueError as e:
        raise f.fail(f"tokenizer: {e}") from e


def _pre_name(raw_json: dict[str, Any]) -> str:
    """llama.cpp's pre-tokenizer name for a ``tokenizer.json`` whose pre-tokenizer is one we know."""
    pre = raw_json.get("pre_tokenizer")
    for name, (known, _) in PRE_TOKENIZERS.items():
        if pre == known or (isinstance(pre, dict) and pre.get("type") == "ByteLevel" and name == "gpt-2"
                            and pre.get("use_regex", True)):  # fmt: skip
            return name
    log.warning("the tokenizer's pre-tokenizer is none llama.cpp names; writing 'gpt-2': llama.cpp may split "
                "text differently from needle (ids given directly are unaffected)")  # fmt: skip
    return "gpt-2"


def tokenizer_metadata(tok: Any) -> dict[str, Any]:
    """``tokenizer.ggml.*`` and ``tokenizer.chat_template`` of a needle tokenizer (a byte-level BPE)."""
    raw_json = json.loads(tok.to_json())
    model = raw_json.get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError(f"only a byte-level BPE tokenizer can be written as GGUF, not {model.get('type')!r}")
    vocab = model["vocab"]
    tokens = [""] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        tokens[i] = text
    types = [1] * len(tokens)
    for added in raw_json.get("added_tokens") or []:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = CONTROL if added.get("special") else USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    meta: dict[str, Any] = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": _pre_name(raw_json),
                            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                            "tokenizer.ggml.merges": merges}  # fmt: skip
    eos, end = getattr(tok, "eos_id", None), getattr(tok, "end_id", None)
    ids = {"bos_token_id": getattr(tok, "bos_id", None), "eos_token_id": eos if eos is not None else end,
           "padding_token_id": getattr(tok, "pad_id", None), "eot_token_id": end if end != eos else None}  # fmt: skip
    meta.update({f"tokenizer.ggml.{k}": int(v) for k, v in ids.items() if v is not None})
    meta["tokenizer.ggml.add_bos_token"] = bool(getattr(tok, "add_bos_token", False))
    if getattr(tok, "chat_template", None):  # llama.cpp's OpenAI route hands it the request's tools
        meta["tokenizer.chat_template"] = with_tool_listing(tok.chat_template)
    return meta
