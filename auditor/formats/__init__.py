"""Report formats: each module renders a GateResult as one string (``render(result) -> str``); text and
markdown render the JSON document (``render_document(doc) -> str``), which is how audit-merge prints them."""

from auditor.formats import html, json_format, markdown, text

FORMATS = {"text": text.render, "json": json_format.render, "markdown": markdown.render, "html": html.render}
# the formats audit-merge can print: it has only JSON documents, never a GateResult
DOCUMENT_FORMATS = {"text": text.render_document, "markdown": markdown.render_document, "json": json_format.dumps}
