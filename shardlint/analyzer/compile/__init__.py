"""Stage 2 of the analysis: lower the step as `jax.jit` does, compile it on the mesh or a TPU
topology with XLA's dumps on, and keep all that XLA says (`compile_step`, `read_dump`)."""

from ._compile import compile_step as compile_step
from ._compile import Compiled as Compiled
from ._compile import mesh_of as mesh_of
from ._compile import parameter_argnums as parameter_argnums
from ._dump import read_dump as read_dump
from ._lower import in_context_as_jit as in_context_as_jit
from ._topology import libtpu_version as libtpu_version
from ._topology import topology_devices as topology_devices
from ._topology import topology_mesh as topology_mesh
from ._topology import TopologyError as TopologyError
from ._xla_log import Remat as Remat
