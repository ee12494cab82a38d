"""Shared pieces of the report tests: the example steps compiled once, and an HTML reader.

Compiles dominate the run time on a 2-core machine, so the example pair (the routed MoE
that loses context sharding, and the per-shard version that keeps it) and a small sweep
are analyzed once per session and every test reads the same analyses. The pages are
read back with `html.parser` into a tiny tree, so tests assert on what the page shows,
not on substrings of the template.
"""

from __future__ import annotations

import dataclasses
from html.parser import HTMLParser

import pytest

from shardlint import analyze
from shardlint.examples import steps

from support import build_mesh
from support.synthetic import many_collectives

MESH = {"data": 2, "context": 4}
SWEEP_VALUES = (1, 2, 4)


def _analyze(make, axes):
    fn, args = make(build_mesh(axes))
    return analyze(fn, *args)


@pytest.fixture(scope="session")
def pair():
    """(before, after): make_step and make_per_shard_step on data=2, context=4."""
    return _analyze(steps.make_step, MESH), _analyze(steps.make_per_shard_step, MESH)


@pytest.fixture(scope="session")
def sweep(pair):
    """The documented sweep structure over context=1,2,4 (context=4 reuses `pair`)."""
    points = []
    for value in SWEEP_VALUES:
        if value == MESH["context"]:
            before, after = pair
        else:
            axes = {**MESH, "context": value}
            before, after = _analyze(steps.make_step, axes), _analyze(steps.make_per_shard_step, axes)
        points.append({"value": value, "before": before, "after": after})
    return {"axis": "context", "points": points}


@pytest.fixture(scope="session")
def synthetic():
    """An unrolled 48-layer model's collectives: ~100 per layer from the same code (one
    collective key, so one row with a count) plus a few whose shape depends on the layer."""
    return many_collectives


# ------------------------------------------------------------------ reading the page

_VOID = {"meta", "br", "input", "img", "link", "hr", "col", "source", "wbr", "area", "base"}


@dataclasses.dataclass(eq=False)
class Element:
    tag: str
    attrs: dict[str, str]
    children: list = dataclasses.field(default_factory=list)

    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def iter(self):
        yield self
        for c in self.children:
            if isinstance(c, Element):
                yield from c.iter()

    def find_all(self, tag: str | None = None, **attrs: str | bool) -> list[Element]:
        """Descendants (self included) with `tag` and attributes; True means 'present'."""
        def ok(e):
            if tag and e.tag != tag:
                return False
            for k, v in attrs.items():
                k = k.replace("_", "-")
                if v is True and k not in e.attrs or v is not True and e.attrs.get(k) != v:
                    return False
            return True
        return [e for e in self.iter() if ok(e)]

    def find(self, tag: str | None = None, **attrs: str | bool) -> Element:
        found = self.find_all(tag, **attrs)
        assert found, f"no <{tag or '*'} {attrs}> in the page"
        return found[0]

    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())


class _Builder(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.root = Element("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag, attrs):
        e = Element(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(e)
        if tag not in _VOID:
            self.stack.append(e)

    def handle_startendtag(self, tag, attrs):
        self.stack[-1].children.append(Element(tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag):
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data):
        self.stack[-1].children.append(data)


def parse_page(text: str) -> Element:
    builder = _Builder()
    builder.feed(text)
    builder.close()
    return builder.root


@pytest.fixture(scope="session")
def parse():
    return parse_page
