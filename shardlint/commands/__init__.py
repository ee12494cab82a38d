"""The commands layer: what `shardlint analyze/report/check/plan/demo` do, above the library.

Loading a target (`file.py:function`) and its mesh, simulating devices, the analyses before
and after the rewrite, the sweep over one mesh axis or target option, the plan over a grid
and the engine that runs its points, the demo and the gate's command live here;
`shardlint.cli` only parses arguments and calls them, and the library packages (analyzer,
rewrites, reports, gate) never see an argparse Namespace.
"""

from ._check import run_check as run_check
from ._run import analyze_command as analyze_command
from ._run import check_command as check_command
from ._run import demo_command as demo_command
from ._plan import plan_command as plan_command
from ._run import report_command as report_command
from ._demo import run_demo as run_demo
from ._sweep import analyze_pair as analyze_pair
from ._sweep import parse_sweep_spec as parse_sweep_spec
from ._sweep import run_sweep as run_sweep
