"""`python -m shardlint ...`: the same as the `shardlint` console script."""

import sys

from .cli import main

sys.exit(main())
