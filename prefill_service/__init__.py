"""The prefill service: prompt forwards, first tokens, and parked KV served to decodes."""
