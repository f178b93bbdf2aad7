"""Sphinx configuration of the documentation site: the guides in this folder (Markdown, through
MyST) and the API reference under reference/, generated from the docstrings of the installed
package by autodoc.

Build it with warnings as errors, as CI does (needs the ``docs`` extra)::

    .venv/bin/sphinx-build -W --keep-going -b html docs build/docs
"""

from __future__ import annotations

project = "hermes-sessions"
author = "hermes-sessions developers"

extensions = ["sphinx.ext.autodoc", "myst_parser"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"

# pydantic's model_config is the same generic text on every model.
autodoc_default_options = {
    "members": True,
    "member-order": "bysource",
    "exclude-members": "model_config",
}
autodoc_typehints = "signature"

# The guides link to each other's headings by the anchors GitHub gives them.
myst_heading_anchors = 4

html_theme = "alabaster"
html_title = "hermes-sessions"
