"""Stage 1 of the analysis, one parser per format XLA writes: HLO text and its stack
tables, the user's asks in StableHLO, device notation, the buffer assignment and live
ranges, and the mesh a dumped module ran on."""

from ._buffers import Allocation as Allocation
from ._buffers import memory_of_buffer_assignment as memory_of_buffer_assignment
from ._buffers import parse_buffer_assignment as parse_buffer_assignment
from ._buffers import Slot as Slot
from ._devices import axes_of_groups as axes_of_groups
from ._devices import axes_of_pairs as axes_of_pairs
from ._devices import MeshInfo as MeshInfo
from ._devices import parse_replica_groups as parse_replica_groups
from ._devices import parse_sharding as parse_sharding
from ._devices import parse_tuple_sharding as parse_tuple_sharding
from ._devices import replica_group_axes as replica_group_axes
from ._devices import Sharding as Sharding
from ._given import mesh_of_module as mesh_of_module
from ._hlo import ArrayType as ArrayType
from ._hlo import Computation as Computation
from ._hlo import HloModule as HloModule
from ._hlo import Instruction as Instruction
from ._hlo import parse_hlo as parse_hlo
from ._live_range import LiveRanges as LiveRanges
from ._live_range import parse_live_range as parse_live_range
from ._stablehlo import Asked as Asked
from ._stablehlo import asked_for as asked_for
from ._stablehlo import op_stack as op_stack
