"""The routed MoE layers: the reference that loses the sharding, the sharded layer that
keeps it, their config, router, expert computation and weight layout, and the Qwen3-Next
block."""

from ._axes import MoeShardingError as MoeShardingError
from ._config import MoeConfig as MoeConfig
from ._config import MoeConfigError as MoeConfigError
from ._config import Sizes as Sizes
from ._experts import init_moe_params as init_moe_params
from ._qwen3_next import Qwen3NextSparseMoeBlock as Qwen3NextSparseMoeBlock
from ._reference import RoutedMoE as RoutedMoE
from ._reference import served_by as served_by
from ._routing import route as route
from ._sharded import ShardedRoutedMoE as ShardedRoutedMoE
