"""pdserve: disaggregated prefill/decode LLM serving as gRPC microservices."""

__version__ = "0.1.0"
