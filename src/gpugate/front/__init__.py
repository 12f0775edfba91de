"""The front: command line, hook runs, status, install."""
