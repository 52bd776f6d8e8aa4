"""Gateway service: the client-facing API that streams generated text."""
