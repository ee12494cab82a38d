"""The analyzer: lower -> compile -> parse -> graph -> findings.

Beside `analyze` and the records, the face holds what the other packages build on: the mesh
and parameters of a step's arguments, TPU topologies, what fits in memory and how it
scales, the lines at the memory peak, the frames that are helpers, and the grouped-matmul /
routed-expert patterns the rewrites share with the detectors.
"""

from ._analyze import analyze as analyze
from ._analyze import analyze_dump as analyze_dump
from ._collectives import collectives_of as collectives_of
from ._compile import mesh_of as mesh_of
from ._compile import parameter_argnums as parameter_argnums
from ._devices import MeshInfo as MeshInfo
from ._devices import Sharding as Sharding
from ._devices import parse_replica_groups as parse_replica_groups
from ._devices import parse_sharding as parse_sharding
from ._fit import fit_of as fit_of
from ._frames import helper_frames as helper_frames
from ._graph import build_graph as build_graph
from ._graph import reshape_groups as reshape_groups
from ._hlo import HloModule as HloModule
from ._hlo import parse_hlo as parse_hlo
from ._lower import in_context_as_jit as in_context_as_jit
from .._vocab import CAUSES as CAUSES
from .._vocab import ArgumentRole as ArgumentRole
from .._vocab import BufferRole as BufferRole
from .._vocab import Cause as Cause
from .._vocab import CollectiveKind as CollectiveKind
from .._vocab import FindingKind as FindingKind
from .._vocab import FINDING_KINDS as FINDING_KINDS
from ._model import SCHEMA as SCHEMA
from ._model import Analysis as Analysis
from ._model import Collective as Collective
from ._model import Finding as Finding
from ._model import GraphNode as GraphNode
from ._model import Memory as Memory
from ._model import Neighbourhood as Neighbourhood
from ._model import Requested as Requested
from ._patterns import is_expert_batched_eqn as is_expert_batched_eqn
from ._patterns import is_grouped_matmul_eqn as is_grouped_matmul_eqn
from ._patterns import reads_expert_weights as reads_expert_weights
from ._peak import peak_lines as peak_lines
from ._peak import unsourced as unsourced
from ._scaling import MemoryScaling as MemoryScaling
from ._scaling import memory_scaling as memory_scaling
from ._scopes import ScopeNode as ScopeNode
from ._scopes import Traffic as Traffic
from ._scopes import scope_tree as scope_tree
from .._source import Source as Source
from ._topology import topology_devices as topology_devices
from ._topology import topology_mesh as topology_mesh
