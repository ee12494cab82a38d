"""The analyzer: parse <- compile -> graph -> explain -> memory, one stage a folder.

compile lowers and compiles the step with XLA's dumps on; parse reads each text XLA writes;
graph is the propagated program as a graph; explain gives every collective its cause and
makes the findings; memory explains the peak and whether the step fits. `analyze` runs them
in order; the records (`Analysis`, `Finding`, ...) are `_model`'s.

Beside `analyze` and the records, the face holds what the other packages build on: the mesh
and parameters of a step's arguments, TPU topologies, what fits in memory and how it
scales, the lines at the memory peak and the frames that are helpers.
"""

from .._source import Source as Source
from .._vocab import ArgumentRole as ArgumentRole
from .._vocab import BufferRole as BufferRole
from .._vocab import Cause as Cause
from .._vocab import CAUSES as CAUSES
from .._vocab import CollectiveKind as CollectiveKind
from .._vocab import FINDING_KINDS as FINDING_KINDS
from .._vocab import FindingKind as FindingKind
from ._analyze import analyze as analyze
from ._analyze import analyze_dump as analyze_dump
from ._model import Analysis as Analysis
from ._model import Collective as Collective
from ._model import Finding as Finding
from ._model import GraphNode as GraphNode
from ._model import Memory as Memory
from ._model import Neighbourhood as Neighbourhood
from ._model import Requested as Requested
from ._model import SCHEMA as SCHEMA
from .compile import in_context_as_jit as in_context_as_jit
from .compile import libtpu_version as libtpu_version
from .compile import mesh_of as mesh_of
from .compile import parameter_argnums as parameter_argnums
from .compile import topology_devices as topology_devices
from .compile import topology_mesh as topology_mesh
from .explain import collectives_of as collectives_of
from .explain import scope_tree as scope_tree
from .explain import ScopeNode as ScopeNode
from .explain import Traffic as Traffic
from .graph import build_graph as build_graph
from .memory import fit_of as fit_of
from .memory import hbm_gib as hbm_gib
from .memory import helper_frames as helper_frames
from .memory import memory_scaling as memory_scaling
from .memory import MemoryScaling as MemoryScaling
from .memory import peak_lines as peak_lines
from .memory import unsourced as unsourced
from .parse import HloModule as HloModule
from .parse import MeshInfo as MeshInfo
from .parse import parse_hlo as parse_hlo
from .parse import parse_replica_groups as parse_replica_groups
from .parse import parse_sharding as parse_sharding
from .parse import Sharding as Sharding
