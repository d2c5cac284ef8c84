"""The tokenizers: ``base`` (special tokens, file names, the protocol), ``native`` (needle's BPE),
``hf`` (a pretrained model's tokenizer.json), ``needle3`` (SentencePiece) with its ``markers``, and
``load`` (``load_tokenizer``, which picks among them)."""
