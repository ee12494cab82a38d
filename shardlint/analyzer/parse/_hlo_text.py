"""The lexical layer of HLO text, under `_hlo.py`'s parser: brackets and quotes, attribute
lists, metadata fields, integer lists, windows and dimensions.

Each helper reads one piece of an instruction's line and raises `_Unreadable` (what it
expected, what it found) when it cannot; the parser adds the line number and raises
`HloParseError`. Metadata and backend configs make long lines, so the scanners jump from
one bracket or quote to the next with `re` rather than walking characters.
"""

from __future__ import annotations

import re

from ._stack import _unquote

_OPERAND_RE = re.compile(r"%([^\s,(){}]+)")

_INT_RE = re.compile(r"-?[0-9]+")


_INT_LIST_RE = re.compile(r"\{\s*(?:-?[0-9]+\s*(?:,\s*-?[0-9]+\s*)*)?\}|-?[0-9]+(?:\s*,\s*-?[0-9]+)*")


_WINDOW_RE = re.compile(r"\{\s*(?:[a-z_]+=[0-9x_\-]+\s*)*\}|")


class _Unreadable(Exception):
    """Text a helper cannot read; the caller adds the line and raises HloParseError."""

    def __init__(self, expected: str, found: str | None = None):
        super().__init__(expected)
        self.expected, self.found = expected, found


def _take_type(text: str) -> tuple[str, str]:
    text = text.lstrip()
    if text.startswith("("):
        end = _matching(text, 0)
        if end < 0:
            raise _Unreadable("a tuple type closed by `)`")
        return text[: end + 1], text[end + 1:].lstrip()
    # A plain array type ends at the first space outside its layout braces.
    depth = 0
    for i, ch in enumerate(text):
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == " " and depth == 0:
            return text[:i], text[i + 1:].lstrip()
    return text, ""


_BRACKETS = {"(": ")", "{": "}", "[": "]"}


_SPECIAL_RE = re.compile(r'[(){}\[\]"\\]')


def _matching(text: str, start: int) -> int:
    """Index of the bracket closing the one at `start`, skipping quoted strings; -1 when
    the text ends first or a bracket closes that was not opened last."""
    return _scan(text, start, whole=False)[0]


def _unclosed(text: str) -> bool:
    """Whether `text` ends inside a quote or with brackets still open (a value that goes on
    on the next line). A bracket closed out of turn is not: the parser names that."""
    return _scan(text, 0, whole=True)[1]


def _scan(text: str, start: int, whole: bool) -> tuple[int, bool]:
    """Walks brackets and quotes from `start`: (the index where the first bracket closes,
    or -1 when `whole` or it never does; whether the text ends with a quote or a bracket
    still open). A bracket closed out of turn ends the walk: (-1, False).

    Jumps from one bracket, quote or backslash to the next (`re`), not char by char:
    metadata and backend configs make long lines."""
    stack: list[str] = []
    in_quote = False
    skip = -1
    for m in _SPECIAL_RE.finditer(text, start):
        i, ch = m.start(), m.group()
        if i <= skip:
            continue
        if in_quote:
            if ch == "\\":
                skip = i + 1
            elif ch == '"':
                in_quote = False
        elif ch == '"':
            in_quote = True
        elif ch in _BRACKETS:
            stack.append(_BRACKETS[ch])
        elif ch == "\\":
            continue
        elif not stack or ch != stack[-1]:
            return -1, False
        else:
            stack.pop()
            if not stack and not whole:
                return i, False
    return -1, in_quote or bool(stack)


_ATTR_KEY_RE = re.compile(r"([\w.\-]+)=")


def _parse_attrs(text: str) -> dict[str, str]:
    """Splits `, key=value, key={...}` at top level into a dict of raw values."""
    attrs: dict[str, str] = {}
    i, n = 0, len(text)
    while i < n:
        while i < n and text[i] in ", ":
            i += 1
        if i == n:
            break
        m = _ATTR_KEY_RE.match(text, i)
        if not m:
            raise _Unreadable("attributes `, key=value` after the operands", text[i:])
        key = m.group(1)
        j = m.end()
        start = j
        while j < n:
            ch = text[j]
            if ch in "({[" or ch == '"':
                end = _matching(text, j) if ch != '"' else _end_quote(text, j)
                if end < 0:
                    raise _Unreadable(f"the value of `{key}=` closed by its bracket or quote",
                                      text[i:])
                j = end + 1
                continue
            if ch == ",":
                break
            j += 1
        attrs[key] = text[start:j].strip()
        i = j
    return attrs


