"""Trains a model from a config file.

    python -m angel_jax.launch --config configs/tiny.py --workdir /tmp/run [--config.KEY=VALUE ...]

Resumes from the latest complete checkpoint in --workdir when there is one.
"""

import argparse
import sys

import jax

from angel_jax.config import ConfigError, load_config


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # One line, like every other input error.
        self.exit(2, f"error: {message}; usage: {self.format_usage().strip()[7:]}\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--config", required=True, help="a config file, e.g. configs/tiny.py")
    parser.add_argument("--workdir", required=True, help="metrics, TensorBoard logs, checkpoints")
    args, overrides = parser.parse_known_args(argv)
    jax.config.update("jax_threefry_partitionable", True)
    try:
        config = load_config(args.config, overrides)
        from angel_jax.train import train_loop

        train_loop(config, args.workdir)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
