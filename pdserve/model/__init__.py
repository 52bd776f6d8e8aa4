"""The model an engine runs: loading, presets, weight layout, compilation, DeepSeekMoE."""
