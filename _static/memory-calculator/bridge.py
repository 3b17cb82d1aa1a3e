"""The memory-calculator page's side of `gpulab.memory`, run in the browser by Pyodide.

calculator.js sends the form's fields as JSON; `run` turns them into the arguments of
`gpulab.memory.estimate` (the function `python -m gpulab.memory` calls) and returns each part in
bytes, GB and GiB (formatted as the CLI's table formats them), the notes, and the command line that
gives the same numbers. No formula lives here: only reading the fields and formatting the result.
The calculator's own ValueError messages come back as `error`, word for word.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex

from gpulab.memory import KNOWN_SHAPES, PARTS, TrainingSetup, estimate

DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainingSetup)}

# TrainingSetup field -> the CLI's option (booleans: the flag that sets the non-default value)
CLI_FLAGS = {
    "precision": "--dtype", "optimizer": "--optimizer", "zero_stage": "--zero", "world_size": "--gpus",
    "batch_size": "--batch", "seq_len": "--seq", "attention": "--attention", "padding_mask": "--padded",
    "checkpointing": "--checkpointing", "checkpoint_every": "--checkpoint-every", "lora_rank": "--lora-rank",
    "quantization": "--quant", "double_quant": "--no-double-quant", "kv_cache_len": "--kv-context",
    "kv_cache_batch": "--kv-batch", "tp_degree": "--tp", "sequence_parallel": "--sp",
    "grad_accumulation": "--grad-accum", "loss_chunk_tokens": "--loss-chunk",
}


def _read(name: str, value: object, label: str) -> object:
    """A form field's value as the TrainingSetup field `name` takes it."""
    default = DEFAULTS[name]
    if isinstance(default, bool):
        return bool(value)
    if isinstance(default, int):
        text = str(value).strip()
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{label}: enter a whole number, not {text or 'nothing'}") from None
    if name == "quantization":
        return str(value) or None
    return str(value)


def _count(text: str, label: str) -> float:
    try:
        count = float(text)
    except ValueError:
        raise ValueError(f"{label}: {text.strip() or 'nothing'} is not a number (write e.g. 7e9)") from None
    if not math.isfinite(count):
        raise ValueError(f"{label}: {text.strip()} is not a finite number")
    return count


def _command(model_args: list[str], setup: dict[str, object]) -> str:
    args = ["python", "-m", "gpulab.memory", *model_args]
    for name, value in setup.items():
        if value == DEFAULTS[name]:
            continue
        if isinstance(value, bool):
            args.append(CLI_FLAGS[name])
        else:
            args += [CLI_FLAGS[name], str(value)]
    return shlex.join(args)


def _row(part: str, value: int) -> dict[str, object]:
    label = {"kv_cache": "KV cache", "backward_extra": "loss gradients (start of backward)"}.get(
        part, part.replace("_", " "))
    return {"part": part, "label": label, "bytes": value, "bytes_text": f"{value:,}",
            "gb": f"{value / 1e9:.3f}", "gib": f"{value / 2**30:.3f}"}


def run(request_json: str) -> str:
    """`{"fields": {name: value}, "labels": {name: label}}` in; JSON of the result or `{"error": ...}` out.

    Fields left out (disabled in the form) take the calculator's defaults.
    """
    request = json.loads(request_json)
    fields, labels = request["fields"], request.get("labels", {})
    try:
        if fields.get("model", "params") == "params":
            text = str(fields.get("params", ""))
            model: object = _count(text, labels.get("params", "parameter count"))
            model_args = ["--params", text.strip()]
        else:
            model = KNOWN_SHAPES[fields["model"]]
            model_args = ["--model", fields["model"]]
        setup = {name: _read(name, fields[name], labels.get(name, name)) for name in DEFAULTS if name in fields}
        result = estimate(model, TrainingSetup(**setup))  # type: ignore[arg-type]
    except (ValueError, OverflowError) as err:
        return json.dumps({"error": str(err)})
    rows = [_row(part, getattr(result, part)) for part in PARTS] + [_row("total", result.total)]
    if hasattr(result, "peak"):  # the most alive at one moment of the step, and that moment
        rows.append({**_row("peak", result.peak), "label": f"peak ({result.peak_moment})"})
    return json.dumps({
        "rows": rows,
        "trainable_params": f"{result.trainable_params:,}",
        "notes": list(result.notes),
        "command": _command(model_args, setup),
    })
