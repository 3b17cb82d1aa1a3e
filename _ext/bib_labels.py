"""Bibliography labels that are unique across the whole book.

Every chapter ends with its own bibliography. pybtex's "alpha" labels (e.g. "PyTorchContributors25")
are made unique only within one list, so two PyTorch documentation pages cited on two different
chapters both get the same label, and Sphinx fails the strict build with "duplicate label". This
style computes the alpha label of every entry in the .bib files once and adds a, b, c... wherever
two entries share one, so a label means the same entry on every page.
"""

from collections import Counter, defaultdict
from pathlib import Path

import pybtex.database
from pybtex.plugin import register_plugin
from pybtex.style.formatting.alpha import Style as AlphaStyle
from pybtex.style.labels.alpha import LabelStyle as AlphaLabelStyle

GLOBAL_LABELS: dict[str, str] = {}


class GlobalAlphaLabelStyle(AlphaLabelStyle):
    def format_labels(self, sorted_entries):
        for entry in sorted_entries:
            yield GLOBAL_LABELS.get(entry.key) or self.format_label(entry)


class GlobalAlphaStyle(AlphaStyle):
    default_label_style = "global_alpha"


def _compute_labels(bib_paths):
    style = GlobalAlphaLabelStyle()
    by_label = defaultdict(list)
    for path in bib_paths:
        for key, entry in pybtex.database.parse_file(str(path)).entries.items():
            by_label[style.format_label(entry)].append(key)
    for label, keys in by_label.items():
        for i, key in enumerate(sorted(keys)):
            GLOBAL_LABELS[key] = label if len(keys) == 1 else label + chr(ord("a") + i)
    assert len(set(GLOBAL_LABELS.values())) == len(GLOBAL_LABELS), Counter(GLOBAL_LABELS.values())


def _on_config_inited(app, config):
    _compute_labels(Path(app.srcdir) / f for f in config.bibtex_bibfiles)


def setup(app):
    register_plugin("pybtex.style.labels", "global_alpha", GlobalAlphaLabelStyle)
    register_plugin("pybtex.style.formatting", "global_alpha", GlobalAlphaStyle)
    app.connect("config-inited", _on_config_inited)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
