"""Below every stage of the rewrite: a step's global equations bound again at one shard's
shapes (`ShardBinder`), by the shape rules of `_shape_rules`."""

from ._binder import ShardBinder as ShardBinder
from ._shape_rules import declared_shapes as declared_shapes
from ._shape_rules import elementwise as elementwise
from ._shape_rules import fitted as fitted
from ._shape_rules import folded as folded
from ._shape_rules import folds_several as folds_several
from ._shape_rules import FOLLOWS_FIRST as FOLLOWS_FIRST
from ._shape_rules import operands_to_resize as operands_to_resize
from ._shape_rules import reshaped as reshaped
from ._shape_rules import Unfit as Unfit
