"""The course's shape: every chapter has its lab, both are in the TOC, and every lab follows the pattern
(install cell, banner, parameters cell, checks, stored outputs in order, nothing private or downloaded),
with nbval's markers in cell tags, headings the book numbers, and long outputs folded."""

import ast
import re
from pathlib import Path

import nbformat
import pytest
from course import toc_docnames

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted(p for p in (ROOT / "chapters").glob("[0-9][0-9]-*.md"))
LABS = sorted((ROOT / "labs").glob("[0-9][0-9]-*.ipynb"))

SECRET = re.compile(r"hf_[A-Za-z0-9]{20,}|ghp_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9]{20,}|(?i:\btoken\s*=\s*['\"][^'\"]+['\"])")
DOWNLOAD = re.compile(r"hf_hub_download|snapshot_download|load_dataset\(|urlretrieve|requests\.get|wget |curl ")
MACHINE_PATH = re.compile(r"(/home/\w|/Users/\w|/root/|/work/|/tmp/|[A-Z]:\\\\Users)")
INSTALL_CELL_ID = "install-gpulab"  # tools/sync_repo_url.py writes it; tests/test_lab_setup_cell.py runs it
# Cell tags that nbval, myst-nb (the book) and papermill read. A misspelt tag is silently ignored:
# "nbval_ignore_output" would make nbval compare a timing.
NBVAL_IGNORE = "nbval-ignore-output"
KNOWN_TAGS = {"parameters", NBVAL_IGNORE, "nbval-skip", "nbval-check-output", "raises-exception",
              "hide-input", "hide-output", "hide-cell", "remove-input", "remove-output", "remove-cell",
              "remove-stderr", "remove-stdout"}
FOLDED = {"hide-output", "hide-cell", "remove-output", "remove-cell"}
LONG_OUTPUT_LINES = 60  # longer outputs are folded in the book (a toggle), e.g. a kernel's source
PROGRESS_BAR = re.compile(r"\d+%\|")


def test_toc_lists_only_existing_pages():
    for f in toc_docnames():
        assert (ROOT / f"{f}.md").exists() or (ROOT / f"{f}.ipynb").exists(), f"_toc.yml lists missing {f}"


def test_every_chapter_has_its_lab_and_both_are_in_the_toc():
    listed = set(toc_docnames())
    assert CHAPTERS and LABS
    lab_numbers = {lab.name[:2]: lab for lab in LABS}
    for chapter in CHAPTERS:
        number = chapter.name[:2]
        assert number in lab_numbers, f"{chapter.name} has no labs/{number}-*.ipynb"
        assert f"chapters/{chapter.stem}" in listed, f"{chapter.name} is not in _toc.yml"
        assert f"labs/{lab_numbers[number].stem}" in listed, f"{lab_numbers[number].name} is not in _toc.yml"
    for lab in LABS:
        assert any(c.name[:2] == lab.name[:2] for c in CHAPTERS), f"{lab.name} has no chapter"


def test_readme_lists_every_chapter_and_lab_in_one_table():
    # a blank line inside a Markdown table ends it: the rows after it render as plain text with pipes
    lines = (ROOT / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| part |"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    table = "\n".join(lines[start:end])
    for page in CHAPTERS + LABS:
        assert f"({page.parent.name}/{page.name})" in table, f"README's table of chapters lacks {page.name}"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.name)
def test_chapter_follows_the_style(chapter):
    text = chapter.read_text()
    for heading in ("## Summary", "## Exercises", "## References"):
        assert heading in text, f"{chapter.name} lacks {heading}"
    assert text.count("{exercise}") >= 2, "at least two exercises"
    assert text.count("{solution}") >= text.count("{exercise}"), "every exercise has a solution"
    assert "{bibliography}" in text and "{cite" in text
    own_labs = [lab.stem for lab in LABS if lab.name[:2] == chapter.name[:2]]
    assert any(f"labs/{stem}" in text for stem in own_labs), "the chapter links its lab"


def code_cells(nb):
    """The lab's code cells after the install cell (which runs first, prints nothing and is stored
    without outputs)."""
    return [c for c in nb.cells if c.cell_type == "code" and c.get("id") != INSTALL_CELL_ID]


