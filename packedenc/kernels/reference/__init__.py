"""Plain-torch reference of every op the models call: the executable spec, runs on the CPU.

`ops.py` holds the forward of each op under the name it has in `packedenc.kernels.Ops`
(varlen attention in `attention.py`, DeBERTa's disentangled attention and conv in `deberta.py`);
`backward.py` the plain-torch
gradients the kernels' backward passes are tested against. This face re-exports the ops, so
`reference.layer_norm(...)` reads like the table's entry.
"""

from packedenc.kernels.reference import backward
from packedenc.kernels.reference.ops import *  # noqa: F401,F403 (the op functions, by their table names)
from packedenc.kernels.reference.ops import (  # noqa: F401 (helpers the kernels and models share)
    _ACTS, ACTIVATIONS, __all__, check_activation, check_bias,
)
