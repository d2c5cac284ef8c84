"""``load_tokenizer``: the tokenizer on disk, whichever family wrote it.

The one module above the three tokenizers (native, Hugging Face, Needle 3) that chooses among
them by what the directory holds; everything that reads a model's tokenizer calls it.

    tok = load_tokenizer("out/")     # Tokenizer, HFTokenizer or Needle3Tokenizer
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as RawTokenizer

from needle.tokenizers.base import SP_MODEL_FILE, TOKENIZER_FILE, TokenizerLike
from needle.tokenizers.hf import HFTokenizer
from needle.tokenizers.native import Tokenizer, native_specials_problem
from needle.tokenizers.needle3 import Needle3Tokenizer


def load_tokenizer(path: str | Path) -> TokenizerLike:
    """The tokenizer in ``path`` (a directory, or its tokenizer.json): native or Hugging Face.

    A tokenizer.json whose first ids are needle's ``SPECIAL_TOKENS`` is needle's own
    (``Tokenizer``, byte-identical behaviour); anything else is a pretrained model's tokenizer,
    read with its tokenizer_config.json, chat template and generation_config.json
    (``HFTokenizer``). A directory with Needle 3's SentencePiece ``tokenizer.model`` (and no
    tokenizer.json), or that ``.model`` file, is ``Needle3Tokenizer`` (needle/tokenizers/needle3.py).
    """
    p = Path(path)
    if (p.is_dir() and (p / SP_MODEL_FILE).is_file() and not (p / TOKENIZER_FILE).is_file()) or (
        p.is_file() and p.suffix == ".model"
    ):
        return Needle3Tokenizer.load(p)
    file = p / TOKENIZER_FILE if p.is_dir() else p
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no tokenizer.json here")
    raw = RawTokenizer.from_str(file.read_text(encoding="utf-8"))
    if native_specials_problem(raw) is None:
        return Tokenizer(raw)
    return HFTokenizer.load(file.parent)
