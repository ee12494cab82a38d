"""Stage 1 of the rewrite: what to rewrite (the analysis's findings: `lost_in`), the step
traced once at its global shapes, and which of its values carry tokens at one shard's
shapes (`trace_step`)."""

from ._lost import Lost as Lost
from ._lost import lost_in as lost_in
from ._trace import Tokens as Tokens
from ._trace import trace_step as trace_step
from ._trace import Traces as Traces
