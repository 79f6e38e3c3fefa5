"""Configuration: the engine that reads YAML and `key=value` overrides into typed dataclasses (engine.py; the YAML
read keeping the words written: yaml_words.py), the config sections both stages share (sections.py), the settings a
machine cannot run (device_checks.py) and what the FSDP launch config asks (fsdp_settings.py). Imports no torch."""
