"""gRPC plumbing shared by every service: the server and its drain, status codes, proto
conversions, the DecodeMany update stream, the health client."""
