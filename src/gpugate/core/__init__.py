"""The core: one phase run (find, decide, kill, wait) and what it decides with."""
