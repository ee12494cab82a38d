"""MaxText's own training loop with each routed MoE computed per shard.

    python -m shardlint.integrations.maxtext.train <config.yml> key=value ... [shardlint_verify=true]

takes the command line `python -m maxtext.trainers.pre_train.train` takes and runs MaxText's
loop (see `_command`, and `_handover` for how the rewritten steps reach it).
"""

import sys

from ._command import main as main

if __name__ == "__main__":
    sys.exit(main())
