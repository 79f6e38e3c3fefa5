"""Configuration: the engine that reads YAML and `key=value` overrides into typed dataclasses (engine.py), and
the config sections both stages share (sections.py). Imports no torch."""
