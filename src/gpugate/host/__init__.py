"""Adapters for the host: /proc, NVML, systemd, container runtimes, locks, files."""
