"""Drop-in integrations with model libraries (optional dependencies, imported on demand)."""
