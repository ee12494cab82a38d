"""Stage 4 of the analysis: every collective with its cause, the op that needed it, its
mesh axes and source line; the findings (propagation drops, contracted tokens)."""

from ._attribution import attribute as attribute
from ._causes import explain as explain
from ._causes import with_gathered_tokens as with_gathered_tokens
from ._collectives import collectives_of as collectives_of
from ._contracted import find_contracted_tokens as find_contracted_tokens
from ._detect import find_lost_sharding as find_lost_sharding
from ._scopes import scope_tree as scope_tree
from ._scopes import ScopeNode as ScopeNode
from ._scopes import Traffic as Traffic