_QUOTE_END_RE = re.compile(r'(?:[^"\\]|\\.)*"', re.DOTALL)


def _end_quote(text: str, start: int) -> int:
    """Index of the quote closing the one at `start` (backslash escapes skipped); -1 when
    the text ends first."""
    m = _QUOTE_END_RE.match(text, start + 1)
    return m.end() - 1 if m else -1


def _dims(text: str) -> tuple[int, ...]:
    # Bounded dynamic dimensions print as `<=8`; keep the bound. Unbounded ones (`?`) have
    # no size and are left out.
    if not text:
        return ()
    dims = []
    for d in text.split(","):
        if not d.isdecimal():
            d = d.strip()
            d = d[2:] if d.startswith("<=") else d
            if d == "?":
                continue
            if not d.isdecimal():
                raise _Unreadable("array dimensions such as `[8,<=16]`", f"[{text}]")
        dims.append(int(d))
    return tuple(dims)


def _metadata_fields(metadata: str) -> dict[str, str]:
    """`{op_name="a b" source_line=3 stack_frame_id=7}` as a dict of unquoted values."""
    fields: dict[str, str] = {}
    text = metadata.strip()
    text = text[1:-1] if text.startswith("{") and text.endswith("}") else text
    i, n = 0, len(text)
    while i < n:
        while i < n and text[i] == " ":
            i += 1
        eq = text.find("=", i)
        if eq < 0:
            break
        key = text[i:eq].strip()
        if eq + 1 < n and text[eq + 1] == '"':
            end = _end_quote(text, eq + 1)
            end = n - 1 if end < 0 else end
            fields[key] = _unquoted(text[eq + 1:end + 1])
        else:
            end = text.find(" ", eq + 1)
            end = n if end < 0 else end
            fields[key] = text[eq + 1:end]
        i = end + 1
    return fields


def _metadata_int(fields: dict[str, str], key: str) -> int | None:
    text = fields.get(key)
    if text is None:
        return None
    if not text.isdecimal():
        raise _Unreadable(f"`metadata={{... {key}=N}}`, an integer", f"{key}={text}")
    return int(text)


def _unquoted(text: str) -> str:
    try:
        return _unquote(text)
    except ValueError as e:  # a backslash escape that is not C's
        raise _Unreadable("a C-escaped quoted string", text) from e


def _int_tuple(text: str, key: str = "") -> tuple[int, ...]:
    """`{0,1}` (or `0,1`) as (0, 1)."""
    if not _INT_LIST_RE.fullmatch(text.strip()):
        raise _Unreadable(f"`{key}={{N,...}}`, a list of integers", f"{key}={text}")
    return tuple(int(d) for d in _INT_RE.findall(text))


def _int_or_none(text: str) -> int | None:
    text = text.strip()
    return int(text) if _INT_RE.fullmatch(text) else None


def _window(text: str) -> dict[str, str]:
    """`{size=1x64x1 pad=0_0x63_0x0_0 stride=...}` as {"size": "1x64x1", ...}."""
    if not _WINDOW_RE.fullmatch(text.strip()):
        raise _Unreadable("a window `{size=AxB stride=AxB pad=L_HxL_H ...}`", f"window={text}")
    return dict(item.partition("=")[::2] for item in text.strip().strip("{}").split())


def _x_ints(window: str, field: str) -> tuple[int, ...]:
    """One `AxBxC` field of a window as (A, B, C); () when the window has none."""
    text = _window(window).get(field, "")
    parts = text.split("x") if text else []
    if not all(p.isdecimal() for p in parts):
        raise _Unreadable(f"a window `{field}=AxB...` of integers", f"window={window}")
    return tuple(int(p) for p in parts)


def _called_name(text: str) -> str | None:
    names = _OPERAND_RE.findall(text)
    return names[0] if names else (text.strip() or None)
