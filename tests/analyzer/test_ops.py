"""The op table answers each consumer's question with the members it had before the table."""

from __future__ import annotations

from shardlint import _ops


def test_each_role_keeps_its_members():
    cumulative = {"cumsum", "cumprod", "cummax", "cummin"}
    scatters = {"scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter-min", "scatter-max"}
    windows = {"reduce_window", "reduce_window_sum", "reduce_window_max"}
    tokens = {"sort", "argsort", "top_k", "cumlogsumexp", "segment_sum"} | cumulative | scatters | windows
    assert _ops.TOKEN_PRIMITIVES == tokens
    assert _ops.NEEDS_WHOLE == tokens | {"reshape", "gather", "dynamic_slice", "dynamic_update_slice",
                                         "custom_call", "pallas_call", "ragged_dot", "ragged_dot_general"}
    assert _ops.TOKEN_OPCODES == {"sort", "reduce-window", "scatter"}
    assert _ops.SAME_DIMS == {"convert_element_type", "copy", "copy_p", "sharding_constraint", "reshard",
                              "mesh_cast"}
    assert _ops.JAXPR_LAYOUT == _ops.SAME_DIMS | {"transpose", "reshape", "squeeze", "expand_dims"}
    assert _ops.WEIGHT_PATH_OPCODES == {"convert", "copy", "bitcast", "reshape", "transpose",
                                        "get-tuple-element", "dynamic-slice", "all-gather", "parameter",
                                        "broadcast", "slice"}
    assert _ops.ROUTING_PRIMITIVES == {"top_k", "sort", "scatter", "scatter-add", "scatter_add", "gather",
                                       "argmax", "argmin"} | cumulative
    assert _ops.ROUTING_FINDING_OPS == {"top_k", "scatter", "scatter-add", "gather", "sort", "cumsum",
                                        "reduce-window", "dot_general"}
    assert _ops.WRITTEN_COLLECTIVES == {"all_gather", "all_gather_invariant", "all_to_all",
                                        "ragged_all_to_all", "ppermute", "psum", "pmax", "pmin",
                                        "psum_scatter", "reduce_scatter", "pbroadcast", "pgather"}


def test_a_role_is_read_in_the_spelling_it_is_listed_under():
    # reshape needs its dimension whole as JAX names it; as an opcode it is a weight's layout op
    assert "reshape" in _ops.primitives(_ops.Role.WHOLE)
    assert "reshape" not in _ops.opcodes(_ops.Role.WHOLE)
    assert "convert" in _ops.opcodes(_ops.Role.WEIGHT_PATH)
    assert "convert" not in _ops.primitives(_ops.Role.LAYOUT)
    assert "convert_element_type" in _ops.primitives(_ops.Role.LAYOUT)
