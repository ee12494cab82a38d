"""Stage 3 of the analysis: the propagated program as a graph, how often each computation
runs, which values are weights, and the grouped-matmul patterns asked of it."""

from ._dataflow import Provenance as Provenance
from ._dataflow import provenance as provenance
from ._graph import around as around
from ._graph import build_graph as build_graph
from ._graph import dims_of as dims_of
from ._graph import node_of as node_of
from ._graph import operand_of as operand_of
from ._graph import sharding_of as sharding_of
from ._graph import source_of as source_of
from ._graph import stack_key as stack_key
from ._patterns import contracted_tokens as contracted_tokens
from ._patterns import feeds_grouped_matmul as feeds_grouped_matmul
from ._patterns import matmuls_after_dispatch as matmuls_after_dispatch
from ._trips import executions as executions
