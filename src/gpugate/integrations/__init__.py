"""Integrations beside the core: the systemd unit's shared-host steps, Slurm, metrics."""
