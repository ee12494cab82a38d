"""Stage 2 of the rewrite: the routed regions of each jaxpr level, grown from their seeds,
refused where per shard would give other numbers, split into groups (`plan_regions`)."""

from ._regions import Group as Group
from ._regions import Level as Level
from ._regions import Plan as Plan
from ._regions import plan_regions as plan_regions
