"""Generated gRPC stubs of protos/pdserve/v1 (run `make protos`; do not edit)."""
