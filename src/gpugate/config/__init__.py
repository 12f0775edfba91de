"""Configuration: the one model (validated by pydantic_core), the file and its errors, TOML
writing, GPU lists."""
