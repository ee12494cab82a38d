"""The grouped-matmul kernels a routed layer runs on a TPU (Pallas), and their plans: which
kernel, which tiles, rows permuted to tile-aligned groups and gathered back."""

from ._gather import runs as runs
from ._gather import token_tile as token_tile
from ._gmm import tiled_experts as tiled_experts
from ._gmm import tiled_swiglu as tiled_swiglu
from ._permute import padded_layout as padded_layout
from ._permute import permute_rows as permute_rows
from ._plan import grouped_kernel as grouped_kernel
from ._plan import Plan as Plan
from ._plan import plan as plan
from ._plan import scope as scope
