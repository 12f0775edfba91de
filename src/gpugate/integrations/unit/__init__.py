"""A systemd unit's shared-host steps: gpus = auto, leases, failed starts, the manual-run guard."""
