"""Reports: the terminal summary, the JSON document and the HTML report."""

from ._text import format_text as format_text
from ._text import human_bytes as human_bytes
from ._text import write_json as write_json
