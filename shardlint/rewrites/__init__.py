"""Rewrites: put the sharding-preserving routed MoE into a step."""

from ._step import JittedStep as JittedStep
from .._token_axes import TokenAxes as TokenAxes
from ._rewrite import rewrite as rewrite
from ._rewritten import RewrittenStep as RewrittenStep
from ._verify import verify_same as verify_same
from ._swap import SwappedStep as SwappedStep
from .._wrapped import Wrapped as Wrapped