def tags(cell) -> list[str]:
    return cell.metadata.get("tags", [])


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.name)
def test_lab_follows_the_pattern(lab):
    nb = nbformat.read(lab, as_version=4)
    cells = code_cells(nb)
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# "), "title first"
    assert "../chapters/" in nb.cells[0].source or lab.name.startswith("00"), "the title links the chapter"
    assert nb.cells[1].get("id") == INSTALL_CELL_ID, "the install cell follows the title"
    setup = cells[0]
    assert "setup(" in setup.source, "the first cell after the install cell prints the banner"
    assert NBVAL_IGNORE in tags(setup), "the banner differs by machine: tag it nbval-ignore-output"
    params = [c for c in cells if "parameters" in tags(c)]
    assert len(params) == 1, "exactly one cell tagged `parameters`"
    assert "GPULAB_PRESET" in params[0].source, "the preset can be overridden from the environment"
    if params[0].outputs:
        assert NBVAL_IGNORE in tags(params[0]), "the preset printed differs by machine"
    assert any("check(" in c.source for c in cells), "at least one check"
    assert "Try it" in "".join(c.source for c in nb.cells if c.cell_type == "markdown")


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.name)
def test_lab_has_stored_outputs_in_order(lab):
    nb = nbformat.read(lab, as_version=4)
    counts = [c.execution_count for c in code_cells(nb)]
    assert None not in counts, "every code cell was executed (run `make refresh`)"
    # from 1, or from 2 when the install cell ran in the same kernel (`make refresh`; then
    # tools/sync_repo_url.py stores it without outputs and count again)
    assert counts[0] in (1, 2) and counts == list(range(counts[0], counts[0] + len(counts))), \
        f"execution counts out of order: {counts}"
    outputs = [o for c in code_cells(nb) for o in c.outputs]
    assert any(o.get("name") == "stdout" and "PASS:" in o.get("text", "") for o in outputs), "checks ran"
    assert not [o for o in outputs if o.output_type == "error"], "a stored error"


def output_text(cell) -> str:
    """What a code cell's stored outputs show as text (streams, markdown, plain text)."""
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in {"display_data", "execute_result"}:
            data = out.get("data", {})
            parts.append(data.get("text/markdown") or ("" if "text/html" in data or "image/png" in data
                                                       else data.get("text/plain", "")))
    return "".join(parts)


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.name)
def test_nbval_markers_are_cell_tags(lab):
    """nbval reads its markers from cell tags, so code shows no test machinery; a cell whose output
    differs by machine (a progress bar's step count and speed) is tagged, and no verdict hides in a
    tagged cell (nbval would not compare it)."""
    nb = nbformat.read(lab, as_version=4)
    for cell in code_cells(nb):
        marker = re.search(r"^\s*#\s*(NBVAL_\w+|PYTEST_VALIDATE_\w+)", cell.source, flags=re.M)
        assert not marker, f"a comment marker in the code: {marker.group(1) if marker else ''}; use a cell tag"
        unknown = set(tags(cell)) - KNOWN_TAGS
        assert not unknown, f"unknown cell tags {unknown} (nbval and the book ignore them): {cell.source[:80]}"
        if PROGRESS_BAR.search(output_text(cell)):
            assert NBVAL_IGNORE in tags(cell), f"a progress bar in a cell nbval compares: {cell.source[:80]}"
        if NBVAL_IGNORE in tags(cell):
            assert not check_calls(cell.source), f"a check in a cell nbval does not compare: {cell.source[:80]}"


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.name)
def test_long_outputs_are_folded(lab):
    nb = nbformat.read(lab, as_version=4)
    for cell in code_cells(nb):
        lines = output_text(cell).count("\n")
        if lines > LONG_OUTPUT_LINES:
            assert FOLDED & set(tags(cell)), \
                f"{lines} lines of output: tag the cell hide-output so the book folds it: {cell.source[:80]}"


