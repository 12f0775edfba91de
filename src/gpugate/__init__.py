"""gpugate: leave a systemd unit's GPUs truly free on start and stop."""

__version__ = "0.1.0"
