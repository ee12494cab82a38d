"""The CI gate: a baseline of collectives and the no-new-all-gather check."""

from ._keys import collective_key as collective_key
from ._keys import normalize_op_path as normalize_op_path
from ._keys import relative_source as relative_source
