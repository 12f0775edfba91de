"""gpugate: leave a systemd unit's GPUs truly free on start and stop."""

__version__ = "0.1.0"

# Errors carry a code and facts; report/ words them. Loading its wording with the package
# makes every error's `message` (and str()) those words, whatever module raised it.
from gpugate.report import error_text as _error_text  # noqa: F401
