"""What a request asks and when it ends: sampling rules, finish rules, model limits; plus the
process-level helpers every layer may use (logging set-up, child processes)."""