# "section 3", "sections 1-3", "Section 2a" (a paper's sections are fine: "the ZeRO paper, section 5")
SECTION_NUMBER = re.compile(r"\b[Ss]ections? \d+[a-z]?\b|§\s*\d")
PAPER = re.compile(r"paper|et al\.")


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.name)
def test_headings_and_references_carry_no_section_numbers(lab):
    """The book numbers a lab's headings ("4.2.3."): a hand-written "3." would show twice, and "see
    section 3" would not match the book's number. Sections are named instead."""
    nb = nbformat.read(lab, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            numbered = re.findall(r"^#{2,6} +\d+[a-z]?[.)] .*", cell.source, flags=re.M)
            assert not numbered, f"hand-numbered headings: {numbered}"
            lines = cell.source.splitlines()
        else:  # comments only: strings and outputs are what the stored run printed
            lines = [line.split("#", 1)[1] for line in cell.source.splitlines() if "#" in line]
        for line in lines:
            if SECTION_NUMBER.search(line) and not PAPER.search(line):
                pytest.fail(f"a section referred to by number (name it instead): {line.strip()[:120]}")


@pytest.mark.parametrize("chapter", sorted((ROOT / "chapters").glob("*.md")), ids=lambda p: p.name)
def test_chapters_name_the_lab_sections_they_cite(chapter):
    for line in chapter.read_text().splitlines():
        match = re.search(r"\b[Ss]ections? \d+[a-z]?\b.{0,20}\blab\b|\blab's sections? \d", line)
        assert not match, f"{chapter.name}: a lab section cited by number: {line.strip()[:120]}"


@pytest.mark.parametrize("path", LABS + sorted((ROOT / "labs" / "scripts").glob("*.py")), ids=lambda p: p.name)
def test_no_secrets_downloads_or_machine_paths(path):
    text = path.read_text()
    assert not SECRET.search(text), "a token"
    assert not DOWNLOAD.search(text), "a download at run time"
    match = MACHINE_PATH.search(text)
    assert not match, f"a machine-specific path: {match.group(0) if match else ''}"
    assert "trust_remote_code=True" not in text


def check_calls(source: str) -> list[str]:
    """The text of every verdict call, `check(...)` or `target(...)`, in a cell's source (balanced parentheses)."""
    calls = []
    for match in re.finditer(r"\b(?:check|target)\(", source):
        depth, i = 1, match.end()
        while depth and i < len(source):
            depth += {"(": 1, ")": -1}.get(source[i], 0)
            i += 1
        calls.append(source[match.start():i])
    return calls


DEVICE = re.compile(r"\bon_gpu\b|\bmulti_gpu\b|\bpreset\.|device\.type|cuda\.is_available")


def cell_tree(cell) -> ast.Module:
    """A code cell's syntax tree (IPython's `%magic` and `!shell` lines left out)."""
    lines = [line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!"))]
    return ast.parse("\n".join(lines))


def assigned_names(node: ast.AST) -> set[str]:
    """Names that assignments in `node` bind (not loop or comprehension variables: those are re-bound
    where they are used)."""
    targets = [t for n in ast.walk(node) if isinstance(n, ast.Assign) for t in n.targets] + \
        [n.target for n in ast.walk(node) if isinstance(n, (ast.AnnAssign, ast.AugAssign))]
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}


def device_dependent_names(nb) -> set[str]:
    """Constants (upper-case names) assigned from the device or the preset (`X = ... if on_gpu else ...`,
    `X = preset.seq_len`), or anywhere inside an `if` on the device (both branches), at any depth."""
    names: set[str] = set()
    for cell in code_cells(nb):
        for node in ast.walk(cell_tree(cell)):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node.value is not None \
                    and DEVICE.search(ast.unparse(node.value)):
                names |= assigned_names(node)
            elif isinstance(node, ast.If) and DEVICE.search(ast.unparse(node.test)):
                names |= set().union(*(assigned_names(n) for n in node.body + node.orelse))
    return {name for name in names if name.isupper()}


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.name)
def test_checks_read_the_same_on_every_device(lab):
    """A verdict line is compared between a GPU-stored run and a CPU re-run: its claim may not depend on the
    device, a check that cannot run on this device says SKIP (never PASS), and the count of verdict lines
    is the same everywhere."""
    nb = nbformat.read(lab, as_version=4)
    varying = device_dependent_names(nb)
    for cell in code_cells(nb):
        for call in check_calls(cell.source):
            head = call.split("measured=")[0].split("skip=")[0]
            for name in varying:
                assert f"{{{name}" not in head, f"the claim embeds {name}, which differs by device: {call[:120]}"
            if re.match(r"(?:check|target)\(not (\(?on_gpu|multi_gpu|cuda)\b", call):
                assert "skip=" in call, f"a device-only check without skip=: {call[:120]}"
            if re.search(r"measured=.*if on_gpu else None", call, flags=re.S):
                assert "skip=" in call, f"a measured bracket on one device only: {call[:120]}"
        # a check inside a loop over something device-dependent prints a device-dependent count of lines
        for loop in (n for n in ast.walk(cell_tree(cell)) if isinstance(n, ast.For)):
            over = {n.id for n in ast.walk(loop.iter) if isinstance(n, ast.Name)} & varying
            calls = [n for stmt in loop.body + loop.orelse for n in ast.walk(stmt) if isinstance(n, ast.Call)]
            assert not (over and any(ast.unparse(c.func) in ("check", "target") for c in calls)), \
                f"checks inside a loop over {', '.join(sorted(over))}: the number of verdict lines differs by device"
        for out in cell.get("outputs", []):
            for line in out.get("text", "").splitlines():
                if line.startswith("PASS:"):
                    assert "skipped" not in line, f"a PASS for something that did not run: {line[:120]}"


