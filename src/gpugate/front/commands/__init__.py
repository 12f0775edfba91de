"""The commands, one module each (pipx's layout): a typed function per command, called by
`cli` with the parsed command line's values; each returns the exit code. No command imports
another: what two share is below them (`front/hook.py`, `front/install.py`).
"""
