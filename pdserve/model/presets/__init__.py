"""Built-in models: seeded tiny models for tests, SmolLM2 from its PyPI package."""
