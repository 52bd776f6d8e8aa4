"""Running a prefill, decode or colocated service: as one process or as an expert-parallel group
of rank processes, with metrics servers and a drain on SIGTERM."""
