"""Report formats: each module renders a GateResult as one string (``render(result) -> str``)."""

from auditor.formats import json_format, markdown, text

FORMATS = {"text": text.render, "json": json_format.render, "markdown": markdown.render}
