"""Routed Mixture-of-Experts layers: the reference that loses the sharding of the token
axis under context parallelism, the layer that keeps it, and the Qwen3-Next block."""

from .._token_axes import TokenAxes as TokenAxes
from .layers import MoeShardingError as MoeShardingError
from .layers import MoeConfig as MoeConfig
from .layers import MoeConfigError as MoeConfigError
from .layers import Sizes as Sizes
from .layers import init_moe_params as init_moe_params
from .layers import Qwen3NextSparseMoeBlock as Qwen3NextSparseMoeBlock
from .layers import RoutedMoE as RoutedMoE
from .layers import served_by as served_by
from .layers import route as route
from .layers import ShardedRoutedMoE as ShardedRoutedMoE
