"""Schema-constrained tool calls: moved to needle/eval/constrain.py, where decoding lives.

Evaluation (needle/eval/decode.py, evaluate.py) and serving (needle/serve/engine.py) share the
grammars and token masks through that lower module, so needle/eval never imports needle/serve
for them. This module re-exports its names: ``from needle.serve.constrain import Constraints``
keeps working.
"""

from needle.eval.constrain import *  # noqa: F401,F403
from needle.eval.constrain import CLOSE_RESERVE, BatchMasks, Constraints, ToolSchemaError, UnsupportedFormat  # noqa: F401
