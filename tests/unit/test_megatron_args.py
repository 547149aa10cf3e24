"""The Megatron integration's arguments: ``--ccld``, ``--ccld-config``, ``--ccld-set``, alone
and chained with a provider of the user's own."""

from __future__ import annotations

import argparse

from ccld_plugin import megatron as ccld


def test_args_provider_alone_and_chained() -> None:
    parser = ccld.add_ccld_args(argparse.ArgumentParser())
    args = parser.parse_args([])
    assert (args.ccld, args.ccld_config, args.ccld_set) == (False, None, None)
    assert ccld.install(args) is None  # off: returns before touching anything

    def mine(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--my-flag", type=int, default=0)
        return p

    provider = ccld.combine_providers(mine, None, ccld.add_ccld_args)
    args = provider(argparse.ArgumentParser()).parse_args(
        [
            "--my-flag",
            "3",
            "--ccld",
            "--ccld-config",
            "c.yaml",
            "--ccld-set",
            "a.b=1",
            "--ccld-set",
            "job=x",
        ]
    )
    assert (args.my_flag, args.ccld, args.ccld_config) == (3, True, "c.yaml")
    assert args.ccld_set == ["a.b=1", "job=x"]
