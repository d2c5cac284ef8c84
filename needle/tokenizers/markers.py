"""Needle 3's fixed special ids and chat markers (cactus-needle 3.x's ``tokenizer.model``).

They sit apart from the tokenizer (needle/tokenizers/needle3.py, which needs sentencepiece) so
that the row format (needle/data/needle3_format.py) and the call parser (needle/data/parse.py)
share them without importing the tokenizer, which hands out the format: every import points down.
"""

from __future__ import annotations

PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
THINK_START, THINK_END = "<think>", "</think>"
TOOLS_START, TOOLS_END = "<tools>", "</tools>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESULT_START, TOOL_RESULT_END = "<tool_result>", "</tool_result>"
# The reference's CHAT_MARKERS, in id order from 4. Ids 4..13 are hard-wired in its code and are
# checked on load; the later ones (<context>, <extract>, <schema> pairs) are checked when present.
MARKERS: tuple[str, ...] = (
    IM_START, IM_END, THINK_START, THINK_END, TOOLS_START, TOOLS_END, TOOL_CALL_START, TOOL_CALL_END,
    TOOL_RESULT_START, TOOL_RESULT_END, "<context>", "</context>", "<extract>", "</extract>", "<schema>", "</schema>",
)  # fmt: skip
FIRST_MARKER_ID = 4
N_FIXED_MARKERS = 10  # <|im_start|> .. </tool_result>: ids 4..13
IM_END_ID = FIRST_MARKER_ID + MARKERS.index(IM_END)
