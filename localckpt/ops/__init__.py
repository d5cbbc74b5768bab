"""Operating localckpt: the CLI, GPU health and node identity (NVML), per-phase metrics and the
fault points of chaos testing."""
