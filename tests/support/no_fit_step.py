"""A step too large for a v5e chip's 16 GiB (a CLI target, `tests/support/no_fit_step.py:make_step`):
the example MoE, which gathers the sequence over `context`, at 65536 tokens of 4096 per
sequence. The TPU compiler refuses it for lack of HBM (35 GiB of temporaries on
`v5e:2x2`, data=1 x context=4), in about 2 s."""

from shardlint.examples.steps import Sizes
from shardlint.examples.steps import make_step as _make_step

SIZES = Sizes(batch=4, seq=65536, emb=4096, mlp=128, experts=4, top_k=2)


def make_step(mesh):
    return _make_step(mesh, SIZES)
