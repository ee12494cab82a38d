"""MaxText: its real training step as a shardlint target, and its own training loop with
the routed MoE kept sharded. This module only re-exports.

    shardlint analyze shardlint.integrations.maxtext:make_step --devices 8 --set ...
    python -m shardlint.integrations.maxtext.train <config.yml> key=value ...

Nothing of MaxText is imported until a function here runs (`_target` says how the step is
built; `train` runs MaxText's loop).
"""

from ._target import INSTALL as INSTALL
from ._target import MaxTextError as MaxTextError
from ._target import defaults as defaults
from ._target import initialize as initialize
from ._target import make_config as make_config
from ._target import make_step as make_step
