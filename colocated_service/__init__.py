"""Prefill and decode in one process: the baseline that prices the disaggregation itself."""