BANNER_DEVICE = re.compile(r"^device: (\w+) - (.+)$", re.M)  # the first line of gpulab.env.banner


def stored_device(lab: Path) -> tuple[str, str]:
    """The device of a lab's stored run, from the banner its setup cell printed: ("cuda", "NVIDIA H200")."""
    for cell in code_cells(nbformat.read(lab, as_version=4)):
        for out in cell.get("outputs", []):
            if match := BANNER_DEVICE.search(out.get("text", "")):
                return match.group(1), match.group(2).strip()
    pytest.fail(f"{lab.name}: no stored banner says which device the run used")


RUN_NAMED = re.compile(r"(?i)measured on|stored run")  # where a chapter says where its figures come from


def names_device(text: str, kind: str, name: str) -> bool:
    """Whether a chapter's text names the device of its lab's stored run where it says where its figures
    come from (within 100 characters of "measured on" or "stored run"): a GPU by its model ("H200", "T4",
    "4090": the first word of its name with a digit in it), else "CPU" or "MPS". For a run on a CPU, no
    figure may be said to be measured on an NVIDIA GPU."""
    near = [text[m.start():m.start() + 100] for m in RUN_NAMED.finditer(text)]
    if kind == "cuda":
        model = next((word for word in name.split() if any(ch.isdigit() for ch in word)), name)
        return any(model in window for window in near)
    if re.search(r"measured on (an? )?NVIDIA", text):
        return False
    return any(("MPS" if kind == "mps" else "CPU") in window for window in near)


def test_names_device_tells_a_gpu_run_from_a_cpu_run():
    cpu_text = "The figures below are from its stored run, **measured on CPU (x86_64, 2 cores)**."
    gpu_text = "The figures below are from its stored run, **measured on an NVIDIA H200**, small preset."
    assert names_device(cpu_text, "cpu", "CPU (x86_64, 2 cores)")
    assert names_device(gpu_text, "cuda", "NVIDIA H200")
    assert not names_device(cpu_text, "cuda", "NVIDIA H200"), "a GPU run quoted as a CPU's"
    assert not names_device(gpu_text + " On a CPU it is slower.", "cpu", "CPU (x86_64, 2 cores)"), \
        "a CPU run quoted as a GPU's"
    assert names_device("measured on a Tesla T4", "cuda", "Tesla T4")
    elsewhere = (cpu_text + " The fused model trains to the same loss as the eager one at every step, and it saves"
                 " one tensor per layer less for backward, as the chapter predicts. At 8B an H200 would take 4 ms"
                 " (computed).")
    assert not names_device(elsewhere, "cuda", "NVIDIA H200"), \
        "a GPU named elsewhere in the section, not where it says where the figures come from"


@pytest.mark.parametrize("chapter", CHAPTERS[1:], ids=lambda p: p.name)
def test_chapters_name_the_device_their_lab_ran_on(chapter):
    """A chapter's 'What the lab measures' quotes its lab's stored run and says where it ran. Once a GPU
    run is imported into labs/, this fails until the chapter names that GPU (and quotes its figures)."""
    lab = next(p for p in LABS if p.name[:2] == chapter.name[:2])
    text = chapter.read_text()
    start = text.index("\n## What the lab measures")
    end = text.find("\n## ", start + 1)
    kind, name = stored_device(lab)
    assert names_device(text[start:end if end > 0 else None], kind, name), \
        f"{chapter.name}'s 'What the lab measures' does not name {name} ({kind}), where {lab.name}'s stored run ran"
