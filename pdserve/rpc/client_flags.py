"""The flags a command-line client of a pdserve server takes to reach it over TLS (``pdserve
generate``, ``pdserve health``; ``pdserve bench`` has its own for HTTPS)."""

from __future__ import annotations

import argparse

from pdserve.rpc.channel_security import ChannelSecurity, Metadata, read_pem


def add_tls_client_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tls`` / ``--tls-ca`` / ``--tls-client-cert`` / ``--tls-client-key``: reach a server over TLS."""
    parser.add_argument(
        "--tls", action="store_true", help="connect over TLS, trusting the system's CAs (see --tls-ca)"
    )
    parser.add_argument(
        "--tls-ca",
        default="",
        help="connect over TLS, trusting this PEM CA bundle (or self-signed certificate)",
    )
    parser.add_argument(
        "--tls-client-cert",
        default="",
        help="PEM certificate to present (a service under mutual TLS), with --tls-client-key",
    )
    parser.add_argument("--tls-client-key", default="", help="PEM private key of --tls-client-cert")


def tls_from_args(args: argparse.Namespace, metadata: Metadata = ()) -> ChannelSecurity:
    """The channel security of the TLS client flags (OSError when a file cannot be read; ValueError
    when only one of the client certificate and key is given)."""
    if bool(args.tls_client_cert) != bool(args.tls_client_key):
        raise ValueError("--tls-client-cert and --tls-client-key go together")
    tls = bool(args.tls or args.tls_ca or args.tls_client_cert)
    return ChannelSecurity(
        metadata,
        tls=tls,
        root_certificates=read_pem(args.tls_ca),
        private_key=read_pem(args.tls_client_key),
        certificate_chain=read_pem(args.tls_client_cert),
    )
