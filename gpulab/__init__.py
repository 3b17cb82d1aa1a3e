"""gpulab: the small package the course's labs share (device and banner, presets and models, data,
timing, memory calculator and measurement, checks, launching multi-process scripts)."""

__version__ = "0.1.0"
