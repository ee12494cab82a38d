"""The analyzer: lower -> compile -> parse -> graph -> findings."""

from ._analyze import analyze as analyze
from ._analyze import analyze_dump as analyze_dump
from ._collectives import collectives_of as collectives_of
from ._devices import MeshInfo as MeshInfo
from ._devices import Sharding as Sharding
from ._devices import parse_replica_groups as parse_replica_groups
from ._devices import parse_sharding as parse_sharding
from ._graph import build_graph as build_graph
from ._hlo import HloModule as HloModule
from ._hlo import parse_hlo as parse_hlo
from .._vocab import CAUSES as CAUSES
from .._vocab import FINDING_KINDS as FINDING_KINDS
from ._model import SCHEMA as SCHEMA
from ._model import Analysis as Analysis
from ._model import Collective as Collective
from ._model import Finding as Finding
from ._model import GraphNode as GraphNode
from ._model import Memory as Memory
from ._model import Neighbourhood as Neighbourhood
from ._model import Requested as Requested
from ._model import Source as Source
from ._scopes import ScopeNode as ScopeNode
from ._scopes import Traffic as Traffic
from ._scopes import scope_tree as scope_tree
