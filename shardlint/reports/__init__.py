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
