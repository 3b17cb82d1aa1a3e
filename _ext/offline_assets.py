"""Serve the book's JavaScript from its own static files, so every page renders offline.

Jupyter Book 1 adds every ``*.js`` under ``_static/`` to every page. The vendored libraries in
``_static/vendor/`` must not be, nor ``_static/widgets-offline.js``: MathJax is loaded by Sphinx on
pages with math (``mathjax_path``) and the widget scripts by myst-nb on pages with widget state
(``nb_ipywidgets_js``). Loaded everywhere, MathJax would run twice and require.js would sit on
every page. This extension drops them from ``html_js_files`` and warns (an error under ``-W``)
when a configured file is missing, that is when ``make static`` has not run.
"""

from pathlib import Path

from sphinx.application import Sphinx
from sphinx.config import Config
from sphinx.util import logging

logger = logging.getLogger(__name__)

VENDOR_PREFIX = "vendor/"


def _filename(entry) -> str:
    # html_js_files entries are "path" or ("path", {attributes})
    return entry[0] if isinstance(entry, (tuple, list)) else entry


def _per_page(config: Config) -> set[str]:
    """Static files that Sphinx or myst-nb load on the pages that need them."""
    return {config.mathjax_path, *getattr(config, "nb_ipywidgets_js", {})}


def drop_vendor_files(app: Sphinx, config: Config) -> None:
    per_page = _per_page(config)

    def keep(entry) -> bool:
        name = _filename(entry)
        return not name.startswith(VENDOR_PREFIX) and name not in per_page

    config.html_js_files = [entry for entry in config.html_js_files if keep(entry)]
    config.html_css_files = [entry for entry in config.html_css_files if keep(entry)]


def check_vendor_files(app: Sphinx) -> None:
    if app.builder.format != "html":
        return
    static = Path(app.srcdir, "_static")
    for uri in sorted(_per_page(app.config)):
        if "://" in uri:
            logger.warning("offline_assets: %s is loaded from the web; vendor it (make static)", uri)
        elif not (static / uri).is_file():
            logger.warning("offline_assets: _static/%s is missing: run `make static`", uri)
    for attributes in getattr(app.config, "nb_ipywidgets_js", {}).values():
        folder = attributes.get("data-html-manager")
        if folder and not (static / folder / "embed-amd.js").is_file():
            logger.warning("offline_assets: data-html-manager: no _static/%s/embed-amd.js", folder)


def setup(app: Sphinx) -> dict:
    # after jupyter_book's and myst_nb's config handlers
    app.connect("config-inited", drop_vendor_files, priority=900)
    app.connect("builder-inited", check_vendor_files)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
