"""The decode service: pulls parked KV from prefills and continues requests, streaming tokens."""
