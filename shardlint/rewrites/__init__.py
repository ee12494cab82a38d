"""Rewrites: put the sharding-preserving routed MoE into a step."""

from ._step import JittedStep as JittedStep
from .._token_axes import TokenAxes as TokenAxes
from ._rewrite import RewrittenStep as RewrittenStep
from ._rewrite import rewrite as rewrite
from ._rewrite import verify_same as verify_same
from ._swap import SwappedStep as SwappedStep
from .._wrapped import Wrapped as Wrapped
