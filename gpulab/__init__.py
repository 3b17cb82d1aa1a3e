"""gpulab: the small package the course's labs share (device and banner, presets and models, data,
timing, memory calculator and measurement, checks, launching multi-process scripts)."""

import logging as _logging

__version__ = "0.1.0"

# bitsandbytes logs a warning at import on a CPU: its optional kernel from the Hugging Face Hub (the
# `kernels` package) is missing. The labs never download anything and do not need it; the warning
# would show in every lab that imports bitsandbytes as if something had failed.
_logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(_logging.ERROR)
