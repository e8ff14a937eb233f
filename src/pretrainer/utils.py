"""Helpers for the seed's script contract: `script.py --pretrain_config_file CONFIG.yaml [key=value ...]`."""

from __future__ import annotations

import argparse


def parse_pretrain_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="pretraining script")
    parser.add_argument("--pretrain_config_file", required=True, help="the YAML config")
    parser.add_argument("overrides", nargs="*", help="key=value overrides applied after the YAML")
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # deepspeed launcher
    return parser.parse_args(argv)  # None: sys.argv[1:]


def get_pretrain_config_file(argv: list[str] | None = None) -> str:
    """The `--pretrain_config_file` path given to the script (what the seed's example utils return)."""
    return parse_pretrain_args(argv).pretrain_config_file
