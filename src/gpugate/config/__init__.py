"""Configuration: the pydantic models, the file and its errors, TOML writing, GPU lists."""
