"""Reports: the terminal summary, the JSON document and the HTML report."""

from ._text import format_scopes as format_scopes
from ._text import format_text as format_text
from .._format import human_bytes as human_bytes
from ._text import write_json as write_json
from ._html import REPORT_SCHEMA as REPORT_SCHEMA
from ._html import render_html as render_html
from ._html import write_html as write_html
