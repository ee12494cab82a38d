"""Reports: the terminal summary, the JSON document and the HTML report."""

from ._data import REPORT_DATA_SCHEMA as REPORT_DATA_SCHEMA
from ._data import write_report_data as write_report_data
from ._text import format_scopes as format_scopes
from ._text import format_sweep as format_sweep
from ._text import format_text as format_text
from .._format import human_bytes as human_bytes
from ._text import write_json as write_json
from ._html import REPORT_SCHEMA as REPORT_SCHEMA
from ._html import render_html as render_html
from ._html import write_html as write_html
from ._plan import PLAN_SCHEMA as PLAN_SCHEMA
from ._plan import format_plan as format_plan
from ._plan import Plan as Plan
from ._plan import PlanPoint as PlanPoint
from ._plan import PlanRow as PlanRow
from ._plan import PlanSide as PlanSide
from ._plan import Longest as Longest
from ._plan import write_plan_html as write_plan_html
from ._plan import plan_of as plan_of
from ._plan import point_of as point_of
from ._plan import read_plan_json as read_plan_json
from ._plan import write_plan_json as write_plan_json
