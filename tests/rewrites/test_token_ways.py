"""Routed layers whose lossy ops see the tokens sharded in two ways (a second layer that
reads them as (seq, batch)): the refusal says both ways in words, with the op and line of
each, and advises the command line that names each; each advice, followed, rewrites the
step with the same numbers instead of refusing again."""

from __future__ import annotations

import re

import pytest

from shardlint.cli import main

TWO_WAYS = '''
import functools

import jax
import jax.numpy as jnp

from shardlint.examples.steps import routed_moe
from support.cause_steps import TOP_K, _batch, _moe_params

MOE = functools.partial(routed_moe, top_k=TOP_K)


def make_step(mesh):
    """Two routed layers: the first reads (batch, seq), the second the transpose."""
    def step(params, x_BSD):
        def loss(params):
            y_BSD = x_BSD + MOE(params[0], x_BSD)
            y_SBD = y_BSD.transpose(1, 0, 2)
            return jnp.mean((y_SBD + MOE(params[1], y_SBD)) ** 2)
        return jax.value_and_grad(loss)(params)
    return step, ([_moe_params(mesh), _moe_params(mesh)], _batch(mesh))
'''


def _rewrite(target, capsys, *words):
    code = main(["analyze", target, "--mesh", "data=2,context=4", "--rewrite", *words])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("two_ways") / "two_ways.py"
    path.write_text(TWO_WAYS)
    return f"{path}:make_step"


def test_the_refusal_says_both_ways_in_words_and_each_advice_rewrites_the_step(target, capsys):
    code, _, err = _rewrite(target, capsys)
    refusal = err.strip().splitlines()[-1]
    assert code == 2 and "sharded 2 ways: batch over data, sequence over context (reshape at " in refusal
    assert "batch over context, sequence over data (reshape at " in refusal
    assert not re.search(r"\(\(|\('|',\)", refusal), refusal       # no Python tuples
    advice = re.findall(r"(--batch-axes \S+ --seq-axes [^\s(]+)", refusal)
    assert len(advice) == 2
    for words in advice:
        code, out, err = _rewrite(target, capsys, *words.split())
        assert code == 0, err[-1500:]
        assert "verifying the rewrite" in err and "no findings" in out
