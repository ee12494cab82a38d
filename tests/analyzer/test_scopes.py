"""The per-scope roll-up on a real compile: the decoder's collectives by named scope and
module path (`layer_0/moe/route`), forward and backward apart, in the text output
(`--by-scope`) and the report."""

from __future__ import annotations

import functools

import shardlint
from shardlint.analyzer import scope_tree
from shardlint._op_paths import BACKWARD, FORWARD, scope_of
from shardlint.examples import decoder

from support import build_mesh


@functools.cache
def _decoder_analysis():
    mesh = build_mesh({"data": 2, "context": 4})
    fn, args = decoder.make_step(mesh, decoder.DecoderConfig(layers=2))
    return shardlint.analyze(fn, *args)


def _node(tree, *path):
    node = tree
    for name in path:
        node = next(c for c in node.children if c.name == name)
    return node


def test_every_collective_is_counted_once_at_the_root_and_in_each_enclosing_scope():
    analysis = _decoder_analysis()
    tree = scope_tree(analysis)
    assert tree.total.count == sum(c.trips or 1 for c in analysis.collectives)
    assert tree.total.bytes == sum(c.step_bytes for c in analysis.collectives)
    for node, _ in tree.walk():
        inside = [c for c in analysis.collectives if scope_of(c.op_path)[1][: len(node.path)] == node.path]
        for direction, traffic in ((FORWARD, node.forward), (BACKWARD, node.backward)):
            mine = [c for c in inside if scope_of(c.op_path)[0] == direction]
            assert traffic.count == len(mine) and traffic.bytes == sum(c.step_bytes for c in mine)
        assert sum(t.count for _, t in node.kinds) == node.total.count
        assert all(child.path[:-1] == node.path for child in node.children)


def test_the_moe_scopes_hold_the_lost_gathers_in_both_layers():
    analysis = _decoder_analysis()
    tree = scope_tree(analysis)
    lost = [c for c in analysis.all_gathers() if c.cause == "lost"]
    assert lost
    for layer in ("layer_0", "layer_1"):
        moe = _node(tree, layer, "moe")
        in_moe = [c for c in lost if scope_of(c.op_path)[1][:2] == (layer, "moe")]
        assert in_moe and dict(moe.kinds)["all-gather"].count >= len(in_moe)
    # The attention's K/V gathers are the attention's on every JAX version: JAX 0.10 labels
    # them with its projections, JAX 0.12 with the norm or the op that made K and V (which
    # once put them under `moe/flatten`); they are placed for the projections reading them.
    for layer in ("layer_0", "layer_1"):
        attention = _node(tree, layer, "attention")
        assert attention.forward.count == 1 and dict(attention.kinds) == {"all-gather": attention.total}
    placed = sum(t.count for node, _ in tree.walk() if node.path for kind, t in node.kinds
                 if kind == "all-gather" and len(node.path) == 1)
    unscoped = [c for c in analysis.all_gathers() if not scope_of(c.op_path)[1]]
    assert placed + len(unscoped) == len(analysis.all_gathers())


def test_scope_of_reads_directions_scopes_and_merged_ops():
    assert scope_of("jit(step)/transpose(jvp(layer_0))/moe/route/top_k") == (BACKWARD, ("layer_0", "moe", "route"))
    assert scope_of("jit(step)/jvp(layer_1)/attention/bsd,dhk->bshk/dot_general") == (FORWARD, ("layer_1", "attention"))
    assert scope_of("jit(step)/(jvp(ce)/reduce_sum:transpose(jvp(logits))/dot_general)") == (BACKWARD, ())
    assert scope_of("x_BSD") == (FORWARD, ())


def test_by_scope_prints_the_tree_and_the_report_draws_it(capsys, tmp_path):
    from shardlint.cli import main
    from shardlint.reports import render_html

    assert main(["analyze", "shardlint.examples.decoder:make_step", "--mesh", "data=2,context=4",
                 "--by-scope"]) == 1
    out = capsys.readouterr().out
    text = out[out.index("collectives by scope"):].splitlines()
    assert text[2].split()[0] == "step" and any(line.startswith("      moe ") for line in text)
    page = render_html(_decoder_analysis())
    assert 'data-scope="before:layer_0/moe/route"' in page and 'id="scopes"' in page
