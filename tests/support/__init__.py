"""What the tests share: step libraries, the dump job, references and helpers; no tests.

Tests import it as `support` (`from support import cause_steps`): pytest puts `tests/` on
`sys.path` when it loads `tests/conftest.py` (a conftest in a folder without `__init__.py`,
the default `prepend` import mode). Scripts run outside pytest put `tests/` there themselves
(`dump_job.py`, benchmarks/train_loop.py).
"""

from .meshes import build_mesh as build_mesh
from .meshes import context_mesh as context_mesh
from .meshes import make_mesh as make_mesh
