"""The KV cache between processes: its layout and packing, the KV handle, the rendezvous and the
transfer channel of a (prefill, decode) pair."""
