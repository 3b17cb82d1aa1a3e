"""tools/stale_numbers.py, which lists the numbers a chapter quotes that its lab no longer prints."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("stale_numbers", ROOT / "tools" / "stale_numbers.py")
stale_numbers = importlib.util.module_from_spec(spec)
sys.modules["stale_numbers"] = stale_numbers
spec.loader.exec_module(stale_numbers)


def test_a_number_matches_its_output_in_another_unit_or_with_more_digits():
    values = stale_numbers.output_values("fp32 | 30.999 ms | 0.0767 TFLOP/s | peak 11,109,896 B | 23.3%")
    for quoted in ("31.0", "76.7", "11,109,896", "23.3", "0.0767"):
        assert stale_numbers.printed(quoted, values), quoted
    for quoted in ("31.5", "76.8", "11,109,897", "233.1"):
        assert not stale_numbers.printed(quoted, values), quoted


def test_only_the_prose_is_read(tmp_path):
    chapter = tmp_path / "99-x.md"
    chapter.write_text("A step took 85.2 ms in 2026, `1.234` in code and $3.14$ in maths.\n"
                       "```python\nx = 12.5\n```\n{cite:p}`a2020` measured 4.56 GB.\n"
                       "$$\ny = 7.25\n$$\n$$ z = 1{,}129 $$\n$$\nw = 2.5\n$$ (eq-w)\nThen 3.75 s.\n")
    assert [n for _, n in stale_numbers.prose_numbers(chapter)] == ["85.2", "4.56", "3.75"]
