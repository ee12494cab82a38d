"""Which dimensions of a reshape hold the same elements: asked of HLO (the analyzer) and of
jaxprs (the rewrites) alike."""

from __future__ import annotations


def reshape_groups(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Groups of operand dims and result dims whose sizes multiply to the same number."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        gi, gj = [i], [j]
        pa, pb = a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                gi.append(i)
                pa *= a[i]
                i += 1
            elif j < len(b):
                gj.append(j)
                pb *= b[j]
                j += 1
            else:
                break
        groups.append((gi, gj))
    if groups:
        groups[-1][0].extend(range(i, len(a)))
        groups[-1][1].extend(range(j, len(b)))
    return groups
